// The Redis tier against real redis-server processes on loopback (tests/redis_fixture.h): round
// trips, chain lookups that stop at the first miss, the TTL, damaged values never returned, a
// killed and a stalled server (bounded calls, the breaker, recovery), the write queue dropping
// when full, a 3-node Redis Cluster (keys over several nodes, ASK and MOVED), and two engines
// (two processes) sharing one server with bit-identical logits. URL parsing and hash slots need
// no server.
#include "kv/tiers/redis_tier.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cachet/engine.h"
#include "cachet/serving.h"
#include "kv/tiers/format.h"
#include "redis_fixture.h"
#include "test_util.h"

namespace cachet::tiers {
namespace {

using testing::RedisReply;
using testing::RedisServers;
using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

TierNamespace Ns() {
  TierNamespace ns;
  ns.model_hash = 0x5eed;
  ns.codec_k = ns.codec_v = "f32";
  ns.page_tokens = 16;
  ns.n_layers = 2;
  ns.n_kv_heads = 2;
  ns.head_dim = 64;
  ns.rope_theta = 10000.0;
  return ns;
}

struct TestRun {
  RunKey key;
  std::string bytes;
};

// Run `id`: one block of tokens and `payload` pseudo-random bytes.
TestRun MakeRun(uint32_t id, size_t payload = 4000) {
  std::mt19937 rng(id);
  std::vector<int32_t> tokens(16);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  std::vector<uint8_t> p(payload);
  for (auto& b : p) b = static_cast<uint8_t>(rng());
  const RunKey parent = NamespaceKey(Ns());
  TestRun r;
  r.key = RunKey::Of(parent, 0, tokens);
  r.bytes = EncodeRun(Ns(), RunMeta{parent, 0, tokens}, p, false);
  return r;
}

std::vector<std::pair<RunKey, std::string>> Batch(const std::vector<TestRun>& runs) {
  std::vector<std::pair<RunKey, std::string>> out;
  for (const TestRun& r : runs) out.emplace_back(r.key, r.bytes);
  return out;
}

std::vector<RunKey> Keys(const std::vector<TestRun>& runs) {
  std::vector<RunKey> out;
  for (const TestRun& r : runs) out.push_back(r.key);
  return out;
}

RedisTierOptions Options(const RedisServers& s, int node = 0) {
  RedisTierOptions o;
  o.nodes = {RedisNode{"127.0.0.1", s.port(node)}};
  o.connect_timeout_ms = 200;
  o.command_timeout_ms = 300;
  o.breaker_failures = 3;
  o.breaker_cooldown_ms = 500;
  return o;
}

std::unique_ptr<RedisTier> OpenTier(const RedisTierOptions& o) {
  auto t = RedisTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

// Whether a Get result is exactly a run's bytes; otherwise what it was instead (never the bytes:
// runs are binary and kilobytes long).
::testing::AssertionResult Is(const std::optional<std::string>& got, const std::string& want) {
  if (got && *got == want) return ::testing::AssertionSuccess();
  if (!got) return ::testing::AssertionFailure() << "a miss, not the run";
  return ::testing::AssertionFailure()
         << got->size() << " other bytes, not the run's " << want.size();
}

int64_t Integer(const RedisReply& r) {
  EXPECT_TRUE(r && r->type == REDIS_REPLY_INTEGER) << (r && r->str ? r->str : "no reply");
  return r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
}

// The `calls` field of INFO commandstats' line for a command (0 if never called).
int64_t Calls(const RedisServers& s, int node, const std::string& command) {
  RedisReply r = s.Command(node, {"INFO", "commandstats"});
  if (!r || r->type != REDIS_REPLY_STRING) return -1;
  const std::string info(r->str, r->len);
  const size_t at = info.find("cmdstat_" + command + ":calls=");
  if (at == std::string::npos) return 0;
  return std::stoll(info.substr(at + command.size() + 15));
}

#define START_OR_FAIL(servers, n, cluster)                 \
  do {                                                     \
    const std::string why_ = (servers).Start(n, cluster);  \
    ASSERT_TRUE(why_.empty()) << "redis-server: " << why_; \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Without a server

TEST(RedisUrl, ParsesNodesAndNamesTheBadPart) {
  auto u = ParseRedisUrl("redis://127.0.0.1:7000/2");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  ASSERT_EQ(u->nodes.size(), 1u);
  EXPECT_EQ(u->nodes[0].host, "127.0.0.1");
  EXPECT_EQ(u->nodes[0].port, 7000);
  EXPECT_EQ(u->db, 2);
  u = ParseRedisUrl("redis://a:7001, redis://b ,redis://[::1]:7003/");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  ASSERT_EQ(u->nodes.size(), 3u);
  EXPECT_EQ(u->nodes[1].host, "b");
  EXPECT_EQ(u->nodes[1].port, 6379);
  EXPECT_EQ(u->nodes[2].host, "::1");
  EXPECT_EQ(u->nodes[2].Address(), "[::1]:7003");
  EXPECT_EQ(u->db, 0);

  const std::pair<const char*, const char*> bad[] = {
      {"", "empty URL"},
      {"127.0.0.1:6379", "no scheme"},
      {"rediss://h:1", "scheme \"rediss\""},
      {"redis://:6379", "no host"},
      {"redis://h:0", "port \"0\""},
      {"redis://h:65536", "port \"65536\""},
      {"redis://h:6379x", "port \"6379x\""},
      {"redis://h:/1", "port \"\""},
      {"redis://h:1/x", "database \"x\""},
      {"redis://h:1/-1", "database \"-1\""},
      {"redis://user@h:1", "credentials must be user:password@ or :password@"},
      {"redis://:@h:1", "an empty password"},
      {"redis://:p%4@h:1", "%-escape"},
      {"redis://:a@h:1,redis://:b@g:2", "different credentials"},
      {"redis://::1:6379", "brackets"},
      {"redis://[::1:6379", "closing ']'"},
      {"redis://h:1?timeout=1", "options"},
      {"redis://h:1/1,redis://g:2/2", "different databases (1 and 2)"},
      {"redis://h:1,", "empty node"},
  };
  for (const auto& [text, want] : bad) {
    auto r = ParseRedisUrl(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(want), std::string::npos)
        << text << " -> " << r.status().message();
    EXPECT_NE(r.status().message().find("--redis"), std::string::npos) << r.status().message();
  }
}

// Credentials: user and password (percent-decoded), given once for every node, never shown in an
// error; a URL without them takes $CACHET_REDIS_PASSWORD's.
TEST(RedisUrl, CredentialsAreParsedAndNeverShown) {
  auto u = ParseRedisUrl("redis://alice:s%40cr%3At@127.0.0.1:7000/1,redis://127.0.0.1:7001/1");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->user, "alice");
  EXPECT_EQ(u->password, "s@cr:t");
  EXPECT_EQ(u->nodes.size(), 2u);
  EXPECT_EQ(u->db, 1);
  u = ParseRedisUrl("redis://:hunter2@h");
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u->user, "");
  EXPECT_EQ(u->password, "hunter2");
  EXPECT_EQ(u->nodes[0].host, "h");
  for (const char* text :
       {"redis://:hunter2@h:0", "redis://bob:hunter2@:1", "redis://:hunter2@h/x"}) {
    auto bad = ParseRedisUrl(text);
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_EQ(bad.status().message().find("hunter2"), std::string::npos) << bad.status().message();
    EXPECT_NE(bad.status().message().find(":***@"), std::string::npos) << bad.status().message();
  }
  ::setenv("CACHET_REDIS_PASSWORD", "from-env", 1);
  auto o = RedisOptionsFromUrl("redis://h:1");
  auto given = RedisOptionsFromUrl("redis://:given@h:1");
  ::unsetenv("CACHET_REDIS_PASSWORD");
  ASSERT_TRUE(o.ok() && given.ok());
  EXPECT_EQ(o->password, "from-env");
  EXPECT_EQ(given->password, "given");
  EXPECT_EQ(RedisOptionsFromUrl("redis://h:1")->password, "");
}

TEST(RedisSlot, Crc16OfKeysAndHashTags) {
  // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
  EXPECT_EQ(RedisTier::SlotOf("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(RedisTier::SlotOf("foo"), 12182);
  EXPECT_EQ(RedisTier::SlotOf("bar"), 5061);
  EXPECT_EQ(RedisTier::SlotOf("{user1000}.following"), RedisTier::SlotOf("user1000"));
  EXPECT_EQ(RedisTier::SlotOf("foo{}{bar}"), RedisTier::SlotOf("foo{}{bar}"));
  EXPECT_NE(RedisTier::SlotOf("foo{}{bar}"), RedisTier::SlotOf("bar"));  // "{}" is no tag
  EXPECT_EQ(RedisTier::SlotOf("foo{{bar}}zap"), RedisTier::SlotOf("{bar"));
  EXPECT_EQ(RedisTier::SlotOf("foo{bar}{zap}"), RedisTier::SlotOf("bar"));
}

TEST(RedisTierOpen, UnreachableAndBadOptionsAreClearErrors) {
  // Port 1: nothing listens there, the connection is refused at once and named in the error.
  RedisTierOptions o;
  o.nodes = {RedisNode{"127.0.0.1", 1}};
  auto t = RedisTier::Open(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("127.0.0.1:1"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("no node answered"), std::string::npos)
      << t.status().message();
  o.command_timeout_ms = 0;
  t = RedisTier::Open(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("command_timeout_ms"), std::string::npos);
  o = RedisTierOptions{};
  t = RedisTier::Open(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("no node"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// One server

TEST(RedisTier, RoundTripKeysAndNx) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  auto tier = OpenTier(Options(s));
  ASSERT_NE(tier, nullptr);
  EXPECT_FALSE(tier->cluster());
  EXPECT_EQ(tier->name(), "redis");
  const std::vector<TestRun> runs = {MakeRun(1), MakeRun(2), MakeRun(3, 100000)};
  EXPECT_EQ(tier->Exists(Keys(runs)), std::vector<bool>(3, false));
  ASSERT_TRUE(tier->Put(Batch(runs)).ok());
  ASSERT_TRUE(tier->Drain(5000));
  EXPECT_EQ(tier->Exists(Keys(runs)), std::vector<bool>(3, true));
  const auto got = tier->Get(Keys(runs));
  ASSERT_EQ(got.size(), 3u);
  int64_t bytes = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    ASSERT_TRUE(got[i].has_value()) << i;
    EXPECT_TRUE(Is(got[i], runs[i].bytes)) << i;
    bytes += static_cast<int64_t>(runs[i].bytes.size());
  }
  // Content-addressed names under the prefix.
  const std::string name = "ckv:" + runs[0].key.Hex();
  EXPECT_EQ(tier->KeyOf(runs[0].key), name);
  EXPECT_EQ(Integer(s.Command(0, {"EXISTS", name})), 1);
  TierStats st = tier->stats();
  EXPECT_EQ(st.hits, 3);
  EXPECT_EQ(st.misses, 0);
  EXPECT_EQ(st.bytes_read, bytes);
  EXPECT_EQ(st.bytes_written, bytes);
  EXPECT_EQ(st.errors, 0);
  EXPECT_EQ(st.dropped, 0);
  // Written again: NX keeps the stored value and writes nothing.
  ASSERT_TRUE(tier->Put(Batch(runs)).ok());
  ASSERT_TRUE(tier->Drain(5000));
  EXPECT_EQ(tier->stats().bytes_written, bytes);
  EXPECT_EQ(tier->counters().kept, 3);
  // Malformed input is the caller's error and stores nothing.
  std::vector<std::pair<RunKey, std::string>> wrong = {{runs[0].key, runs[1].bytes}};
  Status bad = tier->Put(wrong);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find(runs[0].key.Hex()), std::string::npos) << bad.message();
  // Erase.
  tier->Erase(runs[1].key);
  EXPECT_EQ(tier->Exists(Keys(runs)), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(Integer(s.Command(0, {"DBSIZE"})), 2);
}

// redis://host:port/db: the runs go to that database; one the server lacks fails at Open.
TEST(RedisTier, SelectsTheUrlsDatabase) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  auto url = ParseRedisUrl(s.Url() + "/3");
  ASSERT_TRUE(url.ok()) << url.status().ToString();
  RedisTierOptions o = Options(s);
  o.db = url->db;
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const TestRun r = MakeRun(5);
  ASSERT_TRUE(tier->Put(Batch({r})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{r.key})[0], r.bytes));
  EXPECT_EQ(Integer(s.Command(0, {"DBSIZE"})), 0);  // database 0
  RedisReply info = s.Command(0, {"INFO", "keyspace"});
  ASSERT_TRUE(info && info->type == REDIS_REPLY_STRING);
  EXPECT_NE(std::string(info->str, info->len).find("db3:keys=1"), std::string::npos) << info->str;
  o.db = 999;  // the default config has 16 databases
  auto bad = RedisTier::Open(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("SELECT 999"), std::string::npos) << bad.status().message();
}

// A server that requires a password (requirepass) and an ACL user: the tier AUTHs on every
// connection; a wrong or missing password is refused at Open, naming AUTH or NOAUTH, never the
// password.
TEST(RedisTier, AuthenticatesWithPasswordOrAclUser) {
  RedisServers s;
  s.RequirePassword("p4ss-word");
  START_OR_FAIL(s, 1, false);
  RedisTierOptions o = Options(s);
  o.password = "p4ss-word";
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const TestRun r = MakeRun(7);
  ASSERT_TRUE(tier->Put(Batch({r})).ok());
  ASSERT_TRUE(tier->Drain(5000));  // the writer's own connection AUTHs too
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{r.key})[0], r.bytes));
  EXPECT_EQ(Integer(s.Command(0, {"DBSIZE"})), 1);

