#include "kv/paged_sequence.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/kernels.h"
#include "kv/codecs/codec_simd.h"

namespace cachet {

using codecs::Role;

PagedSequence::PagedSequence(PagePool& pool) : pool_(pool), tables_(pool.layout().heads_total()) {}

PagedSequence::~PagedSequence() { Clear(); }

void PagedSequence::Clear() {
  for (BlockTable& t : tables_) {
    for (int32_t p : t.pages) pool_.Unref(p);
    for (int32_t p : t.seal_pages) pool_.Unref(p);
    t.pages.clear();
    t.seal_pages.clear();
    t.key_bounds.clear();
    t.n_tokens = 0;
  }
  for (BlockTable& t : cold_tables_) {
    for (int32_t p : t.pages) cold_pool_->Unref(p);
  }
  cold_tables_.clear();
  n_tokens_ = 0;
}

std::unique_ptr<PagedSequence> PagedSequence::Fork() const {
  auto child = std::make_unique<PagedSequence>(pool_);
  child->n_tokens_ = n_tokens_;
  for (size_t i = 0; i < tables_.size(); ++i) {
    child->tables_[i].pages = tables_[i].pages;
    child->tables_[i].n_tokens = tables_[i].n_tokens;
    for (int32_t p : tables_[i].pages) pool_.Ref(p);
  }
  child->cold_pool_ = cold_pool_;
  child->cold_fetch_ = cold_fetch_;
  child->cold_tables_.resize(cold_tables_.size());
  for (size_t i = 0; i < cold_tables_.size(); ++i) {
    child->cold_tables_[i].pages = cold_tables_[i].pages;
    child->cold_tables_[i].n_tokens = cold_tables_[i].n_tokens;
    for (int32_t p : cold_tables_[i].pages) cold_pool_->Ref(p);
  }
  child->quest_pages_ = quest_pages_;
  child->quest_keep_ = quest_keep_;
  return child;
}

int PagedSequence::longest_head() const {
  int n = 0;
  for (const BlockTable& t : tables_) n = std::max(n, int(t.n_tokens));
  return n;
}

int PagedSequence::pages_held() const {
  int n = 0;
  for (const BlockTable& t : tables_) n += static_cast<int>(t.pages.size() + t.seal_pages.size());
  return n;
}

size_t PagedSequence::bytes_held() const {
  size_t n = 0;
  for (const BlockTable& t : tables_) {
    for (int32_t p : t.pages) n += pool_.page_bytes(p);
    for (int32_t p : t.seal_pages) n += pool_.page_bytes(p);
  }
  return n + cold_bytes_held();
}

size_t PagedSequence::cold_bytes_held() const {
  size_t n = 0;
  for (const BlockTable& t : cold_tables_) {
    for (int32_t p : t.pages) n += cold_pool_->page_bytes(p);
  }
  return n;
}

void PagedSequence::AttachBlock(std::span<const int32_t> pages) {
  const int pt = pool_.layout().page_tokens;
  for (size_t i = 0; i < tables_.size(); ++i) {
    BlockTable& t = tables_[i];
    pool_.Ref(pages[i]);
    t.pages.push_back(pages[i]);
    t.n_tokens += pt;
  }
  n_tokens_ += pt;
}

bool PagedSequence::BlockPages(int block, std::vector<int32_t>* pages) const {
  const KvLayout& lay = pool_.layout();
  const int pt = lay.page_tokens;
  pages->clear();
  for (const BlockTable& t : tables_) {
    // Only pages in their final form: full and, with a recent window, old enough to be encoded.
    if (t.n_tokens != n_tokens_ || (block + 1) * pt > t.n_tokens ||
        (!lay.plain() && block >= lay.SealedPages(t.n_tokens) && !IsSinkPage(block))) {
      return false;
    }
    pages->push_back(t.pages[block]);
  }
  return true;
}

int64_t PagedSequence::SealsNeeded(const BlockTable& t, int n) const {
  const KvLayout& lay = pool_.layout();
  if (lay.plain() || !lay.staged()) return 0;
  const int64_t len = t.n_tokens;
  int64_t fills = 0;  // staged pages the next n tokens seal (raw now, not sinks)
  for (int64_t p = lay.SealedPages(len); p < lay.SealedPages(len + n); ++p) {
    fills += !IsSinkPage(p) && (p >= int64_t(t.pages.size()) || !IsCodecPage(t.pages[p]));
  }
  return fills;
}

Status PagedSequence::Reserve(int n) {
  if (n <= 0) return OkStatus();
  const KvLayout& lay = pool_.layout();
  const int64_t pt = lay.page_tokens;
  // Plan: count the pages each table needs (new pages of the right kind, private copies of shared
  // partly filled last pages, codec pages for staged pages that will fill), then take them all
  // at once so a failure changes nothing.
  int64_t need_raw = 0, need_codec = 0;
  for (const BlockTable& t : tables_) {
    const int64_t len = t.n_tokens, want = (len + n + pt - 1) / pt;
    for (int64_t p = static_cast<int64_t>(t.pages.size()); p < want; ++p) {
      (RawPage(p) ? need_raw : need_codec) += 1;
    }
    if (len % pt != 0 && pool_.refcount(t.pages.back()) > 1) {
      (IsCodecPage(t.pages.back()) ? need_codec : need_raw) += 1;
    }
    need_codec += std::max<int64_t>(0, SealsNeeded(t, n) - int64_t(t.seal_pages.size()));
  }
  if (need_raw + need_codec == 0) return OkStatus();
  if (need_raw + need_codec > std::numeric_limits<int32_t>::max() / 2) {
    return ResourceExhausted("KV reservation too large");
  }
  scratch_raw_.clear();
  scratch_codec_.clear();
  CACHET_RETURN_IF_ERROR(pool_.Alloc(static_cast<int>(need_raw), static_cast<int>(need_codec),
                                     &scratch_raw_, &scratch_codec_));
  // Apply.
  size_t next_raw = 0, next_codec = 0;
  for (BlockTable& t : tables_) {
    const int64_t len = t.n_tokens, want = (len + n + pt - 1) / pt;
    if (len % pt != 0 && pool_.refcount(t.pages.back()) > 1) {
      const int32_t shared = t.pages.back();
      const int32_t copy =
          IsCodecPage(shared) ? scratch_codec_[next_codec++] : scratch_raw_[next_raw++];
      pool_.CopyPage(shared, copy);
      pool_.Unref(shared);
      t.pages.back() = copy;
    }
    for (int64_t p = static_cast<int64_t>(t.pages.size()); p < want; ++p) {
      t.pages.push_back(RawPage(p) ? scratch_raw_[next_raw++] : scratch_codec_[next_codec++]);
    }
    for (int64_t fills = SealsNeeded(t, n); int64_t(t.seal_pages.size()) < fills;) {
      t.seal_pages.push_back(scratch_codec_[next_codec++]);
    }
  }
  return OkStatus();
}

void PagedSequence::Seal(BlockTable& t, int64_t page_index) {
  const KvLayout& lay = pool_.layout();
  const int32_t raw = t.pages[page_index];
  const int32_t sealed = t.seal_pages.front();
  t.seal_pages.erase(t.seal_pages.begin());
  thread_local std::vector<float> rows;
  rows.resize(size_t(lay.page_tokens) * lay.head_dim);
  for (Role role : {Role::kKey, Role::kValue}) {
    codecs::DecodePage(lay.raw_codec(), role, pool_.rows(raw, role), lay.page_tokens,
                       lay.page_tokens, lay.head_dim, rows.data());
    codecs::EncodePage(pool_.codec_of(sealed, role), role, rows.data(), lay.page_tokens,
                       lay.page_tokens, lay.head_dim, pool_.rows(sealed, role));
  }
  std::memcpy(pool_.positions(sealed), pool_.positions(raw), lay.page_tokens * sizeof(int32_t));
  pool_.Unref(raw);
  t.pages[page_index] = sealed;
}

void PagedSequence::Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) {
  BlockTable& t = table(layer, kv_head);
  const KvLayout& lay = pool_.layout();
  const int64_t page_index = t.n_tokens / lay.page_tokens;
  const int32_t page = t.pages[page_index];
  // A codec page is a row-wise codec's: the token is encoded where it lands.
  WriteRow(pool_, page, t.n_tokens % lay.page_tokens, k, v, pos);
  ++t.n_tokens;
  if (!lay.plain() && lay.staged()) {
    const int64_t sealed = lay.SealedPages(t.n_tokens);
    const int64_t q = sealed - 1;  // the page this token may have aged into its final form
    if (sealed > lay.SealedPages(t.n_tokens - 1) && !IsSinkPage(q) && !IsCodecPage(t.pages[q])) {
      Seal(t, q);
    }
  }
  // Quest: the bounds of the page this token put in its final form, so that the first decode step
  // after a prompt has none left to build. Only when every page before it has them: a table that
  // lost its bounds (a fork, prefix reuse, Retain) gets them all back at the next decode step,
  // which builds them one task per table rather than here on one thread.
  if (quest()) {
    const int64_t final_pages = FinalPages(t);
    if (int64_t(t.key_bounds.size()) == (final_pages - 1) * 2 * lay.head_dim) {
      ExtendKeyBounds(pool_, t, final_pages);
    }
  }
}

