#include "kv/chunk_cache.h"

#include <algorithm>

namespace cachet {

ChunkCache::ChunkCache(PagePool& pool, size_t max_bytes) : pool_(pool), max_bytes_(max_bytes) {
  pool_.add_reclaimer(this);
}

ChunkCache::~ChunkCache() {
  pool_.remove_reclaimer(this);
  lru_.clear();  // the entries' sequences give their pages back before the pool goes
}

uint64_t ChunkCache::KeyOf(uint64_t salt, std::span<const int32_t> tokens) {
  uint64_t h = 1469598103934665603ull ^ salt;  // FNV-1a over the salt and the ids
  for (int32_t t : tokens) {
    for (int b = 0; b < 4; ++b) {
      h ^= (static_cast<uint32_t>(t) >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h ^ tokens.size();
}

std::shared_ptr<const ChunkEntry> ChunkCache::Find(uint64_t salt, std::span<const int32_t> tokens) {
  ++stats_.lookups;
  auto [lo, hi] = index_.equal_range(KeyOf(salt, tokens));
  for (auto it = lo; it != hi; ++it) {
    const Slot& s = *it->second;
    if (s.salt != salt ||
        !std::equal(tokens.begin(), tokens.end(), s.entry->tokens.begin(), s.entry->tokens.end())) {
      continue;
    }
    lru_.splice(lru_.begin(), lru_, it->second);
    ++stats_.hits;
    return s.entry;
  }
  return nullptr;
}

void ChunkCache::Erase(Lru::iterator it) {
  auto [lo, hi] = index_.equal_range(KeyOf(it->salt, it->entry->tokens));
  for (auto i = lo; i != hi; ++i) {
    if (i->second == it) {
      index_.erase(i);
      break;
    }
  }
  bytes_ -= it->bytes;
  lru_.erase(it);
}

void ChunkCache::Insert(uint64_t salt, std::shared_ptr<ChunkEntry> entry) {
  const uint64_t key = KeyOf(salt, entry->tokens);
  auto [lo, hi] = index_.equal_range(key);
  for (auto it = lo; it != hi; ++it) {
    if (it->second->salt == salt && it->second->entry->tokens == entry->tokens) {
      Erase(it->second);
      break;
    }
  }
  const size_t bytes = entry->seq->bytes_held();
  lru_.push_front({salt, std::move(entry), bytes});
  index_.emplace(key, lru_.begin());
  bytes_ += bytes;
  ++stats_.inserted;
  if (max_bytes_ > 0) EvictWhile([&](size_t) { return bytes_ > max_bytes_; });
}

template <class Pred>
size_t ChunkCache::EvictWhile(Pred pred) {
  size_t freed = 0;
  for (auto it = lru_.end(); it != lru_.begin() && pred(freed);) {
    --it;
    if (it->entry.use_count() > 1) continue;  // pinned by a reader
    auto victim = it++;
    freed += victim->bytes;
    Erase(victim);
    ++stats_.evicted;
  }
  return freed;
}

void ChunkCache::Clear() {
  EvictWhile([](size_t) { return true; });
}

size_t ChunkCache::ReclaimableBytes() const {
  size_t n = 0;
  for (const Slot& s : lru_) {
    if (s.entry.use_count() == 1) n += s.bytes;
  }
  return n;
}

size_t ChunkCache::Reclaim(size_t bytes) {
  return EvictWhile([&](size_t freed) { return freed < bytes; });
}

ChunkCacheStats ChunkCache::stats() const {
  ChunkCacheStats s = stats_;
  s.entries = static_cast<int64_t>(lru_.size());
  s.bytes = static_cast<int64_t>(bytes_);
  return s;
}

}  // namespace cachet