  o.password = "wrong-one";
  auto wrong = RedisTier::Open(o);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("AUTH: WRONGPASS"), std::string::npos)
      << wrong.status().message();
  EXPECT_EQ(wrong.status().message().find("wrong-one"), std::string::npos);
  o.password.clear();
  auto none = RedisTier::Open(o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("NOAUTH"), std::string::npos) << none.status().message();

  // The least an ACL user needs, as docs/DEPLOY.md lists it: the tier's keys and commands.
  RedisReply acl =
      s.Command(0, {"ACL", "SETUSER", "cachet", "on", ">us3r-pw", "~ckv:*", "+get", "+set",
                    "+getex", "+exists", "+del", "+select", "+asking", "+cluster"});
  ASSERT_TRUE(acl && acl->type == REDIS_REPLY_STATUS) << (acl ? acl->str : "no reply");
  o.user = "cachet";
  o.password = "us3r-pw";
  auto user = OpenTier(o);
  ASSERT_NE(user, nullptr);
  EXPECT_TRUE(Is(user->Get(std::vector<RunKey>{r.key})[0], r.bytes));
  const TestRun r2 = MakeRun(8);
  ASSERT_TRUE(user->Put(Batch({r2})).ok());
  ASSERT_TRUE(user->Drain(5000));
  EXPECT_TRUE(Is(user->Get(std::vector<RunKey>{r2.key})[0], r2.bytes));
  user->Erase(r2.key);
  EXPECT_EQ(user->Exists(std::vector<RunKey>{r2.key}), std::vector<bool>{false});
  EXPECT_EQ(user->stats().errors, 0);
  o.password = "p4ss-word";  // the default user's password is not this user's
  auto mixed = RedisTier::Open(o);
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.status().message().find("AUTH as cachet: WRONGPASS"), std::string::npos)
      << mixed.status().message();
}

