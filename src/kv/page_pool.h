// The page pool: arenas of fixed-size slots, each holding one page (page_tokens tokens of one KV
// head of one layer: K rows, V rows, and the tokens' original positions). A page is either raw
// (f32 rows, writable in place) or encoded by the layout's K/V codecs; each kind has its own arena
// of its own slot size, so a compressed page really takes fewer bytes. Slots carry only ids and
// refcounts; byte accounting is exact and the capacity (bytes) is a hard limit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cachet/status.h"
#include "kv/codecs/calibration.h"
#include "kv/codecs/codec.h"
#include "kv/codecs/rope_table.h"

namespace cachet {

// Page ids with this bit set live in the codec arena.
constexpr int32_t kCodecPageBit = 1 << 30;
inline bool IsCodecPage(int32_t id) { return (id & kCodecPageBit) != 0; }

struct KvLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 16;
  codecs::Codec codec_k = codecs::Codec::kF32;
  codecs::Codec codec_v = codecs::Codec::kF32;
  int sinks = 0;  // pages holding any of the first `sinks` tokens stay raw (full precision)
  // The calibrated codecs' statistics (pca*, kvq*; null when neither codec needs them).
  std::shared_ptr<const codecs::Calibration> calibration = nullptr;
  // The model's RoPE, when a codec stores keys before it (kvq; null otherwise).
  std::shared_ptr<const codecs::RopeTable> rope = nullptr;
  // Recent window: a page stays raw until `window` newer tokens follow it, then it is encoded.
  int window = 0;
  // Every position is below this (the engine's context; 0: not known). Codec layouts whose
  // context fits in 16 bits store positions in 16 (a quarter of a bit per value less at head_dim
  // 64); the plain layout, the reference, keeps them in 32 as its kernel reads them.
  int64_t max_tokens = 0;

  // Plain layouts store every page raw; others encode pages (see PagedSequence).
  bool plain() const { return codec_k == codecs::Codec::kF32 && codec_v == codecs::Codec::kF32; }
  // Codecs that need a whole page (KIVI keys), and any codec with a recent window, stage tokens in
  // raw pages and encode each page once it is full and `window` tokens old; otherwise row-wise
  // codecs encode each token as it is written.
  bool staged() const {
    return window > 0 || codecs::NeedsFullPage(codec_k, codecs::Role::kKey) ||
           codecs::NeedsFullPage(codec_v, codecs::Role::kValue);
  }
  // The first staged page that n tokens leave unsealed: pages before it are full and old enough.
  int64_t SealedPages(int64_t n) const {
    return n - window < page_tokens ? 0 : (n - window) / page_tokens;
  }
  int64_t slot_floats() const { return int64_t{2} * page_tokens * head_dim; }
  bool short_positions() const { return !plain() && max_tokens > 0 && max_tokens <= 65536; }
  size_t position_bytes() const { return short_positions() ? 2 : 4; }
  size_t page_position_bytes() const { return page_tokens * position_bytes(); }
  // Raw pages hold rows unquantized: f32 in a plain layout, f16 beside a codec (the sinks, the
  // recent window and KIVI's residual are mixed precision's high tier, at half the bytes of f32).
  codecs::Codec raw_codec() const { return plain() ? codecs::Codec::kF32 : codecs::Codec::kF16; }
  size_t raw_k_bytes() const {
    return codecs::PageBytes(raw_codec(), codecs::Role::kKey, page_tokens, head_dim);
  }
  size_t raw_data_bytes() const { return 2 * raw_k_bytes(); }
  size_t raw_page_bytes() const { return raw_data_bytes() + page_position_bytes(); }
  size_t codec_k_bytes() const {
    return codecs::PageBytes(codec_k, codecs::Role::kKey, page_tokens, head_dim);
  }
  size_t codec_v_bytes() const {
    return codecs::PageBytes(codec_v, codecs::Role::kValue, page_tokens, head_dim);
  }
  size_t codec_page_bytes() const {
    return codec_k_bytes() + codec_v_bytes() + page_position_bytes();
  }
  // Bytes of a page as most of a long sequence stores it.
  size_t page_bytes() const { return plain() ? raw_page_bytes() : codec_page_bytes(); }
  int heads_total() const { return n_layers * n_kv_heads; }
  // The layout of this one's cold pool (demoted or aged tokens) in codecs c: every row coded, so
  // no sinks and no window.
  KvLayout Cold(codecs::CodecPair c) const {
    KvLayout l = *this;
    l.codec_k = c.k;
    l.codec_v = c.v;
    l.sinks = l.window = 0;
    return l;
  }
  std::string codec_name() const;  // "f32", or "<k>/<v>"
  // What a page of codec c needs to code table's (layer * n_kv_heads + KV head) role: its
  // calibrated plan, null for every other codec.
  const codecs::CalPlan* plan(int table, codecs::Role role, codecs::Codec c) const;
};

