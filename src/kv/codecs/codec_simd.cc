// Highway codec decoding: pages the attention kernel does not read in place.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include "kv/codecs/codec_simd.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "kernels/kernels.h"
#include "kv/codecs/calibrated_rows.h"
#include "kv/codecs/calibration.h"
#include "kv/codecs/rope_table.h"
#include "util/dtype.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kv/codecs/codec_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/hwy_util-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::codecs::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// out[i] = scale * q[i] (+ offset) for n signed bytes.
HWY_INLINE void Int8ToF32(const int8_t* HWY_RESTRICT q, int n, float scale,
                          float* HWY_RESTRICT out) {
  const DF df;
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<int8_t, DF> d8;
  const int N = static_cast<int>(hn::Lanes(df));
  const auto vs = hn::Set(df, scale);
  int i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::Mul(vs, hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, q + i)))), df,
               out + i);
  }
  for (; i < n; ++i) out[i] = scale * q[i];
}

// out[i] = min + scale * code[i] for n unsigned codes.
HWY_INLINE void CodesToF32(const uint8_t* HWY_RESTRICT codes, int n, float min, float scale,
                           float* HWY_RESTRICT out) {
  const DF df;
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  const int N = static_cast<int>(hn::Lanes(df));
  const auto vs = hn::Set(df, scale), vm = hn::Set(df, min);
  int i = 0;
  for (; i + N <= n; i += N) {
    const auto c = hn::ConvertTo(
        df, hn::BitCast(di, hn::PromoteTo(hn::Rebind<uint32_t, DF>(), hn::LoadU(d8, codes + i))));
    hn::StoreU(hn::MulAdd(vs, c, vm), df, out + i);
  }
  for (; i < n; ++i) out[i] = min + scale * codes[i];
}

// One llama.cpp q4_0 block's 16 bytes: value j is byte j's low nibble, value 16 + j its high one;
// out[i] = min + scale * nibble.
HWY_INLINE void Q4Block(const uint8_t* HWY_RESTRICT bytes, float min, float scale,
                        float* HWY_RESTRICT out) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  if (N > 16) {  // wider vectors than a half block: the scalar unpack
    uint8_t codes[32];
    for (int j = 0; j < 16; ++j) codes[j] = bytes[j] & 15, codes[j + 16] = bytes[j] >> 4;
    CodesToF32(codes, 32, min, scale, out);
    return;
  }
  const hn::Rebind<uint32_t, DF> du;
  const hn::Rebind<uint8_t, DF> d8;
  const auto vs = hn::Set(df, scale), vm = hn::Set(df, min);
  const auto mask = hn::Set(du, 15u);
  for (int j = 0; j < 16; j += N) {
    const auto b = hn::PromoteTo(du, hn::LoadU(d8, bytes + j));
    hn::StoreU(hn::MulAdd(vs,
                          hn::ConvertTo(df, hn::BitCast(hn::RebindToSigned<decltype(du)>(),
                                                        hn::And(b, mask))),
                          vm),
               df, out + j);
    hn::StoreU(hn::MulAdd(vs,
                          hn::ConvertTo(df, hn::BitCast(hn::RebindToSigned<decltype(du)>(),
                                                        hn::ShiftRight<4>(b))),
                          vm),
               df, out + 16 + j);
  }
}