int64_t PagedSequence::FinalPages(const BlockTable& t) const {
  const KvLayout& lay = pool_.layout();
  const int64_t pt = lay.page_tokens, full = t.n_tokens / pt;
  if (lay.plain() || !lay.staged()) return full;
  // Sink pages are a prefix and stay raw: final once full. Others are final once sealed.
  return std::max(lay.SealedPages(t.n_tokens), std::min(full, (lay.sinks + pt - 1) / pt));
}

namespace {

// The first cnt K and V rows of a page in f32, whatever stores them.
void DecodeRows(PagePool& pool, int32_t page, int cnt, float* k, float* v) {
  const KvLayout& lay = pool.layout();
  for (Role role : {Role::kKey, Role::kValue}) {
    codecs::DecodePage(pool.codec_of(page, role), role, pool.rows(page, role), cnt, lay.page_tokens,
                       lay.head_dim, role == Role::kKey ? k : v);
  }
}

}  // namespace

void PagedSequence::WriteRow(PagePool& pool, int32_t page, int off, const float* k, const float* v,
                             int32_t pos) {
  const KvLayout& lay = pool.layout();
  const int hd = lay.head_dim;
  for (Role role : {Role::kKey, Role::kValue}) {
    const codecs::Codec c = pool.codec_of(page, role);
    codecs::EncodePage(c, role, role == Role::kKey ? k : v, 1, 1, hd,
                       pool.rows(page, role) + off * codecs::RowStride(c, hd));
  }
  pool.positions(page)[off] = pos;
}

