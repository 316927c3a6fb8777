// Kept caches of the serving runtime (Runtime::CreateCache, CompletionRequest::cache_id) on
// kvtiny: requests on a pressed cache generate what a session loaded from its file generates in
// process, hold its pages once, and the cache is found again by a restarted runtime, or by
// another runtime on the same Redis (a real redis-server on loopback); caches past the RAM cap
// leave it and come back; unknown ids, other salts and a press on a cache are refused; deleting
// frees the pages and the stored copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cachet/engine.h"
#include "cachet/serving.h"
#include "redis_fixture.h"
#include "runtime_collector.h"
#include "test_util.h"

namespace cachet {
namespace {

using testing::Collector;

RuntimeOptions Options(const std::string& cache_dir) {
  RuntimeOptions o;
  o.engine.model_dir = testing::ModelDir();
  o.engine.threads = 2;
  o.engine.kv_codec_k = o.engine.kv_codec_v = "q8_0";
  o.max_sequences = 4;
  o.batch_tokens = 64;  // the context takes several steps
  o.cache_dir = cache_dir;
  return o;
}

const char* kContext =
    "Once upon a time, there was a little girl named Lily. She had a red ball and a small dog "
    "named Max. Every day after school they ran to the park by the river. One day, a bird flew "
    "over the tall tree and saw a shiny thing in the grass below. It was a key! The bird picked "
    "it up and flew home to show its mother what it had found. The cat sat on the mat and "
    "looked at the dog. The dog was big and brown and liked to run in the park.";

press::PressOptions SnapKv(double ratio) {
  press::PressOptions p;
  EXPECT_TRUE(press::ParsePressSpec("snapkv", &p).ok());
  p.ratio = ratio;
  return p;
}

// Creates a cache and waits for it.
Result<KvCacheInfo> Create(Runtime& rt, KvCacheRequest request) {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Result<KvCacheInfo>> out;
  auto id = rt.CreateCache(std::move(request), [&](const Result<KvCacheInfo>& r) {
    std::lock_guard<std::mutex> lock(mu);
    out = r;
    cv.notify_all();
  });
  if (!id.ok()) return id.status();
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return out.has_value(); });
  return *out;
}

CompletionRequest OnCache(const std::string& id, std::vector<int32_t> prompt, int max_tokens) {
  CompletionRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_at_eos = false;
  r.cache_id = id;
  return r;
}

int PagesInUse(const KvStats& s) { return s.pages_used - s.pages_reclaimable; }

