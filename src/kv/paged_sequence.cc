#include "kv/paged_sequence.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "kv/aging.h"
#include "kv/compaction.h"
#include "kv/staging.h"
#include "kv/table_attention.h"

namespace cachet {

PagedSequence::PagedSequence(PagePool& pool) : pool_(pool), tables_(pool.layout().heads_total()) {}

PagedSequence::~PagedSequence() { Clear(); }

void PagedSequence::Clear() {
  for (BlockTable& t : tables_) {
    for (int32_t p : t.pages) pool_.Unref(p);
    for (int32_t p : t.seal_pages) pool_.Unref(p);
    if (t.claim >= 0) pool_.ReleaseClaim(t.claim);
    t = BlockTable{};
  }
  for (BlockTable& t : cold_tables_) {
    for (int32_t p : t.pages) cold_pool_->Unref(p);
  }
  cold_tables_.clear();
  n_tokens_ = 0;
  exact_tokens_ = INT_MAX;
}

void PagedSequence::Adopt(std::vector<BlockTable> tables, std::vector<BlockTable> cold_tables,
                          int n_tokens) {
  Clear();
  tables_ = std::move(tables);
  cold_tables_ = std::move(cold_tables);
  n_tokens_ = n_tokens;
  exact_tokens_ = 0;  // a saved cache may have been renumbered: its blocks are not published
}

std::unique_ptr<PagedSequence> PagedSequence::Fork() const {
  auto child = std::make_unique<PagedSequence>(pool_);
  child->n_tokens_ = n_tokens_;
  child->exact_tokens_ = exact_tokens_;
  for (size_t i = 0; i < tables_.size(); ++i) {
    child->tables_[i].pages = tables_[i].pages;
    child->tables_[i].n_tokens = tables_[i].n_tokens;
    for (int32_t p : tables_[i].pages) pool_.Ref(p);
  }
  child->cold_pool_ = cold_pool_;
  child->cold_fetch_ = cold_fetch_;
  child->age_after_ = age_after_;
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
  pages->clear();
  if ((int64_t(block) + 1) * pool_.layout().page_tokens > exact_tokens_) return false;
  for (const BlockTable& t : tables_) {
    // Only pages in their final form: full and, with a recent window, old enough to be encoded.
    if (t.n_tokens != n_tokens_ || block >= FinalPages(pool_.layout(), t.n_tokens)) return false;
    pages->push_back(t.pages[block]);
  }
  return true;
}

void PagedSequence::AgeOut() {
  if (age_after_ > 0 && cold_pool_ != nullptr && observer_ == nullptr) {
    // A full cold pool is not an error: the pages stay hot (and the hot pool says when it is
    // full).
    (void)AgeOutPages(pool_, tables_, *cold_pool_, cold_tables_, n_tokens_, age_after_);
  }
}

int64_t PagedSequence::RunPages(int64_t p) const {
  const KvLayout& lay = pool_.layout();
  if (lay.staged() || lay.max_tokens <= 0 || IsSinkPage(lay, p)) return 1;
  const int64_t room = (lay.max_tokens + lay.page_tokens - 1) / lay.page_tokens - p;
  return std::clamp<int64_t>(std::min<int64_t>(kMaxRunPages, (p + 1) / 8), 1,
                             std::max<int64_t>(room, 1));
}

int PagedSequence::TakeClaimedPages(BlockTable& t, int64_t want) {
  const KvLayout& lay = pool_.layout();
  int taken = 0;
  for (int64_t p = static_cast<int64_t>(t.pages.size()); p < want; ++p) {
    const bool raw = WrittenRaw(lay, p);
    if (t.claim >= 0 && pool_.claim_codec(t.claim) == raw) {  // pages of another kind now
      pool_.ReleaseClaim(t.claim);
      t.claim = -1;
    }
    int32_t page = t.claim >= 0 ? pool_.TakeClaimed(t.claim) : -1;
    if (page < 0 && RunPages(p) > 1) {
      if (t.claim >= 0) pool_.ReleaseClaim(t.claim);
      t.claim = pool_.Claim(!raw, static_cast<int>(RunPages(p)));
      if (t.claim >= 0) page = pool_.TakeClaimed(t.claim);
    }
    if (page < 0) break;  // the rest from the step's allocation
    scratch_claimed_.push_back(page);
    ++taken;
  }
  return taken;
}

Status PagedSequence::Reserve(int n) {
  if (n <= 0) return OkStatus();
  // A move that succeeded stays when the reservation below fails: the same tokens.
  AgeOut();
  const KvLayout& lay = pool_.layout();
  const int64_t pt = lay.page_tokens;
  // Plan: count the pages each table needs (new pages of the right kind, private copies of shared
  // partly filled last pages, codec pages for staged pages that will fill), then take them all
  // at once so a failure changes nothing.
  int64_t need_raw = 0, need_codec = 0;
  for (const BlockTable& t : tables_) {
    const int64_t len = t.n_tokens, want = (len + n + pt - 1) / pt;
    for (int64_t p = static_cast<int64_t>(t.pages.size()); p < want; ++p) {
      (WrittenRaw(lay, p) ? need_raw : need_codec) += 1;
    }
    if (len % pt != 0 && pool_.refcount(t.pages.back()) > 1) {
      (IsCodecPage(t.pages.back()) ? need_codec : need_raw) += 1;
    }
    need_codec += std::max<int64_t>(0, SealsNeeded(lay, t, n) - int64_t(t.seal_pages.size()));
  }
  if (need_raw + need_codec == 0) return OkStatus();
  if (need_raw + need_codec > std::numeric_limits<int32_t>::max() / 2) {
    return ResourceExhausted("KV reservation too large");
  }
  // Steps of fewer tokens than a run (decode) take a table's new pages from its claim of free
  // slots (TakeClaimedPages) when the pool has every page of the step free: pages taken a few at
  // a time would lie heads_total() slots apart, each a new stream for the prefetchers (restored
  // that way, a context decoded 1.23x slower, docs/BENCHMARKS.md). The rest, a longer step's pages
  // (one allocation lays each table's side by side), and everything when the pool is short (its
  // reclaimers are asked as before) come from one allocation; a failure gives claimed pages back.
  scratch_claimed_.clear();
  scratch_taken_.assign(tables_.size(), 0);
  if (n < pt * kMaxRunPages &&
      size_t(need_raw) * lay.raw_page_bytes() + size_t(need_codec) * lay.codec_page_bytes() <=
          pool_.free_bytes()) {
    for (size_t ti = 0; ti < tables_.size(); ++ti) {
      BlockTable& t = tables_[ti];
      const int64_t want = (t.n_tokens + n + pt - 1) / pt;
      const size_t from = scratch_claimed_.size();
      scratch_taken_[ti] = TakeClaimedPages(t, want);
      for (size_t i = from; i < scratch_claimed_.size(); ++i) {
        (IsCodecPage(scratch_claimed_[i]) ? need_codec : need_raw) -= 1;
      }
    }
  }
  scratch_raw_.clear();
  scratch_codec_.clear();
  if (Status s = pool_.Alloc(static_cast<int>(need_raw), static_cast<int>(need_codec),
                             &scratch_raw_, &scratch_codec_);
      !s.ok()) {
    for (int32_t page : scratch_claimed_) pool_.Unref(page);
    return s;
  }
  // Apply.
  size_t next_raw = 0, next_codec = 0, next_claimed = 0;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    BlockTable& t = tables_[ti];
    const int64_t len = t.n_tokens, want = (len + n + pt - 1) / pt;
    if (len % pt != 0 && pool_.refcount(t.pages.back()) > 1) {
      const int32_t shared = t.pages.back();
      const int32_t copy =
          IsCodecPage(shared) ? scratch_codec_[next_codec++] : scratch_raw_[next_raw++];
      pool_.CopyPage(shared, copy);
      pool_.Unref(shared);
      t.pages.back() = copy;
    }
    for (int i = 0; i < scratch_taken_[ti]; ++i) {
      t.pages.push_back(scratch_claimed_[next_claimed++]);
    }
    for (int64_t p = static_cast<int64_t>(t.pages.size()); p < want; ++p) {
      t.pages.push_back(WrittenRaw(lay, p) ? scratch_raw_[next_raw++]
                                           : scratch_codec_[next_codec++]);
    }
    for (int64_t fills = SealsNeeded(lay, t, n); int64_t(t.seal_pages.size()) < fills;) {
      t.seal_pages.push_back(scratch_codec_[next_codec++]);
    }
  }
  return OkStatus();
}

