// The Runtime's kept caches (Runtime::CreateCache): id -> a session holding a prefilled, maybe
// pressed context, resident in the KV pool, and optionally saved to a directory (Session::Save:
// <id>.ckv, with <id>.json for what the file does not hold: salt, time, compression, note) from
// which a later process loads it on first use.
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

namespace cachet {

class CacheRegistry {
 public:
  explicit CacheRegistry(std::string dir) : dir_(std::move(dir)) {}

  // Scheduler thread. Keeps session as a new cache under a fresh random id, saved to the
  // directory when there is one (a failed save keeps nothing and says why).
  Result<KvCacheInfo> Add(std::unique_ptr<Session> session, std::string_view cache_salt,
                          std::string compression, std::string note);
  // Scheduler thread. The cache's session, loaded from the directory when not resident.
  // NotFound ("cache_id: ...") for an unknown id and for another salt's alike.
  Result<std::shared_ptr<Session>> Get(Engine& engine, const std::string& id,
                                       std::string_view cache_salt);
  // Scheduler thread. Drops the cache (its pages go back once no fork holds them) and its files.
  Status Remove(const std::string& id, std::string_view cache_salt);

  // Any thread: resident caches.
  std::optional<KvCacheInfo> Resident(const std::string& id, std::string_view cache_salt) const;
  std::vector<KvCacheInfo> List(std::string_view cache_salt) const;
  int count() const;
  int64_t bytes() const;
  bool has_dir() const { return !dir_.empty(); }

 private:
  struct Entry {
    uint64_t salt = 0;  // Engine's key of the cache salt
    KvCacheInfo info;
    std::shared_ptr<Session> session;
  };
  Result<std::shared_ptr<Session>> Load(Engine& engine, const std::string& id,
                                        std::string_view cache_salt);
  std::string PathOf(const std::string& id, std::string_view ext) const;

  const std::string dir_;
  mutable std::mutex mu_;  // guards entries_ (the map and the infos; sessions as said above)
  std::map<std::string, Entry> entries_;
};

// Whether id has the form CacheRegistry gives ("kvc-" and 32 lowercase hex digits): nothing else
// is ever turned into a path.
bool IsCacheId(std::string_view id);

}  // namespace cachet
