// The page row readers of the attention kernel (kernels/cpu/attention.cc): how f32 / f16 / bf16,
// q4_0 / q8_0 block and KIVI channel rows are loaded into f32 lanes. Per-target header with
// Highway's toggle guard; attention.cc includes it after "hwy/highway.h" in its foreach_target
// block.

#if defined(CACHET_KERNELS_CPU_ATTENTION_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CACHET_KERNELS_CPU_ATTENTION_ROWS_INL_H_
#undef CACHET_KERNELS_CPU_ATTENTION_ROWS_INL_H_
#else
#define CACHET_KERNELS_CPU_ATTENTION_ROWS_INL_H_
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/hwy_util-inl.h"
#include "kernels/kernels.h"

// GCC < 12.3 makes HWY_SCALAR the fallback target; attention.cc uses the reference there.
#if HWY_TARGET != HWY_SCALAR
HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {
namespace {

// K/V rows are f32, or f16 / bf16 (KV codecs) widened to f32 as they are loaded.
template <class T>
HWY_INLINE VF LoadRow(const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(DF(), p);
  } else {
    return hn::PromoteTo(DF(), hn::LoadU(hn::Rebind<T, DF>(), p));
  }
}
template <class T>
HWY_INLINE float Elem(const T* p, int i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else if constexpr (std::is_same_v<T, hwy::float16_t>) {
    return F16ToF32(reinterpret_cast<const uint16_t*>(p)[i]);
  } else {
    return Bf16ToF32(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}

// A page's K or V rows as the kernel reads them: Load(t, d) is lanes [d, d + N) of row t widened
// to f32 (d a multiple of N), Elem(t, d) one value (the tail of a row that is not whole vectors).
template <class T>
struct PlainRows {  // f32, f16 or bf16, row t at p + t * hd
  static constexpr bool kBlocks = false;
  const T* HWY_RESTRICT p;
  int hd;
  HWY_INLINE VF Load(int t, int d) const { return LoadRow(p + static_cast<int64_t>(t) * hd + d); }
  HWY_INLINE float Elem(int t, int d) const {
    return cpu::HWY_NAMESPACE::Elem(p, static_cast<int>(static_cast<int64_t>(t) * hd + d));
  }
};

// A block's f16 scale (its first two bytes), converted by the vector unit.
HWY_INLINE float BlockScale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, 2);
  const hn::Full128<float> d4;
  const hn::Rebind<uint16_t, decltype(d4)> d16;
  return hn::GetLane(
      hn::PromoteTo(d4, hn::BitCast(hn::Rebind<hwy::float16_t, decltype(d4)>(), hn::Set(d16, h))));
}

// llama.cpp's q4_0 / q8_0 blocks (kernels::PageData): row t is hd / 32 blocks, each an f16 scale
// s and 32 codes c, value s * (c + kOffset): q4_0 has unsigned nibbles (byte i holds c_i in its
// low nibble and c_{16+i} in its high one) and offset -8, q8_0 signed bytes. The kernels walk a
// row block by block and apply the scale once per block, not per value. A reader of kHalves gives
// two vectors per load: codes [o, o + N) and [16 + o, 16 + o + N) of a block.
template <DType kType>
struct BlockRows {
  static constexpr bool kBlocks = true;
  static constexpr bool kHalves = kType == DType::kQ4_0;
  static constexpr int kBlockBytes = kHalves ? 18 : 34;
  static constexpr float kOffset = kHalves ? -8.0f : 0.0f;
  const uint8_t* HWY_RESTRICT p;
  int64_t row_bytes;
  HWY_INLINE const uint8_t* Block(int t, int blk) const {
    return p + t * row_bytes + blk * kBlockBytes;
  }
  HWY_INLINE float Scale(int t, int blk) const { return BlockScale(Block(t, blk)); }
  // Codes [o, o + N) of a block as f32 c + kOffset, unscaled (Scale applies); q4_0 also gives
  // [16 + o, 16 + o + N) from the same load (o < 16). With 16 lanes a q4_0 block is decoded by a
  // lookup in its 16 possible values.
  HWY_INLINE void Values(int t, int blk, int o, VF* lo, VF* hi) const {
    const DF df;
    const hn::Rebind<int32_t, DF> di;
    const uint8_t* codes = Block(t, blk) + 2;
    if constexpr (kHalves) {
      const auto b =
          hn::BitCast(di, hn::PromoteTo(hn::Rebind<uint32_t, DF>(),
                                        hn::LoadU(hn::Rebind<uint8_t, DF>(), codes + o)));
      const auto c_lo = hn::And(b, hn::Set(di, 15));
      const auto c_hi = hn::ShiftRight<4>(b);
      if constexpr (hn::MaxLanes(DF()) == 16) {
        const VF table = hn::Iota(df, kOffset);  // c - 8 for c = 0..15
        *lo = hn::TableLookupLanes(table, hn::IndicesFromVec(df, c_lo));
        *hi = hn::TableLookupLanes(table, hn::IndicesFromVec(df, c_hi));
      } else {
        const VF bias = hn::Set(df, kOffset);
        *lo = hn::Add(hn::ConvertTo(df, c_lo), bias);
        *hi = hn::Add(hn::ConvertTo(df, c_hi), bias);
      }
    } else {
      const hn::Rebind<int8_t, DF> d8;
      *lo = hn::ConvertTo(
          df, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(codes + o))));
      (void)hi;
    }
  }
  HWY_INLINE float Elem(int, int) const { return 0.0f; }  // rows are whole vectors (hd % 32 == 0)
};