void PagedSequence::DemoteRow(BlockTable& c, const float* k, const float* v, int32_t pos,
                              const std::vector<int32_t>& fresh, size_t* next) {
  const KvLayout& cl = cold_pool_->layout();
  const int pt = cl.page_tokens;
  const int off = c.n_tokens % pt;
  if (off == 0) {
    c.pages.push_back(fresh[(*next)++]);
  } else if (cold_pool_->refcount(c.pages.back()) > 1) {  // shared with a fork: copy first
    const int32_t shared = c.pages.back(), copy = fresh[(*next)++];
    cold_pool_->CopyPage(shared, copy);
    cold_pool_->Unref(shared);
    c.pages.back() = copy;
  }
  WriteRow(*cold_pool_, c.pages.back(), off, k, v, pos);
  ++c.n_tokens;  // key bounds cover full pages before the last only: appending keeps them valid
}

Status PagedSequence::Retain(std::span<const std::vector<int32_t>> keep, bool demote,
                             std::span<const std::vector<float>> values) {
  const KvLayout& lay = pool_.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  if (keep.size() != tables_.size()) {
    return InvalidArgument("Retain: " + std::to_string(keep.size()) + " keep lists for " +
                           std::to_string(tables_.size()) + " (layer, KV head) tables");
  }
  if (demote) {
    if (cold_pool_ == nullptr) return FailedPrecondition("Retain: demote without a cold pool");
    const KvLayout& cl = cold_pool_->layout();
    if (cl.staged() || cl.page_tokens != pt || cl.head_dim != hd) {
      return InvalidArgument(
          "Retain: the cold pool must use a row-wise codec and the same page "
          "shape");
    }
  }
  const bool staged = !lay.plain() && lay.staged();
  // Plan: validate, and find the destination pages whose contents change but that others share.
  std::vector<uint8_t> copy_dest;  // per table, per destination page: needs a private copy
  std::vector<size_t> copy_begin(tables_.size() + 1, 0);
  int need_raw = 0, need_codec = 0;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    const BlockTable& t = tables_[ti];
    const std::vector<int32_t>& k = keep[ti];
    for (size_t i = 0; i < k.size(); ++i) {
      if (k[i] < 0 || k[i] >= t.n_tokens || (i > 0 && k[i] <= k[i - 1])) {
        return InvalidArgument("Retain: keep list " + std::to_string(ti) +
                               " is not ascending within [0, " + std::to_string(t.n_tokens) + ")");
      }
    }
    const int dest_pages = static_cast<int>((k.size() + pt - 1) / pt);
    const bool new_values = ti < values.size() && !values[ti].empty();
    if (new_values && values[ti].size() != k.size() * size_t(hd)) {
      return InvalidArgument("Retain: values of table " + std::to_string(ti) +
                             " do not match its keep list");
    }
    copy_begin[ti] = copy_dest.size();
    // A destination page gets a fresh page when it changes kind (staged pages follow the new
    // length) or when its rows change while others share it.
    for (int d = 0; d < dest_pages; ++d) {
      const bool was_codec = IsCodecPage(t.pages[d]);
      const bool codec = staged ? WantsCodecPage(d, int64_t(k.size())) : was_codec;
      const bool fresh = codec != was_codec ||
                         (!PageRowsUnchanged(k, d, new_values) && pool_.refcount(t.pages[d]) > 1);
      copy_dest.push_back(fresh);
      if (fresh) (codec ? need_codec : need_raw) += 1;
    }
  }
  copy_begin[tables_.size()] = copy_dest.size();
  // Cold pages for the demoted tokens (a pool of one codec: all are codec pages, or all raw when
  // its codec is f32).
  std::vector<int32_t> cold_new;
  if (demote) {
    if (cold_tables_.empty()) cold_tables_.resize(tables_.size());  // empty tables: no state
    int need_cold = 0;
    for (size_t ti = 0; ti < tables_.size(); ++ti) {
      const BlockTable& c = cold_tables_[ti];
      const int64_t dropped = tables_[ti].n_tokens - int64_t(keep[ti].size());
      const int64_t n = c.n_tokens + dropped;
      need_cold += static_cast<int>((n + pt - 1) / pt - int64_t(c.pages.size()));
      // A shared, partly filled last cold page is copied before it is appended to.
      need_cold += dropped > 0 && c.n_tokens % pt != 0 && cold_pool_->refcount(c.pages.back()) > 1;
    }
    const bool raw = cold_pool_->layout().plain();  // only one of the two gets pages
    CACHET_RETURN_IF_ERROR(
        cold_pool_->Alloc(raw ? need_cold : 0, raw ? 0 : need_cold, &cold_new, &cold_new));
  }
  scratch_raw_.clear();
  scratch_codec_.clear();
  if (Status s = pool_.Alloc(need_raw, need_codec, &scratch_raw_, &scratch_codec_); !s.ok()) {
    for (int32_t p : cold_new) cold_pool_->Unref(p);
    return s;
  }
  size_t next_cold = 0;

  if (staged) {
    RetainStaged(keep, demote, values, copy_dest, copy_begin, cold_new);
    return OkStatus();
  }
  // Apply. A kept token only moves to an earlier index, so walking source pages in order, each
  // decoded whole before any of its rows is overwritten, never reads a row that was written.
  size_t next_raw = 0, next_codec = 0;
  std::vector<float> kbuf(size_t(pt) * hd), vbuf(size_t(pt) * hd);
  std::vector<int32_t> src_pos(pt), released;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    BlockTable& t = tables_[ti];
    const std::vector<int32_t>& k = keep[ti];
    const int dest_pages = static_cast<int>((k.size() + pt - 1) / pt);
    std::vector<int32_t> dest(t.pages.begin(), t.pages.begin() + dest_pages);
    for (int d = 0; d < dest_pages; ++d) {
      if (!copy_dest[copy_begin[ti] + d]) continue;
      released.push_back(dest[d]);
      dest[d] = IsCodecPage(dest[d]) ? scratch_codec_[next_codec++] : scratch_raw_[next_raw++];
    }
    // Source pages in order: decode each whole, demote its dropped tokens, then write its kept
    // ones (to this page or earlier ones, all of whose tokens are already handled).
    size_t kj = 0;
    for (int s = 0; s * pt < t.n_tokens; ++s) {
      const int cnt = std::min(pt, t.n_tokens - s * pt), first = s * pt;
      size_t kend = kj;
      while (kend < k.size() && k[kend] < first + cnt) ++kend;
      const bool drops = demote && static_cast<int>(kend - kj) < cnt;
      const float* new_v = ti < values.size() && !values[ti].empty() ? values[ti].data() : nullptr;
      bool writes = new_v != nullptr && kend > kj;
      for (size_t x = kj; x < kend && !writes; ++x) {
        writes = k[x] != static_cast<int32_t>(x) || copy_dest[copy_begin[ti] + x / pt];
      }
      if (!drops && !writes) {
        kj = kend;
        continue;
      }
      const int32_t sp = t.pages[s];
      DecodeRows(pool_, sp, cnt, kbuf.data(), vbuf.data());
      std::memcpy(src_pos.data(), pool_.positions(sp), cnt * sizeof(int32_t));
      if (drops) {
        size_t x = kj;
        for (int r = 0; r < cnt; ++r) {
          if (x < kend && k[x] == first + r) {
            ++x;
            continue;
          }
          DemoteRow(cold_tables_[ti], kbuf.data() + size_t(r) * hd, vbuf.data() + size_t(r) * hd,
                    src_pos[r], cold_new, &next_cold);
        }
      }
      for (size_t x = kj; x < kend; ++x) {
        const int d = static_cast<int>(x / pt), off = static_cast<int>(x % pt);
        if (k[x] == static_cast<int32_t>(x) && !copy_dest[copy_begin[ti] + d] && !new_v) continue;
        const int s_off = k[x] - first;
        const int32_t dp = dest[d];
        const float* kr = kbuf.data() + size_t(s_off) * hd;
        const float* vr = new_v ? new_v + x * hd : vbuf.data() + size_t(s_off) * hd;
        WriteRow(pool_, dp, off, kr, vr, src_pos[s_off]);
      }
      kj = kend;
    }
    for (size_t p = dest_pages; p < t.pages.size(); ++p) pool_.Unref(t.pages[p]);
    t.pages.assign(dest.begin(), dest.end());
    t.key_bounds.clear();
    t.n_tokens = static_cast<int32_t>(k.size());
  }
  for (int32_t p : released) pool_.Unref(p);
  return OkStatus();
}