// Unpacks n little-endian codes of 2, 3 or 4 bits (n even; 4 bits: two per byte).
HWY_INLINE void Unpack(const uint8_t* in, int n, int bits, uint8_t* codes) {
  if (bits == 4) {  // the compiler vectorizes this one
    for (int i = 0; i < n / 2; ++i) codes[2 * i] = in[i] & 15, codes[2 * i + 1] = in[i] >> 4;
    return;
  }
  int i = 0;
#if HWY_TARGET <= HWY_AVX2
  // BMI2: eight codes (bits bytes) deposited into the low bits of eight bytes.
  const uint64_t mask = 0x0101010101010101ull * ((1u << bits) - 1);
  for (; i + 8 <= n; i += 8, in += bits) {
    const uint32_t w =
        uint32_t{in[0]} | uint32_t{in[1]} << 8 | (bits == 3 ? uint32_t{in[2]} << 16 : 0);
    const uint64_t c = _pdep_u64(w, mask);
    std::memcpy(codes + i, &c, 8);
  }
#endif
  uint32_t acc = 0;  // the rest bit by bit (groups of eight codes end on a byte boundary)
  for (int have = 0; i < n; ++i) {
    while (have < bits) acc |= uint32_t{*in++} << have, have += 8;
    codes[i] = acc & ((1u << bits) - 1);
    acc >>= bits;
    have -= bits;
  }
}

// N 4-bit codes from N / 2 bytes (little-endian: byte j holds codes 2j and 2j + 1), in order.
#if HWY_TARGET != HWY_SCALAR
HWY_INLINE hn::Vec<hn::Rebind<int32_t, DF>> Nibbles(const uint8_t* HWY_RESTRICT in) {
  const hn::Rebind<uint8_t, DF> d8;
  const hn::Half<decltype(d8)> d8h;
  const auto b = hn::ZeroExtendVector(d8, hn::LoadU(d8h, in));
  const auto c = hn::InterleaveLower(d8, hn::And(b, hn::Set(d8, 15)), hn::ShiftRight<4>(b));
  return hn::BitCast(hn::Rebind<int32_t, DF>(), hn::PromoteTo(hn::Rebind<uint32_t, DF>(), c));
}
#endif

// Levels of a codec looked up per lane: in a vector when they fit one, else gathered.
struct LevelLookup {
  explicit LevelLookup(const float* lv, int n_levels)
      : levels(lv), in_vector(n_levels <= static_cast<int>(hn::Lanes(DF()))) {
    if (in_vector && n_levels > 0) std::memcpy(table, lv, n_levels * sizeof(float));
  }
  HWY_INLINE hn::Vec<DF> operator()(hn::Vec<hn::Rebind<int32_t, DF>> code) const {
    const DF df;
    return in_vector ? hn::TableLookupLanes(hn::Load(df, table), hn::IndicesFromVec(df, code))
                     : hn::GatherIndex(df, levels, code);
  }
  HWY_ALIGN float table[hn::MaxLanes(DF())] = {};
  const float* levels;
  bool in_vector;
};

// Rotate-half RoPE of one row by its position's angles (cos half, sin half), inline as
// kernels::RopeRotateHalf turns it (one dispatched call per row would not be).
HWY_INLINE void TurnRow(float* x, int dim, const float* cs) {
#if HWY_TARGET != HWY_SCALAR
  kernels::cpu::HWY_NAMESPACE::RotateHalfRow(x, dim, cs, cs + dim / 2);
#else
  kernels::ref::RopeRotateHalf(x, 1, dim, cs, cs + dim / 2);
#endif
}

// Rows turned by their positions' RoPE once decoded (keys stored before RoPE), or not (null).
struct RowTurn {
  const RopeTable* rope;
  const int32_t* positions;
  HWY_INLINE void operator()(int t, float* x, int dim) const {
    if (rope == nullptr) return;
    float own[2 * kMaxDim];
    TurnRow(x, dim, rope->Angles(positions[t], own));
  }
};