// Something that holds pages it could give back when the pool runs dry (the prefix cache, the
// chunk cache).
class PageReclaimer {
 public:
  virtual ~PageReclaimer() = default;
  virtual size_t ReclaimableBytes() const = 0;
  // Frees at least `bytes` bytes of pages if it can; returns the bytes freed.
  virtual size_t Reclaim(size_t bytes) = 0;
};

class PagePool {
 public:
  // Memory is reserved, not touched: RSS grows only with the pages actually written.
  PagePool(const KvLayout& layout, size_t capacity_bytes);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const KvLayout& layout() const { return layout_; }
  bool short_positions() const { return short_positions_; }
  size_t capacity_bytes() const { return capacity_bytes_; }
  size_t used_bytes() const {
    return raw_.used * layout_.raw_page_bytes() + codec_.used * layout_.codec_page_bytes();
  }
  size_t free_bytes() const { return capacity_bytes_ - used_bytes(); }
  size_t high_water_bytes() const { return high_water_bytes_; }
  size_t raw_bytes_used() const { return raw_.used * layout_.raw_page_bytes(); }
  size_t codec_bytes_used() const { return codec_.used * layout_.codec_page_bytes(); }
  int32_t raw_pages_used() const { return raw_.used; }
  int32_t codec_pages_used() const { return codec_.used; }

  // Counts in units of the layout's page_bytes() (exact for a plain layout), saturated.
  int32_t capacity_pages() const { return Pages(capacity_bytes_); }
  int32_t used_pages() const { return raw_.used + codec_.used; }
  int32_t free_pages() const { return Pages(free_bytes()); }
  int32_t high_water_pages() const {
    return static_cast<int32_t>(high_water_bytes_ / layout_.page_bytes());
  }

  // Fresh pages (refcount 1), all or nothing: ResourceExhausted leaves the pool unchanged (the
  // reclaimer is asked for pages only when it can cover the whole shortfall).
  Status Alloc(int n_raw, int n_codec, std::vector<int32_t>* raw, std::vector<int32_t>* codec);
  Status Alloc(int n, std::vector<int32_t>* out) { return Alloc(n, 0, out, nullptr); }
  // Runs of free slots set aside for one table's next pages (PagedSequence: decode appends a page
  // per table every page_tokens tokens, and pages taken as they come lie heads_total() slots
  // apart). Claimed slots stay free capacity: they count as free, and Alloc takes them when no
  // other slot is left. Claim sets aside up to n unclaimed free slots of one kind (-1: none);
  // TakeClaimed makes the next a page (refcount 1), -1 once the claim is spent (or its slots were
  // taken, or the bytes are not free); ReleaseClaim gives the rest back.
  int32_t Claim(bool codec, int n);
  int32_t TakeClaimed(int32_t claim);
  void ReleaseClaim(int32_t claim);
  bool claim_codec(int32_t claim) const { return claims_[claim].codec; }
  // Reclaimers are asked in the order they were added.
  void add_reclaimer(PageReclaimer* r) { reclaimers_.push_back(r); }
  void remove_reclaimer(PageReclaimer* r);
  size_t reclaimable_bytes() const;
  size_t available_bytes() const { return free_bytes() + reclaimable_bytes(); }