bool PagedSequence::WantsCodecPage(int64_t page_index, int64_t n_tokens) const {
  return page_index < pool_.layout().SealedPages(n_tokens) && !IsSinkPage(page_index);
}

bool PagedSequence::PageRowsUnchanged(const std::vector<int32_t>& keep, int page_index,
                                      bool new_values) const {
  const size_t pt = size_t(pool_.layout().page_tokens);
  for (size_t j = page_index * pt; j < std::min(keep.size(), (page_index + 1) * pt); ++j) {
    if (new_values || keep[j] != static_cast<int32_t>(j)) return false;
  }
  return true;
}

// Staged pages are encoded whole (KIVI keys per channel over the page) and their kind follows the
// token count (sealed once full and `window` tokens old), so each table is decoded, compacted and
// its changed pages encoded again in the kind its new length asks for.
void PagedSequence::RetainStaged(std::span<const std::vector<int32_t>> keep, bool demote,
                                 std::span<const std::vector<float>> values,
                                 const std::vector<uint8_t>& fresh,
                                 const std::vector<size_t>& fresh_begin,
                                 const std::vector<int32_t>& cold_new) {
  const KvLayout& lay = pool_.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  size_t next_raw = 0, next_codec = 0, next_cold = 0;
  std::vector<float> k_all, v_all, kr(size_t(pt) * hd), vr(size_t(pt) * hd);
  std::vector<int32_t> pos_all, released;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    BlockTable& t = tables_[ti];
    const std::vector<int32_t>& k = keep[ti];
    const bool new_values = ti < values.size() && !values[ti].empty();
    Gather(t, &k_all, &v_all, &pos_all);
    if (demote) {
      size_t x = 0;
      for (int32_t r = 0; r < t.n_tokens; ++r) {
        if (x < k.size() && k[x] == r) {
          ++x;
          continue;
        }
        DemoteRow(cold_tables_[ti], &k_all[size_t(r) * hd], &v_all[size_t(r) * hd], pos_all[r],
                  cold_new, &next_cold);
      }
    }
    const int64_t n = int64_t(k.size());
    const int dest_pages = static_cast<int>((n + pt - 1) / pt);
    for (int d = 0; d < dest_pages; ++d) {
      if (!fresh[fresh_begin[ti] + d] && PageRowsUnchanged(k, d, new_values)) continue;
      int32_t& page = t.pages[d];
      const bool codec = WantsCodecPage(d, n);
      if (fresh[fresh_begin[ti] + d]) {
        released.push_back(page);
        page = codec ? scratch_codec_[next_codec++] : scratch_raw_[next_raw++];
      }
      const int cnt = static_cast<int>(std::min<int64_t>(pt, n - int64_t(d) * pt));
      for (int r = 0; r < cnt; ++r) {
        const size_t x = size_t(d) * pt + r, src = size_t(k[x]) * hd;
        std::copy_n(&k_all[src], hd, &kr[size_t(r) * hd]);
        std::copy_n(new_values ? &values[ti][x * hd] : &v_all[src], hd, &vr[size_t(r) * hd]);
        pool_.positions(page)[r] = pos_all[k[x]];
      }
      for (Role role : {Role::kKey, Role::kValue}) {
        codecs::EncodePage(pool_.codec_of(page, role), role,
                           role == Role::kKey ? kr.data() : vr.data(), cnt, pt, hd,
                           pool_.rows(page, role));
      }
    }
    for (size_t p = dest_pages; p < t.pages.size(); ++p) pool_.Unref(t.pages[p]);
    t.pages.resize(dest_pages);
    t.key_bounds.clear();
    t.n_tokens = static_cast<int32_t>(n);
  }
  for (int32_t p : released) pool_.Unref(p);
}