// A kvq page whose channels all have the same width (values, and keys whose channels are alike):
// each row's codes unpacked (4 bits: straight from the row into lanes) and their levels looked
// up, times each channel's spread and the row's scale, plus the channels' means; then its
// outliers, then (keys) its RoPE.
void DecodeUniformKvq(const CalPlan& p, Codec c, const uint8_t* page, int n, int dim, float* rows,
                      const RowTurn& turn) {
  const DF df;
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  const int N = static_cast<int>(hn::Lanes(df));
  const size_t rb = RowStride(c, dim);
  const int bits = p.bits_per_value;
  const float* lv = p.stats->ChannelLevels(bits);
  const LevelLookup level(lv, 1 << bits);
  const float *mean = p.stats->ch_mean.data(), *sigma = p.sigma.data();
  const KvqOutlierPatch outliers(p);
  const size_t at = KvqCodesOffset(dim);
  uint8_t codes[kMaxDim];
  for (int t = 0; t < n; ++t) {
    const uint8_t* in = page + t * rb;
    const float r = KvqRowScale(in);
    const auto vr = hn::Set(df, r);
    float* x = rows + size_t(t) * dim;
    int i = 0;
#if HWY_TARGET != HWY_SCALAR
    if (bits == 4) {
      for (; i + N <= dim; i += N) {
        hn::StoreU(hn::MulAdd(hn::Mul(hn::LoadU(df, sigma + i), vr),
                              level(Nibbles(in + at + i / 2)), hn::LoadU(df, mean + i)),
                   df, x + i);
      }
    }
#endif
    if (i < dim) {
      Unpack(in + at, dim, bits, codes);
      for (; i + N <= dim; i += N) {
        const auto code = hn::PromoteTo(di, hn::LoadU(d8, codes + i));
        hn::StoreU(
            hn::MulAdd(hn::Mul(hn::LoadU(df, sigma + i), vr), level(code), hn::LoadU(df, mean + i)),
            df, x + i);
      }
      for (; i < dim; ++i) x[i] = mean[i] + sigma[i] * r * lv[codes[i]];
    }
    outliers.Apply(in, x);
    turn(t, x, dim);
  }
}

// A pca or kvq row's scale: kvq's byte, pca's f16.
HWY_INLINE float CalRowScale(bool kvq, const uint8_t* row) {
  if (kvq) return KvqRowScale(row);
  uint16_t h;
  std::memcpy(&h, row, 2);
  return F16ToF32(h);
}

// Coordinate i of a pca or kvq row of rb bytes and scale r decoded alone (mean: kvq's, else null),
// its code's word read within the row.
HWY_INLINE float CalValue(const CalPlan& p, const uint8_t* row, size_t rb, float r,
                          const float* mean, int i) {
  const size_t at = p.byte_at[i];
  uint32_t w = 0;
  if (at + 4 <= rb) {
    std::memcpy(&w, row + at, 4);
  } else {
    for (size_t b = 0; at + b < rb; ++b) w |= uint32_t{row[at + b]} << (8 * b);
  }
  const float v = r * p.table[p.level_at[i] + ((w >> p.shift[i]) & uint32_t(p.mask[i]))];
  return mean != nullptr ? mean[i] + v : v;
}