TEST(RedisTier, ChainLookupStopsAtTheFirstMiss) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  auto tier = OpenTier(Options(s));
  ASSERT_NE(tier, nullptr);
  std::vector<TestRun> chain;
  for (uint32_t i = 0; i < 5; ++i) chain.push_back(MakeRun(10 + i));
  // Runs 0, 1 and 3 held; 2 missing.
  ASSERT_TRUE(tier->Put(Batch({chain[0], chain[1], chain[3]})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  ASSERT_EQ(s.Command(0, {"CONFIG", "RESETSTAT"})->type, REDIS_REPLY_STATUS);
  const auto got = tier->Get(Keys(chain));
  ASSERT_EQ(got.size(), 5u);
  EXPECT_TRUE(Is(got[0], chain[0].bytes));
  EXPECT_TRUE(Is(got[1], chain[1].bytes));
  EXPECT_FALSE(got[2].has_value());
  EXPECT_FALSE(got[3].has_value());  // held, but past the gap: not fetched
  EXPECT_FALSE(got[4].has_value());
  // One pipelined EXISTS over the chain, then GETEXs (reads that renew the TTL) of the held
  // prefix only.
  EXPECT_EQ(Calls(s, 0, "exists"), 5);
  EXPECT_EQ(Calls(s, 0, "getex"), 2);
  EXPECT_EQ(Calls(s, 0, "get"), 0);
  const TierStats st = tier->stats();
  EXPECT_EQ(st.hits, 2);
  EXPECT_EQ(st.misses, 3);
  // A chain whose first run is missing costs one round trip of EXISTS and no GET.
  ASSERT_EQ(s.Command(0, {"CONFIG", "RESETSTAT"})->type, REDIS_REPLY_STATUS);
  const std::vector<RunKey> tail = {chain[2].key, chain[3].key};
  EXPECT_EQ(tier->Get(tail), (std::vector<std::optional<std::string>>(2)));
  EXPECT_EQ(Calls(s, 0, "getex"), 0);
}

TEST(RedisTier, ValuesCarryTheTtl) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  RedisTierOptions o = Options(s);
  o.ttl_ms = 60000;
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const TestRun r = MakeRun(20);
  ASSERT_TRUE(tier->Put(Batch({r})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  const int64_t pttl = Integer(s.Command(0, {"PTTL", tier->KeyOf(r.key)}));
  EXPECT_GT(pttl, 50000);
  EXPECT_LE(pttl, 60000);
  // A hit renews the TTL (GETEX): a prefix in use does not expire under its readers.
  ASSERT_TRUE(s.Command(0, {"PEXPIRE", tier->KeyOf(r.key), "5000"}));
  ASSERT_TRUE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());
  EXPECT_GT(Integer(s.Command(0, {"PTTL", tier->KeyOf(r.key)})), 50000);
  // A short TTL: the run is gone once it passes.
  o.ttl_ms = 150;
  auto brief = OpenTier(o);
  ASSERT_NE(brief, nullptr);
  const TestRun q = MakeRun(21);
  ASSERT_TRUE(brief->Put(Batch({q})).ok());
  ASSERT_TRUE(brief->Drain(5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_FALSE(brief->Get(std::vector<RunKey>{q.key})[0].has_value());
}

TEST(RedisTier, DamagedValuesAreCountedDeletedAndNeverReturned) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  auto tier = OpenTier(Options(s));
  ASSERT_NE(tier, nullptr);
  const TestRun a = MakeRun(30), b = MakeRun(31), c = MakeRun(32), d = MakeRun(33);
  ASSERT_TRUE(tier->Put(Batch({a, b, c, d})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  // a: one byte in the middle flipped in place (SETRANGE).
  const size_t mid = a.bytes.size() / 2;
  const std::string flipped(1, static_cast<char>(a.bytes[mid] ^ 0x01));
  EXPECT_EQ(Integer(s.Command(0, {"SETRANGE", tier->KeyOf(a.key), std::to_string(mid), flipped})),
            static_cast<int64_t>(a.bytes.size()));
  // b: truncated by 7 bytes.
  ASSERT_EQ(s.Command(0, {"SET", tier->KeyOf(b.key), b.bytes.substr(0, b.bytes.size() - 7)})->type,
            REDIS_REPLY_STATUS);
  // c: an intact run, but another key's (d's bytes under c's name).
  ASSERT_EQ(s.Command(0, {"SET", tier->KeyOf(c.key), d.bytes})->type, REDIS_REPLY_STATUS);
  for (const TestRun* r : {&a, &b, &c}) {
    EXPECT_FALSE(tier->Get(std::vector<RunKey>{r->key})[0].has_value());
    EXPECT_EQ(Integer(s.Command(0, {"EXISTS", tier->KeyOf(r->key)})), 0) << "not deleted";
  }
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{d.key})[0], d.bytes));
  const TierStats st = tier->stats();
  EXPECT_EQ(st.corrupt, 3);
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.misses, 3);
  EXPECT_EQ(st.errors, 0);
  // Stored again once deleted (NX no longer finds the damaged value).
  ASSERT_TRUE(tier->Put(Batch({a})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{a.key})[0], a.bytes));
}

