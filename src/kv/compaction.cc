#include "kv/compaction.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "kernels/kernels.h"
#include "kv/staging.h"

namespace cachet {

using codecs::Role;

namespace {

class Compaction {
 public:
  Compaction(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
             std::vector<BlockTable>& cold_tables, std::span<const std::vector<int32_t>> keep,
             bool demote, std::span<const std::vector<float>> values, const Renumbering* renumber)
      : pool_(pool),
        lay_(pool.layout()),
        tables_(tables),
        cold_pool_(cold_pool),
        cold_tables_(cold_tables),
        keep_(keep),
        demote_(demote),
        values_(values),
        renumber_(renumber) {}

  // Validates, and takes every page Apply will write: pages shared with another sequence or the
  // prefix cache are copied before they are written, and when the pool cannot supply those
  // copies nothing changes.
  Status Plan() {
    CACHET_RETURN_IF_ERROR(Validate());
    PlanFreshPages();
    return TakePages();
  }
  // Gives back the pages Plan took, when Apply will not run.
  void Release() {
    for (int32_t p : fresh_raw_) pool_.Unref(p);
    for (int32_t p : fresh_codec_) pool_.Unref(p);
    for (int32_t p : fresh_cold_) cold_pool_->Unref(p);
  }
  void Apply() {
    for (size_t ti = 0; ti < tables_.size(); ++ti) {
      if (Stages(lay_)) {
        ApplyStaged(ti);
      } else {
        ApplyRowWise(ti);
      }
    }
    for (int32_t p : released_) pool_.Unref(p);
  }

 private:
  Status Validate() const;
  void PlanFreshPages();
  Status TakePages();
  void ApplyRowWise(size_t ti);
  void ApplyStaged(size_t ti);

  int dest_pages(size_t ti) const {
    return static_cast<int>((keep_[ti].size() + lay_.page_tokens - 1) / lay_.page_tokens);
  }
  // The replacement V rows of table ti's kept tokens; null: their own.
  const float* new_values(size_t ti) const {
    return ti < values_.size() && !values_[ti].empty() ? values_[ti].data() : nullptr;
  }
  bool fresh(size_t ti, int d) const { return fresh_[fresh_begin_[ti] + d]; }
  int32_t TakeFresh(bool codec) {
    return codec ? fresh_codec_[next_codec_++] : fresh_raw_[next_raw_++];
  }
  // Whether destination page d (< dest_pages) of table ti keeps every row holding its own token
  // as it is.
  bool PageRowsUnchanged(size_t ti, int d) const {
    if (new_values(ti)) return false;
    const std::vector<int32_t>& keep = keep_[ti];
    const size_t pt = size_t(lay_.page_tokens);
    for (size_t j = d * pt; j < std::min(keep.size(), (d + 1) * pt); ++j) {
      if (keep[j] != static_cast<int32_t>(j) || Moves(ti, keep[j])) return false;
    }
    return true;
  }
  // Whether row r of table ti (its current index) takes another position.
  bool Moves(size_t ti, int32_t r) const {
    if (!renumber_) return false;
    const int pt = lay_.page_tokens;
    const int32_t pos = pool_.position(tables_[ti].pages[r / pt], r % pt);
    return renumber_->new_pos[pos] != pos;
  }
  // A kept row's key and position as they are written: re-rotated when renumbered.
  int32_t Renumbered(float* key, int32_t pos) const {
    if (!renumber_ || renumber_->new_pos[pos] == pos) return pos;
    const int32_t to = renumber_->new_pos[pos];
    RerotateKey(key, lay_.head_dim, to - pos, renumber_->inv_freq);
    return to;
  }
  // Appends a token to table ti's cold table (a shared, partly filled last page copied first).
  void Demote(size_t ti, const float* k, const float* v, int32_t pos);
  // Table ti keeps its first `pages` pages, now holding its kept tokens; the rest go.
  void Shrink(size_t ti, int pages);

  PagePool& pool_;
  const KvLayout& lay_;
  std::vector<BlockTable>& tables_;
  PagePool* cold_pool_;
  std::vector<BlockTable>& cold_tables_;
  std::span<const std::vector<int32_t>> keep_;
  bool demote_;
  std::span<const std::vector<float>> values_;
  const Renumbering* renumber_;