void PagedSequence::Positions(int layer, int kv_head, std::vector<int32_t>* positions) const {
  const BlockTable& t = table(layer, kv_head);
  const int pt = pool_.layout().page_tokens;
  positions->resize(t.n_tokens);
  for (int p = 0; p * pt < t.n_tokens; ++p) {
    std::memcpy(positions->data() + size_t(p) * pt, pool_.positions(t.pages[p]),
                std::min(pt, t.n_tokens - p * pt) * sizeof(int32_t));
  }
}

kernels::PagedKv PagedSequence::View(int layer, int kv_head) const {
  const BlockTable& t = table(layer, kv_head);
  const KvLayout& lay = pool_.layout();
  kernels::PagedKv v;
  v.slots = pool_.slots_base();
  v.positions = pool_.positions_base();
  v.slot_floats = lay.slot_floats();
  v.page_tokens = lay.page_tokens;
  v.head_dim = lay.head_dim;
  v.page_ids = t.pages.data();
  v.n_tokens = t.n_tokens;
  return v;
}

void PagedSequence::ExtendKeyBounds(PagePool& pool, const BlockTable& t, int64_t pages) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  thread_local std::vector<float> kbuf;
  kbuf.resize(size_t(pt) * hd);
  for (int64_t p = int64_t(t.key_bounds.size() / (2 * hd)); p < pages; ++p) {
    const int32_t page = t.pages[p];
    // SIMD decoding (the scalar DecodePage made the first decode step after a 16k prompt cost
    // 0.16 s); rotation codecs decode rotated, so their rows are turned back.
    const codecs::Codec c = pool.codec_of(page, Role::kKey);
    codecs::simd::DecodeStored(c, Role::kKey, pool.rows(page, Role::kKey), pt, pt, hd, kbuf.data());
    if (codecs::IsRotated(c)) {
      for (int j = 0; j < pt; ++j) codecs::Unrotate(kbuf.data() + size_t(j) * hd, hd);
    }
    const size_t at = t.key_bounds.size();
    t.key_bounds.resize(at + 2 * hd);
    kernels::KeyBounds(kbuf.data(), pt, hd, t.key_bounds.data() + at,
                       t.key_bounds.data() + at + hd);
  }
}