void PagedSequence::Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) {
  BlockTable& t = table(layer, kv_head);
  const int pt = pool_.layout().page_tokens;
  const int ti = layer * pool_.layout().n_kv_heads + kv_head;
  // A codec page is a row-wise codec's: the token is encoded where it lands.
  WriteRow(pool_, ti, t.pages[t.n_tokens / pt], t.n_tokens % pt, k, v, pos);
  ++t.n_tokens;
  ++t.unsealed;
}

void PagedSequence::SealAged(int layer) {
  const KvLayout& lay = pool_.layout();
  for (int h = 0; h < lay.n_kv_heads; ++h) {
    const int ti = layer * lay.n_kv_heads + h;
    BlockTable& t = tables_[ti];
    if (t.unsealed == 0) continue;
    SealAgedPages(pool_, ti, t);
    if (quest()) {
      t.quest.OnFinal(pool_, ti, t.pages, FinalPages(lay, t.n_tokens - t.unsealed),
                      FinalPages(lay, t.n_tokens));
    }
    t.unsealed = 0;
  }
}

void PagedSequence::CommitTokens(int n) {
  n_tokens_ += n;
  for (int l = 0; l < pool_.layout().n_layers; ++l) SealAged(l);
}

Status PagedSequence::Retain(std::span<const std::vector<int32_t>> keep, bool demote,
                             std::span<const std::vector<float>> values) {
  return Compact(pool_, tables_, cold_pool_, cold_tables_, keep, demote, values);
}