#if HWY_TARGET <= HWY_AVX3
// The levels of 16 codes of a row of mixed widths (CalPlan::lanes_ok) on AVX-512, without gathers
// (a row's two gathers per 16 coordinates were half of a kvtiny kvq4 decode step): the row's
// 16-dword window is loaded once, each lane's code is cut out of the two dwords it spans (permuted
// into it), and its level looked up in the pooled levels of widths 1 to 5 (64 floats: two
// two-table permutes and a blend). Wider coordinates get a narrower level here: callers decode
// them apart (CalPlan::wide).
class WindowLevels {
 public:
  explicit WindowLevels(const float* pooled62) {
    HWY_ALIGN float pooled[64] = {};  // widths 1 .. 5: 2 + 4 + ... + 32
    std::copy_n(pooled62, 62, pooled);
    t0_ = _mm512_load_ps(pooled), t1_ = _mm512_load_ps(pooled + 16);
    t2_ = _mm512_load_ps(pooled + 32), t3_ = _mm512_load_ps(pooled + 48);
  }
  // Coordinates [i, i + 16) of a row of rb bytes.
  HWY_INLINE hn::Vec512<float> operator()(const CalPlan& p, const uint8_t* in, size_t rb,
                                          int i) const {
    const hn::Full512<uint32_t> du;
    const hn::Full512<int32_t> di;
    // The window's bytes within the row, straight from it (masked: no fault past the page, and
    // no copy of the row whose stores a wider load could not be forwarded from).
    const int64_t first = 4 * int64_t{p.lane_base[i / 16]}, valid = int64_t(rb) - first;
    const __mmask64 in_row = valid >= 64 ? ~__mmask64{0} : (__mmask64{1} << valid) - 1;
    const auto window = hn::Vec512<uint32_t>{_mm512_maskz_loadu_epi8(in_row, in + first)};
    const auto at = hn::LoadU(di, p.lane_word.data() + i);
    const auto lo = hn::TableLookupLanes(window, hn::IndicesFromVec(du, hn::BitCast(du, at)));
    const auto hi = hn::TableLookupLanes(
        window, hn::IndicesFromVec(du, hn::BitCast(du, hn::Add(at, hn::Set(di, 1)))));
    const auto bit = hn::BitCast(du, hn::LoadU(di, p.lane_bit.data() + i));
    // (hi << 1) << (31 - bit): hi's bits above the code's start, without a shift by 32.
    const auto word = hn::Or(hn::Shr(lo, bit),
                             hn::Shl(hn::Shl(hi, hn::Set(du, 1u)), hn::Sub(hn::Set(du, 31u), bit)));
    const auto mask = hn::BitCast(du, hn::LoadU(di, p.mask.data() + i));
    const auto idx =
        hn::Add(hn::BitCast(di, hn::And(word, mask)), hn::LoadU(di, p.lane_level.data() + i));
    const __m512 a = _mm512_permutex2var_ps(t0_, idx.raw, t1_);
    const __m512 b = _mm512_permutex2var_ps(t2_, idx.raw, t3_);
    return hn::Vec512<float>{
        _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx.raw, _mm512_set1_epi32(32)), a, b)};
  }

 private:
  __m512 t0_, t1_, t2_, t3_;
};

// A pca or kvq page of mixed widths (CalPlan::lanes_ok) on AVX-512: per 16 coordinates their
// WindowLevels, times their spreads and the row's scale (kvq: plus the channels' means); the few
// coordinates of more bits are then decoded one by one (kvq: then the outliers, then RoPE).
void DecodeCalLanes(const CalPlan& p, Codec c, const uint8_t* page, int n, int dim, float* rows,
                    const RowTurn& turn) {
  const hn::Full512<float> df;
  const size_t rb = RowStride(c, dim);
  const bool kvq = IsKvq(c);
  const WindowLevels window(kvq ? p.stats->ch_levels.data() : p.stats->levels.data());
  const float *mean = kvq ? p.stats->ch_mean.data() : nullptr, *sigma = p.sigma.data();
  const std::optional<KvqOutlierPatch> outliers =
      kvq ? std::optional<KvqOutlierPatch>(p) : std::nullopt;
  for (int t = 0; t < n; ++t) {
    const uint8_t* in = page + t * rb;
    const float r = CalRowScale(kvq, in);
    const auto vr = hn::Set(df, r);
    float* x = rows + size_t(t) * dim;
    for (int i = 0; i < dim; i += 16) {
      // r (sigma level), as the plan's table and the scalar decoder round it: the same bits.
      const auto v = hn::Mul(vr, hn::Mul(hn::LoadU(df, sigma + i), window(p, in, rb, i)));
      hn::StoreU(kvq ? hn::Add(hn::LoadU(df, mean + i), v) : v, df, x + i);
    }
    // (The lanes looked the wide coordinates' codes up among narrower levels.)
    for (int ch : p.wide) x[ch] = CalValue(p, in, rb, r, mean, ch);
    if (kvq) outliers->Apply(in, x);
    turn(t, x, dim);
  }
}