  std::vector<uint8_t> fresh_;       // per table, per destination page: written into a fresh page
  std::vector<size_t> fresh_begin_;  // per table: its first entry in fresh_
  int need_raw_ = 0, need_codec_ = 0;
  std::vector<int32_t> fresh_raw_, fresh_codec_, fresh_cold_;
  size_t next_raw_ = 0, next_codec_ = 0, next_cold_ = 0;
  std::vector<int32_t> released_;   // pages replaced by fresh ones, unreferenced at the end
  std::vector<float> kbuf_, vbuf_;  // one page's rows
  std::vector<int32_t> pos_;
  std::vector<float> table_k_, table_v_;  // a staged table's rows
  std::vector<int32_t> table_pos_;
};

Status Compaction::Validate() const {
  const int pt = lay_.page_tokens, hd = lay_.head_dim;
  if (keep_.size() != tables_.size()) {
    return InvalidArgument("Retain: " + std::to_string(keep_.size()) + " keep lists for " +
                           std::to_string(tables_.size()) + " (layer, KV head) tables");
  }
  if (demote_) {
    if (cold_pool_ == nullptr) return FailedPrecondition("Retain: demote without a cold pool");
    const KvLayout& cl = cold_pool_->layout();
    if (cl.staged() || cl.page_tokens != pt || cl.head_dim != hd) {
      return InvalidArgument(
          "Retain: the cold pool must use a row-wise codec and the same page "
          "shape");
    }
  }
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    const int32_t n = tables_[ti].n_tokens;
    const std::vector<int32_t>& k = keep_[ti];
    for (size_t i = 0; i < k.size(); ++i) {
      if (k[i] < 0 || k[i] >= n || (i > 0 && k[i] <= k[i - 1])) {
        return InvalidArgument("Retain: keep list " + std::to_string(ti) +
                               " is not ascending within [0, " + std::to_string(n) + ")");
      }
    }
    if (new_values(ti) && values_[ti].size() != k.size() * size_t(hd)) {
      return InvalidArgument("Retain: values of table " + std::to_string(ti) +
                             " do not match its keep list");
    }
  }
  return OkStatus();
}

// A destination page gets a fresh page when it changes kind (staged pages follow the new length)
// or when its rows change while others share it.
void Compaction::PlanFreshPages() {
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    const BlockTable& t = tables_[ti];
    fresh_begin_.push_back(fresh_.size());
    for (int d = 0; d < dest_pages(ti); ++d) {
      const bool was_codec = IsCodecPage(t.pages[d]);
      const bool codec =
          Stages(lay_) ? WantsCodecPage(lay_, d, int64_t(keep_[ti].size())) : was_codec;
      const bool fresh =
          codec != was_codec || (!PageRowsUnchanged(ti, d) && pool_.refcount(t.pages[d]) > 1);
      fresh_.push_back(fresh);
      if (fresh) (codec ? need_codec_ : need_raw_) += 1;
    }
  }
}

Status Compaction::TakePages() {
  const int pt = lay_.page_tokens;
  if (demote_) {
    if (cold_tables_.empty()) cold_tables_.resize(tables_.size());  // empty tables: no state
    int need_cold = 0;
    for (size_t ti = 0; ti < tables_.size(); ++ti) {
      const int64_t dropped = tables_[ti].n_tokens - int64_t(keep_[ti].size());
      need_cold += static_cast<int>(ColdPagesNeeded(*cold_pool_, cold_tables_[ti], dropped));
    }
    // A pool of one codec: all its pages are codec pages, or all raw when its codec is f32.
    const bool raw = cold_pool_->layout().plain();
    CACHET_RETURN_IF_ERROR(
        cold_pool_->Alloc(raw ? need_cold : 0, raw ? 0 : need_cold, &fresh_cold_, &fresh_cold_));
  }
  if (Status s = pool_.Alloc(need_raw_, need_codec_, &fresh_raw_, &fresh_codec_); !s.ok()) {
    for (int32_t p : fresh_cold_) cold_pool_->Unref(p);
    return s;
  }
  const size_t rows = size_t(pt) * lay_.head_dim;
  kbuf_.resize(rows);
  vbuf_.resize(rows);
  pos_.resize(pt);
  return OkStatus();
}

