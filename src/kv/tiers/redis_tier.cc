#include "kv/tiers/redis_tier.h"

#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <ctime>

namespace cachet::tiers {
namespace {

// A writer batch: enough runs to amortize a round trip, few enough bytes that one batch does not
// hold the queue's memory long after its replies.
constexpr size_t kWriteBatchRuns = 64;
constexpr uint64_t kWriteBatchBytes = uint64_t{16} << 20;

timeval Millis(int ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

// Writing to a socket whose peer is gone raises SIGPIPE, which kills a process that does not
// handle it, and hiredis writes with plain write(). The signal is blocked in this thread for the
// scope of the I/O and a SIGPIPE it caused is consumed, so no process-wide handler is changed.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&set_, nullptr, &zero) < 0 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t set_, old_;
  bool was_pending_ = false;
};

}  // namespace

std::string RedisReplyText(const redisReply* r) {
  if (r == nullptr) return "no reply";
  if (r->type == REDIS_REPLY_ERROR || r->type == REDIS_REPLY_STATUS ||
      r->type == REDIS_REPLY_STRING) {
    return std::string(r->str, r->len);
  }
  return "reply of type " + std::to_string(r->type);
}

void RedisTier::FreeReply::operator()(redisReply* r) const {
  if (r != nullptr) freeReplyObject(r);
}

struct RedisTier::Conns {
  std::map<std::string, redisContext*> by_addr;
  ~Conns() {
    for (auto& [addr, c] : by_addr) redisFree(c);
  }
};

RedisTier::RedisTier(const RedisTierOptions& options)
    : options_(options),
      fg_(std::make_unique<Conns>()),
      bg_(std::make_unique<Conns>()),
      seeds_(options.nodes) {}

RedisTier::~RedisTier() {
  if (writer_.joinable()) {
    Drain(options_.drain_ms);
    {
      std::lock_guard<std::mutex> lock(q_mu_);
      stop_ = true;
    }
    q_cv_.notify_all();
    writer_.join();
  }
}

Result<std::unique_ptr<RedisTier>> RedisTier::Open(const RedisTierOptions& o) {
  if (o.nodes.empty()) return InvalidArgument("redis tier: no node given (--redis URL)");
  auto positive = [](const char* what, int64_t v) -> Status {
    if (v > 0) return OkStatus();
    return InvalidArgument(std::string("redis tier: ") + what + " must be > 0, got " +
                           std::to_string(v));
  };
  CACHET_RETURN_IF_ERROR(positive("ttl_ms", o.ttl_ms));
  CACHET_RETURN_IF_ERROR(positive("connect_timeout_ms", o.connect_timeout_ms));
  CACHET_RETURN_IF_ERROR(positive("command_timeout_ms", o.command_timeout_ms));
  CACHET_RETURN_IF_ERROR(positive("write_queue_bytes", static_cast<int64_t>(std::min<uint64_t>(
                                                           o.write_queue_bytes, INT64_MAX))));
  CACHET_RETURN_IF_ERROR(positive("breaker_failures", o.breaker_failures));
  if (o.breaker_cooldown_ms < 0 || o.drain_ms < 0 || o.db < 0) {
    return InvalidArgument("redis tier: breaker_cooldown_ms, drain_ms and db must be >= 0");
  }
  for (const RedisNode& n : o.nodes) {
    if (n.host.empty() || n.port < 1 || n.port > 65535) {
      return InvalidArgument("redis tier: node \"" + n.Address() + "\" needs a host and a port");
    }
  }
  std::unique_ptr<RedisTier> tier(new RedisTier(o));
  CACHET_RETURN_IF_ERROR(tier->Init());
  tier->writer_ = std::thread([t = tier.get()] { t->WriterLoop(); });
  return tier;
}

Status RedisTier::Init() {
  SigpipeGuard guard;
  std::string why_all;
  for (const RedisNode& seed : seeds_) {
    std::string why;
    redisContext* c = Connect(*fg_, seed, &why);
    if (c == nullptr) {
      why_all += (why_all.empty() ? "" : "; ") + seed.Address() + ": " + why;
      continue;
    }
    Reply r(static_cast<redisReply*>(redisCommand(c, "CLUSTER SLOTS")));
    if (!r) {
      why_all += (why_all.empty() ? "" : "; ") + seed.Address() + ": " + c->errstr;
      Disconnect(*fg_, seed);
      continue;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string err = RedisReplyText(r.get());
      if (err.find("cluster support disabled") == std::string::npos) {
        return FailedPrecondition("redis " + seed.Address() + ": CLUSTER SLOTS: " + err);
      }
      if (seeds_.size() > 1) {
        return InvalidArgument("redis: several nodes were given (a cluster's), but " +
                               seed.Address() + " is a standalone server (" + err + ")");
      }
      {
        std::lock_guard<std::mutex> lock(map_mu_);
        owners_ = {seed};
      }
      // Reconnected with the database selected now: a database the server lacks is refused here.
      Disconnect(*fg_, seed);
      probing_ = false;
      if (Connect(*fg_, seed, &why) == nullptr) {
        return InvalidArgument("redis " + seed.Address() + ": " + why);
      }
      return OkStatus();
    }
    if (options_.db != 0) {
      return InvalidArgument("redis " + seed.Address() + " is a cluster node: a cluster has only " +
                             "database 0, not " + std::to_string(options_.db));
    }
    cluster_ = true;
    probing_ = false;
    if (!ParseSlots(r.get(), seed, &why)) {
      return FailedPrecondition("redis cluster at " + seed.Address() + ": " + why);
    }
    return OkStatus();
  }
  std::string list;
  for (const RedisNode& n : seeds_) list += (list.empty() ? "" : ",") + n.Address();
  return FailedPrecondition("redis " + list + ": no node answered (" + why_all + ")");
}

namespace {

// An idle connection has nothing to read (every reply is read): if its socket is readable, the
// server closed it (a restart, a timeout, a kill) and a command sent on it would be lost.
bool Stale(const redisContext* c) {
  if (c->err != 0) return true;
  pollfd p{c->fd, POLLIN, 0};
  return ::poll(&p, 1, 0) != 0;
}

}  // namespace

redisContext* RedisTier::Connect(Conns& conns, const RedisNode& node, std::string* why) {
  const std::string addr = node.Address();
  if (auto it = conns.by_addr.find(addr); it != conns.by_addr.end()) {
    if (!Stale(it->second)) return it->second;
    redisFree(it->second);
    conns.by_addr.erase(it);
  }
  redisContext* c =
      redisConnectWithTimeout(node.host.c_str(), node.port, Millis(options_.connect_timeout_ms));
  if (c == nullptr || c->err != 0) {
    *why = c == nullptr ? "cannot allocate a connection" : c->errstr;
    if (c != nullptr) redisFree(c);
    return nullptr;
  }
  if (redisSetTimeout(c, Millis(options_.command_timeout_ms)) != REDIS_OK) {
    *why = std::string("cannot set the command timeout: ") + c->errstr;
    redisFree(c);
    return nullptr;
  }
  if (!options_.password.empty()) {  // before anything else: every command needs it
    Reply r(static_cast<redisReply*>(
        options_.user.empty()
            ? redisCommand(c, "AUTH %b", options_.password.data(), options_.password.size())
            : redisCommand(c, "AUTH %b %b", options_.user.data(), options_.user.size(),
                           options_.password.data(), options_.password.size())));
    if (!r || r->type == REDIS_REPLY_ERROR) {
      *why = "AUTH" + (options_.user.empty() ? std::string() : " as " + options_.user) + ": " +
             (r ? RedisReplyText(r.get()) : c->errstr);
      redisFree(c);
      return nullptr;
    }
  }
  if (!probing_ && !cluster_ && options_.db != 0) {
    Reply r(static_cast<redisReply*>(redisCommand(c, "SELECT %d", options_.db)));
    if (!r || r->type == REDIS_REPLY_ERROR) {
      *why = "SELECT " + std::to_string(options_.db) + ": " +
             (r ? RedisReplyText(r.get()) : c->errstr);
      redisFree(c);
      return nullptr;
    }
  }
  conns.by_addr[addr] = c;
  return c;
}

void RedisTier::Disconnect(Conns& conns, const RedisNode& node) {
  if (auto it = conns.by_addr.find(node.Address()); it != conns.by_addr.end()) {
    redisFree(it->second);
    conns.by_addr.erase(it);
  }
}

bool RedisTier::Allowed(const RedisNode& node) {
  std::lock_guard<std::mutex> lock(health_mu_);
  return Clock::now() >= health_[node.Address()].open_until;
}

bool RedisTier::Refused(const RedisNode& node) const {
  std::lock_guard<std::mutex> lock(health_mu_);
  const auto it = health_.find(node.Address());
  return it != health_.end() && Clock::now() < it->second.open_until;
}

void RedisTier::Succeeded(const RedisNode& node) {
  std::lock_guard<std::mutex> lock(health_mu_);
  Health& h = health_[node.Address()];
  h.failures = 0;
  h.open_until = {};
}

void RedisTier::Failed(const RedisNode& node) {
  bool opened = false;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    Health& h = health_[node.Address()];
    // Past the threshold every failure (the trial call after a cooldown) reopens it at once.
    if (++h.failures >= options_.breaker_failures) {
      h.open_until = Clock::now() + std::chrono::milliseconds(options_.breaker_cooldown_ms);
      opened = true;
    }
  }
  if (opened) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++counters_.breaker_opened;
  }
}

