// The Redis tier: runs stored in a Redis server or Redis Cluster that several processes and
// machines share, so a prompt one server computed is a hit on another.
//
// Keys: key_prefix + the run key's 32 hex digits ("ckv:0123..."): content addresses, so a value
// is written once (SET key value NX PX ttl_ms) and never rewritten; the TTL lets Redis forget runs
// nobody asked for (and a maxmemory policy may evict any of them: the tier is a cache).
//
// Get is a chain lookup in at most two round trips: one pipelined EXISTS over the chain finds the
// first key not held, then one pipelined GET fetches the keys before it. Nothing past the first
// miss is fetched: a chain is used only up to its first gap, and the runs after a gap can be
// hundreds of megabytes (the oldest run of a chain expires first under the TTL, leaving the rest).
// Every value is checked (CheckRun, and its key) before it is returned; a damaged one is counted
// corrupt and deleted.
//
// Put never waits on the network: runs are queued for a background writer thread (its own
// connections) under a byte cap; when the queue is full, or the run's node is refused by the
// circuit breaker, the run is dropped and counted. The writer pipelines SET NX PX per node.
//
// Failures: every connection has a connect timeout and a command timeout (per socket read or
// write), so no call waits longer than those on a dead or stalled server. Each node has a circuit
// breaker: after breaker_failures consecutive failed round trips (refused, timed out, I/O error)
// it opens for breaker_cooldown_ms, during which the node's keys are misses (Get, Exists) and its
// writes are dropped without any I/O; the first round trip after the cooldown closes it again or
// reopens it. A failed connection is dropped and reconnected on its next use.
//
// Redis Cluster: detected at Open (CLUSTER SLOTS answers), with every URL given as a seed. A key
// goes to the node owning its hash slot (CRC16/XMODEM of the key, or of its {hash tag}, mod 16384).
// Commands are pipelined per node, all nodes' batches sent before any reply is read. A MOVED reply
// refreshes the slot map (CLUSTER SLOTS) and the command is retried once at the node it named; an
// ASK reply sends ASKING and the command to the node named, leaving the map alone.
//
// Thread-safety: Get, Exists and Erase (the prefix cache's calls: one scheduler thread) share one
// set of connections under a mutex; the writer thread has its own; the slot map, the breakers and
// the counters are shared under their own mutexes. stats() may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kv/tiers/tier.h"

struct redisContext;
struct redisReply;

namespace cachet::tiers {

struct RedisNode {
  std::string host;  // a name, an IPv4 address or an IPv6 address (without brackets)
  int port = 6379;
  std::string Address() const;  // "host:port", "[v6]:port"
  bool operator==(const RedisNode&) const = default;
};

// --redis: "redis://[[user]:password@]host[:port][/db]", or several comma-separated (the seed
// nodes of a cluster, one set of credentials for all). The password may be percent-encoded.
struct RedisUrl {
  std::vector<RedisNode> nodes;
  int db = 0;
  std::string user;      // empty: Redis's default user
  std::string password;  // empty: no AUTH
};
// Errors name the URL item (its password masked) and the part that is wrong (scheme, host, port,
// db, credentials).
Result<RedisUrl> ParseRedisUrl(std::string_view text);
// "host:port" as a cluster's redirect names it (MOVED 3999 127.0.0.1:6381); an empty host is
// `from`'s. False if it is not one.
bool ParseHostPort(std::string_view s, const RedisNode& from, RedisNode* out);
// A reply's text for an error message (an error, a status or a string; else its type).
std::string RedisReplyText(const redisReply* r);

struct RedisTierOptions {
  std::vector<RedisNode> nodes;  // one server, or any nodes of a cluster
  int db = 0;                    // SELECT db (a cluster has only db 0)
  // AUTH [user] password on every connection (none when the password is empty).
  std::string user;
  std::string password;
  std::string key_prefix = "ckv:";
  int64_t ttl_ms = 24ll * 3600 * 1000;
  int connect_timeout_ms = 200;
  int command_timeout_ms = 500;
  uint64_t write_queue_bytes = uint64_t{256} << 20;  // runs waiting for the writer
  int breaker_failures = 3;                          // consecutive failures that open a breaker
  int breaker_cooldown_ms = 5000;                    // how long an open breaker refuses calls
  int drain_ms = 2000;  // how long the destructor lets the writer finish queued runs
};
// The options a --redis URL gives (the rest defaults). A URL without a password takes
// $CACHET_REDIS_PASSWORD's (which keeps it off the command line and out of `ps`).
Result<RedisTierOptions> RedisOptionsFromUrl(std::string_view text);

// What the tier did beyond TierStats: for tests and diagnostics.
struct RedisCounters {
  int64_t moved = 0;           // MOVED replies followed
  int64_t ask = 0;             // ASK replies followed
  int64_t slot_refreshes = 0;  // slot maps read (CLUSTER SLOTS) after Open's
  int64_t breaker_opened = 0;  // times a node's breaker opened
  int64_t kept = 0;            // writes refused by NX: the key was already held
};

class RedisTier final : public Tier {
 public:
  // Connects to the first reachable node, tells a cluster from a standalone server and starts
  // the writer. Fails when no node answers or the options are not usable (a clear message naming
  // the node and the reason): a misconfigured cache is better caught at startup.
  static Result<std::unique_ptr<RedisTier>> Open(const RedisTierOptions& options);
  ~RedisTier() override;  // lets the writer finish queued runs for up to drain_ms