// kvq rows of kDim channels on AVX-512 made in registers: each 16 channels decoded (kNibbles: a
// page of one width of 4 bits, its codes straight from the row; else WindowLevels), the wide
// channels and the outliers blended into their lanes, the row's two halves turned by RoPE together
// (keys), and the row stored once. Stored, patched by scalar stores and loaded again to be turned,
// every key row waited on a store that could not be forwarded (`kernels_bench 1 calibrated`, the
// TinyLlama shape's kvq4 keys of one width: 21.8 -> 12.2 ns a row, in cache).
template <bool kNibbles, int kDim>
void DecodeKvqRows(const CalPlan& p, Codec c, const uint8_t* page, int n, float* rows,
                   const RowTurn& turn) {
  constexpr int kVecs = kDim / 16, kOut = kDim / 64;
  static_assert(kOut * 64 == kDim);
  const hn::Full512<float> df;
  using V = hn::Vec512<float>;
  const size_t rb = RowStride(c, kDim), at = KvqCodesOffset(kDim);
  const float *mean = p.stats->ch_mean.data(), *sigma = p.sigma.data();
  const std::optional<LevelLookup> level =
      kNibbles ? std::optional<LevelLookup>(std::in_place, p.stats->ChannelLevels(4), 16)
               : std::nullopt;
  const std::optional<WindowLevels> window =
      kNibbles ? std::nullopt : std::optional<WindowLevels>(p.stats->ch_levels.data());
  const KvqOutlierPatch outliers(p);
  const int n_wide = kNibbles ? 0 : static_cast<int>(p.wide.size());
  float own[2 * kDim];  // the angles of a position past the table
  for (int t = 0; t < n; ++t) {
    const uint8_t* in = page + t * rb;
    const float r = KvqRowScale(in);
    const V vr = hn::Set(df, r);
    V v[kVecs];
#pragma GCC unroll 32
    for (int k = 0; k < kVecs; ++k) {
      const int i = 16 * k;
      if constexpr (kNibbles) {
        v[k] = hn::MulAdd(hn::Mul(hn::LoadU(df, sigma + i), vr), (*level)(Nibbles(in + at + i / 2)),
                          hn::LoadU(df, mean + i));
      } else {
        v[k] = hn::Add(hn::LoadU(df, mean + i),
                       hn::Mul(vr, hn::Mul(hn::LoadU(df, sigma + i), (*window)(p, in, rb, i))));
      }
    }
    // Blended in as the scalar decoder stores them: the wide channels, then the outliers.
    auto blend = [&](int ch, float value) HWY_ATTR {
#pragma GCC unroll 32
      for (int k = 0; k < kVecs; ++k) {
        const unsigned lane = unsigned(ch - 16 * k);
        const __mmask16 m = static_cast<__mmask16>(lane < 16 ? 1u << (lane & 15) : 0u);
        v[k].raw = _mm512_mask_mov_ps(v[k].raw, m, _mm512_set1_ps(value));
      }
    };
    for (int w = 0; w < n_wide; ++w) {
      blend(p.wide[w], CalValue(p, in, rb, r, mean, p.wide[w]));
    }
#pragma GCC unroll 8
    for (int j = 0; j < kOut; ++j) {
      int ch;
      const float value =
          kNibbles ? outliers.NibbleValue(in, in + at, j, &ch) : outliers.Value(in, j, &ch);
      blend(ch, value);
    }
    float* x = rows + size_t(t) * kDim;
    if (turn.rope == nullptr) {
#pragma GCC unroll 32
      for (int k = 0; k < kVecs; ++k) hn::StoreU(v[k], df, x + 16 * k);
      continue;
    }
    // Rotate-half RoPE as kernels' RotateHalfRow turns a row: the same operations.
    const float* cs = turn.rope->Angles(turn.positions[t], own);
    constexpr int kHalfVecs = kVecs / 2;
#pragma GCC unroll 16
    for (int k = 0; k < kHalfVecs; ++k) {
      const V co = hn::LoadU(df, cs + 16 * k), si = hn::LoadU(df, cs + kDim / 2 + 16 * k);
      const V x0 = v[k], x1 = v[k + kHalfVecs];
      hn::StoreU(hn::NegMulAdd(x1, si, hn::Mul(x0, co)), df, x + 16 * k);
      hn::StoreU(hn::MulAdd(x0, si, hn::Mul(x1, co)), df, x + kDim / 2 + 16 * k);
    }
  }
}