// Bound on one call against a dead or stalled server: a connect and a command timeout, with
// slack for a loaded machine.
double CallBoundMs(const RedisTierOptions& o) {
  return o.connect_timeout_ms + 2.0 * o.command_timeout_ms + 400;
}

TEST(RedisTier, KilledServerOpensTheBreakerAndTheTierRecovers) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  const RedisTierOptions o = Options(s);
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const TestRun r = MakeRun(40), q = MakeRun(41);
  ASSERT_TRUE(tier->Put(Batch({r})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  ASSERT_TRUE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());

  s.Kill(0);
  double slowest = 0;
  for (int i = 0; i < o.breaker_failures; ++i) {
    const auto t0 = Clock::now();
    EXPECT_FALSE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());
    slowest = std::max(slowest, MsSince(t0));
  }
  EXPECT_LT(slowest, CallBoundMs(o));
  EXPECT_TRUE(tier->breaker_open());
  EXPECT_GE(tier->counters().breaker_opened, 1);
  const int64_t errors = tier->stats().errors;
  EXPECT_GE(errors, o.breaker_failures);
  // Open: no I/O at all, so every call returns at once; lookups are misses counted as errors,
  // writes are dropped.
  auto t0 = Clock::now();
  EXPECT_FALSE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());
  EXPECT_EQ(tier->Exists(std::vector<RunKey>{r.key}), std::vector<bool>{false});
  ASSERT_TRUE(tier->Put(Batch({q})).ok());
  EXPECT_LT(MsSince(t0), 50.0);
  EXPECT_EQ(tier->stats().errors, errors + 2);
  EXPECT_EQ(tier->stats().dropped, 1);

  // Restarted (empty: no persistence); after the cooldown the next call closes the breaker.
  const std::string why = s.Restart(0);
  ASSERT_TRUE(why.empty()) << why;
  std::this_thread::sleep_for(std::chrono::milliseconds(o.breaker_cooldown_ms + 100));
  EXPECT_FALSE(tier->breaker_open());
  EXPECT_FALSE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());  // a miss, not an error
  EXPECT_EQ(tier->stats().errors, errors + 2);
  ASSERT_TRUE(tier->Put(Batch({r, q})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  const auto got = tier->Get(std::vector<RunKey>{r.key, q.key});
  EXPECT_TRUE(Is(got[0], r.bytes));
  EXPECT_TRUE(Is(got[1], q.bytes));
  EXPECT_EQ(tier->stats().errors, errors + 2);
}

TEST(RedisTier, StalledServerCostsAtMostTheTimeouts) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  const RedisTierOptions o = Options(s);
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const TestRun r = MakeRun(50);
  ASSERT_TRUE(tier->Put(Batch({r})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  s.Pause(0);  // accepts connections (the kernel does) but never answers
  double slowest = 0;
  for (int i = 0; i < o.breaker_failures; ++i) {
    const auto t0 = Clock::now();
    EXPECT_FALSE(tier->Get(std::vector<RunKey>{r.key})[0].has_value());
    const double ms = MsSince(t0);
    slowest = std::max(slowest, ms);
    EXPECT_GE(ms, o.command_timeout_ms * 0.8) << "call " << i << " did not wait for an answer";
  }
  EXPECT_LT(slowest, CallBoundMs(o));
  EXPECT_TRUE(tier->breaker_open());
  // Put never waits on the network, open breaker or not.
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < 20; ++i) ASSERT_TRUE(tier->Put(Batch({MakeRun(60 + i)})).ok());
  EXPECT_LT(MsSince(t0), 100.0);
  EXPECT_EQ(tier->stats().dropped, 20);
  s.Resume(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(o.breaker_cooldown_ms + 100));
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{r.key})[0], r.bytes));
}