bool RedisTier::breaker_open() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  const Clock::time_point now = Clock::now();
  for (const auto& [addr, h] : health_) {
    if (now < h.open_until) return true;
  }
  return false;
}

std::vector<RedisTier::Reply> RedisTier::Execute(Conns& conns, std::span<const Command> cmds) {
  SigpipeGuard guard;
  const size_t n = cmds.size();
  std::vector<Reply> out(n);
  std::vector<std::optional<RedisNode>> redirect(n);  // where a redirected command goes next
  std::vector<bool> asking(n, false);                 // ... after ASKING (an ASK redirect)
  std::vector<size_t> todo(n);
  for (size_t i = 0; i < n; ++i) todo[i] = i;
  int64_t moved = 0, ask = 0;
  bool refreshed = false;
  // Round 0 sends every command to its slot's node; round 1 retries the redirected ones once.
  for (int round = 0; round < 2 && !todo.empty(); ++round) {
    struct Group {
      RedisNode node;
      std::vector<size_t> idx;
      redisContext* c = nullptr;
    };
    std::vector<Group> groups;
    std::map<std::string, size_t> group_of;
    for (const size_t i : todo) {
      const RedisNode node = redirect[i] ? *redirect[i] : NodeOfKey(cmds[i].args[1]);
      const auto [it, fresh] = group_of.emplace(node.Address(), groups.size());
      if (fresh) groups.push_back(Group{node, {}, nullptr});
      groups[it->second].idx.push_back(i);
    }
    // Every node's batch is sent before any reply is read: the nodes work in parallel.
    for (Group& g : groups) {
      if (!Allowed(g.node)) continue;  // its breaker is open: these commands fail, at no cost
      std::string why;
      g.c = Connect(conns, g.node, &why);
      if (g.c == nullptr) {
        Failed(g.node);
        continue;
      }
      std::vector<const char*> argv;
      std::vector<size_t> argl;
      bool ok = true;
      for (const size_t i : g.idx) {
        if (asking[i] && redisAppendCommand(g.c, "ASKING") != REDIS_OK) ok = false;
        argv.clear();
        argl.clear();
        for (const std::string_view a : cmds[i].args) {
          argv.push_back(a.data());
          argl.push_back(a.size());
        }
        if (ok && redisAppendCommandArgv(g.c, static_cast<int>(argv.size()), argv.data(),
                                         argl.data()) != REDIS_OK) {
          ok = false;
        }
        if (!ok) break;
      }
      for (int done = 0; ok && !done;) {
        if (redisBufferWrite(g.c, &done) != REDIS_OK) ok = false;
      }
      if (!ok) {
        Disconnect(conns, g.node);
        Failed(g.node);
        g.c = nullptr;
      }
    }
    std::vector<size_t> next;
    bool refresh = false;
    for (Group& g : groups) {
      if (g.c == nullptr) continue;
      bool ok = true;
      for (const size_t i : g.idx) {
        void* raw = nullptr;
        if (asking[i]) {
          if (redisGetReply(g.c, &raw) != REDIS_OK) {
            ok = false;
            break;
          }
          freeReplyObject(raw);
          raw = nullptr;
        }
        if (redisGetReply(g.c, &raw) != REDIS_OK) {
          ok = false;
          break;
        }
        Reply r(static_cast<redisReply*>(raw));
        if (r->type == REDIS_REPLY_ERROR) {
          const std::string_view err(r->str, r->len);
          const bool is_moved = err.starts_with("MOVED "), is_ask = err.starts_with("ASK ");
          RedisNode target;
          if ((is_moved || is_ask) && round == 0 &&
              ParseHostPort(err.substr(err.rfind(' ') + 1), g.node, &target)) {
            redirect[i] = target;
            asking[i] = is_ask;
            next.push_back(i);
            refresh |= is_moved;
            (is_moved ? moved : ask) += 1;
          }
          continue;  // any other error reply (or a second redirect) fails the command
        }
        out[i] = std::move(r);
      }
      if (ok) {
        Succeeded(g.node);
      } else {
        Disconnect(conns, g.node);
        Failed(g.node);
      }
    }
    if (refresh && !refreshed) {
      std::string why;
      RefreshSlots(conns, &why);  // a failed refresh leaves the old map: MOVED still says where
      refreshed = true;
    }
    todo = std::move(next);
  }
  int64_t failed = 0;
  for (const Reply& r : out) failed += r == nullptr;
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.errors += failed;
  counters_.moved += moved;
  counters_.ask += ask;
  return out;
}