void Compaction::Demote(size_t ti, const float* k, const float* v, int32_t pos) {
  AppendColdRow(*cold_pool_, int(ti), cold_tables_[ti], fresh_cold_, &next_cold_, k, v, pos);
}

void Compaction::Shrink(size_t ti, int pages) {
  BlockTable& t = tables_[ti];
  for (size_t p = pages; p < t.pages.size(); ++p) pool_.Unref(t.pages[p]);
  t.pages.resize(pages);
  t.quest.Invalidate();
  t.n_tokens = static_cast<int32_t>(keep_[ti].size());
}

// A kept token only moves to an earlier index, so walking source pages in order, each decoded
// whole before any of its rows is overwritten, never reads a row that was written: demote its
// dropped tokens, then write its kept ones (to this page or earlier ones, all of whose tokens are
// already handled).
void Compaction::ApplyRowWise(size_t ti) {
  BlockTable& t = tables_[ti];
  const std::vector<int32_t>& k = keep_[ti];
  const int pt = lay_.page_tokens, hd = lay_.head_dim;
  const float* new_v = new_values(ti);
  std::vector<int32_t> dest(t.pages.begin(), t.pages.begin() + dest_pages(ti));
  for (int d = 0; d < dest_pages(ti); ++d) {
    if (!fresh(ti, d)) continue;
    released_.push_back(dest[d]);
    dest[d] = TakeFresh(IsCodecPage(dest[d]));
  }
  size_t kj = 0;
  for (int s = 0; s * pt < t.n_tokens; ++s) {
    const int cnt = std::min(pt, t.n_tokens - s * pt), first = s * pt;
    size_t kend = kj;
    while (kend < k.size() && k[kend] < first + cnt) ++kend;
    const bool drops = demote_ && static_cast<int>(kend - kj) < cnt;
    bool writes = new_v != nullptr && kend > kj;
    for (size_t x = kj; x < kend && !writes; ++x) {
      writes = k[x] != static_cast<int32_t>(x) || fresh(ti, x / pt) || Moves(ti, k[x]);
    }
    if (!drops && !writes) {
      kj = kend;
      continue;
    }
    const int32_t sp = t.pages[s];
    DecodeRows(pool_, int(ti), sp, cnt, kbuf_.data(), vbuf_.data());
    pool_.ReadPositions(sp, cnt, pos_.data());
    if (drops) {
      size_t x = kj;
      for (int r = 0; r < cnt; ++r) {
        if (x < kend && k[x] == first + r) {
          ++x;
          continue;
        }
        Demote(ti, kbuf_.data() + size_t(r) * hd, vbuf_.data() + size_t(r) * hd, pos_[r]);
      }
    }
    for (size_t x = kj; x < kend; ++x) {
      const int d = static_cast<int>(x / pt), off = static_cast<int>(x % pt);
      const int s_off = k[x] - first;
      const bool moves = renumber_ && renumber_->new_pos[pos_[s_off]] != pos_[s_off];
      if (k[x] == static_cast<int32_t>(x) && !fresh(ti, d) && !new_v && !moves) continue;
      const float* vr = new_v ? new_v + x * hd : vbuf_.data() + size_t(s_off) * hd;
      float* kr = kbuf_.data() + size_t(s_off) * hd;
      const int32_t pos = Renumbered(kr, pos_[s_off]);
      WriteRow(pool_, int(ti), dest[d], off, kr, vr, pos);
    }
    kj = kend;
  }
  Shrink(ti, dest_pages(ti));
  std::copy(dest.begin(), dest.end(), t.pages.begin());
}

