#include "kv/page_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

namespace cachet {

std::string KvLayout::codec_name() const {
  if (plain()) return "f32";
  return std::string(codecs::CodecName(codec_k)) + "/" + codecs::CodecName(codec_v);
}

const codecs::CalPlan* KvLayout::plan(int table, codecs::Role role, codecs::Codec c) const {
  if (!codecs::IsCalibrated(c)) return nullptr;
  return &calibration->plan(table, role, c);
}

void PagePool::MapArena(Arena& a, size_t k_bytes, size_t v_bytes, size_t capacity_bytes) {
  const size_t data_bytes_per_slot = k_bytes + v_bytes;
  a.k_bytes = k_bytes;
  a.data_bytes = data_bytes_per_slot;
  const size_t page_bytes = data_bytes_per_slot + layout_.page_position_bytes();
  a.slots = static_cast<int32_t>(std::min<size_t>(capacity_bytes / page_bytes, kCodecPageBit - 1));
  const size_t data = static_cast<size_t>(a.slots) * data_bytes_per_slot;
  const size_t pos = static_cast<size_t>(a.slots) * layout_.page_position_bytes();
  a.mapped = data + pos;
  if (a.mapped > 0) {
    void* p = ::mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // Transparent huge pages where the system allows them on request (THP "madvise", Debian's
    // default): a decode step reads every page of a long context, and with 4 KiB OS pages each
    // 4 KiB f16 page slot cost a TLB miss. mha-85m at 16k tokens, 2 threads: f16 KV decode 7-17%
    // faster, snapkv+max 16-27% (docs/BENCHMARKS.md). Slots are handed out from the start of
    // the arena, so this holds at most a partly used 2 MiB page more per region. Advice only.
    ::madvise(p, a.mapped, MADV_HUGEPAGE);
    a.base = static_cast<uint8_t*>(p);
    a.positions = a.base + data;
  }
}

PagePool::PagePool(const KvLayout& layout, size_t capacity_bytes)
    : layout_(layout), short_positions_(layout.short_positions()), capacity_bytes_(capacity_bytes) {
  MapArena(raw_, layout.raw_k_bytes(), layout.raw_k_bytes(), capacity_bytes);
  if (!layout.plain()) {
    MapArena(codec_, layout.codec_k_bytes(), layout.codec_v_bytes(), capacity_bytes);
  }
}

PagePool::~PagePool() {
  for (Arena* a : {&raw_, &codec_}) {
    if (a->base) ::munmap(a->base, a->mapped);
  }
}

void PagePool::remove_reclaimer(PageReclaimer* r) {
  reclaimers_.erase(std::remove(reclaimers_.begin(), reclaimers_.end(), r), reclaimers_.end());
}

size_t PagePool::reclaimable_bytes() const {
  size_t n = 0;
  for (const PageReclaimer* r : reclaimers_) n += r->ReclaimableBytes();
  return n;
}

Status PagePool::Alloc(int n_raw, int n_codec, std::vector<int32_t>* raw,
                       std::vector<int32_t>* codec) {
  const size_t need = static_cast<size_t>(n_raw) * layout_.raw_page_bytes() +
                      static_cast<size_t>(n_codec) * layout_.codec_page_bytes();
  auto fits = [&] {
    return need <= free_bytes() && n_raw <= raw_.free_slots() + claimed_[0] &&
           n_codec <= codec_.free_slots() + claimed_[1];
  };
  // Pages one reclaimer lets go may still be held by another (a chunk cache entry's pages are
  // also the prefix cache's): go round again while anything was let go.
  for (bool progress = true; !fits() && progress && need <= available_bytes();) {
    progress = false;
    for (PageReclaimer* r : reclaimers_) {
      if (fits()) break;
      progress |= r->Reclaim(need > free_bytes() ? need - free_bytes() : layout_.page_bytes()) > 0;
    }
  }
  if (!fits()) {
    return ResourceExhausted(
        "KV pool exhausted: need " + std::to_string(need) + " bytes (" +
        std::to_string(n_raw + n_codec) + " pages), " + std::to_string(available_bytes()) + " of " +
        std::to_string(capacity_bytes_) + " bytes free; raise --kv-mem or shorten the prompt");
  }
  // In ascending order (callers lay each table's pages side by side in the order given): the free
  // heap's come so, slots stolen from claims when the pool is short may not.
  auto take = [&](Arena& a, int n, bool is_codec, std::vector<int32_t>* out) {
    if (n == 0) return;  // out may be null then
    const size_t first = out->size();
    for (int i = 0; i < n; ++i) {
      const int32_t slot = a.free_slots() > 0 ? a.PopFree() : StealClaimed(is_codec);
      Taken(a, slot);
      out->push_back(slot | (is_codec ? kCodecPageBit : 0));
    }
    std::sort(out->begin() + first, out->end());
  };
  take(raw_, n_raw, false, raw);
  take(codec_, n_codec, true, codec);
  high_water_bytes_ = std::max(high_water_bytes_, used_bytes());
  return OkStatus();
}

int32_t PagePool::StealClaimed(bool codec) {
  // From where the last steal stopped: a long allocation from a pool of many spent claims stays
  // linear.
  for (size_t i = 0; i < claims_.size(); ++i) {
    const size_t at = (steal_at_ + i) % claims_.size();
    ClaimedRun& c = claims_[at];
    if (c.live && c.codec == codec && c.next < c.slots.size()) {
      steal_at_ = at;
      const int32_t slot = c.slots.back();
      c.slots.pop_back();
      --claimed_[codec];
      return slot;
    }
  }
  std::fprintf(stderr, "cachet: internal error: no claimed slot to take\n");
  std::abort();
}

int32_t PagePool::Claim(bool codec, int n) {
  Arena& a = codec ? codec_ : raw_;
  const int m = std::min(n, a.free_slots());
  if (m <= 0) return -1;
  int32_t id;
  if (!free_claims_.empty()) {
    id = free_claims_.back();
    free_claims_.pop_back();
  } else {
    id = static_cast<int32_t>(claims_.size());
    claims_.emplace_back();
  }
  ClaimedRun& c = claims_[id];
  c.slots.clear();
  for (int i = 0; i < m; ++i) c.slots.push_back(a.PopFree());
  c.next = 0;
  c.codec = codec;
  c.live = true;
  claimed_[codec] += m;
  return id;
}

int32_t PagePool::TakeClaimed(int32_t claim) {
  ClaimedRun& c = claims_[claim];
  const size_t bytes = c.codec ? layout_.codec_page_bytes() : layout_.raw_page_bytes();
  if (!c.live || c.next >= c.slots.size() || bytes > free_bytes()) return -1;
  Arena& a = c.codec ? codec_ : raw_;
  const int32_t slot = c.slots[c.next++];
  --claimed_[c.codec];
  Taken(a, slot);
  high_water_bytes_ = std::max(high_water_bytes_, used_bytes());
  return slot | (c.codec ? kCodecPageBit : 0);
}

void PagePool::ReleaseClaim(int32_t claim) {
  ClaimedRun& c = claims_[claim];
  Arena& a = c.codec ? codec_ : raw_;
  for (size_t i = c.slots.size(); i > c.next; --i) a.PushFree(c.slots[i - 1]);
  claimed_[c.codec] -= static_cast<int32_t>(c.slots.size() - c.next);
  c.slots.clear();
  c.next = 0;
  c.live = false;
  free_claims_.push_back(claim);
}

void PagePool::CopyPage(int32_t from, int32_t to) {
  if (IsCodecPage(from)) {
    std::memcpy(codec_keys(to), codec_keys(from), codec_data_bytes());
  } else {
    std::memcpy(rows(to, codecs::Role::kKey), rows(from, codecs::Role::kKey),
                layout_.raw_data_bytes());
  }
  CopyPositions(from, to, layout_.page_tokens);
}

void PagePool::SetPositions(int32_t page, int first, const int32_t* pos, int cnt) {
  uint8_t* p = position_data(page);
  if (!short_positions_) {
    std::memcpy(reinterpret_cast<int32_t*>(p) + first, pos, cnt * sizeof(int32_t));
    return;
  }
  uint16_t* s = reinterpret_cast<uint16_t*>(p) + first;
  for (int i = 0; i < cnt; ++i) {
    if (pos[i] < 0 || pos[i] > 0xFFFF) {
      std::fprintf(stderr, "cachet: internal error: position %d does not fit 16 bits\n", pos[i]);
      std::abort();
    }
    s[i] = static_cast<uint16_t>(pos[i]);
  }
}

void PagePool::Unref(int32_t page) {
  int32_t& rc = refs(page);
  if (rc <= 0) {
    std::fprintf(stderr, "cachet: internal error: page %d freed twice\n", page);
    std::abort();
  }
  if (--rc == 0) {
    Arena& a = IsCodecPage(page) ? codec_ : raw_;
    a.PushFree(page & ~kCodecPageBit);
    --a.used;
  }
}

}  // namespace cachet
