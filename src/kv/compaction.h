// Eviction compaction of a sequence's block tables, plan then apply (PagedSequence::Retain says
// what keep, demote and values mean).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cachet/status.h"
#include "kv/block_table.h"

namespace cachet {

// New positions for the tokens a compaction keeps (PagedSequence::Renumber): new_pos[p] for the
// token at position p. A kept token whose position changes has its key re-rotated by the
// difference (RoPE, rotate-half pairs, inv_freq: the model's head_dim / 2 frequencies), so it
// reads as if computed at its new position; values need nothing.
struct Renumbering {
  std::span<const int32_t> new_pos;
  std::span<const float> inv_freq;
};

// The cos (first head_dim / 2) and sin (then) of a rotation by delta positions, as RoPE computes
// them (angle in double), for kernels::RopeRotateHalf.
void RopeShift(int head_dim, int32_t delta, std::span<const float> inv_freq,
               std::vector<float>* cs);
// Rotates one key row (head_dim values, rotate-half pairs) by delta positions.
void RerotateKey(float* key, int head_dim, int32_t delta, std::span<const float> inv_freq);

// tables are in pool; cold_tables (one per table once anything is demoted, else empty) in
// cold_pool, which may be null when demote is false. With renumber, kept tokens take their new
// positions (demote must be false).
Status Compact(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
               std::vector<BlockTable>& cold_tables, std::span<const std::vector<int32_t>> keep,
               bool demote, std::span<const std::vector<float>> values,
               const Renumbering* renumber = nullptr);

// A renumbering of hot tables (in pool) and their cold tables (in cold_pool, may be empty), each
// with its keep lists: both planned before either is applied, so a pool without room for the
// copies changes nothing (ResourceExhausted).
Status CompactRenumbering(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
                          std::vector<BlockTable>& cold_tables,
                          std::span<const std::vector<int32_t>> keep,
                          std::span<const std::vector<int32_t>> cold_keep,
                          const Renumbering& renumber);

}  // namespace cachet