bool PagedSequence::QuestSelect(PagePool& pool, const BlockTable& t, const kernels::AttnBatch& b,
                                int pages, double keep, std::vector<int32_t>* selected) {
  const KvLayout& lay = pool.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  const int n_pages = (t.n_tokens + pt - 1) / pt;
  const int candidates = n_pages - 1;  // the last page is always read
  const int k = pages > 0 ? pages : std::max(1, static_cast<int>(std::ceil(keep * candidates)));
  if (k >= candidates) return false;
  // Bounds of the candidates without them yet (usually built as the pages filled; here after a
  // fork, prefix reuse or Retain, and for the recent window's pages).
  if (int64_t(t.key_bounds.size()) < int64_t(candidates) * 2 * hd) {
    ExtendKeyBounds(pool, t, candidates);
  }
  // Upper bound of q.k over a page: sum_i max(q_i min_i, q_i max_i); the group's heads share the
  // selection, so a page counts by its best head.
  thread_local std::vector<float> score;
  score.resize(candidates);
  kernels::PageBoundScores(b.q, b.n_heads, hd, t.key_bounds.data(), candidates, score.data());
  thread_local std::vector<std::pair<float, int32_t>> ub;
  ub.resize(candidates);
  for (int p = 0; p < candidates; ++p) ub[p] = {score[p], p};
  std::nth_element(ub.begin(), ub.begin() + k, ub.end(), [](const auto& a, const auto& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  });
  std::sort(ub.begin(), ub.begin() + k,
            [](const auto& a, const auto& c) { return a.second < c.second; });
  selected->clear();
  for (int i = 0; i < k; ++i) selected->push_back(ub[i].second);
  selected->push_back(n_pages - 1);
  return true;
}

void PagedSequence::AddRefs(PagePool& pool, const BlockTable& t, const std::vector<int32_t>* subset,
                            std::vector<PageRef>* refs) {
  const int pt = pool.layout().page_tokens;
  const int n_pages = (t.n_tokens + pt - 1) / pt;
  int32_t first = refs->empty() ? 0 : refs->back().first_key + refs->back().cnt;
  auto add = [&](int p) {
    const int32_t cnt = std::min(pt, t.n_tokens - p * pt);
    refs->push_back({&pool, t.pages[p], cnt, first});
    first += cnt;
  };
  if (subset) {
    for (int32_t p : *subset) add(p);
  } else {
    for (int p = 0; p < n_pages; ++p) add(p);
  }
}