TEST(RedisTier, FullWriteQueueDropsInsteadOfWaiting) {
  RedisServers s;
  START_OR_FAIL(s, 1, false);
  RedisTierOptions o = Options(s);
  o.command_timeout_ms = 3000;  // the writer stays stuck on the paused server while we Put
  const std::vector<TestRun> runs = [] {
    std::vector<TestRun> v;
    for (uint32_t i = 0; i < 10; ++i) v.push_back(MakeRun(70 + i, 50000));
    return v;
  }();
  const uint64_t run_bytes = runs[0].bytes.size() + 36;  // the value and its key
  o.write_queue_bytes = run_bytes * 5 / 2;               // two runs fit, not three
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  s.Pause(0);
  const auto t0 = Clock::now();
  for (const TestRun& r : runs) ASSERT_TRUE(tier->Put(Batch({r})).ok());
  EXPECT_LT(MsSince(t0), 100.0);
  // The cap bounds the runs queued and in the writer's hands together: two were taken.
  EXPECT_EQ(tier->stats().dropped, 8);
  s.Resume(0);
  ASSERT_TRUE(tier->Drain(10000));
  EXPECT_EQ(tier->Exists(Keys(runs)), (std::vector<bool>{true, true, false, false, false, false,
                                                         false, false, false, false}));
  EXPECT_EQ(tier->stats().dropped, 8);
  EXPECT_EQ(tier->stats().errors, 0);
}

// ---------------------------------------------------------------------------------------------
// A 3-node Redis Cluster

// password: the nodes require it (every node the slot map names is AUTHed to as it is reached).
void ClusterRoundTrip(const std::string& password) {
  RedisServers s;
  s.RequirePassword(password);
  START_OR_FAIL(s, 3, true);
  RedisTierOptions o = Options(s);
  o.nodes.clear();
  auto url = ParseRedisUrl(s.ClusterUrl());
  ASSERT_TRUE(url.ok()) << url.status().ToString();
  o.nodes = url->nodes;
  o.password = password;
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  EXPECT_TRUE(tier->cluster());
  std::vector<TestRun> runs;
  for (uint32_t i = 0; i < 30; ++i) runs.push_back(MakeRun(100 + i));
  // The tier's slots are the server's.
  for (const TestRun& r : runs) {
    EXPECT_EQ(Integer(s.Command(0, {"CLUSTER", "KEYSLOT", tier->KeyOf(r.key)})),
              RedisTier::SlotOf(tier->KeyOf(r.key)));
  }
  ASSERT_TRUE(tier->Put(Batch(runs)).ok());
  ASSERT_TRUE(tier->Drain(5000));
  int64_t total = 0;
  for (int n = 0; n < 3; ++n) {
    const int64_t held = Integer(s.Command(n, {"DBSIZE"}));
    EXPECT_GT(held, 0) << "node " << n << " holds none of 30 keys";
    total += held;
  }
  EXPECT_EQ(total, 30);
  const auto got = tier->Get(Keys(runs));  // one chain over all three nodes
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_TRUE(Is(got[i], runs[i].bytes)) << i;
  const TierStats st = tier->stats();
  EXPECT_EQ(st.hits, 30);
  EXPECT_EQ(st.errors, 0);
  EXPECT_EQ(tier->counters().moved, 0);  // the slot map was right
  // A database other than 0 is refused for a cluster.
  o.db = 1;
  auto bad = RedisTier::Open(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("only database 0"), std::string::npos)
      << bad.status().message();
}