  std::string_view name() const override { return "redis"; }
  // keys are a chain: nothing is returned past the first key not held (see above).
  std::vector<std::optional<std::string>> Get(std::span<const RunKey> keys) override;
  // Queues the runs for the writer and returns at once; dropped runs are counted, not errors.
  Status Put(std::span<const std::pair<RunKey, std::string>> runs) override;
  std::vector<bool> Exists(std::span<const RunKey> keys) override;
  void Erase(const RunKey& key) override;
  // entries and bytes_held stay 0: a shared Redis holds what every process wrote, which this one
  // does not know.
  TierStats stats() const override;

  // Named values beside the runs, for objects with their own identity (the server's saved
  // caches): key_prefix + name, written and read at once on the callers' connections (not
  // queued: the caller waits for Redis's answer), under the tier's TTL, renewed when read. A
  // failure names what Redis said or that it did not answer; the values are not checked here.
  Status SetValue(std::string_view name, std::string_view value);
  Result<std::optional<std::string>> GetValue(std::string_view name);  // nullopt: not held
  Status DeleteValue(std::string_view name);

  // Waits until every queued run is written (or dropped); false if timeout_ms passed first.
  bool Drain(int timeout_ms);
  bool cluster() const { return cluster_; }
  bool breaker_open() const;  // some node's breaker refuses calls now
  RedisCounters counters() const;
  std::string KeyOf(const RunKey& key) const;  // key_prefix + key.Hex()
  // The cluster hash slot of a key: CRC16/XMODEM of the key, or of the text between the first
  // '{' and the '}' after it when that is not empty, mod 16384.
  static int SlotOf(std::string_view key);

 private:
  using Clock = std::chrono::steady_clock;
  struct Conns;  // one thread's connections, by node address
  struct FreeReply {
    void operator()(redisReply* r) const;
  };
  using Reply = std::unique_ptr<redisReply, FreeReply>;
  // One command whose args[1] is the key that routes it.
  struct Command {
    std::vector<std::string_view> args;
  };
  struct Health {
    int failures = 0;  // consecutive failed round trips
    Clock::time_point open_until{};
  };
  struct Queued {
    std::string key;  // KeyOf
    std::string bytes;
  };

  explicit RedisTier(const RedisTierOptions& options);
  Status Init();
  void WriterLoop();

  // The replies to cmds, pipelined per node, redirects followed; a null reply is a failure
  // (connection, timeout, breaker, server error, unresolved redirect), counted in errors.
  std::vector<Reply> Execute(Conns& conns, std::span<const Command> cmds);
  redisContext* Connect(Conns& conns, const RedisNode& node, std::string* why);
  void Disconnect(Conns& conns, const RedisNode& node);
  RedisNode NodeOfKey(std::string_view key) const;
  // Reads the slot map from the first node that answers; false if none did.
  bool RefreshSlots(Conns& conns, std::string* why);
  bool ParseSlots(const redisReply* r, const RedisNode& from, std::string* why);

  bool Allowed(const RedisNode& node);  // the breaker lets a round trip through
  bool Refused(const RedisNode& node) const;
  void Succeeded(const RedisNode& node);
  void Failed(const RedisNode& node);

  RedisTierOptions options_;
  bool cluster_ = false;
  bool probing_ = true;  // Open is telling a cluster from a server: no SELECT yet

  mutable std::mutex fg_mu_;  // the callers' connections
  // Hits are read with GETEX ... PX ttl, so a prefix in use does not expire under its readers;
  // a server without GETEX (before Redis 6.2) turns it off for plain GET.
  bool getex_ = true;  // under fg_mu_
  std::unique_ptr<Conns> fg_;
  std::unique_ptr<Conns> bg_;  // the writer's (only its thread uses them)

  mutable std::mutex map_mu_;
  std::vector<RedisNode> seeds_;
  std::vector<RedisNode> owners_;     // distinct nodes of the slot map
  std::vector<uint16_t> slot_owner_;  // slot -> index into owners_ (cluster only)

  mutable std::mutex health_mu_;
  std::map<std::string, Health> health_;  // by RedisNode::Address()

  std::mutex q_mu_;
  std::condition_variable q_cv_;     // the writer waits for work
  std::condition_variable idle_cv_;  // Drain waits for the writer
  std::deque<Queued> queue_;
  uint64_t queue_bytes_ = 0;  // queued and in flight: what the cap bounds
  bool writing_ = false;
  bool stop_ = false;
  std::thread writer_;

  mutable std::mutex stats_mu_;
  TierStats stats_;
  RedisCounters counters_;
};

}  // namespace cachet::tiers
