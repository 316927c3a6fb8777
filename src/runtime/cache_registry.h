// The Runtime's kept caches (Runtime::CreateCache): id -> a session holding a prefilled, maybe
// pressed context, resident in the KV pool, and stored where it outlives the process when the
// runtime has a store: a directory (Session::Save's <id>.ckv, with <id>.json for what the file
// does not hold: salt, time, compression, note) and Redis (the same two under "cache:{<id>}:kv"
// and ":meta", the tier's TTL renewed by every load), so that a later process, or another
// machine on the same Redis, loads it on first use.
//
// Resident caches hold at most max_resident_bytes of pages: past that the least recently used
// ones leave RAM (their pages go back once no request holds them) and are loaded again from the
// store when asked for. Without a store nothing can leave, so a cache that would pass the cap is
// refused instead.
//
// Threads: sessions are created, forked, saved and destroyed only on the scheduler thread (the
// methods so marked); the descriptions are guarded by a mutex, so other threads list and describe
// resident caches without waiting for a step.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/engine.h"
#include "cachet/serving.h"
#include "kv/tiers/redis_tier.h"

namespace cachet {

class CacheRegistry {
 public:
  // dir: "" for none; redis: null for none.
  CacheRegistry(std::string dir, std::unique_ptr<tiers::RedisTier> redis,
                int64_t max_resident_bytes);

  // Scheduler thread. Keeps session as a new cache under a fresh random id, stored in the
  // directory and Redis when there are (a failed store keeps nothing and says why).
  Result<KvCacheInfo> Add(std::unique_ptr<Session> session, std::string_view cache_salt,
                          std::string compression, std::string note);
  // Scheduler thread. The cache's session, loaded from the directory or else Redis when not
  // resident. NotFound ("cache_id: ...") for an unknown id and for another salt's alike.
  Result<std::shared_ptr<Session>> Get(Engine& engine, const std::string& id,
                                       std::string_view cache_salt);
  // Scheduler thread. Drops the cache (its pages go back once no fork holds them) and its stored
  // copies.
  Status Remove(const std::string& id, std::string_view cache_salt);

  // Any thread: resident caches.
  std::optional<KvCacheInfo> Resident(const std::string& id, std::string_view cache_salt) const;
  std::vector<KvCacheInfo> List(std::string_view cache_salt) const;
  int count() const;
  int64_t bytes() const;
  int64_t unloaded() const;  // caches that left RAM for the cap
  bool has_store() const { return !dir_.empty() || redis_ != nullptr; }

 private:
  struct Entry {
    uint64_t salt = 0;  // Engine's key of the cache salt
    KvCacheInfo info;
    std::shared_ptr<Session> session;
    uint64_t last_used = 0;
  };
  struct Stored {      // a cache's two parts as a store holds them
    std::string meta;  // the sidecar's JSON
    std::string kv;    // Session::Save's bytes
  };
  Result<std::shared_ptr<Session>> Load(Engine& engine, const std::string& id,
                                        std::string_view cache_salt);
  // The stored cache (NotFound when no store has it). kv_too: also its pages' bytes.
  Result<Stored> Fetch(const std::string& id, bool kv_too, std::string* from);
  void RemoveOrphans();
  std::string PathOf(const std::string& id, std::string_view ext) const;
  Status Store(const std::string& id, const Stored& stored);
  void Keep(Entry e);  // resident from now on; older caches over the cap leave RAM

  const std::string dir_;
  const std::unique_ptr<tiers::RedisTier> redis_;
  const int64_t max_resident_bytes_;
  uint64_t clock_ = 0;     // scheduler thread: last_used stamps
  mutable std::mutex mu_;  // guards entries_ and unloaded_ (sessions as said above)
  std::map<std::string, Entry> entries_;
  int64_t unloaded_ = 0;
};

// Whether id has the form CacheRegistry gives ("kvc-" and 32 lowercase hex digits): nothing else
// is ever turned into a path or a key.
bool IsCacheId(std::string_view id);

}  // namespace cachet
