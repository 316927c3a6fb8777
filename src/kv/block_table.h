// One (layer, KV head)'s pages in a sequence, and reading and writing their rows whatever codec
// stores them.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/page_pool.h"
#include "kv/quest_index.h"

namespace cachet {

struct BlockTable {
  std::vector<int32_t> pages;
  int32_t n_tokens = 0;
  std::vector<int32_t> seal_pages;  // codec pages reserved for staged pages that will fill
  int32_t claim = -1;    // the pool's claim of free slots for the next pages (PagedSequence)
  int32_t unsealed = 0;  // tokens appended since the last SealAged (kv/staging.h)
  // Built as pages reach their final form (one thread, once the tokens have attended), else lazily
  // by decode steps (one task per table then).
  mutable QuestIndex quest;
};

// Pages belong to one table (layer * n_kv_heads + KV head): calibrated codecs code each its own
// way (KvLayout::plan), so every function that codes a page is told its table.

// Codes rows [n][head_dim] into rows [first, first + n) of a page, in its codec for role. The
// rows' positions must be set: keys a codec stores before RoPE (kvq) are turned back by them.
void EncodePageRows(PagePool& pool, int table, int32_t page, codecs::Role role, const float* rows,
                    int first, int n);
// The first cnt rows of a page's role as attention and Quest read them: decoded (SIMD) into the
// basis they are stored in, keys stored before RoPE (kvq) turned by their positions.
void DecodeStoredRows(PagePool& pool, int table, int32_t page, codecs::Role role, int cnt,
                      float* rows);

// Cold tables (a press's demoted tokens, kv/compaction.cc; pages aged out, kv/aging.cc) grow row
// by row. The pages appending n rows to c takes: new pages past its last, and a private copy of a
// shared (forked), partly filled last page.
int64_t ColdPagesNeeded(const PagePool& cold, const BlockTable& c, int64_t n);
// Appends one token to c (table `table` of the cold pool), taking the pages it needs from
// fresh[*next], as ColdPagesNeeded counted them.
void AppendColdRow(PagePool& cold, int table, BlockTable& c, const std::vector<int32_t>& fresh,
                   size_t* next, const float* k, const float* v, int32_t pos);

// Encodes one token's K and V rows into row `off` of a page, in the page's codecs.
void WriteRow(PagePool& pool, int table, int32_t page, int off, const float* k, const float* v,
              int32_t pos);
// The first cnt K and V rows of a page in f32.
void DecodeRows(PagePool& pool, int table, int32_t page, int cnt, float* k, float* v);
// A table's K and V rows in f32, with their positions, in table order.
void GatherTable(PagePool& pool, int table, const BlockTable& t, std::vector<float>* k,
                 std::vector<float>* v, std::vector<int32_t>* positions);

}  // namespace cachet