std::string RedisTier::KeyOf(const RunKey& key) const { return options_.key_prefix + key.Hex(); }

std::vector<std::optional<std::string>> RedisTier::Get(std::span<const RunKey> keys) {
  std::vector<std::optional<std::string>> out(keys.size());
  if (keys.empty()) return out;
  std::vector<std::string> names;
  names.reserve(keys.size());
  for (const RunKey& k : keys) names.push_back(KeyOf(k));
  std::vector<Command> cmds;
  auto commands = [&](std::string_view verb, size_t count) {
    cmds.clear();
    for (size_t i = 0; i < count; ++i) cmds.push_back(Command{{verb, names[i]}});
  };
  int64_t hits = 0, corrupt = 0, bytes = 0;
  std::vector<Command> bad;
  {
    std::lock_guard<std::mutex> lock(fg_mu_);
    size_t held = keys.size();
    if (keys.size() > 1) {  // which prefix of the chain is held: only that is fetched
      commands("EXISTS", keys.size());
      const std::vector<Reply> exists = Execute(*fg_, cmds);
      held = 0;
      while (held < keys.size() && exists[held] && exists[held]->type == REDIS_REPLY_INTEGER &&
             exists[held]->integer > 0) {
        ++held;
      }
    }
    if (held > 0) {
      const std::string ttl = std::to_string(options_.ttl_ms);
      auto fetch = [&] {
        cmds.clear();
        for (size_t i = 0; i < held; ++i) {
          cmds.push_back(getex_ ? Command{{"GETEX", names[i], "PX", ttl}}
                                : Command{{"GET", names[i]}});
        }
        return Execute(*fg_, cmds);
      };
      std::vector<Reply> got = fetch();
      if (getex_ && got[0] && got[0]->type == REDIS_REPLY_ERROR &&
          std::string_view(got[0]->str, got[0]->len).find("unknown command") !=
              std::string_view::npos) {
        getex_ = false;
        got = fetch();
      }
      for (size_t i = 0; i < held && got[i] && got[i]->type == REDIS_REPLY_STRING; ++i) {
        const std::string_view value(got[i]->str, got[i]->len);
        const Result<RunHeader> h = CheckRun(value);
        if (!h.ok() || h->key != keys[i]) {
          // Damaged in Redis or in transit, or stored under the wrong name: never served, and
          // deleted so that the next publish of this prefix stores it again.
          ++corrupt;
          bad.push_back(Command{{"DEL", names[i]}});
          break;
        }
        out[i].emplace(value);
        ++hits;
        bytes += static_cast<int64_t>(value.size());
      }
    }
    if (!bad.empty()) Execute(*fg_, bad);
  }
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.hits += hits;
  stats_.misses += static_cast<int64_t>(keys.size()) - hits;
  stats_.corrupt += corrupt;
  stats_.bytes_read += bytes;
  return out;
}