// DecodeKvqRows for the head widths it is made for (64, 128), or false.
bool DecodeKvqInRegisters(const CalPlan& p, Codec c, const uint8_t* page, int n, int dim,
                          float* rows, const RowTurn& turn) {
  const bool nibbles = p.uniform && p.bits_per_value == 4;
  if (!nibbles && !p.lanes_ok) return false;
  switch (dim) {
    case 64:
      nibbles ? DecodeKvqRows<true, 64>(p, c, page, n, rows, turn)
              : DecodeKvqRows<false, 64>(p, c, page, n, rows, turn);
      return true;
    case 128:
      nibbles ? DecodeKvqRows<true, 128>(p, c, page, n, rows, turn)
              : DecodeKvqRows<false, 128>(p, c, page, n, rows, turn);
      return true;
    default:
      return false;
  }
}
#endif

// A pca or kvq page's rows: per lane (coordinate), the 32-bit word holding its code is gathered
// from a copy of the row (padded, so no gather reads past it), shifted and masked, and
// sigma_i level[code] gathered from the plan's table, times the row's scale; kvq adds the
// channels' means, patches its outliers in and (keys) turns the row by its RoPE.
void DecodeCalImpl(const CalPlan& p, Codec c, const uint8_t* page, int n, int dim, float* rows,
                   const RowTurn& turn) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::RebindToUnsigned<DF> du;
  const int N = static_cast<int>(hn::Lanes(df));
  const size_t rb = RowStride(c, dim);
  const bool kvq = IsKvq(c);
#if HWY_TARGET <= HWY_AVX3
  if (kvq && N == 16 && DecodeKvqInRegisters(p, c, page, n, dim, rows, turn)) return;
#endif
  if (kvq && p.uniform) return DecodeUniformKvq(p, c, page, n, dim, rows, turn);
#if HWY_TARGET <= HWY_AVX3
  if (p.lanes_ok && N == 16) return DecodeCalLanes(p, c, page, n, dim, rows, turn);
#endif
  // A row of at most 8 bits x 512 coordinates after its header, then padding.
  HWY_ALIGN uint8_t buf[32 + 512 + 8] = {};
  const uint32_t* words = reinterpret_cast<const uint32_t*>(buf);
  const float* mean = kvq ? p.stats->ch_mean.data() : nullptr;
  const std::optional<KvqOutlierPatch> outliers =
      kvq ? std::optional<KvqOutlierPatch>(p) : std::nullopt;
  for (int t = 0; t < n; ++t) {
    const uint8_t* in = page + t * rb;
    std::memcpy(buf, in, rb);
    const float r = CalRowScale(kvq, in);
    const auto vr = hn::Set(df, r);
    float* x = rows + size_t(t) * dim;
    int i = 0;
    for (; i + N <= dim; i += N) {
      const auto w = hn::GatherOffset(du, words, hn::LoadU(di, p.byte_at.data() + i));
      const auto code = hn::And(hn::Shr(w, hn::BitCast(du, hn::LoadU(di, p.shift.data() + i))),
                                hn::BitCast(du, hn::LoadU(di, p.mask.data() + i)));
      const auto idx = hn::Add(hn::BitCast(di, code), hn::LoadU(di, p.level_at.data() + i));
      auto v = hn::Mul(vr, hn::GatherIndex(df, p.table.data(), idx));
      if (kvq) v = hn::Add(hn::LoadU(df, mean + i), v);
      hn::StoreU(v, df, x + i);
    }
    for (; i < dim; ++i) x[i] = CalValue(p, in, rb, r, mean, i);
    if (kvq) outliers->Apply(in, x);
    turn(t, x, dim);
  }
}