Status PagedSequence::Renumber(std::span<const int32_t> new_pos, std::span<const float> inv_freq) {
  if (static_cast<int>(new_pos.size()) != n_tokens_) {
    return InvalidArgument("Renumber: " + std::to_string(new_pos.size()) + " positions for " +
                           std::to_string(n_tokens_) + " tokens");
  }
  if (static_cast<int>(inv_freq.size()) != pool_.layout().head_dim / 2) {
    return InvalidArgument("Renumber: " + std::to_string(inv_freq.size()) +
                           " RoPE frequencies for head_dim " +
                           std::to_string(pool_.layout().head_dim));
  }
  int32_t last = -1, first_changed = n_tokens_;
  for (int32_t p = 0; p < n_tokens_; ++p) {
    if (new_pos[p] < -1 || (new_pos[p] >= 0 && new_pos[p] <= last)) {
      return InvalidArgument("Renumber: the kept tokens' new positions must ascend (position " +
                             std::to_string(p) + " -> " + std::to_string(new_pos[p]) + ")");
    }
    if (new_pos[p] >= 0) last = new_pos[p];
    if (new_pos[p] != p) first_changed = std::min(first_changed, p);
  }
  auto keep_of = [&](PagePool& pool, const std::vector<BlockTable>& tables) {
    const int pt = pool.layout().page_tokens;
    std::vector<std::vector<int32_t>> keep(tables.size());
    for (size_t ti = 0; ti < tables.size(); ++ti) {
      const BlockTable& t = tables[ti];
      for (int32_t r = 0; r < t.n_tokens; ++r) {
        if (new_pos[pool.position(t.pages[r / pt], r % pt)] >= 0) keep[ti].push_back(r);
      }
    }
    return keep;
  };
  const std::vector<std::vector<int32_t>> keep = keep_of(pool_, tables_);
  const std::vector<std::vector<int32_t>> cold_keep = cold_tables_.empty()
                                                          ? std::vector<std::vector<int32_t>>{}
                                                          : keep_of(*cold_pool_, cold_tables_);
  const Renumbering renumber{new_pos, inv_freq};
  CACHET_RETURN_IF_ERROR(
      CompactRenumbering(pool_, tables_, cold_pool_, cold_tables_, keep, cold_keep, renumber));
  n_tokens_ = last + 1;
  exact_tokens_ = std::min(exact_tokens_, first_changed);
  return OkStatus();
}