TEST(RuntimeCaches, RequestsOnAPressedCacheEqualTheSavedSessionInProcess) {
  testing::TempDir dir;
  const std::string cache_dir = dir.path() + "/caches";
  auto rt = Runtime::Create(Options(cache_dir));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const int before = PagesInUse(r.kv_stats());
  // Long enough that the cache's pages outnumber what a request adds to them.
  const std::string text = std::string(kContext) + kContext + kContext + kContext;
  const std::vector<int32_t> context = r.tokenizer().EncodePrompt(text);
  auto info = Create(r, {context, "", SnapKv(0.5), "a note"});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->id.starts_with("kvc-"));
  EXPECT_EQ(info->id.size(), 36u);
  EXPECT_EQ(info->tokens, static_cast<int>(context.size()));
  EXPECT_EQ(info->compression, "snapkv ratio 0.500");
  EXPECT_EQ(info->note, "a note");
  const int64_t heads = int64_t{r.config().n_layers} * r.config().n_kv_heads;
  EXPECT_LE(info->held_rows, heads * static_cast<int64_t>(context.size() + 1) / 2);  // pressed
  EXPECT_TRUE(std::filesystem::exists(cache_dir + "/" + info->id + ".ckv"));
  const int cache_pages = PagesInUse(r.kv_stats()) - before;
  ASSERT_GT(cache_pages, 0);
  EXPECT_EQ(r.Metrics().kv_caches, 1);
  EXPECT_EQ(r.Metrics().kv_cache_bytes, info->bytes);

  // Three requests on it at once (no BOS: the prompt follows the context).
  const std::vector<int32_t> question = r.tokenizer().Encode(" Where did the bird fly?");
  Collector a, b, c;
  ASSERT_TRUE(r.Submit(OnCache(info->id, question, 24), a.Callback(&r)).ok());
  ASSERT_TRUE(r.Submit(OnCache(info->id, question, 24), b.Callback(&r)).ok());
  ASSERT_TRUE(r.Submit(OnCache(info->id, question, 24), c.Callback(&r)).ok());
  a.Wait();
  b.Wait();
  c.Wait();
  ASSERT_TRUE(a.last.error.ok()) << a.last.error.ToString();
  ASSERT_EQ(a.tokens.size(), 24u);
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_EQ(a.last.usage.prompt_tokens, static_cast<int>(context.size() + question.size()));
  EXPECT_EQ(a.last.usage.cached_tokens, static_cast<int>(context.size()));
  // Each fork holds only its own tokens' pages (and copies of partly filled last pages): the
  // three together hold less than one more copy of the context, and nothing once they end.
  const int most = std::max({a.most_pages.load(), b.most_pages.load(), c.most_pages.load()});
  EXPECT_GT(most, before + cache_pages);  // seen while they ran
  EXPECT_LT(most - before - cache_pages, cache_pages);
  EXPECT_EQ(PagesInUse(r.kv_stats()) - before, cache_pages);

  // In process: the saved file, loaded and forked, continued with the same question.
  EngineOptions eo = Options("").engine;
  auto engine = Engine::Create(eo);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto loaded = (*engine)->LoadSession(cache_dir + "/" + info->id + ".ckv");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  GenerateOptions g;
  g.max_tokens = 24;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  auto fork = (*loaded)->Fork();
  auto in_process = fork->Generate(question, g);
  ASSERT_TRUE(in_process.ok()) << in_process.status().ToString();
  EXPECT_EQ(in_process->tokens, a.tokens);
  // Pressed and generated in process from scratch: the same again.
  auto fresh = (*engine)->NewSession();
  ASSERT_TRUE(fresh->EvalPressed(context, SnapKv(0.5), nullptr).ok());
  auto direct = fresh->Generate(question, g);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(direct->tokens, a.tokens);
  // Without the context the question continues otherwise.
  Collector alone;
  CompletionRequest no_context =
      OnCache("", r.tokenizer().EncodePrompt("Where did the bird fly?"), 24);
  ASSERT_TRUE(r.Submit(no_context, alone.Callback()).ok());
  alone.Wait();
  EXPECT_NE(alone.tokens, a.tokens);

  // Deleted: the pages, the metric and the files go; the id is unknown from then on.
  ASSERT_TRUE(r.DeleteCache(info->id, "").ok());
  EXPECT_EQ(PagesInUse(r.kv_stats()), before);
  EXPECT_EQ(r.Metrics().kv_caches, 0);
  EXPECT_EQ(r.Metrics().kv_cache_bytes, 0);
  EXPECT_FALSE(std::filesystem::exists(cache_dir + "/" + info->id + ".ckv"));
  EXPECT_EQ(r.FindCache(info->id, "").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.DeleteCache(info->id, "").code(), StatusCode::kNotFound);
  EXPECT_TRUE(r.ListCaches("").empty());
}

// A prompt that fits the pool alone but not beside the kept caches: an error that says what holds
// the pool and how to free it (it was the engine's "KV pool exhausted ... shorten the prompt").
TEST(RuntimeCaches, APromptTheKeptCachesLeaveNoRoomForSaysSo) {
  RuntimeOptions o = Options("");
  o.engine.kv_mem_mib = 1;
  o.cache_mem_bytes = 1 << 20;
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const int fits = testing::TokensThePoolHolds(r);
  auto info = Create(r, {std::vector<int32_t>(fits * 4 / 10, 10), "", std::nullopt, ""});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  Collector c;
  CompletionRequest q;
  q.prompt.assign(fits * 3 / 4, 11);
  q.max_tokens = 4;
  ASSERT_TRUE(r.Submit(q, c.Callback()).ok());
  c.Wait();
  EXPECT_EQ(c.last.error.code(), StatusCode::kResourceExhausted) << c.last.error.ToString();
  EXPECT_NE(c.last.error.message().find("beside the 1 kept caches"), std::string::npos)
      << c.last.error.message();
  EXPECT_NE(c.last.error.message().find("DELETE /v1/caches/ID"), std::string::npos);
  // Once the cache is deleted, the same prompt runs.
  ASSERT_TRUE(r.DeleteCache(info->id, "").ok());
  Collector again;
  ASSERT_TRUE(r.Submit(q, again.Callback()).ok());
  again.Wait();
  EXPECT_TRUE(again.last.error.ok()) << again.last.error.ToString();
}

