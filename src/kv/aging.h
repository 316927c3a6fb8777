// Precision by age (--kv-cold CODEC --kv-cold-after N): a table's full pages whose tokens are all
// N or more tokens old move from the hot pool to the sequence's cold pool, re-coded in its codec
// (usually fewer bits). Recent tokens draw most of a query's attention, so their precision
// matters most: the window in f16, the hot codec behind it, the cold codec for the rest. Every
// cold page is read by attention (unlike a press's demoted tokens, which decode steps fetch a
// fraction of).
#pragma once

#include <vector>

#include "cachet/status.h"
#include "kv/block_table.h"
#include "kv/page_pool.h"

namespace cachet {

// Moves, per table, the hot pages past the sink pages that are in their final form (full, and
// sealed in staged layouts) and whose last token's position is below `n_tokens - after`: rows
// decoded, appended to the table's cold pages in the cold codec, the hot pages released. Tables
// stay in position order (sinks, then the recent pages; the cold table in order too). Plan, then
// apply: when the cold pool cannot supply the pages, nothing changes (ResourceExhausted).
Status AgeOutPages(PagePool& pool, std::vector<BlockTable>& tables, PagePool& cold_pool,
                   std::vector<BlockTable>& cold_tables, int n_tokens, int after);

}  // namespace cachet