// A KIVI key page: per-channel f16 (min, scale), then each token's codes packed.
void DecodeKiviKeys(const uint8_t* page, int n, int dim, int bits, float* rows) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  uint8_t codes[512];
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(page);
  const uint8_t* packed = page + 4 * size_t(dim);
  const size_t row_bytes = size_t(dim) * bits / 8;
  float mins[512], scales[512];
  for (int ch = 0; ch < dim; ++ch)
    mins[ch] = F16ToF32(meta[2 * ch]), scales[ch] = F16ToF32(meta[2 * ch + 1]);
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  for (int t = 0; t < n; ++t) {
    Unpack(packed + t * row_bytes, dim, bits, codes);
    float* x = rows + size_t(t) * dim;
    int ch = 0;
    for (; ch + N <= dim; ch += N) {
      const auto cv = hn::ConvertTo(df, hn::BitCast(di, hn::PromoteTo(hn::Rebind<uint32_t, DF>(),
                                                                      hn::LoadU(d8, codes + ch))));
      hn::StoreU(hn::MulAdd(hn::LoadU(df, scales + ch), cv, hn::LoadU(df, mins + ch)), df, x + ch);
    }
    for (; ch < dim; ++ch) x[ch] = mins[ch] + scales[ch] * codes[ch];
  }
}

// A rotation codec's row (rot4, rot3, rot2): scale * level[code], the levels looked up in a
// vector (codes: room for dim unpacked codes).
void DecodeRotRow(Codec c, const LevelLookup& level, const uint8_t* in, int dim, uint8_t* codes,
                  float* x) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  uint16_t h;
  std::memcpy(&h, in, 2);
  const float scale = F16ToF32(h);
  const auto vs = hn::Set(df, scale);
  int i = 0;
#if HWY_TARGET != HWY_SCALAR
  if (c == Codec::kRot4) {
    for (; i + N <= dim; i += N) hn::StoreU(hn::Mul(level(Nibbles(in + 2 + i / 2)), vs), df, x + i);
  }
#endif
  if (i < dim) {
    Unpack(in + 2, dim, RotBits(c), codes);
    const hn::Rebind<int32_t, DF> di;
    const hn::Rebind<uint8_t, DF> d8;
    for (; i + N <= dim; i += N) {
      hn::StoreU(hn::Mul(level(hn::PromoteTo(di, hn::LoadU(d8, codes + i))), vs), df, x + i);
    }
    for (; i < dim; ++i) x[i] = scale * RotLevels(c)[codes[i]];
  }
}