Status RedisTier::Put(std::span<const std::pair<RunKey, std::string>> runs) {
  // Checked before anything is queued, on the caller's thread: a malformed run is the caller's
  // bug and is reported to it, not discovered later by the writer.
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& [key, bytes] = runs[i];
    const Result<RunHeader> h = CheckRun(bytes);
    if (!h.ok() || h->key != key) {
      return InvalidArgument("redis tier: Put run " + std::to_string(i) + " of " +
                             std::to_string(runs.size()) + " (key " + key.Hex() + "): " +
                             (h.ok() ? "the bytes are run " + h->key.Hex() : h.status().message()));
    }
  }
  int64_t dropped = 0;
  std::vector<Queued> incoming;
  for (const auto& [key, bytes] : runs) {
    std::string name = KeyOf(key);
    if (Refused(NodeOfKey(name))) {
      ++dropped;  // the node is down: queueing would only delay the drop
      continue;
    }
    incoming.push_back(Queued{std::move(name), bytes});
  }
  {
    std::lock_guard<std::mutex> lock(q_mu_);
    for (Queued& q : incoming) {
      const uint64_t size = q.key.size() + q.bytes.size();
      if (stop_ || queue_bytes_ + size > options_.write_queue_bytes) {
        ++dropped;
        continue;
      }
      queue_bytes_ += size;
      queue_.push_back(std::move(q));
    }
  }
  q_cv_.notify_one();
  if (dropped > 0) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.dropped += dropped;
  }
  return OkStatus();
}

