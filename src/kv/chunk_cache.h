// The chunk cache (docs/REUSE.md): K/V of token runs computed on their own (after the model's BOS,
// if it has one, at positions from 0), keyed by their tokens and the cache salt, whatever position
// they are reused at. Entries hold pages of the engine's pool in its layout; the least recently
// used ones go when the pool runs dry (a PageReclaimer, asked after the prefix cache) or when the
// cache passes its byte cap.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/page_pool.h"
#include "kv/paged_sequence.h"

namespace cachet {

struct ChunkEntry {
  std::vector<int32_t> tokens;  // the chunk's own tokens
  int lead = 0;                 // tokens before them in seq (the BOS), at positions 0..lead-1
  std::unique_ptr<PagedSequence> seq;
};

struct ChunkCacheStats {
  int64_t lookups = 0, hits = 0, inserted = 0, evicted = 0;
  int64_t entries = 0, bytes = 0;
};

class ChunkCache final : public PageReclaimer {
 public:
  // max_bytes: the most its entries hold (0: no cap but the pool's).
  ChunkCache(PagePool& pool, size_t max_bytes);
  ~ChunkCache() override;
  ChunkCache(const ChunkCache&) = delete;
  ChunkCache& operator=(const ChunkCache&) = delete;

  // The entry for these tokens under salt, or null. While the returned pointer is held the
  // entry is pinned: neither reclaimed nor evicted.
  std::shared_ptr<const ChunkEntry> Find(uint64_t salt, std::span<const int32_t> tokens);
  // Adds an entry (replacing one of the same tokens and salt), then evicts least recently used
  // unpinned entries over the cap.
  void Insert(uint64_t salt, std::shared_ptr<ChunkEntry> entry);
  void Clear();  // drops every unpinned entry

  size_t ReclaimableBytes() const override;
  size_t Reclaim(size_t bytes) override;
  ChunkCacheStats stats() const;

 private:
  struct Slot {
    uint64_t salt;
    std::shared_ptr<ChunkEntry> entry;
    size_t bytes;
  };
  using Lru = std::list<Slot>;  // most recently used first
  static uint64_t KeyOf(uint64_t salt, std::span<const int32_t> tokens);
  // Drops unpinned entries from the least recently used end while pred(bytes freed) holds.
  template <class Pred>
  size_t EvictWhile(Pred pred);
  void Erase(Lru::iterator it);

  PagePool& pool_;
  size_t max_bytes_;
  Lru lru_;
  std::unordered_multimap<uint64_t, Lru::iterator> index_;
  size_t bytes_ = 0;
  ChunkCacheStats stats_;
};

}  // namespace cachet