// Staged pages are encoded whole (KIVI keys per channel over the page) and their kind follows the
// token count (sealed once full and `window` tokens old), so the table is decoded, compacted and
// its changed pages encoded again in the kind its new length asks for.
void Compaction::ApplyStaged(size_t ti) {
  BlockTable& t = tables_[ti];
  const std::vector<int32_t>& k = keep_[ti];
  const int pt = lay_.page_tokens, hd = lay_.head_dim;
  const float* new_v = new_values(ti);
  GatherTable(pool_, int(ti), t, &table_k_, &table_v_, &table_pos_);
  // Which destination pages hold a moved row, found before positions change.
  std::vector<uint8_t> moved(dest_pages(ti), 0);
  if (renumber_) {
    for (size_t x = 0; x < k.size(); ++x) {
      const int32_t r = k[x];
      const int32_t to = Renumbered(&table_k_[size_t(r) * hd], table_pos_[r]);
      if (to != table_pos_[r]) moved[x / pt] = 1;
      table_pos_[r] = to;
    }
  }
  if (demote_) {
    size_t x = 0;
    for (int32_t r = 0; r < t.n_tokens; ++r) {
      if (x < k.size() && k[x] == r) {
        ++x;
        continue;
      }
      Demote(ti, &table_k_[size_t(r) * hd], &table_v_[size_t(r) * hd], table_pos_[r]);
    }
  }
  const int64_t n = int64_t(k.size());
  for (int d = 0; d < dest_pages(ti); ++d) {
    if (!fresh(ti, d) && !moved[d] && PageRowsUnchanged(ti, d)) continue;
    int32_t& page = t.pages[d];
    if (fresh(ti, d)) {
      released_.push_back(page);
      page = TakeFresh(WantsCodecPage(lay_, d, n));
    }
    const int cnt = static_cast<int>(std::min<int64_t>(pt, n - int64_t(d) * pt));
    for (int r = 0; r < cnt; ++r) {
      const size_t x = size_t(d) * pt + r, src = size_t(k[x]) * hd;
      std::copy_n(&table_k_[src], hd, &kbuf_[size_t(r) * hd]);
      std::copy_n(new_v ? new_v + x * hd : &table_v_[src], hd, &vbuf_[size_t(r) * hd]);
      pool_.set_position(page, r, table_pos_[k[x]]);
    }
    for (Role role : {Role::kKey, Role::kValue}) {
      EncodePageRows(pool_, int(ti), page, role, role == Role::kKey ? kbuf_.data() : vbuf_.data(),
                     0, cnt);
    }
  }
  Shrink(ti, dest_pages(ti));
}

}  // namespace

void RopeShift(int head_dim, int32_t delta, std::span<const float> inv_freq,
               std::vector<float>* cs) {
  const int half = head_dim / 2;
  cs->resize(size_t(head_dim));
  for (int j = 0; j < half; ++j) {
    const double angle = double(delta) * double(inv_freq[j]);
    (*cs)[j] = static_cast<float>(std::cos(angle));
    (*cs)[half + j] = static_cast<float>(std::sin(angle));
  }
}

void RerotateKey(float* key, int head_dim, int32_t delta, std::span<const float> inv_freq) {
  thread_local std::vector<float> cs;
  RopeShift(head_dim, delta, inv_freq, &cs);
  kernels::RopeRotateHalf(key, 1, head_dim, cs.data(), cs.data() + head_dim / 2);
}

Status Compact(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
               std::vector<BlockTable>& cold_tables, std::span<const std::vector<int32_t>> keep,
               bool demote, std::span<const std::vector<float>> values,
               const Renumbering* renumber) {
  if (renumber && demote) return InvalidArgument("Compact: renumbering does not demote");
  Compaction c(pool, tables, cold_pool, cold_tables, keep, demote, values, renumber);
  CACHET_RETURN_IF_ERROR(c.Plan());
  c.Apply();
  return OkStatus();
}

Status CompactRenumbering(PagePool& pool, std::vector<BlockTable>& tables, PagePool* cold_pool,
                          std::vector<BlockTable>& cold_tables,
                          std::span<const std::vector<int32_t>> keep,
                          std::span<const std::vector<int32_t>> cold_keep,
                          const Renumbering& renumber) {
  std::vector<BlockTable> none;
  Compaction hot(pool, tables, nullptr, none, keep, false, {}, &renumber);
  CACHET_RETURN_IF_ERROR(hot.Plan());
  std::vector<BlockTable> none_cold;
  std::optional<Compaction> cold;
  if (!cold_tables.empty()) {
    cold.emplace(*cold_pool, cold_tables, nullptr, none_cold, cold_keep, false,
                 std::span<const std::vector<float>>{}, &renumber);
    if (Status s = cold->Plan(); !s.ok()) {
      hot.Release();
      return s;
    }
  }
  hot.Apply();
  if (cold) cold->Apply();
  return OkStatus();
}

}  // namespace cachet
