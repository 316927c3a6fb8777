// Chunk reuse at any position (docs/REUSE.md): a prompt made of parts, some of them chunks
// (documents, tool outputs) whose K/V the engine caches on their own and moves to wherever they
// appear, and how the lost attention between chunks is restored (blending).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "cachet/status.h"

namespace cachet {

// How a prompt's reused chunks are reconciled with what precedes them.
struct BlendOptions {
  enum class Kind {
    kNone,        // plain concatenation of the chunks' own K/V
    kEpic,        // recompute the first `epic_tokens` tokens of every chunk (EPIC, LegoLink)
    kCacheBlend,  // recompute the `recompute` fraction of tokens whose K/V deviate most
  };
  Kind kind = Kind::kNone;
  int epic_tokens = 16;
  double recompute = 0.15;
  // CacheBlend: the layer whose K/V deviation picks the tokens (layers before it are recomputed
  // for every reused token).
  int check_layer = 1;
};
// "none", "epic[:K]", "cacheblend[:R]"; InvalidArgument naming the spec otherwise.
Result<BlendOptions> ParseBlend(std::string_view spec);
std::string BlendName(const BlendOptions& b);  // the spec ParseBlend reads back

// One part of a prompt: plain tokens, or a chunk looked up in (and added to) the chunk cache.
struct PromptPart {
  std::span<const int32_t> tokens;
  bool chunk = false;
};

// What Session::EvalChunked did.
struct ChunkReuseStats {
  int prompt_tokens = 0;
  int chunk_tokens = 0;  // tokens of the chunk parts
  int chunk_hits = 0;    // chunks found in the chunk cache
  int chunk_misses = 0;  // chunks computed on their own (and cached) first
  int hit_tokens = 0;    // tokens of the chunks found cached
  // Tokens of the chunks not found that the prefix cache or its disk and Redis tiers held (the
  // chunk computed as a prompt of BOS and its tokens, as another process may have done).
  int prefix_tokens = 0;
  int recomputed_tokens = 0;    // chunk tokens computed in place (EPIC's, CacheBlend's selection)
  double chunk_compute_ms = 0;  // of the misses' own prefill
};

}  // namespace cachet