// Pages of the hot and the cold pool as the attention kernels read them. Each role (K, V) is read
// in one basis: rotated when a pool's codec rotates that role (rotated queries score rotated keys,
// values accumulate rotated and the output is rotated back once per row), else the original one.
// Rows stored in the other basis (raw sink and window pages beside a rotation codec, a cold pool
// of another codec) are decoded and rotated into it.
struct PagedSequence::RefRows final : kernels::PageRows {
  // Each ref's pages are hot's or cold's (null: no cold pool).
  RefRows(std::span<const PageRef> refs, const KvLayout& layout, bool rot_k, bool rot_v,
          const PagePool& hot, const PagePool* cold)
      : refs_(refs), layout_(layout), rot_k_(rot_k), rot_v_(rot_v), hot_(&hot) {
    SetBytes(hot, bytes_[0]);
    if (cold != nullptr) SetBytes(*cold, bytes_[1]);
  }
  int n_pages() const override { return static_cast<int>(refs_.size()); }
  int n_keys() const override {
    return refs_.empty() ? 0 : refs_.back().first_key + refs_.back().cnt;
  }
  int page_tokens() const override { return layout_.page_tokens; }
  int head_dim() const override { return layout_.head_dim; }
  const int32_t* Positions(int page, int* cnt) const override {
    *cnt = refs_[page].cnt;
    return refs_[page].pool->positions(refs_[page].page);
  }
  kernels::PageData Rows(int page, float* k_buf, float* v_buf) const override {
    PagePool& pool = *refs_[page].pool;
    const int32_t id = refs_[page].page;
    kernels::PageData d;
    const codecs::Codec ck = pool.codec_of(id, Role::kKey);
    if (ck == codecs::Codec::kKivi4 || ck == codecs::Codec::kKivi2) {  // read fused
      const uint8_t* k = pool.rows(id, Role::kKey);
      d.k_channels = reinterpret_cast<const uint16_t*>(k);
      d.k = k + codecs::KiviKeyMetaBytes(layout_.head_dim);
      d.k_bits = ck == codecs::Codec::kKivi4 ? 4 : 2;
    } else {
      d.k = Rows(ck, Role::kKey, rot_k_, pool.rows(id, Role::kKey), refs_[page].cnt, k_buf,
                 &d.k_type);
    }
    d.v = Rows(pool.codec_of(id, Role::kValue), Role::kValue, rot_v_, pool.rows(id, Role::kValue),
               refs_[page].cnt, v_buf, &d.v_type);
    return d;
  }
  void Prefetch(int page) const override {
    PagePool& pool = *refs_[page].pool;
    const int32_t id = refs_[page].page;
    const size_t* bytes = bytes_[&pool != hot_][IsCodecPage(id)];
    for (Role role : {Role::kKey, Role::kValue}) {
      const char* p = reinterpret_cast<const char*>(pool.rows(id, role));
      const size_t n = bytes[role == Role::kValue];
      for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off);
    }
  }

 private:
  // Bytes of a page's K and V rows in a pool, by kind (raw, codec), as codec_of gives their codecs.
  static void SetBytes(const PagePool& pool, size_t (&bytes)[2][2]) {
    const KvLayout& l = pool.layout();
    const codecs::Codec raw = l.raw_codec();
    bytes[0][0] = codecs::PageBytes(raw, Role::kKey, l.page_tokens, l.head_dim);
    bytes[0][1] = codecs::PageBytes(raw, Role::kValue, l.page_tokens, l.head_dim);
    bytes[1][0] = codecs::PageBytes(l.codec_k, Role::kKey, l.page_tokens, l.head_dim);
    bytes[1][1] = codecs::PageBytes(l.codec_v, Role::kValue, l.page_tokens, l.head_dim);
  }

  // f32, f16, bf16, q8_0 and q4_0 rows in the basis they are stored in are read in place (the
  // kernel widens or unpacks them as it loads); other rows are decoded into buf.
  const void* Rows(codecs::Codec c, Role role, bool rotated, const uint8_t* data, int cnt,
                   float* buf, DType* type) const {
    if (rotated != codecs::IsRotated(c)) {
      const int hd = layout_.head_dim;
      codecs::simd::DecodeStored(c, role, data, cnt, layout_.page_tokens, hd, buf);
      for (int t = 0; t < cnt; ++t) {
        rotated ? codecs::Rotate(buf + size_t(t) * hd, hd)
                : codecs::Unrotate(buf + size_t(t) * hd, hd);
      }
      *type = DType::kF32;
      return buf;
    }
    switch (c) {
      case codecs::Codec::kF32:
        *type = DType::kF32;
        return data;
      case codecs::Codec::kF16:
        *type = DType::kF16;
        return data;
      case codecs::Codec::kBF16:
        *type = DType::kBF16;
        return data;
      case codecs::Codec::kQ8_0:  // llama.cpp's block layouts: the kernel unpacks them fused
        *type = DType::kQ8_0;
        return data;
      case codecs::Codec::kQ4_0:
        *type = DType::kQ4_0;
        return data;
      default:
        codecs::simd::DecodeStored(c, role, data, cnt, layout_.page_tokens, layout_.head_dim, buf);
        *type = DType::kF32;
        return buf;
    }
  }

  std::span<const PageRef> refs_;
  const KvLayout& layout_;
  bool rot_k_, rot_v_;
  const PagePool* hot_;
  size_t bytes_[2][2][2] = {};  // [hot, cold][raw, codec page][K, V]: Prefetch's byte counts
};