TEST(RuntimeCaches, UnknownIdsOtherSaltsAndPressesAreRefused) {
  testing::TempDir dir;
  auto rt = Runtime::Create(Options(dir.path()));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const std::vector<int32_t> context = r.tokenizer().EncodePrompt(kContext);
  auto info = Create(r, {context, "tenant-a", std::nullopt, ""});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->compression, "none");
  const std::vector<int32_t> q = r.tokenizer().Encode(" The end.");

  CompletionRequest pressed = OnCache(info->id, q, 4);
  pressed.cache_salt = "tenant-a";
  pressed.press = SnapKv(0.5);
  auto refused = r.Submit(pressed, [](const TokenEvent&) {});
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(refused.status().message().starts_with("kv_press:")) << refused.status().message();

  // Another salt, no salt, an unknown id and a malformed one: the same NotFound, named.
  for (const auto& [id, salt] : std::vector<std::pair<std::string, std::string>>{
           {info->id, "tenant-b"},
           {info->id, ""},
           {"kvc-00000000000000000000000000000000", "tenant-a"},
           {"../../etc/passwd", "tenant-a"}}) {
    Collector c;
    CompletionRequest req = OnCache(id, q, 4);
    req.cache_salt = salt;
    ASSERT_TRUE(r.Submit(req, c.Callback()).ok());
    c.Wait();
    EXPECT_EQ(c.last.error.code(), StatusCode::kNotFound) << id << " " << salt;
    EXPECT_NE(c.last.error.message().find(id), std::string::npos) << c.last.error.message();
    EXPECT_TRUE(c.tokens.empty());
    EXPECT_EQ(r.FindCache(id, salt).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(r.DeleteCache(id, salt).code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(r.ListCaches("").size(), 0u);
  ASSERT_EQ(r.ListCaches("tenant-a").size(), 1u);
  EXPECT_TRUE(r.FindCache(info->id, "tenant-a").ok());
  // A prompt that, after the cache's tokens, leaves no room in the context.
  Collector too_long;
  CompletionRequest req =
      OnCache(info->id, std::vector<int32_t>(r.n_ctx() - context.size(), q[0]), 4);
  req.cache_salt = "tenant-a";
  ASSERT_TRUE(r.Submit(req, too_long.Callback()).ok());
  too_long.Wait();
  EXPECT_EQ(too_long.last.error.code(), StatusCode::kOutOfRange);
}

TEST(RuntimeCaches, RestartedRuntimeFindsTheCacheOnDisk) {
  testing::TempDir dir;
  std::string id;
  std::vector<int32_t> question, first;
  {
    auto rt = Runtime::Create(Options(dir.path()));
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto info = Create(**rt, {(*rt)->tokenizer().EncodePrompt(kContext), "t", SnapKv(0.5), "n"});
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    id = info->id;
    question = (*rt)->tokenizer().Encode(" The dog");
    Collector c;
    CompletionRequest req = OnCache(id, question, 16);
    req.cache_salt = "t";
    ASSERT_TRUE((*rt)->Submit(req, c.Callback()).ok());
    c.Wait();
    first = c.tokens;
    ASSERT_EQ(first.size(), 16u);
  }
  auto rt = Runtime::Create(Options(dir.path()));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_TRUE((*rt)->ListCaches("t").empty());  // not resident until looked up
  EXPECT_EQ((*rt)->FindCache(id, "other").status().code(), StatusCode::kNotFound);
  auto found = (*rt)->FindCache(id, "t");
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->compression, "snapkv ratio 0.500");
  EXPECT_EQ(found->note, "n");
  EXPECT_EQ((*rt)->Metrics().kv_caches, 1);
  Collector c;
  CompletionRequest req = OnCache(id, question, 16);
  req.cache_salt = "t";
  ASSERT_TRUE((*rt)->Submit(req, c.Callback()).ok());
  c.Wait();
  EXPECT_EQ(c.tokens, first);
  // Damaged on disk: a reason for the client, without the server's paths.
  const std::string ckv = dir.path() + "/" + id + ".ckv";
  const std::string bytes = testing::ReadFile(ckv);
  { std::ofstream(ckv, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2); }
  auto other = Runtime::Create(Options(dir.path()));
  ASSERT_TRUE(other.ok());
  auto damaged = (*other)->FindCache(id, "t");
  EXPECT_EQ(damaged.status().code(), StatusCode::kNotFound);
  EXPECT_NE(damaged.status().message().find("checksum"), std::string::npos)
      << damaged.status().message();
  EXPECT_EQ(damaged.status().message().find(dir.path()), std::string::npos)
      << damaged.status().message();
  ASSERT_TRUE((*rt)->DeleteCache(id, "t").ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  // Pages without a description (a writer crashed between the two files): removed at the next
  // start once ten minutes old, left alone while a writer may still be at it.
  const std::string old_orphan = dir.path() + "/kvc-" + std::string(32, 'a') + ".ckv";
  const std::string new_orphan = dir.path() + "/kvc-" + std::string(32, 'b') + ".ckv";
  for (const std::string& p : {old_orphan, new_orphan}) std::ofstream(p) << bytes;
  std::filesystem::last_write_time(
      old_orphan, std::filesystem::file_time_type::clock::now() - std::chrono::minutes(11));
  // A damaged description: its cache is no salt's, any DELETE of the id removes it, and the
  // next start removes one ten minutes old.
  const std::string damaged_id = "kvc-" + std::string(32, 'c');
  const std::string old_damaged = "kvc-" + std::string(32, 'd');
  for (const std::string& d : {damaged_id, old_damaged}) {
    std::ofstream(dir.path() + "/" + d + ".ckv") << bytes;
    std::ofstream(dir.path() + "/" + d + ".json") << "{not json";
  }
  std::filesystem::last_write_time(
      dir.path() + "/" + old_damaged + ".ckv",
      std::filesystem::file_time_type::clock::now() - std::chrono::minutes(11));
  auto restarted = Runtime::Create(Options(dir.path()));
  ASSERT_TRUE(restarted.ok());
  EXPECT_FALSE(std::filesystem::exists(old_orphan));
  EXPECT_TRUE(std::filesystem::exists(new_orphan));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + old_damaged + ".json"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + old_damaged + ".ckv"));
  EXPECT_EQ((*restarted)->FindCache(damaged_id, "t").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE((*restarted)->DeleteCache(damaged_id, "anyone").ok());
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + damaged_id + ".json"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + damaged_id + ".ckv"));
}

