#include "kv/prefix_tree.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <queue>

#include "kv/paged_sequence.h"
#include "kv/tiers/kv_tiers.h"

namespace cachet {

PrefixTree::PrefixTree(PagePool& pool, uint64_t model_id) : pool_(pool), model_id_(model_id) {
  pool_.add_reclaimer(this);
}

PrefixTree::~PrefixTree() {
  pool_.remove_reclaimer(this);
  Clear();
}

void PrefixTree::Clear() {
  for (auto& [key, node] : nodes_) {
    for (int32_t p : node.pages) pool_.Unref(p);
  }
  nodes_.clear();
}

uint64_t PrefixTree::BlockKey(uint64_t parent, std::span<const int32_t> block,
                              uint64_t salt) const {
  // (parent, model, salt, tokens) hashed in one call; page_tokens <= 256 bounds the buffer.
  uint64_t buf[3 + 128];
  buf[0] = parent;
  buf[1] = model_id_;
  buf[2] = salt;
  std::memcpy(buf + 3, block.data(), block.size_bytes());
  const uint64_t key = XXH3_64bits(buf, 3 * sizeof(uint64_t) + block.size_bytes());
  return key == 0 ? 1 : key;  // 0 marks "no parent"
}

const PrefixTree::Node* PrefixTree::Find(uint64_t key, uint64_t parent,
                                         std::span<const int32_t> block) const {
  auto it = nodes_.find(key);
  if (it == nodes_.end()) return nullptr;
  const Node& n = it->second;
  // A 64-bit collision is unlikely but must never hand out another prompt's KV.
  if (n.parent != parent ||
      !std::equal(block.begin(), block.end(), n.tokens.begin(), n.tokens.end())) {
    return nullptr;
  }
  return &n;
}

template <class Fn>
int PrefixTree::Walk(std::span<const int32_t> tokens, uint64_t salt, int max_tokens,
                     Fn&& on_block) const {
  const int pt = pool_.layout().page_tokens;
  uint64_t parent = 0;
  int matched = 0;
  const int limit = std::min<int>(max_tokens, static_cast<int>(tokens.size()));
  while (matched + pt <= limit) {
    const auto block = tokens.subspan(matched, pt);
    const uint64_t key = BlockKey(parent, block, salt);
    const Node* n = Find(key, parent, block);
    if (n == nullptr) break;
    on_block(*n);
    parent = key;
    matched += pt;
  }
  return matched;
}

int PrefixTree::Promote(std::span<const int32_t> tokens, uint64_t salt, int max_tokens,
                        std::vector<int>* source) {
  // Runs are stored by their length: the tail run of this prompt covers all its whole blocks,
  // so they are all asked for (and adopted), though Lookup reuses max_tokens at most.
  const int pt = pool_.layout().page_tokens;
  const int want = static_cast<int>(tokens.size()) / pt;
  if (max_tokens < pt) return 0;
  // RAM's blocks stay pinned while the load allocates, which may reclaim unused nodes.
  std::vector<int32_t> pinned;
  const int have =
      Walk(tokens, salt, static_cast<int>(tokens.size()),
           [&](const Node& n) { pinned.insert(pinned.end(), n.pages.begin(), n.pages.end()); }) /
      pt;
  if (have >= want) return have;
  for (int32_t p : pinned) pool_.Ref(p);
  std::vector<int32_t> pages;
  const int loaded = tiers_->Load(tokens, salt, have, want, &pages, source);
  for (int32_t p : pinned) pool_.Unref(p);
  uint64_t parent = 0;
  for (int b = 0; b < have; ++b)
    parent = BlockKey(parent, tokens.subspan(size_t(b) * pt, pt), salt);
  const size_t heads = static_cast<size_t>(pool_.layout().heads_total());
  ++clock_;
  int b = have;
  for (; b < have + loaded; ++b) {
    const auto block = tokens.subspan(size_t(b) * pt, pt);
    const uint64_t key = BlockKey(parent, block, salt);
    if (nodes_.contains(key)) break;  // a collision: keep the entry RAM has
    Node n;
    n.parent = parent;
    n.tokens.assign(block.begin(), block.end());
    const auto first = pages.begin() + static_cast<std::ptrdiff_t>((b - have) * heads);
    n.pages.assign(first, first + static_cast<std::ptrdiff_t>(heads));
    n.last_used = clock_;
    if (parent != 0) ++nodes_.at(parent).children;
    nodes_.emplace(key, std::move(n));
    parent = key;
  }
  for (size_t i = static_cast<size_t>(b - have) * heads; i < pages.size(); ++i) {
    pool_.Unref(pages[i]);  // loaded but not adopted
  }
  source->resize(b - have);
  return have;
}

int PrefixTree::Lookup(std::span<const int32_t> tokens, uint64_t salt, int max_tokens,
                       PagedSequence& seq, std::vector<int>* from_tier) {
  std::vector<int> source;  // of the blocks after the first `in_ram`
  const int in_ram = tiers_ != nullptr ? Promote(tokens, salt, max_tokens, &source) : 0;
  ++stats_.lookups;
  ++clock_;
  const int reused = Walk(tokens, salt, max_tokens, [&](const Node& n) {
    const_cast<Node&>(n).last_used = clock_;
    seq.AttachBlock(n.pages);
  });
  if (reused > 0) {
    ++stats_.hits;
    stats_.hit_tokens += reused;
  }
  const int pt = pool_.layout().page_tokens;
  const int loaded_end = in_ram + static_cast<int>(source.size());
  for (int b = in_ram; from_tier != nullptr && b < std::min(reused / pt, loaded_end); ++b) {
    const size_t t = static_cast<size_t>(source[b - in_ram]);
    if (from_tier->size() <= t) from_tier->resize(t + 1, 0);
    (*from_tier)[t] += pt;
  }
  return reused;
}

int PrefixTree::Match(std::span<const int32_t> tokens, uint64_t salt, int max_tokens) const {
  return Walk(tokens, salt, max_tokens, [](const Node&) {});
}

void PrefixTree::Publish(std::span<const int32_t> tokens, uint64_t salt, const PagedSequence& seq) {
  const int pt = pool_.layout().page_tokens;
  const int blocks = std::min<int>(seq.n_tokens(), static_cast<int>(tokens.size())) / pt;
  ++clock_;
  uint64_t parent = 0;
  std::vector<int32_t> pages;
  std::vector<const Node*> chain;  // the blocks published, for the tiers
  for (int b = 0; b < blocks; ++b) {
    const auto block = tokens.subspan(size_t(b) * pt, pt);
    const uint64_t key = BlockKey(parent, block, salt);
    auto it = nodes_.find(key);
    if (it != nodes_.end()) {
      if (Find(key, parent, block) == nullptr) break;  // collision: keep the existing entry
      it->second.last_used = clock_;
    } else {
      if (!seq.BlockPages(b, &pages)) break;
      Node n;
      n.parent = parent;
      n.tokens.assign(block.begin(), block.end());
      n.pages = pages;
      n.last_used = clock_;
      for (int32_t p : pages) pool_.Ref(p);
      if (parent != 0) ++nodes_.at(parent).children;
      it = nodes_.emplace(key, std::move(n)).first;
    }
    chain.push_back(&it->second);
    parent = key;
  }
  if (tiers_ != nullptr && !chain.empty()) {
    tiers_->Store(tokens, salt, static_cast<int>(chain.size()),
                  [&](int b) { return std::span<const int32_t>(chain[b]->pages); });
  }
}

bool PrefixTree::Unused(const Node& n) const {
  return std::all_of(n.pages.begin(), n.pages.end(),
                     [&](int32_t p) { return pool_.refcount(p) == 1; });
}

template <class Fn>
void PrefixTree::ForEachUnpinned(Fn&& fn) const {
  // A node is freeable once no sequence uses it or any node below it. A used node usually has
  // used ancestors, but not always: a sequence that computed a block itself may have published
  // it under another sequence's copy of the parent block. So pin every ancestor of a used node.
  std::unordered_map<uint64_t, bool> pinned;
  for (const auto& [key, node] : nodes_) {
    if (Unused(node)) continue;
    for (uint64_t k = key; k != 0;) {
      bool& p = pinned[k];
      if (p) break;
      p = true;
      k = nodes_.at(k).parent;
    }
  }
  for (const auto& [key, node] : nodes_) {
    if (!pinned.count(key)) fn(node);
  }
}

size_t PrefixTree::ReclaimableBytes() const {
  size_t bytes = 0;
  ForEachUnpinned([&](const Node& n) {
    for (int32_t p : n.pages) bytes += pool_.page_bytes(p);
  });
  return bytes;
}

int32_t PrefixTree::ReclaimablePages() const {
  int32_t count = 0;
  ForEachUnpinned([&](const Node& n) { count += static_cast<int32_t>(n.pages.size()); });
  return count;
}

void PrefixTree::EvictNode(std::unordered_map<uint64_t, Node>::iterator it) {
  for (int32_t p : it->second.pages) pool_.Unref(p);
  stats_.evicted_pages += static_cast<int64_t>(it->second.pages.size());
  ++stats_.evicted_blocks;
  if (it->second.parent != 0) --nodes_.at(it->second.parent).children;
  nodes_.erase(it);
}

size_t PrefixTree::Reclaim(size_t bytes) {
  using Entry = std::pair<uint64_t, uint64_t>;  // (last_used, key), oldest first
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> leaves;
  for (const auto& [key, node] : nodes_) {
    if (node.children == 0 && Unused(node)) leaves.emplace(node.last_used, key);
  }
  size_t freed = 0;
  while (freed < bytes && !leaves.empty()) {
    const uint64_t key = leaves.top().second;
    leaves.pop();
    auto it = nodes_.find(key);
    const uint64_t parent = it->second.parent;
    for (int32_t p : it->second.pages) freed += pool_.page_bytes(p);
    EvictNode(it);
    if (parent != 0) {
      const Node& p = nodes_.at(parent);
      if (p.children == 0 && Unused(p)) leaves.emplace(p.last_used, parent);
    }
  }
  return freed;
}

void PrefixTree::CollectPages(std::vector<int32_t>* pages) const {
  for (const auto& [key, node] : nodes_)
    pages->insert(pages->end(), node.pages.begin(), node.pages.end());
}

int32_t PrefixTree::cached_pages() const {
  int32_t n = 0;
  for (const auto& [key, node] : nodes_) n += static_cast<int32_t>(node.pages.size());
  return n;
}

}  // namespace cachet
