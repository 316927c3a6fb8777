// The prefix cache's tiers below RAM (disk, later Redis): full pages of published prefixes are
// packed into runs of blocks (format.h), written through to every tier when the prefix tree
// publishes them, and read back in order, RAM -> disk -> ..., when a lookup runs past what RAM
// holds: the pages are decoded into fresh pool pages and handed to the tree.
//
// Runs are aligned: run r of a sequence holds its blocks [r * R, (r + 1) * R) (R = run_blocks,
// 16 by default: 256 tokens of 16-token pages), keyed by the chain of the runs before it, the
// cache salt and its tokens; the last run of a sequence may be shorter (whole blocks). A lookup
// asks for full runs up to the tokens it may reuse, then the shorter tail run of exactly that
// length, and stops at the first run no tier has.
//
// A run's payload: for each of its blocks, for each (layer, KV head) in table order, the page as
// the pool holds it: one byte of kind (0 raw, 1 codec), its K and V bytes in that kind's codec,
// then its page_tokens positions (int32). The namespace (model, codecs, page size, mixed
// precision) makes a run of another layout a miss, never a wrong page.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kv/page_pool.h"
#include "kv/tiers/format.h"
#include "kv/tiers/tier.h"

namespace cachet::tiers {

// What one tier did for the prefix cache, beyond its own TierStats.
struct TierReport {
  std::string name;
  TierStats stats;
  int64_t loaded_tokens = 0;  // prompt tokens served from this tier
  int64_t rejected = 0;       // runs found but refused (damaged, another namespace or tokens)
  int64_t stored_runs = 0;    // runs this process wrote to it
};

class KvTiers {
 public:
  // Bumped whenever the payload's packing changes (TierNamespace::payload_layout).
  static constexpr uint32_t kPayloadLayout = 1;

  // zstd: runs are stored compressed (EncodeRun).
  KvTiers(PagePool& pool, TierNamespace ns, std::vector<std::unique_ptr<Tier>> tiers,
          bool zstd = false, int run_blocks = kDefaultRunBlocks);

  // Blocks [from_block, to_block) of tokens (to_block * page_tokens <= tokens.size()) as far as
  // the tiers hold them in order: appends one page per (layer, KV head) per block loaded to
  // *pages (fresh, refcount 1: the caller's) and the tier each came from to *source; returns the
  // blocks loaded. A miss, a refused run or a pool without room ends the load; never an error.
  int Load(std::span<const int32_t> tokens, uint64_t salt, int from_block, int to_block,
           std::vector<int32_t>* pages, std::vector<int>* source);

  // Writes the runs of blocks [0, n_blocks) of tokens that the tiers do not hold yet to every
  // tier. pages_of(b) gives block b's pages (one per table, in their final form).
  using PagesOf = std::function<std::span<const int32_t>(int block)>;
  void Store(std::span<const int32_t> tokens, uint64_t salt, int n_blocks, const PagesOf& pages_of);

  int tiers() const { return static_cast<int>(tiers_.size()); }
  // How long a run stored (or loaded) is taken to be still held without asking (default 60 s).
  void set_recheck(std::chrono::steady_clock::duration d) { recheck_ = d; }
  std::vector<TierReport> Report() const;

 private:
  // Keys of the runs covering blocks [0, n_blocks): full runs, then the shorter tail if any.
  void RunKeys(std::span<const int32_t> tokens, uint64_t salt, int n_blocks,
               std::vector<RunKey>* keys) const;
  std::string Pack(int first_block, int n_blocks, const PagesOf& pages_of) const;
  // A run's payload of n_blocks blocks, of which [skip, n_blocks) are wanted.
  struct Piece {
    std::span<const uint8_t> payload;
    int n_blocks, skip;
  };
  // Fresh pages holding the wanted blocks of the leading pieces that are what this layout packs
  // and that the pool has room for, appended block-major; returns how many pieces that is.
  int Unpack(std::span<const Piece> pieces, std::vector<int32_t>* pages);

  PagePool& pool_;
  TierNamespace ns_;
  RunKey root_;  // NamespaceKey(ns_): the parent of a sequence's first run
  std::vector<std::unique_ptr<Tier>> tiers_;
  bool zstd_;
  int run_blocks_;
  std::vector<TierReport> reports_;
  // Runs known to be held by every tier (written or seen by this process) and since when, so
  // that publishing the same prefix again packs nothing. A tier may lose a run after that (a
  // dropped background write, Redis evicting or expiring it, the disk cap), so a run older than
  // recheck_ is asked about again. Cleared when it grows past a bound.
  std::unordered_map<RunKey, std::chrono::steady_clock::time_point, RunKeyHash> stored_;
  std::chrono::steady_clock::duration recheck_ = std::chrono::seconds(60);
};

}  // namespace cachet::tiers