void PagedSequence::Attend(int layer, int kv_head, const kernels::AttnBatch& batch) const {
  const int ti = layer * pool_.layout().n_kv_heads + kv_head;
  const BlockTable& t = tables_[ti];
  const BlockTable* cold =
      cold_tables_.empty() || cold_tables_[ti].n_tokens == 0 ? nullptr : &cold_tables_[ti];
  // Decode steps may read a subset of pages: Quest over the hot pages, the fetch over cold ones.
  const bool decode = batch.n_tok == 1 && observer_ == nullptr;
  thread_local std::vector<int32_t> hot_sel, cold_sel;
  const bool hot_subset =
      decode && quest() && QuestSelect(pool_, t, batch, quest_pages_, quest_keep_, &hot_sel);
  const bool cold_subset =
      decode && cold && QuestSelect(*cold_pool_, *cold, batch, 0, cold_fetch_, &cold_sel);
  kernels::AttnBatch b = batch;
  if (observer_ != nullptr) {
    // Keys in pass order: the hot table's, then the cold table's.
    const int n_keys = t.n_tokens + (cold ? cold->n_tokens : 0);
    const auto obs = observer_->Observe(layer, kv_head, n_keys, batch);
    b.observe = obs.data();
    b.n_observe = static_cast<int>(obs.size());
  }
  if (pool_.layout().plain() && cold == nullptr) {
    kernels::PagedKv v = View(layer, kv_head);
    if (hot_subset) {  // the selected pages form a page table of their own
      thread_local std::vector<int32_t> ids;
      ids.clear();
      for (int32_t p : hot_sel) ids.push_back(t.pages[p]);
      const int pt = pool_.layout().page_tokens;
      v.page_ids = ids.data();
      v.n_tokens =
          static_cast<int>((ids.size() - 1) * pt + (t.n_tokens - (t.n_tokens - 1) / pt * pt));
    }
    kernels::PagedAttention(b, v);
  } else {
    thread_local std::vector<PageRef> refs;
    refs.clear();
    AddRefs(pool_, t, hot_subset ? &hot_sel : nullptr, &refs);
    if (cold) AddRefs(*cold_pool_, *cold, cold_subset ? &cold_sel : nullptr, &refs);
    // The basis of each role: the hot pool's (a cold pool of another basis is converted).
    const bool rot_k = codecs::IsRotated(pool_.layout().codec_k),
               rot_v = codecs::IsRotated(pool_.layout().codec_v);
    const int hd = pool_.layout().head_dim, q_dim = b.n_heads * hd;
    thread_local std::vector<float> q_rot, out_rot;
    if (rot_k) {  // rotated queries, compact
      q_rot.resize(size_t(b.n_tok) * q_dim);
      for (int i = 0; i < b.n_tok; ++i) {
        for (int h = 0; h < b.n_heads; ++h) {
          float* q = q_rot.data() + size_t(i) * q_dim + size_t(h) * hd;
          std::copy_n(batch.q + i * batch.q_stride + h * hd, hd, q);
          codecs::Rotate(q, hd);
        }
      }
      b.q = q_rot.data();
      b.q_stride = q_dim;
    }
    if (rot_v) {
      out_rot.resize(size_t(b.n_tok) * q_dim);
      b.out = out_rot.data();
      b.out_stride = q_dim;
    }
    kernels::PagedAttentionRows(
        b, RefRows(refs, pool_.layout(), rot_k, rot_v, pool_, cold ? cold_pool_ : nullptr));
    if (rot_v) {
      for (int i = 0; i < b.n_tok; ++i) {
        for (int h = 0; h < b.n_heads; ++h) {
          float* out = batch.out + i * batch.out_stride + h * hd;
          std::copy_n(out_rot.data() + size_t(i) * q_dim + size_t(h) * hd, hd, out);
          codecs::Unrotate(out, hd);
        }
      }
    }
  }
  if (observer_ != nullptr) observer_->Merge(layer, kv_head);
}

void PagedSequence::Gather(int layer, int kv_head, std::vector<float>* k, std::vector<float>* v,
                           std::vector<int32_t>* positions) const {
  Gather(table(layer, kv_head), k, v, positions);
}

void PagedSequence::Gather(const BlockTable& t, std::vector<float>* k, std::vector<float>* v,
                           std::vector<int32_t>* positions) const {
  const KvLayout& lay = pool_.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  k->resize(size_t(t.n_tokens) * hd);
  v->resize(size_t(t.n_tokens) * hd);
  positions->resize(t.n_tokens);
  PagePool& pool = pool_;
  for (int p = 0; p * pt < t.n_tokens; ++p) {
    const int32_t page = t.pages[p];
    const int cnt = std::min(pt, t.n_tokens - p * pt);
    float* kd = k->data() + size_t(p) * pt * hd;
    float* vd = v->data() + size_t(p) * pt * hd;
    DecodeRows(pool, page, cnt, kd, vd);
    std::memcpy(positions->data() + size_t(p) * pt, pool.positions(page), cnt * sizeof(int32_t));
  }
}

}  // namespace cachet