TEST(RedisCluster, KeysSpreadOverTheNodesAndRoundTrip) { ClusterRoundTrip(""); }
TEST(RedisCluster, PasswordOnEveryNode) { ClusterRoundTrip("cluster-pw"); }

std::string NodeId(const RedisServers& s, int node) {
  RedisReply r = s.Command(node, {"CLUSTER", "MYID"});
  return r && r->type == REDIS_REPLY_STRING ? std::string(r->str, r->len) : "";
}

TEST(RedisCluster, FollowsAskDuringAMigrationAndMovedAfterIt) {
  RedisServers s;
  START_OR_FAIL(s, 3, true);
  // One seed node: the tier learns the rest from CLUSTER SLOTS.
  auto tier = OpenTier(Options(s, 0));
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->cluster());
  // Two runs whose slot node 0 owns (slots [0, 5461)), in different slots.
  std::vector<TestRun> runs;
  for (uint32_t id = 200; runs.size() < 2; ++id) {
    TestRun r = MakeRun(id);
    const int slot = RedisTier::SlotOf(tier->KeyOf(r.key));
    if (slot < 5461 && (runs.empty() || RedisTier::SlotOf(tier->KeyOf(runs[0].key)) != slot)) {
      runs.push_back(std::move(r));
    }
  }
  const TestRun& moving = runs[0];
  const std::string key = tier->KeyOf(moving.key), slot = std::to_string(RedisTier::SlotOf(key));
  ASSERT_TRUE(tier->Put(Batch(runs)).ok());
  ASSERT_TRUE(tier->Drain(5000));
  ASSERT_EQ(Integer(s.Command(0, {"EXISTS", key})), 1);

  // Migrate the slot to node 1: while it migrates, node 0 answers ASK for the key it moved.
  const std::string id0 = NodeId(s, 0), id1 = NodeId(s, 1);
  ASSERT_FALSE(id0.empty());
  ASSERT_FALSE(id1.empty());
  ASSERT_EQ(s.Command(1, {"CLUSTER", "SETSLOT", slot, "IMPORTING", id0})->type, REDIS_REPLY_STATUS);
  ASSERT_EQ(s.Command(0, {"CLUSTER", "SETSLOT", slot, "MIGRATING", id1})->type, REDIS_REPLY_STATUS);
  RedisReply m =
      s.Command(0, {"MIGRATE", "127.0.0.1", std::to_string(s.port(1)), key, "0", "5000"});
  ASSERT_TRUE(m && m->type == REDIS_REPLY_STATUS) << (m && m->str ? m->str : "no reply");
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{moving.key})[0], moving.bytes));
  const auto both = tier->Get(Keys(runs));
  EXPECT_TRUE(Is(both[0], moving.bytes));
  EXPECT_TRUE(Is(both[1], runs[1].bytes));
  EXPECT_GE(tier->counters().ask, 2);
  EXPECT_EQ(tier->counters().moved, 0);

  // The migration done: node 0 answers MOVED; the tier refreshes its map and retries.
  for (const int n : {1, 0, 2}) {  // the new owner first, as the cluster tutorial does
    ASSERT_EQ(s.Command(n, {"CLUSTER", "SETSLOT", slot, "NODE", id1})->type, REDIS_REPLY_STATUS);
  }
  EXPECT_TRUE(Is(tier->Get(std::vector<RunKey>{moving.key})[0], moving.bytes));
  const RedisCounters after = tier->counters();
  EXPECT_GE(after.moved, 1);
  EXPECT_GE(after.slot_refreshes, 1);
  // The map is right now: no more redirects, and a write of the slot lands on node 1.
  EXPECT_TRUE(Is(tier->Get(Keys(runs))[0], moving.bytes));
  EXPECT_EQ(tier->counters().moved, after.moved);
  tier->Erase(moving.key);
  EXPECT_EQ(Integer(s.Command(1, {"EXISTS", key})), 0);
  ASSERT_TRUE(tier->Put(Batch({moving})).ok());
  ASSERT_TRUE(tier->Drain(5000));
  EXPECT_EQ(Integer(s.Command(1, {"EXISTS", key})), 1);
  EXPECT_EQ(tier->stats().errors, 0);
}

}  // namespace
}  // namespace cachet::tiers

// ---------------------------------------------------------------------------------------------
// Engines sharing one server