// Lane j: byte (o + j) % 8 of bytes (o a multiple of the lanes).
template <class D8>
HWY_INLINE hn::Vec<D8> RepeatBytes(D8 d8, uint64_t bytes, int o) {
  if constexpr (hn::MaxLanes(D8()) >= 8) {
    return hn::BitCast(d8, hn::Set(hn::Repartition<uint64_t, D8>(), bytes));
  } else {
    const auto word = static_cast<uint32_t>(bytes >> (8 * (o & 7)));
    return hn::BitCast(d8, hn::Set(hn::Repartition<uint32_t, D8>(), word));
  }
}

// 2-bit level blocks (PageData::v_levels): read as q4_0's halves, lane j of a load taking byte
// (o + j) % 8 of the block's codes at bit 2 * ((o + j) / 8), and 4 more for the second half;
// the codes index the levels (padded to 16 with zeros) through a table lookup.
struct LevelRows {
  static constexpr bool kBlocks = true;
  static constexpr bool kHalves = true;
  const uint8_t* HWY_RESTRICT p;
  int64_t row_bytes;
  const float* HWY_RESTRICT levels;  // 16 floats
  HWY_INLINE const uint8_t* Block(int t, int blk) const {
    return p + t * row_bytes + blk * kLevelBlockBytes;
  }
  HWY_INLINE float Scale(int t, int blk) const { return BlockScale(Block(t, blk)); }
  HWY_INLINE void Values(int t, int blk, int o, VF* lo, VF* hi) const {
    const DF df;
    const hn::Rebind<uint32_t, DF> du;
    const hn::Rebind<uint8_t, DF> d8;
    uint64_t bytes;
    std::memcpy(&bytes, Block(t, blk) + 2, 8);
    const auto w = hn::PromoteTo(du, RepeatBytes(d8, bytes, o));
    const auto shift = hn::ShiftLeft<1>(hn::ShiftRight<3>(hn::Iota(du, o)));
    const auto three = hn::Set(du, 3);
    const auto c_lo = hn::And(hn::Shr(w, shift), three);
    const auto c_hi = hn::And(hn::Shr(w, hn::Add(shift, hn::Set(du, 4))), three);
    const hn::Rebind<int32_t, DF> di;
    const VF table = hn::LoadU(df, levels);
    *lo = hn::TableLookupLanes(table, hn::IndicesFromVec(df, hn::BitCast(di, c_lo)));
    *hi = hn::TableLookupLanes(table, hn::IndicesFromVec(df, hn::BitCast(di, c_hi)));
  }
  HWY_INLINE float Elem(int, int) const { return 0.0f; }
};