// What a request on cache id generates (greedy).
std::vector<int32_t> Answer(Runtime& rt, const std::string& id, const std::string& salt,
                            const std::vector<int32_t>& question) {
  Collector c;
  CompletionRequest req = OnCache(id, question, 12);
  req.cache_salt = salt;
  EXPECT_TRUE(rt.Submit(req, c.Callback()).ok());
  c.Wait();
  EXPECT_EQ(c.last.finish_reason, "length") << c.last.error.ToString();
  return c.tokens;
}

TEST(RuntimeCaches, CachesPastTheRamCapLeaveItAndComeBackFromDisk) {
  // One cache's bytes, from a runtime with the default cap.
  int64_t one = 0;
  {
    auto probe = Runtime::Create(Options(""));
    ASSERT_TRUE(probe.ok()) << probe.status().ToString();
    auto info = Create(**probe, {(*probe)->tokenizer().EncodePrompt(kContext), "", {}, ""});
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    one = info->bytes;
  }
  ASSERT_GT(one, 0);
  RuntimeOptions o = Options("");
  o.cache_mem_bytes = one * 3 / 2;  // room for one
  {  // Without a store a second cache is refused, and nothing of it is kept.
    auto rt = Runtime::Create(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const std::vector<int32_t> context = (*rt)->tokenizer().EncodePrompt(kContext);
    ASSERT_TRUE(Create(**rt, {context, "", {}, ""}).ok());
    const int pages = PagesInUse((*rt)->kv_stats());
    auto second = Create(**rt, {context, "", {}, ""});
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(second.status().message().find("--cache-mem-mib"), std::string::npos);
    EXPECT_EQ((*rt)->Metrics().kv_caches, 1);
    EXPECT_EQ(PagesInUse((*rt)->kv_stats()), pages);
  }
  testing::TempDir dir;
  o.cache_dir = dir.path();
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const std::vector<int32_t> question = r.tokenizer().Encode(" The dog");
  auto a = Create(r, {r.tokenizer().EncodePrompt(kContext), "", {}, ""});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  const std::vector<int32_t> first = Answer(r, a->id, "", question);
  const int with_a = PagesInUse(r.kv_stats());
  auto b = Create(r, {r.tokenizer().EncodePrompt(std::string(kContext) + " The end."), "", {}, ""});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  // a left RAM for b: one cache's pages in use, a's stored copy still there.
  EXPECT_EQ(r.Metrics().kv_caches, 1);
  EXPECT_EQ(r.Metrics().kv_caches_unloaded, 1);
  ASSERT_EQ(r.ListCaches("").size(), 1u);
  EXPECT_EQ(r.ListCaches("")[0].id, b->id);
  EXPECT_LT(PagesInUse(r.kv_stats()), with_a * 3 / 2);
  // Asked for again, a comes back from disk (b leaves) and answers as before.
  EXPECT_EQ(Answer(r, a->id, "", question), first);
  EXPECT_EQ(r.Metrics().kv_caches_unloaded, 2);
  ASSERT_EQ(r.ListCaches("").size(), 1u);
  EXPECT_EQ(r.ListCaches("")[0].id, a->id);
}

TEST(RedisCaches, AnotherRuntimeOnTheSameRedisContinuesFromTheCache) {
  testing::RedisServers redis;
  ASSERT_EQ(redis.Start(1, /*cluster=*/false), "");
  RuntimeOptions o = Options("");  // no directory: Redis is the only store
  o.engine.redis_url = redis.Url();
  auto a = Runtime::Create(o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = Runtime::Create(o);  // another process or machine, as far as caches go
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const std::vector<int32_t> context = (*a)->tokenizer().EncodePrompt(kContext);
  const std::vector<int32_t> question = (*a)->tokenizer().Encode(" Where did the bird fly?");
  auto info = Create(**a, {context, "t", SnapKv(0.5), "shared"});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  const std::vector<int32_t> on_a = Answer(**a, info->id, "t", question);
  ASSERT_EQ(on_a.size(), 12u);
  testing::RedisReply keys = redis.Command(0, {"KEYS", "*" + info->id + "*"});
  ASSERT_TRUE(keys);
  EXPECT_EQ(keys->elements, 2u);  // its pages and its description

  EXPECT_EQ((*b)->FindCache(info->id, "other").status().code(), StatusCode::kNotFound);
  auto found = (*b)->FindCache(info->id, "t");
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->compression, "snapkv ratio 0.500");
  EXPECT_EQ(found->note, "shared");
  EXPECT_EQ(found->held_rows, info->held_rows);
  EXPECT_EQ(Answer(**b, info->id, "t", question), on_a);

  // A damaged value is refused with a reason, never answered from.
  ASSERT_TRUE(redis.Command(0, {"SETRANGE", "ckv:cache:{" + info->id + "}:kv", "200", "XXXX"}));
  auto c = Runtime::Create(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto damaged = (*c)->FindCache(info->id, "t");
  EXPECT_EQ(damaged.status().code(), StatusCode::kNotFound);
  EXPECT_NE(damaged.status().message().find("cannot be loaded"), std::string::npos)
      << damaged.status().ToString();

  // Deleting on b removes the stored copies: a keeps its resident one, a new runtime finds none.
  ASSERT_TRUE((*b)->DeleteCache(info->id, "t").ok());
  keys = redis.Command(0, {"KEYS", "*" + info->id + "*"});
  ASSERT_TRUE(keys);
  EXPECT_EQ(keys->elements, 0u);
  EXPECT_TRUE((*a)->FindCache(info->id, "t").ok());
  EXPECT_EQ((*c)->FindCache(info->id, "t").status().code(), StatusCode::kNotFound);

  // Redis gone: a lookup is Unavailable (retry later), not NotFound (the cache may well exist).
  auto again = Create(**a, {context, "t", {}, ""});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  redis.Kill(0);
  EXPECT_EQ((*c)->FindCache(again->id, "t").status().code(), StatusCode::kUnavailable);
  auto refused = Create(**a, {context, "t", {}, ""});  // nowhere to store it: nothing kept
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ((*a)->Metrics().kv_caches, 2);
}

}  // namespace
}  // namespace cachet
