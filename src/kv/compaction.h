// Eviction compaction of a sequence's block tables, plan then apply (PagedSequence::Retain says
// what keep, demote and values mean).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cachet/status.h"
#include "kv/block_table.h"

namespace cachet {

// tables are in pool; cold_tables (one per table once anything is demoted, else empty) in
// cold_pool, which may be null when demote is false.
Status Compact(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
               std::vector<BlockTable>& cold_tables, std::span<const std::vector<int32_t>> keep,
               bool demote, std::span<const std::vector<float>> values);

}  // namespace cachet
