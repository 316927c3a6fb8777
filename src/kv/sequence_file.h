// A sequence's KV cache as a file (`cachet cache save`, Session::Save): every (layer, KV head)
// table's pages in their own codec, exactly as the pool holds them (evicted tokens gone, demoted
// ones in the cold codec, staged pages raw), with the session's tokens and last logits, so a later
// process continues from it as the saving one would have. Self-checking like the tiers' runs:
// magic, version, the model-and-layout namespace, sizes and an xxh3 checksum are all verified
// before a page is allocated. The byte layout is in docs/ARCHITECTURE.md ("Saved caches").
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"
#include "kv/paged_sequence.h"
#include "kv/tiers/format.h"

namespace cachet {

// 2: the cold codecs as "K[:V]" and the age at which pages go cold (precision by age); version 1
// files (no age) are still read.
inline constexpr uint32_t kSequenceFileVersion = 2;

// What a saved cache holds besides its pages.
struct SequenceImage {
  std::vector<int32_t> tokens;   // whose K/V the pages hold (before any eviction)
  std::vector<int32_t> pending;  // sampled but not yet evaluated
  std::vector<float> logits;     // of the last token (empty: none)
  std::string compression;       // how it was compressed, as the saver described it
};

// The header of a saved cache, readable without a model.
struct SequenceFileInfo {
  tiers::TierNamespace ns;  // model content hash and KV layout
  std::string cold_codec;   // "" without cold tokens; "K" or "K:V" (codecs::PairName)
  double cold_fetch = 1.0;
  int32_t age_out = 0;  // pages this many tokens old go cold (PagedSequence::age_out); 0: demoted
  int32_t quest_pages = 0;
  double quest_keep = 1.0;
  int32_t n_tokens = 0;    // tokens of the sequence (SequenceImage::tokens)
  int64_t held_rows = 0;   // token rows its tables hold, over every (layer, KV head), cold included
  int64_t page_bytes = 0;  // bytes of the pages it stores (hot and cold)
  std::string compression;
};

std::string SaveSequence(const PagedSequence& seq, const tiers::TierNamespace& ns,
                         const SequenceImage& image);

// The header of a saved cache (the whole file checked: magic, version, sizes, checksum).
Result<SequenceFileInfo> ReadSequenceInfo(std::span<const uint8_t> bytes);

// Loads a saved cache into seq (which must be empty), all or nothing. ns is the engine's: a file
// of another model or layout is FailedPrecondition naming what differs. cold_pool_for gives the
// pool for a cold codec (demoted tokens).
Status LoadSequence(std::span<const uint8_t> bytes, const tiers::TierNamespace& ns,
                    const std::function<Result<PagePool*>(std::string_view codec)>& cold_pool_for,
                    PagedSequence* seq, SequenceImage* image);

}  // namespace cachet
