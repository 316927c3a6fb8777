// Attention over block tables: the page-table views the attention kernels read.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kernels.h"
#include "kv/block_table.h"

namespace cachet {

// The pages of one table that an attention pass reads.
struct TablePages {
  PagePool* pool;
  const BlockTable* table;
  const std::vector<int32_t>* subset;  // logical pages, ascending; null: every page
  int index = 0;                       // the table's: layer * n_kv_heads + KV head
};

// A plain (f32) layout's table as the kernels take it.
kernels::PagedKv PlainView(const PagePool& pool, const BlockTable& t);

// Attention over the hot table's pages, then the cold table's (keys in that order; cold may be
// null). A plain layout without a cold table is read as a page table; anything else through
// kernels::PageRows, in the hot pool's basis for each role (where that is plain and the cold
// table's pages are most of the pass, the cold pool's).
void AttendTables(const kernels::AttnBatch& batch, const TablePages& hot, const TablePages* cold);

}  // namespace cachet