Status PagedSequence::Truncate(int n) {
  if (n < 0 || n > n_tokens_) {
    return InvalidArgument("Truncate: " + std::to_string(n) + " tokens is outside [0, " +
                           std::to_string(n_tokens_) + "]");
  }
  const KvLayout& lay = pool_.layout();
  const int pt = lay.page_tokens, hd = lay.head_dim;
  // Plan: the rows each hot table keeps (a prefix: rows are in position order), the raw pages
  // that sealed, partly kept pages go back to, and the rows each cold table keeps (in the order
  // tokens were demoted, so not a prefix).
  std::vector<int32_t> kept(tables_.size());
  int need_raw = 0;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    const BlockTable& t = tables_[ti];
    int32_t m = 0;
    for (int32_t r = 0; r < t.n_tokens; ++r) {
      if (pool_.position(t.pages[r / pt], r % pt) >= n) continue;
      if (m != r) return FailedPrecondition("Truncate: a table's rows are not in position order");
      ++m;
    }
    kept[ti] = m;
    need_raw += m % pt != 0 && Stages(lay) && IsCodecPage(t.pages[m / pt]);
  }
  std::vector<std::vector<int32_t>> cold_keep(cold_tables_.size());
  bool cold_drops = false;
  for (size_t ti = 0; ti < cold_tables_.size(); ++ti) {
    const BlockTable& c = cold_tables_[ti];
    const int cpt = cold_pool_->layout().page_tokens;
    for (int32_t r = 0; r < c.n_tokens; ++r) {
      if (cold_pool_->position(c.pages[r / cpt], r % cpt) < n) {
        cold_keep[ti].push_back(r);
      } else {
        cold_drops = true;
      }
    }
  }
  std::vector<int32_t> raw;
  if (need_raw > 0) CACHET_RETURN_IF_ERROR(pool_.Alloc(need_raw, &raw));
  if (cold_drops) {  // compacted in the cold pool (all or nothing), copies of shared pages first
    std::vector<BlockTable> unused;
    Status s = Compact(*cold_pool_, cold_tables_, nullptr, unused, cold_keep, false, {});
    if (!s.ok()) {
      for (int32_t p : raw) pool_.Unref(p);
      return s;
    }
  }
  // Apply.
  size_t next_raw = 0;
  thread_local std::vector<float> kbuf, vbuf;
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    BlockTable& t = tables_[ti];
    const int32_t m = kept[ti];
    if (m % pt != 0 && Stages(lay) && IsCodecPage(t.pages[m / pt])) {
      // A sealed page partly kept: staged pages are written raw, so its rows go back to one.
      const int32_t sealed = t.pages[m / pt], fresh = raw[next_raw++];
      const int cnt = m % pt;
      kbuf.resize(size_t(pt) * hd);
      vbuf.resize(size_t(pt) * hd);
      DecodeRows(pool_, int(ti), sealed, cnt, kbuf.data(), vbuf.data());
      for (codecs::Role role : {codecs::Role::kKey, codecs::Role::kValue}) {
        codecs::EncodePage(lay.raw_codec(), role,
                           role == codecs::Role::kKey ? kbuf.data() : vbuf.data(), cnt, pt, hd,
                           pool_.rows(fresh, role));
      }
      pool_.CopyPositions(sealed, fresh, cnt);
      pool_.Unref(sealed);
      t.pages[m / pt] = fresh;
    }
    const size_t keep_pages = (size_t(m) + pt - 1) / pt;
    for (size_t p = keep_pages; p < t.pages.size(); ++p) pool_.Unref(t.pages[p]);
    t.pages.resize(keep_pages);
    for (int32_t p : t.seal_pages) pool_.Unref(p);
    t.seal_pages.clear();
    t.n_tokens = m;
    t.quest.KeepPages(m / pt, hd);
  }
  n_tokens_ = n;
  if (n <= exact_tokens_) exact_tokens_ = INT_MAX;  // what is left was never changed
  return OkStatus();
}

void PagedSequence::Positions(int layer, int kv_head, std::vector<int32_t>* positions) const {
  const BlockTable& t = table(layer, kv_head);
  const int pt = pool_.layout().page_tokens;
  positions->resize(t.n_tokens);
  for (int p = 0; p * pt < t.n_tokens; ++p) {
    pool_.ReadPositions(t.pages[p], std::min(pt, t.n_tokens - p * pt),
                        positions->data() + size_t(p) * pt);
  }
}

kernels::PagedKv PagedSequence::View(int layer, int kv_head) const {
  return PlainView(pool_, table(layer, kv_head));
}

