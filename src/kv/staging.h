// Codec staging: which pages of a block table are raw and which are codec pages. Row-wise codecs
// encode each token into its page as it is written; staged layouts (KIVI keys, --kv-window) write
// tokens into raw pages and seal a page into a codec page once it is full and `window` tokens
// old, after the tokens that aged it have attended. Pages holding the first `sinks` tokens stay
// raw.
#pragma once

#include <cstdint>

#include "kv/block_table.h"
#include "kv/page_pool.h"

namespace cachet {

inline bool IsSinkPage(const KvLayout& lay, int64_t page_index) {
  return page_index * lay.page_tokens < lay.sinks;
}
// A codec layout whose pages are written raw and sealed later.
inline bool Stages(const KvLayout& lay) { return !lay.plain() && lay.staged(); }
// Whether page p is written raw (plain layouts, sinks, staging) or encoded directly.
inline bool WrittenRaw(const KvLayout& lay, int64_t p) {
  return lay.plain() || lay.staged() || IsSinkPage(lay, p);
}
// Staged layouts: whether page p of a table of n tokens is sealed into the codec.
inline bool WantsCodecPage(const KvLayout& lay, int64_t p, int64_t n_tokens) {
  return p < lay.SealedPages(n_tokens) && !IsSinkPage(lay, p);
}
// Pages of a table of n tokens in their final form: full and, in staged layouts, sealed or sinks.
int64_t FinalPages(const KvLayout& lay, int64_t n_tokens);
// Codec pages to reserve so that the next n tokens can seal the staged pages they age.
int64_t SealsNeeded(const KvLayout& lay, const BlockTable& t, int n);
// Seals every staged page the table's tokens have aged (full and `window` tokens old) that is
// still raw, each into one of t.seal_pages. Called once the tokens appended have attended: a
// prompt chunk reads its own tokens at the staging precision, as a decode step reads its page.
void SealAgedPages(PagePool& pool, int table, BlockTable& t);

}  // namespace cachet
