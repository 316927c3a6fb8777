// The disk tier: one file per run under a directory, so a restarted process (or another process
// on the machine) answers a repeated prompt from disk instead of recomputing it.
//
// Files: DIR/<first two hex digits>/<32 hex digits of the key> (256 shards keep directories
// small). A run is written to DIR/<shard>/.tmp-<writer>-<n> and renamed, so a final name only
// ever holds a whole run; a crash leaves at most a temp file, removed by a later Open once stale.
// Eviction: least recently used first (last Get or Put) under a byte cap. The access time is the
// file's mtime, set explicitly (strictly increasing within a process), so the order survives a
// restart.
//
// Open rebuilds the index by reading each file's header (not its payload): a file under a run's
// name whose header is damaged, names another key or disagrees with the file's size is deleted;
// a run of another format version is left alone (a newer process may share the directory) and
// so are files not named like runs (the directory is the user's). Get reads and checks the whole
// run (CheckRun) and deletes a damaged one: bytes returned are always an intact run of that key.
//
// Sharing a directory between processes: each keeps its own index and enforces the cap over the
// entries it knows (its scan, its puts, runs it read that another process wrote), so together
// they may hold up to the sum of their caps. A file another process evicted is a miss (counted
// and dropped from the index); a key not in the index is still looked for on disk.
//
// Thread-safety: one mutex serializes every call, file I/O included. Tier calls come from the
// prefix cache's lookups and spills, which are not concurrent enough for finer locking to pay.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kv/tiers/tier.h"

namespace cachet::tiers {

struct DiskTierOptions {
  std::string dir;
  uint64_t capacity_bytes = 0;  // --disk-cache-mib
  // Temp files older than this are a crashed writer's and are removed by Open.
  int64_t stale_temp_seconds = 600;
};

class DiskTier final : public Tier {
 public:
  // Creates DIR if needed and indexes the runs already there.
  static Result<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  ~DiskTier() override;

  std::string_view name() const override { return "disk"; }
  std::vector<std::optional<std::string>> Get(std::span<const RunKey> keys) override;
  Status Put(std::span<const std::pair<RunKey, std::string>> runs) override;
  std::vector<bool> Exists(std::span<const RunKey> keys) override;
  void Erase(const RunKey& key) override;
  TierStats stats() const override;

  std::string PathOf(const RunKey& key) const;  // where key's run is stored

 private:
  explicit DiskTier(const DiskTierOptions& options);
  struct Entry {
    uint64_t bytes = 0;
    std::list<RunKey>::iterator lru;
    RunKey parent;  // the run before it in its chain
  };
  Status Scan();
  std::optional<std::string> ReadRun(const RunKey& key);
  Status WriteRun(const RunKey& key, const std::string& bytes);
  int64_t NextStamp();  // the next access time, ns since the epoch
  // Adds or refreshes, as most recent; then the runs before it in its chain, more recent still.
  void Index(const RunKey& key, uint64_t bytes, const RunKey& parent);
  void Drop(const RunKey& key);
  // fn(key, entry) for `from` and each run before it in its chain, while the index holds them.
  template <class Fn>
  void ForChain(const RunKey& from, Fn fn);
  // Oldest first, until incoming bytes fit under the cap; never the chain before `parent` (a run
  // is useless without it): false, nothing evicted, when that is what it would take.
  bool EvictFor(uint64_t incoming, const RunKey* parent = nullptr);

  DiskTierOptions options_;
  uint64_t writer_id_ = 0;  // tells this object's temp files from other writers'
  uint64_t temp_counter_ = 0;
  int64_t last_stamp_ = 0;
  mutable std::mutex mu_;
  std::unordered_map<RunKey, Entry, RunKeyHash> index_;
  std::list<RunKey> lru_;  // front: least recently used
  uint64_t bytes_held_ = 0;
  TierStats stats_;
};

}  // namespace cachet::tiers