  void Ref(int32_t page) { ++refs(page); }
  void Unref(int32_t page);  // frees the page when its last reference goes
  // Copies a page's contents and positions into another page of the same kind (copy-on-write).
  void CopyPage(int32_t from, int32_t to);
  int32_t refcount(int32_t page) const {
    const Arena& a = IsCodecPage(page) ? codec_ : raw_;
    const int32_t slot = page & ~kCodecPageBit;
    return slot < a.fresh ? a.refs[slot] : 0;
  }
  size_t page_bytes(int32_t page) const {
    return IsCodecPage(page) ? layout_.codec_page_bytes() : layout_.raw_page_bytes();
  }

  // A page's K or V rows as stored: raw pages (layout().raw_codec()) or codec pages.
  codecs::Codec codec_of(int32_t page, codecs::Role role) const {
    return !IsCodecPage(page)           ? layout_.raw_codec()
           : role == codecs::Role::kKey ? layout_.codec_k
                                        : layout_.codec_v;
  }
  const codecs::CalPlan* plan_of(int32_t page, int table, codecs::Role role) const {
    return layout_.plan(table, role, codec_of(page, role));
  }
  // Read per page by every attention pass: the sizes are the arenas' own, not recomputed.
  uint8_t* rows(int32_t page, codecs::Role role) {
    const Arena& a = IsCodecPage(page) ? codec_ : raw_;
    uint8_t* k = a.base + static_cast<size_t>(page & ~kCodecPageBit) * a.data_bytes;
    return role == codecs::Role::kKey ? k : k + a.k_bytes;
  }
  // Codec pages: encoded K, then encoded V.
  uint8_t* codec_keys(int32_t page) { return rows(page | kCodecPageBit, codecs::Role::kKey); }
  uint8_t* codec_values(int32_t page) { return rows(page | kCodecPageBit, codecs::Role::kValue); }
  // A page's K bytes then its V bytes, contiguous, as stored (the tiers copy pages whole).
  uint8_t* data(int32_t page) { return rows(page, codecs::Role::kKey); }
  const uint8_t* data(int32_t page) const { return const_cast<PagePool*>(this)->data(page); }
  size_t data_bytes(bool codec_page) const {
    return codec_page ? codec_data_bytes() : layout_.raw_data_bytes();
  }
  // A page's token positions, in 16 or 32 bits (KvLayout::short_positions): read and written
  // only through these. Positions(page, cnt, buf) points at the first cnt as int32, in place
  // where they are stored so, else widened into buf (cnt values).
  const int32_t* Positions(int32_t page, int cnt, int32_t* buf) const {
    const uint8_t* p = position_data(page);
    if (!short_positions_) return reinterpret_cast<const int32_t*>(p);
    const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
    for (int i = 0; i < cnt; ++i) buf[i] = s[i];
    return buf;
  }
  void ReadPositions(int32_t page, int cnt, int32_t* out) const {
    const int32_t* p = Positions(page, cnt, out);
    if (p != out) std::memcpy(out, p, cnt * sizeof(int32_t));
  }
  int32_t position(int32_t page, int r) const {
    const uint8_t* p = position_data(page);
    return short_positions_ ? reinterpret_cast<const uint16_t*>(p)[r]
                            : reinterpret_cast<const int32_t*>(p)[r];
  }
  // Positions must be in [0, 65536) where they are stored in 16 bits (the engine keeps them below
  // its context; loaders check what they read): anything else aborts as an internal error.
  void set_position(int32_t page, int r, int32_t pos) { SetPositions(page, r, &pos, 1); }
  void SetPositions(int32_t page, int first, const int32_t* pos, int cnt);
  // Copies the first cnt positions of a page of this pool into another.
  void CopyPositions(int32_t from, int32_t to, int cnt) {
    std::memcpy(position_data(to), position_data(from), cnt * layout_.position_bytes());
  }
  const uint8_t* position_data(int32_t page) const {
    const Arena& a = IsCodecPage(page) ? codec_ : raw_;
    return a.positions + static_cast<size_t>(page & ~kCodecPageBit) * layout_.page_position_bytes();
  }
  uint8_t* position_data(int32_t page) {
    return const_cast<uint8_t*>(std::as_const(*this).position_data(page));
  }
  // The f32 slots of a plain layout, as kernels::PagedKv takes them.
  const float* slots_base() const { return reinterpret_cast<const float*>(raw_.base); }
  // Plain layouts only (their positions are 32-bit).
  const int32_t* positions_base() const { return reinterpret_cast<const int32_t*>(raw_.positions); }