void RedisTier::WriterLoop() {
  const std::string ttl = std::to_string(options_.ttl_ms);
  std::vector<Queued> batch;
  std::vector<Command> cmds;
  for (;;) {
    uint64_t batch_bytes = 0;
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(q_mu_);
      q_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) {
        // The destructor gave the queue drain_ms: what is left is dropped, not waited for.
        const int64_t left = static_cast<int64_t>(queue_.size());
        queue_.clear();
        queue_bytes_ = 0;
        lock.unlock();
        idle_cv_.notify_all();
        std::lock_guard<std::mutex> stats_lock(stats_mu_);
        stats_.dropped += left;
        return;
      }
      while (!queue_.empty() && batch.size() < kWriteBatchRuns &&
             (batch.empty() || batch_bytes < kWriteBatchBytes)) {
        batch_bytes += queue_.front().key.size() + queue_.front().bytes.size();
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      writing_ = true;
    }
    cmds.clear();
    for (const Queued& q : batch) cmds.push_back(Command{{"SET", q.key, q.bytes, "NX", "PX", ttl}});
    const std::vector<Reply> replies = Execute(*bg_, cmds);
    int64_t written = 0, kept = 0, dropped = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const redisReply* r = replies[i].get();
      if (r != nullptr && r->type == REDIS_REPLY_STATUS) {
        written += static_cast<int64_t>(batch[i].bytes.size());
      } else if (r != nullptr && r->type == REDIS_REPLY_NIL) {
        ++kept;  // NX: another process (or this one, earlier) stored it
      } else {
        ++dropped;
      }
    }
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.bytes_written += written;
      stats_.dropped += dropped;
      counters_.kept += kept;
    }
    {
      std::lock_guard<std::mutex> lock(q_mu_);
      queue_bytes_ -= batch_bytes;
      writing_ = false;
    }
    idle_cv_.notify_all();
  }
}

bool RedisTier::Drain(int timeout_ms) {
  std::unique_lock<std::mutex> lock(q_mu_);
  return idle_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [&] { return queue_.empty() && !writing_; });
}