namespace cachet {
namespace {

using testing::RedisReply;
using testing::RedisServers;

EngineOptions RedisOptions(const std::string& url) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.n_ctx = 1024;
  o.redis_url = url;
  return o;
}

std::vector<int32_t> PromptOf(int n) {
  auto e = Engine::Create(RedisOptions(""));
  EXPECT_TRUE(e.ok());
  std::string text;
  std::vector<int32_t> ids;
  for (int i = 0; static_cast<int>(ids.size()) < n; ++i) {
    text += "Lily went to the park on day " + std::to_string(i) +
            " and saw a big red ball under the old tree. ";
    ids = (*e)->tokenizer().EncodePrompt(text);
  }
  ids.resize(n);
  return ids;
}

struct Outcome {
  std::vector<float> logits;
  KvStats kv;
};

// One engine, as one process: created, a prompt evaluated, destroyed (its queued writes drained).
Outcome Eval(const EngineOptions& o, const std::vector<int32_t>& prompt) {
  Outcome r;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return r;
  auto s = (*e)->NewSession();
  EXPECT_TRUE(s->Eval(prompt, &r.logits).ok());
  r.kv = (*e)->kv_stats();
  return r;
}

// 600 tokens: runs of 256, 256 and 80 (the last partial block is never stored).
TEST(RedisEngine, SecondEngineServesThePromptFromRedis) {
  RedisServers s;
  const std::string why = s.Start(1, false);
  ASSERT_TRUE(why.empty()) << "redis-server: " << why;
  const auto prompt = PromptOf(600);
  const Outcome cold = Eval(RedisOptions(""), prompt);
  const Outcome first = Eval(RedisOptions(s.Url()), prompt);
  EXPECT_EQ(first.logits, cold.logits);
  ASSERT_EQ(first.kv.tiers.size(), 1u);
  EXPECT_EQ(first.kv.tiers[0].name, "redis");
  EXPECT_EQ(first.kv.tiers[0].loaded_tokens, 0);
  RedisReply keys = s.Command(0, {"DBSIZE"});
  ASSERT_TRUE(keys && keys->type == REDIS_REPLY_INTEGER);
  EXPECT_EQ(keys->integer, 3);
  const Outcome second = Eval(RedisOptions(s.Url()), prompt);
  EXPECT_EQ(second.logits, cold.logits);  // bit for bit
  EXPECT_EQ(second.kv.prefix_hit_tokens, 592);
  ASSERT_EQ(second.kv.tiers.size(), 1u);
  EXPECT_EQ(second.kv.tiers[0].loaded_tokens, 592);
  EXPECT_EQ(second.kv.tiers[0].hits, 3);
  EXPECT_EQ(second.kv.tiers[0].bytes_written, 0);
  EXPECT_EQ(second.kv.tiers[0].errors, 0);
}

// --redis with credentials, end to end: a server that requires a password serves the second
// engine's prompt; a wrong password stops the engine at start, naming AUTH.
TEST(RedisEngine, PasswordInTheUrl) {
  RedisServers s;
  s.RequirePassword("kv pass");
  const std::string why = s.Start(1, false);
  ASSERT_TRUE(why.empty()) << "redis-server: " << why;
  const std::string url = "redis://:kv%20pass@127.0.0.1:" + std::to_string(s.port(0));
  const auto prompt = PromptOf(600);
  const Outcome first = Eval(RedisOptions(url), prompt);
  const Outcome second = Eval(RedisOptions(url), prompt);
  EXPECT_EQ(second.logits, first.logits);
  EXPECT_EQ(second.kv.prefix_hit_tokens, 592);
  ASSERT_EQ(second.kv.tiers.size(), 1u);
  EXPECT_EQ(second.kv.tiers[0].loaded_tokens, 592);
  auto e = Engine::Create(RedisOptions("redis://:nope@127.0.0.1:" + std::to_string(s.port(0))));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("AUTH: WRONGPASS"), std::string::npos)
      << e.status().message();
}

// Disk over Redis: a process with an empty disk cache gets the prompt from Redis, and says so.
TEST(RedisEngine, DiskOverRedisFallsThroughToRedis) {
  RedisServers s;
  const std::string why = s.Start(1, false);
  ASSERT_TRUE(why.empty()) << "redis-server: " << why;
  testing::TempDir disk_a, disk_b;
  const auto prompt = PromptOf(300);
  EngineOptions a = RedisOptions(s.Url()), b = RedisOptions(s.Url());
  a.disk_cache_dir = disk_a.path();
  b.disk_cache_dir = disk_b.path();
  const Outcome cold = Eval(RedisOptions(""), prompt);
  Eval(a, prompt);
  const Outcome hit = Eval(b, prompt);
  EXPECT_EQ(hit.logits, cold.logits);
  ASSERT_EQ(hit.kv.tiers.size(), 2u);
  EXPECT_EQ(hit.kv.tiers[0].name, "disk");
  EXPECT_EQ(hit.kv.tiers[1].name, "redis");
  EXPECT_EQ(hit.kv.tiers[0].loaded_tokens, 0);
  EXPECT_EQ(hit.kv.tiers[1].loaded_tokens, 288);
  EXPECT_NE(hit.kv.ToString().find("redis tier"), std::string::npos);
}

TEST(RedisEngine, RuntimeReportsPromptTokensFromRedis) {
  RedisServers s;
  const std::string why = s.Start(1, false);
  ASSERT_TRUE(why.empty()) << "redis-server: " << why;
  RuntimeOptions o;
  o.engine = RedisOptions(s.Url());
  o.max_sequences = 2;
  const auto prompt = PromptOf(300);
  CompletionRequest req;
  req.prompt = prompt;
  req.max_tokens = 4;
  req.sampling.temperature = 0;
  auto run = [&](Runtime& rt) {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::vector<int32_t> tokens;
    EXPECT_TRUE(rt.Submit(req, [&](const TokenEvent& e) {
                    std::lock_guard<std::mutex> lock(mu);
                    tokens.insert(tokens.end(), e.tokens.begin(), e.tokens.end());
                    if (e.finished) {
                      done = true;
                      cv.notify_all();
                    }
                  }).ok());
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return done; }));
    return tokens;
  };
  std::vector<int32_t> first;
  {
    auto rt = Runtime::Create(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    first = run(**rt);
  }
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_EQ(run(**rt), first);
  const RuntimeMetrics m = (*rt)->Metrics();
  ASSERT_EQ(m.prompt_tokens_by_source.size(), 3u);
  EXPECT_EQ(m.prompt_tokens_by_source[2].first, "redis");
  EXPECT_EQ(m.prompt_tokens_by_source[2].second, 288);
  EXPECT_EQ(m.prompt_tokens_by_source[1].second, 0);
  ASSERT_EQ(m.kv_tiers.size(), 1u);
  EXPECT_EQ(m.kv_tiers[0].hits, 2);
}