 private:
  struct Arena {
    uint8_t* base = nullptr;
    uint8_t* positions = nullptr;  // page_position_bytes() a slot, after every slot's rows
    size_t data_bytes = 0;         // a page's K and V rows
    size_t k_bytes = 0;            // its K rows, the V rows' offset
    size_t mapped = 0;
    int32_t slots = 0;
    int32_t used = 0;
    // Slots [fresh, slots) were never handed out: the bookkeeping grows with the slots used, not
    // the capacity (a context of 10^8 tokens filled 1.6 GB of it at start-up).
    int32_t fresh = 0;
    std::vector<int32_t> refs;  // [0, fresh)
    // Freed slots, a min-heap. The lowest free slot goes first, freed or fresh, so slots taken
    // one after another ascend as a fresh pool's do: a table's pages then lie side by side in
    // address order, which the prefetchers stream. A stack gave a finished sequence's slots back
    // in reverse, and contexts computed in them decoded 1.2-1.5x slower (docs/BENCHMARKS.md).
    std::vector<int32_t> free;
    int32_t free_slots() const { return static_cast<int32_t>(free.size()) + (slots - fresh); }
    void PushFree(int32_t slot) {
      free.push_back(slot);
      std::push_heap(free.begin(), free.end(), std::greater<int32_t>());
    }
    int32_t PopFree() {
      if (!free.empty()) {  // every freed slot lies below fresh
        std::pop_heap(free.begin(), free.end(), std::greater<int32_t>());
        const int32_t slot = free.back();
        free.pop_back();
        return slot;
      }
      if (static_cast<size_t>(fresh) == refs.size()) {
        refs.resize(std::min<size_t>(slots, std::max<size_t>(64, refs.size() * 2)));
      }
      return fresh++;
    }
  };
  int32_t Pages(size_t bytes) const {
    return static_cast<int32_t>(std::min<size_t>(bytes / layout_.page_bytes(), INT32_MAX));
  }
  void MapArena(Arena& a, size_t k_bytes, size_t v_bytes, size_t capacity_bytes);
  size_t codec_data_bytes() const { return layout_.codec_k_bytes() + layout_.codec_v_bytes(); }
  int32_t& refs(int32_t page) {
    Arena& a = IsCodecPage(page) ? codec_ : raw_;
    const int32_t slot = page & ~kCodecPageBit;
    if (slot >= a.fresh) {
      std::fprintf(stderr, "cachet: internal error: page %d was never allocated\n", page);
      std::abort();
    }
    return a.refs[slot];
  }

  struct ClaimedRun {
    std::vector<int32_t> slots;  // taken from the front (next), stolen from the back
    size_t next = 0;
    bool codec = false;
    bool live = false;
  };
  int32_t StealClaimed(bool codec);
  void Taken(Arena& a, int32_t slot) {
    a.refs[slot] = 1;
    ++a.used;
  }

  KvLayout layout_;
  bool short_positions_ = false;  // layout_.short_positions(), read per page by attention
  size_t capacity_bytes_ = 0;
  Arena raw_, codec_;
  size_t high_water_bytes_ = 0;
  std::vector<PageReclaimer*> reclaimers_;
  std::vector<ClaimedRun> claims_;
  std::vector<int32_t> free_claims_;
  int32_t claimed_[2] = {0, 0};  // slots live claims hold unused: raw, codec
  size_t steal_at_ = 0;          // the claim StealClaimed last took from
};

}  // namespace cachet