std::vector<bool> RedisTier::Exists(std::span<const RunKey> keys) {
  std::vector<bool> out(keys.size(), false);
  if (keys.empty()) return out;
  std::vector<std::string> names;
  std::vector<Command> cmds;
  names.reserve(keys.size());
  for (const RunKey& k : keys) names.push_back(KeyOf(k));
  for (const std::string& name : names) cmds.push_back(Command{{"EXISTS", name}});
  std::lock_guard<std::mutex> lock(fg_mu_);
  const std::vector<Reply> replies = Execute(*fg_, cmds);
  for (size_t i = 0; i < keys.size(); ++i) {
    out[i] = replies[i] && replies[i]->type == REDIS_REPLY_INTEGER && replies[i]->integer > 0;
  }
  return out;
}

void RedisTier::Erase(const RunKey& key) {
  const std::string name = KeyOf(key);
  const Command del{{"DEL", name}};
  std::lock_guard<std::mutex> lock(fg_mu_);
  Execute(*fg_, std::span(&del, 1));
}

namespace {

// Why a value command failed: Redis's error, or that no reply came.
std::string ReplyError(const redisReply* r) {
  if (!r) return "Redis did not answer (down, timed out, or its circuit breaker is open)";
  if (r->type == REDIS_REPLY_ERROR) return "Redis answered: " + std::string(r->str, r->len);
  return "Redis answered with reply type " + std::to_string(r->type);
}

}  // namespace

Status RedisTier::SetValue(std::string_view name, std::string_view value) {
  const std::string key = options_.key_prefix + std::string(name);
  const std::string ttl = std::to_string(options_.ttl_ms);
  const Command set{{"SET", key, value, "PX", ttl}};
  std::lock_guard<std::mutex> lock(fg_mu_);
  const std::vector<Reply> r = Execute(*fg_, std::span(&set, 1));
  if (!r[0] || r[0]->type != REDIS_REPLY_STATUS) {
    return Unavailable("redis: storing " + key + " (" + std::to_string(value.size()) +
                       " bytes): " + ReplyError(r[0].get()));
  }
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  stats_.bytes_written += static_cast<int64_t>(value.size());
  return OkStatus();
}

Result<std::optional<std::string>> RedisTier::GetValue(std::string_view name) {
  const std::string key = options_.key_prefix + std::string(name);
  const std::string ttl = std::to_string(options_.ttl_ms);
  std::lock_guard<std::mutex> lock(fg_mu_);
  const Command get = getex_ ? Command{{"GETEX", key, "PX", ttl}} : Command{{"GET", key}};
  std::vector<Reply> r = Execute(*fg_, std::span(&get, 1));
  if (getex_ && r[0] && r[0]->type == REDIS_REPLY_ERROR &&
      std::string_view(r[0]->str, r[0]->len).find("unknown command") != std::string_view::npos) {
    getex_ = false;
    const Command plain{{"GET", key}};
    r = Execute(*fg_, std::span(&plain, 1));
  }
  if (r[0] && r[0]->type == REDIS_REPLY_NIL) return std::optional<std::string>();
  if (!r[0] || r[0]->type != REDIS_REPLY_STRING) {
    return Unavailable("redis: reading " + key + ": " + ReplyError(r[0].get()));
  }
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  stats_.bytes_read += static_cast<int64_t>(r[0]->len);
  return std::optional<std::string>(std::string(r[0]->str, r[0]->len));
}

Status RedisTier::DeleteValue(std::string_view name) {
  const std::string key = options_.key_prefix + std::string(name);
  const Command del{{"DEL", key}};
  std::lock_guard<std::mutex> lock(fg_mu_);
  const std::vector<Reply> r = Execute(*fg_, std::span(&del, 1));
  if (!r[0] || r[0]->type != REDIS_REPLY_INTEGER) {
    return Unavailable("redis: deleting " + key + ": " + ReplyError(r[0].get()));
  }
  return OkStatus();
}

TierStats RedisTier::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

RedisCounters RedisTier::counters() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return counters_;
}

}  // namespace cachet::tiers