void DecodeStoredImpl(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim,
                      float* rows, const CalPlan* plan, const RopeTable* rope,
                      const int32_t* positions) {
  if (IsPca(c) || IsKvq(c)) return DecodeCalImpl(*plan, c, page, n, dim, rows, {rope, positions});
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  constexpr int kBlock = 32;
  uint8_t codes[512];
  const bool kivi = c == Codec::kKivi4 || c == Codec::kKivi2;
  const int kivi_bits = c == Codec::kKivi4 ? 4 : 2;
  if (kivi && role == Role::kKey) return DecodeKiviKeys(page, n, dim, kivi_bits, rows);
  const size_t stride = RowStride(c, dim);
  // Made once per page: the levels copied into a vector per row stalled every row's first lookup
  // (a wide load waiting on the copy's narrow stores; a third of a rot4 decode step).
  const bool rot = c == Codec::kRot4 || c == Codec::kRot3 || c == Codec::kRot2;
  const LevelLookup level(rot ? RotLevels(c) : nullptr, rot ? 1 << RotBits(c) : 0);
  for (int t = 0; t < n; ++t) {
    const uint8_t* in = page + t * stride;
    float* x = rows + size_t(t) * dim;
    switch (c) {
      case Codec::kF32:
        std::memcpy(x, in, 4 * size_t(dim));
        break;
      case Codec::kF16: {
        const hn::Rebind<hwy::float16_t, DF> dh;
        const hwy::float16_t* h = reinterpret_cast<const hwy::float16_t*>(in);
        int i = 0;
        for (; i + N <= dim; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, h + i)), df, x + i);
        for (; i < dim; ++i) x[i] = F16ToF32(reinterpret_cast<const uint16_t*>(in)[i]);
        break;
      }
      case Codec::kBF16: {
        const hn::Rebind<uint16_t, DF> du16;
        const hn::Rebind<uint32_t, DF> du32;
        const uint16_t* h = reinterpret_cast<const uint16_t*>(in);
        int i = 0;
        for (; i + N <= dim; i += N) {
          hn::StoreU(
              hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, h + i)))), df,
              x + i);
        }
        for (; i < dim; ++i) x[i] = Bf16ToF32(h[i]);
        break;
      }
      case Codec::kInt8: {
        float scale;
        std::memcpy(&scale, in, 4);
        Int8ToF32(reinterpret_cast<const int8_t*>(in + 4), dim, scale, x);
        break;
      }
      case Codec::kQ8_0:
        for (int b = 0; b < dim / kBlock; ++b) {
          const uint8_t* blk = in + b * (2 + kBlock);
          uint16_t dh;
          std::memcpy(&dh, blk, 2);
          Int8ToF32(reinterpret_cast<const int8_t*>(blk + 2), kBlock, F16ToF32(dh), x + b * kBlock);
        }
        break;
      case Codec::kQ4_0:
      case Codec::kCq4:  // in the basis it is stored in
        for (int b = 0; b < dim / kBlock; ++b) {
          const uint8_t* blk = in + b * (2 + kBlock / 2);
          uint16_t dh;
          std::memcpy(&dh, blk, 2);
          const float d = F16ToF32(dh);
          Q4Block(blk + 2, -8.0f * d, d, x + b * kBlock);
        }
        break;
      case Codec::kKivi4:
      case Codec::kKivi2: {
        const int groups = dim / kBlock;
        const uint16_t* meta = reinterpret_cast<const uint16_t*>(in);
        Unpack(in + 4 * groups, dim, kivi_bits, codes);
        for (int g = 0; g < groups; ++g) {
          CodesToF32(codes + g * kBlock, kBlock, F16ToF32(meta[2 * g]), F16ToF32(meta[2 * g + 1]),
                     x + g * kBlock);
        }
        break;
      }
      case Codec::kRot4:
      case Codec::kRot3:
      case Codec::kRot2:
        DecodeRotRow(c, level, in, dim, codes, x);
        break;
      default:  // QJL rotation codecs (a Hadamard transform per row), cq2, gear4: scalar
        codecs::DecodeStored(c, role, in, 1, 1, dim, x, plan);
        break;
    }
  }
  (void)tokens;
}

}  // namespace cachet::codecs::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::codecs::simd {
HWY_EXPORT(DecodeStoredImpl);

void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                  const CalPlan* plan, const RopeTable* rope, const int32_t* positions) {
  if (IsCalibrated(c) && plan == nullptr) {  // a bug, not bad input: the scalar path says so
    return codecs::DecodeStored(c, role, page, n, tokens, dim, rows, plan);
  }
  if (!StoredBeforeRope(c, role)) rope = nullptr;
  HWY_DYNAMIC_DISPATCH(DecodeStoredImpl)
  (c, role, page, n, tokens, dim, rows, plan, rope, positions);
}
}  // namespace cachet::codecs::simd
#endif