void PagedSequence::Attend(int layer, int kv_head, const kernels::AttnBatch& batch) const {
  const int ti = layer * pool_.layout().n_kv_heads + kv_head;
  const BlockTable& t = tables_[ti];
  const BlockTable* cold =
      cold_tables_.empty() || cold_tables_[ti].n_tokens == 0 ? nullptr : &cold_tables_[ti];
  // Decode steps may read a subset of pages: Quest over the hot pages, the fetch over cold ones.
  const bool decode = batch.decode && observer_ == nullptr;
  thread_local std::vector<int32_t> hot_sel, cold_sel;
  const bool hot_subset =
      decode && quest() &&
      t.quest.Select(pool_, ti, t.pages, t.n_tokens, batch, quest_pages_, quest_keep_, &hot_sel);
  const bool cold_subset = decode && cold &&
                           cold->quest.Select(*cold_pool_, ti, cold->pages, cold->n_tokens, batch,
                                              0, cold_fetch_, &cold_sel);
  kernels::AttnBatch b = batch;
  if (observer_ != nullptr) {
    // Keys in pass order: the hot table's, then the cold table's.
    const int n_keys = t.n_tokens + (cold ? cold->n_tokens : 0);
    const auto obs = observer_->Observe(layer, kv_head, n_keys, batch);
    b.observe = obs.data();
    b.n_observe = static_cast<int>(obs.size());
  }
  const TablePages hot_pages{&pool_, &t, hot_subset ? &hot_sel : nullptr, ti};
  const TablePages cold_pages{cold_pool_, cold, cold_subset ? &cold_sel : nullptr, ti};
  AttendTables(b, hot_pages, cold ? &cold_pages : nullptr);
  if (observer_ != nullptr) observer_->Merge(layer, kv_head);
}

int PagedSequence::DecodeParts(int threads) const {
  if (threads <= 1 || observer_ != nullptr || quest() ||
      (cold_pool_ != nullptr && cold_fetch_ < 1.0)) {
    return 1;
  }
  const int heads = pool_.layout().n_kv_heads;
  const int balance = (4 * threads + heads - 1) / heads;
  int keys = 0;
  for (size_t i = 0; i < tables_.size(); ++i) {
    keys =
        std::max(keys, tables_[i].n_tokens + (cold_tables_.empty() ? 0 : cold_tables_[i].n_tokens));
  }
  return std::clamp(std::min(keys / kKeysPerPart, balance), 1, kMaxParts);
}

void PagedSequence::Gather(int layer, int kv_head, std::vector<float>* k, std::vector<float>* v,
                           std::vector<int32_t>* positions) const {
  GatherTable(pool_, layer * pool_.layout().n_kv_heads + kv_head, table(layer, kv_head), k, v,
              positions);
}

void PagedSequence::GatherCold(int layer, int kv_head, std::vector<float>* k, std::vector<float>* v,
                               std::vector<int32_t>* positions) const {
  const int ti = layer * pool_.layout().n_kv_heads + kv_head;
  if (cold_tables_.empty() || cold_tables_[ti].n_tokens == 0) {
    k->clear(), v->clear(), positions->clear();
    return;
  }
  GatherTable(*cold_pool_, ti, cold_tables_[ti], k, v, positions);
}

const float* PagedSequence::RawKey(int layer, int kv_head, int row) const {
  const int pt = pool_.layout().page_tokens;
  const int32_t page = table(layer, kv_head).pages[row / pt];
  return reinterpret_cast<const float*>(pool_.rows(page, codecs::Role::kKey)) +
         size_t(row % pt) * pool_.layout().head_dim;
}

const float* PagedSequence::RawValue(int layer, int kv_head, int row) const {
  const int pt = pool_.layout().page_tokens;
  const int32_t page = table(layer, kv_head).pages[row / pt];
  return reinterpret_cast<const float*>(pool_.rows(page, codecs::Role::kValue)) +
         size_t(row % pt) * pool_.layout().head_dim;
}

void PagedSequence::OverwriteRow(int layer, int kv_head, int row, const float* k, const float* v) {
  const int pt = pool_.layout().page_tokens;
  const int32_t page = table(layer, kv_head).pages[row / pt];
  WriteRow(pool_, layer * pool_.layout().n_kv_heads + kv_head, page, row % pt, k, v,
           pool_.position(page, row % pt));
}

}  // namespace cachet