// Offsets o of the loads within a block: [0, 16) for q4_0, [0, 32) for q8_0.
template <class Rows>
constexpr int kCodeSpan = Rows::kHalves ? 16 : 32;

constexpr int kMaxLanes = static_cast<int>(hn::MaxLanes(DF()));
static_assert(kMaxLanes <= 16, "BlockRows: a vector must fit in a half block");

// KIVI keys (PageData::k_channels): codes of kBits (4 or 2) packed little-endian, row t at
// t * hd * kBits / 8 bytes. Load gives lanes [d, d + N) of row t's codes as f32, in channel order;
// the per-channel minimum and scale are applied by the caller (ScoreChannelPage folds them into
// the query).
template <int kBits>
struct ChannelRows {
  static constexpr bool kBlocks = false;
  const uint8_t* HWY_RESTRICT codes;
  int hd;
  HWY_INLINE VF Load(int t, int d) const {
    const DF df;
    const hn::Rebind<uint8_t, DF> d8;
    const uint8_t* in = codes + static_cast<int64_t>(t) * hd * kBits / 8 + d * kBits / 8;
    // N * kBits / 8 bytes hold the N codes: a half (4 bits) or quarter (2 bits) vector load, so
    // that nothing past them is read.
    const hn::Half<decltype(d8)> d8h;
    hn::Vec<decltype(d8)> c;
    if constexpr (kBits == 4) {
      const auto b = hn::ZeroExtendVector(d8, hn::LoadU(d8h, in));
      c = hn::InterleaveLower(d8, hn::And(b, hn::Set(d8, 15)), hn::ShiftRight<4>(b));
    } else {
      const auto b = hn::ZeroExtendVector(
          d8, hn::ZeroExtendVector(d8h, hn::LoadU(hn::Half<decltype(d8h)>(), in)));
      const auto mask = hn::Set(d8, 3);
      const auto c01 =
          hn::InterleaveLower(d8, hn::And(b, mask), hn::And(hn::ShiftRight<2>(b), mask));
      const auto c23 =
          hn::InterleaveLower(d8, hn::And(hn::ShiftRight<4>(b), mask), hn::ShiftRight<6>(b));
      const hn::RepartitionToWide<decltype(d8)> d16;
      c = hn::BitCast(d8, hn::InterleaveLower(d16, hn::BitCast(d16, c01), hn::BitCast(d16, c23)));
    }
    return hn::ConvertTo(
        df, hn::BitCast(hn::Rebind<int32_t, DF>(), hn::PromoteTo(hn::Rebind<uint32_t, DF>(), c)));
  }
  HWY_INLINE float Elem(int, int) const { return 0.0f; }  // rows are whole vectors (hd % 32 == 0)
};

// A KIVI key page's per-channel minimum and scale (f16 pairs) as f32.
HWY_INLINE void ChannelMeta(const uint16_t* meta, int hd, float* mins, float* scales) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const hn::Rebind<uint32_t, DF> du;
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Rebind<hwy::float16_t, DF> dh;
  for (int ch = 0; ch < hd; ch += N) {
    const auto pairs = hn::LoadU(du, reinterpret_cast<const uint32_t*>(meta + 2 * ch));
    const hn::Rebind<int32_t, DF> di;
    const auto lo = hn::DemoteTo(d16, hn::BitCast(di, hn::And(pairs, hn::Set(du, 0xffffu))));
    const auto hi = hn::DemoteTo(d16, hn::BitCast(di, hn::ShiftRight<16>(pairs)));
    hn::StoreU(hn::PromoteTo(df, hn::BitCast(dh, lo)), df, mins + ch);
    hn::StoreU(hn::PromoteTo(df, hn::BitCast(dh, hi)), df, scales + ch);
  }
}

}  // namespace
}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();
#endif  // HWY_TARGET != HWY_SCALAR

#endif  // include guard