// Redis at maxmemory. With eviction (allkeys-lru) runs disappear under the engines: a later
// process finds only the recent ones and computes the rest; without it (noeviction) the server
// refuses the writes, which the writing process counts as dropped. Either way every prompt's
// logits are the cold run's.
TEST(RedisEngine, MaxmemoryEvictsOrRefusesAndAnswersStayCold) {
  for (const char* policy : {"allkeys-lru", "noeviction"}) {
    SCOPED_TRACE(policy);
    RedisServers s;
    const std::string why = s.Start(1, false);
    ASSERT_TRUE(why.empty()) << "redis-server: " << why;
    // A 256-token run of kvtiny's f32 pages is 2 MiB: room for a few of the eight written (the
    // writer's pipelined SETs sit in Redis's query buffer, which counts against maxmemory too).
    ASSERT_TRUE(s.Command(0, {"CONFIG", "SET", "maxmemory", "10mb"}));
    ASSERT_TRUE(s.Command(0, {"CONFIG", "SET", "maxmemory-policy", policy}));
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::vector<float>> cold;
    for (int i = 0; i < 4; ++i) {
      std::vector<int32_t> p = PromptOf(520 + 8 * (i % 2));
      p[1] = 100 + i;  // distinct from the first block on: no run is shared
      prompts.push_back(p);
      cold.push_back(Eval(RedisOptions(""), p).logits);
    }
    // One long-lived process writes all four prompts (eight runs), then its queue drains.
    auto writer = Engine::Create(RedisOptions(s.Url()));
    ASSERT_TRUE(writer.ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<float> logits;
      ASSERT_TRUE((*writer)->NewSession()->Eval(prompts[i], &logits).ok());
      EXPECT_EQ(logits, cold[i]);
    }
    KvStats::Tier w;
    int64_t last = -1;
    for (int tries = 0, still = 0; tries < 200 && still < 4; ++tries) {  // writes answered
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      w = (*writer)->kv_stats().tiers.at(0);
      const int64_t now = w.bytes_written + w.dropped;
      still = now > 0 && now == last ? still + 1 : 0;
      last = now;
    }
    // Fresh processes, the most recent prompt first: what Redis still holds is used, the rest
    // computed, and the answers are the cold ones.
    int64_t loaded = 0, misses = 0;
    for (int i = 3; i >= 0; --i) {
      const Outcome got = Eval(RedisOptions(s.Url()), prompts[i]);
      ASSERT_EQ(got.logits, cold[i]) << "prompt " << i;
      loaded += got.kv.tiers.at(0).loaded_tokens;
      misses += got.kv.tiers.at(0).misses;
    }
    RedisReply stats = s.Command(0, {"INFO", "stats"});
    ASSERT_TRUE(stats && stats->type == REDIS_REPLY_STRING);
    const std::string st(stats->str, stats->len);
    const size_t at = st.find("evicted_keys:");
    ASSERT_NE(at, std::string::npos);
    const long evicted = std::atol(st.c_str() + at + 13);
    EXPECT_GT(misses, 0);  // eight runs do not fit
    if (std::string(policy) == "allkeys-lru") {
      EXPECT_GT(evicted, 0);
      EXPECT_GT(loaded, 0);  // the last prompt's runs were still there
      EXPECT_EQ(w.dropped, 0);
    } else {
      EXPECT_EQ(evicted, 0);
      EXPECT_GT(w.dropped, 0) << "bytes written " << w.bytes_written;  // OOM replies to SET
    }
  }
}

// `cachet bench --tier-ttft` with both tiers: TTFT from each source, and what each loaded.
TEST(RedisEngine, BenchTierTtftReadsDiskAndRedis) {
  RedisServers s;
  const std::string why = s.Start(1, false);
  ASSERT_TRUE(why.empty()) << "redis-server: " << why;
  testing::TempDir disk;
  const testing::CliRun r = testing::RunCachet(
      "bench --tier-ttft --ctx 300 --reps 1 --json -t 1 "
      "--disk-cache " +
      disk.path() + " --redis " + s.Url());
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string& out = r.out;
  const auto j = nlohmann::json::parse(out);
  for (const char* src : {"compute", "compute_and_store", "ram", "disk", "redis"}) {
    ASSERT_TRUE(j["ttft_ms"].contains(src)) << out;
    EXPECT_GT(j["ttft_ms"][src].get<double>(), 0.0) << src;
  }
  EXPECT_EQ(j["disk_tokens_loaded"].get<double>(), 288);  // 18 whole 16-token pages
  EXPECT_EQ(j["redis_tokens_loaded"].get<double>(), 288);
  EXPECT_GT(j["redis_bytes_read"].get<double>(), 0);
}

TEST(RedisEngine, BadOptionsAreClearErrors) {
  EngineOptions o = RedisOptions("redis://127.0.0.1:1");
  o.prefix_cache = false;
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--redis needs the prefix cache"), std::string::npos)
      << e.status().message();
  e = Engine::Create(RedisOptions("redis://127.0.0.1:99999"));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("port \"99999\""), std::string::npos) << e.status().message();
  e = Engine::Create(RedisOptions("redis://127.0.0.1:1"));  // nothing listens on port 1
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("127.0.0.1:1"), std::string::npos) << e.status().message();
}

}  // namespace
}  // namespace cachet
