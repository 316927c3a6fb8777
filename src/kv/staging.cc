#include "kv/staging.h"

#include <algorithm>
#include <cstring>

namespace cachet {

using codecs::Role;

int64_t FinalPages(const KvLayout& lay, int64_t n_tokens) {
  const int64_t pt = lay.page_tokens, full = n_tokens / pt;
  if (!Stages(lay)) return full;
  // Sink pages are a prefix and stay raw: final once full. Others are final once sealed.
  return std::max(lay.SealedPages(n_tokens), std::min(full, (lay.sinks + pt - 1) / pt));
}

int64_t SealsNeeded(const KvLayout& lay, const BlockTable& t, int n) {
  if (!Stages(lay)) return 0;
  const int64_t len = t.n_tokens;
  int64_t fills = 0;  // staged pages the next n tokens seal (raw now, not sinks)
  for (int64_t p = lay.SealedPages(len); p < lay.SealedPages(len + n); ++p) {
    fills += !IsSinkPage(lay, p) && (p >= int64_t(t.pages.size()) || !IsCodecPage(t.pages[p]));
  }
  return fills;
}

void SealAgedPages(PagePool& pool, int table, BlockTable& t) {
  const KvLayout& lay = pool.layout();
  if (!Stages(lay)) return;
  // Sealed pages are a prefix (after the sinks): the raw ones to seal end the aged span.
  int64_t first = lay.SealedPages(t.n_tokens);
  while (first > 0 && !IsSinkPage(lay, first - 1) && !IsCodecPage(t.pages[first - 1])) --first;
  thread_local std::vector<float> rows;
  rows.resize(size_t(lay.page_tokens) * lay.head_dim);
  for (int64_t p = first; p < lay.SealedPages(t.n_tokens); ++p) {
    const int32_t raw = t.pages[p];
    const int32_t codec = t.seal_pages.front();
    t.seal_pages.erase(t.seal_pages.begin());
    pool.CopyPositions(raw, codec, lay.page_tokens);
    for (Role role : {Role::kKey, Role::kValue}) {
      codecs::DecodePage(lay.raw_codec(), role, pool.rows(raw, role), lay.page_tokens,
                         lay.page_tokens, lay.head_dim, rows.data());
      EncodePageRows(pool, table, codec, role, rows.data(), 0, lay.page_tokens);
    }
    pool.Unref(raw);
    t.pages[p] = codec;
  }
}

}  // namespace cachet
