// PrefixTree: a radix tree over full pages of tokens, so requests that share a prompt prefix share
// its KV pages instead of recomputing them. A node is one block of page_tokens tokens; its key
// chains the parent's key, the block's tokens, the model's identity and the cache salt (xxhash),
// so tenants with different salts never share pages. The tree holds one reference on each page of
// a node; nodes no sequence uses are evicted least-recently-used when the pool needs room.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/page_pool.h"

namespace cachet {

class PagedSequence;
namespace tiers {
class KvTiers;
}

struct PrefixStats {
  int64_t lookups = 0;
  int64_t hits = 0;  // lookups that reused at least one block
  int64_t hit_tokens = 0;
  int64_t evicted_blocks = 0;
  int64_t evicted_pages = 0;
};

class PrefixTree final : public PageReclaimer {
 public:
  PrefixTree(PagePool& pool, uint64_t model_id);
  ~PrefixTree() override;

  // Tiers below RAM (null: none): Lookup falls through to them past what RAM holds, Publish
  // writes through to them.
  void set_tiers(tiers::KvTiers* tiers) { tiers_ = tiers; }

  // Longest cached prefix of tokens, in whole blocks, covering at most max_tokens tokens. The
  // matched pages are attached to seq (which must be empty); returns the tokens reused. Blocks
  // RAM does not hold are loaded from the tiers first, when there are some: *from_tier (if
  // given) gets the tokens each tier served (the rest came from RAM).
  int Lookup(std::span<const int32_t> tokens, uint64_t salt, int max_tokens, PagedSequence& seq,
             std::vector<int>* from_tier = nullptr);
  // The tokens Lookup would reuse now, without attaching anything or counting a lookup.
  int Match(std::span<const int32_t> tokens, uint64_t salt, int max_tokens) const;
  // Publishes the full blocks of seq (whose tokens are tokens) so later requests can reuse them.
  void Publish(std::span<const int32_t> tokens, uint64_t salt, const PagedSequence& seq);

  // PageReclaimer: bytes the tree could free, and freeing them (LRU leaves first).
  size_t ReclaimableBytes() const override;
  size_t Reclaim(size_t bytes) override;
  int32_t ReclaimablePages() const;

  int64_t cached_blocks() const { return static_cast<int64_t>(nodes_.size()); }
  int32_t cached_pages() const;  // pages held by the tree (shared with sequences or not)
  const PrefixStats& stats() const { return stats_; }
  void Clear();  // drops every node the tree holds
  // Every page reference the tree holds (one per page of each node), for accounting checks.
  void CollectPages(std::vector<int32_t>* pages) const;

 private:
  struct Node {
    uint64_t parent = 0;  // parent key; 0 for a root block
    std::vector<int32_t> tokens;
    std::vector<int32_t> pages;  // one per (layer, KV head)
    int32_t children = 0;
    uint64_t last_used = 0;
  };
  uint64_t BlockKey(uint64_t parent, std::span<const int32_t> block, uint64_t salt) const;
  const Node* Find(uint64_t key, uint64_t parent, std::span<const int32_t> block) const;
  // Follows tokens' cached blocks from the root (at most max_tokens tokens), calling on_block for
  // each; returns the tokens matched.
  template <class Fn>
  int Walk(std::span<const int32_t> tokens, uint64_t salt, int max_tokens, Fn&& on_block) const;
  bool Unused(const Node& n) const;  // only the tree references its pages
  // Loads the blocks of tokens past RAM's match from the tiers into new nodes; returns the blocks
  // RAM had, *source gets the tier of each block loaded after them.
  int Promote(std::span<const int32_t> tokens, uint64_t salt, int max_tokens,
              std::vector<int>* source);
  // Calls fn(node) for every node no sequence uses, below or at it.
  template <class Fn>
  void ForEachUnpinned(Fn&& fn) const;
  void EvictNode(std::unordered_map<uint64_t, Node>::iterator it);

  PagePool& pool_;
  uint64_t model_id_;
  tiers::KvTiers* tiers_ = nullptr;
  std::unordered_map<uint64_t, Node> nodes_;
  uint64_t clock_ = 0;
  PrefixStats stats_;
};

}  // namespace cachet
