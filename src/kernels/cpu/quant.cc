// Highway MatMul and DequantRow for the GGUF block-quantized weight types (q8_0, q5_0, q5_1, q4_0,
// q4_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs; layouts in kernels/ref/quant.cc). Weights
// stay quantized in memory: blocks are widened to f32 vectors on the fly (integers promoted to i32
// lanes, converted, scaled), all arithmetic is f32. QuantMatMul prefers the int8 kernels
// (kernels/cpu/quant_int8.cc) where the CPU has them; this f32 path serves CPUs without AVX-512
// VNNI.
//
// n == 1 (decode): each row's dequantized vectors are dotted with x as they are produced.
// n > 1 (prefill): each task dequantizes a block of rows into per-thread f32 scratch once and runs
// a 4 tokens x 4 rows register tile over it for all tokens. Every output is computed with the same
// operation order whatever the thread count.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/tasks.h"
#include "kernels/int8_dot.h"
#include "kernels/kernels.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/quant.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/hwy_util-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
void QuantMatMulImpl(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                     int64_t y_stride, ThreadPool& pool) {
  ref::MatMul(x, n, w, bias, y, y_stride, pool);
}
void QuantDequantRowImpl(const Matrix& w, int64_t r, float* out) {
  ref::QuantDequantRow(w, r, out);
}
#else
namespace {

using DI32 = hn::RebindToSigned<DF>;
using DU8 = hn::Rebind<uint8_t, DF>;
using DI8 = hn::Rebind<int8_t, DF>;

constexpr int64_t kMinParallelWeights = 1 << 16;
constexpr int64_t kPrefillBlockBytes = 256 << 10;  // f32 rows a prefill task keeps hot

HWY_INLINE float LoadF16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

HWY_INLINE hn::Vec<DI32> LoadU8(const uint8_t* p) {
  return hn::PromoteTo(DI32(), hn::LoadU(DU8(), p));
}

// Calls fn(c, v) with v = the dequantized columns [c, c + N) of a row, for every column in column
// order (c = 0, N, 2N, ...), so that a decode row accumulates each lane in the order prefill's tile
// does. Requires N <= 16 (true of every x86 target).
template <DType kType, class Fn>
HWY_INLINE void ForEachVec(const uint8_t* row, int64_t cols, const Fn& fn) {
  const DF df;
  const DI32 di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t be = DTypeBlockElems(kType), bb = DTypeBlockBytes(kType);
  const int64_t n_blocks = cols / be;
  for (int64_t i = 0; i < n_blocks; ++i) {
    const uint8_t* b = row + i * bb;
    const int64_t c0 = i * be;
    if constexpr (kType == DType::kQ8_0) {
      const VF d = hn::Set(df, LoadF16(b));
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int64_t k = 0; k < 32; k += N) {
        fn(c0 + k, hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(DI8(), q + k))), d));
      }
    } else if constexpr (kType == DType::kQ4_0) {
      const VF d = hn::Set(df, LoadF16(b));
      const auto mask = hn::Set(di, 0xF), eight = hn::Set(di, 8);
      for (int64_t k = 0; k < 16; k += N) {  // codes 0-15: the low nibbles
        fn(c0 + k, hn::Mul(hn::ConvertTo(df, hn::Sub(hn::And(LoadU8(b + 2 + k), mask), eight)), d));
      }
      for (int64_t k = 0; k < 16; k += N) {  // codes 16-31: the high nibbles
        fn(c0 + 16 + k,
           hn::Mul(hn::ConvertTo(df, hn::Sub(hn::ShiftRight<4>(LoadU8(b + 2 + k)), eight)), d));
      }
    } else if constexpr (kType == DType::kQ5_0 || HasBlockMin(kType)) {
      // q5_0: d * (code - 16); q4_1, q5_1: d * code + m.
      const VF d = hn::Set(df, LoadF16(b));
      const VF m = hn::Set(df, HasBlockMin(kType) ? LoadF16(b + 2) : 0.0f);
      uint32_t qh = 0;
      if constexpr (HasFifthBit(kType)) std::memcpy(&qh, b + FifthBitsAt(kType), 4);
      const auto bits = hn::Set(di, static_cast<int32_t>(qh));
      const auto mask = hn::Set(di, 0xF), one = hn::Set(di, 1), sixteen = hn::Set(di, 16);
      // Code j: its nibble, and bit j of qh as the fifth bit.
      auto code = [&](int64_t j, hn::Vec<DI32> nibble) {
        if constexpr (HasFifthBit(kType)) {
          const auto fifth =
              hn::And(hn::operator>>(bits, hn::Iota(di, static_cast<int32_t>(j))), one);
          nibble = hn::Or(nibble, hn::ShiftLeft<4>(fifth));
        }
        if constexpr (HasBlockMin(kType)) return hn::MulAdd(hn::ConvertTo(df, nibble), d, m);
        return hn::Mul(hn::ConvertTo(df, hn::Sub(nibble, sixteen)), d);
      };
      const uint8_t* qs = BlockNibbles<kType>(b, 0);
      for (int64_t k = 0; k < 16; k += N) fn(c0 + k, code(k, hn::And(LoadU8(qs + k), mask)));
      for (int64_t k = 0; k < 16; k += N) {
        fn(c0 + 16 + k, code(16 + k, hn::ShiftRight<4>(LoadU8(qs + k))));
      }
    } else if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
      constexpr bool kFifth = kType == DType::kQ5_K;  // q5_K: bit is of qh[l], code l's fifth bit
      const float d = LoadF16(b), dmin = LoadF16(b + 2);
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + FifthBitsAt(kType);
      const uint8_t* q = b + NibblesAt(kType);
      const auto mask = hn::Set(di, 0xF), one = hn::Set(di, 1);
      auto fifth = [&](int64_t k, int bit) {
        return hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(LoadU8(qh + k), bit), one));
      };
      for (int j = 0; j < 256; j += 64, q += 32) {
        const int is = j / 32;
        uint8_t s1, m1, s2, m2;
        if (is < 4) {
          s1 = sc[is] & 63, m1 = sc[is + 4] & 63;
          s2 = sc[is + 1] & 63, m2 = sc[is + 5] & 63;
        } else {
          s1 = (sc[is + 4] & 0xF) | ((sc[is - 4] >> 6) << 4);
          m1 = (sc[is + 4] >> 4) | ((sc[is] >> 6) << 4);
          s2 = (sc[is + 5] & 0xF) | ((sc[is - 3] >> 6) << 4);
          m2 = (sc[is + 5] >> 4) | ((sc[is + 1] >> 6) << 4);
        }
        const VF d1 = hn::Set(df, d * s1), mn1 = hn::Set(df, dmin * m1);
        const VF d2 = hn::Set(df, d * s2), mn2 = hn::Set(df, dmin * m2);
        for (int64_t k = 0; k < 32; k += N) {
          auto code = hn::And(LoadU8(q + k), mask);
          if constexpr (kFifth) code = hn::Or(code, fifth(k, is));
          fn(c0 + j + k, hn::MulSub(hn::ConvertTo(df, code), d1, mn1));
        }
        for (int64_t k = 0; k < 32; k += N) {
          auto code = hn::ShiftRight<4>(LoadU8(q + k));
          if constexpr (kFifth) code = hn::Or(code, fifth(k, is + 1));
          fn(c0 + j + 32 + k, hn::MulSub(hn::ConvertTo(df, code), d2, mn2));
        }
      }
    } else if constexpr (kType == DType::kIQ4_NL || kType == DType::kIQ4_XS) {
      // The levels the nibbles index, by one byte shuffle per 16 nibbles, times the (sub-)block's
      // scale.
      const hn::Full128<int8_t> d8;
      const hn::Full128<uint8_t> du8;
      const auto table = hn::LoadU(d8, kIQ4Values);
      constexpr int64_t kSub = DTypeBlockElems(kType) / 32;
      float dw[kSub], o[kSub];
      BlockScales<kType>(b, kSub, dw, o);
      for (int64_t s = 0; s < kSub; ++s) {
        const auto v = hn::LoadU(du8, BlockNibbles<kType>(b, s));
        alignas(16) int8_t levels[32];
        hn::Store(hn::TableLookupBytes(table, hn::BitCast(d8, hn::And(v, hn::Set(du8, 15)))), d8,
                  levels);
        hn::Store(hn::TableLookupBytes(table, hn::BitCast(d8, hn::ShiftRight<4>(v))), d8,
                  levels + 16);
        const VF d = hn::Set(df, dw[s]);
        for (int64_t k = 0; k < 32; k += N) {
          fn(c0 + 32 * s + k,
             hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(DI8(), levels + k))), d));
        }
      }
    } else if constexpr (kType == DType::kQ3_K || kType == DType::kQ2_K) {
      // 32-value block k: two bits of each of 32 bytes of codes (and q3_K's third bit from
      // hmask), each half of it with its own scale and offset.
      float dw[16], o[16];
      HalfScales<kType>(b, dw, o);
      const uint8_t* qs = b + TwoBitCodesAt(kType);
      const auto three = hn::Set(di, 3), one = hn::Set(di, 1);
      for (int k = 0; k < 8; ++k) {
        for (int64_t l = 0; l < 32; l += N) {
          auto code =
              hn::And(hn::ShiftRightSame(LoadU8(qs + 32 * (k / 4) + l), 2 * (k % 4)), three);
          if constexpr (kType == DType::kQ3_K) {
            code =
                hn::Or(code, hn::ShiftLeft<2>(hn::And(hn::ShiftRightSame(LoadU8(b + l), k), one)));
          }
          const int s = 2 * k + static_cast<int>(l / 16);
          fn(c0 + 32 * k + l,
             hn::MulSub(hn::ConvertTo(df, code), hn::Set(df, dw[s]), hn::Set(df, o[s])));
        }
      }
    } else {
      static_assert(kType == DType::kQ6_K);
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = LoadF16(b + 208);
      const auto mask = hn::Set(di, 0xF), three = hn::Set(di, 3), off = hn::Set(di, 32);
      for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        // Quarter j of the 128 values: 32 columns from ql (low nibbles of the first or second
        // 32 bytes, then their high nibbles) and two bits of qh.
        for (int j = 0; j < 4; ++j) {
          for (int64_t l = 0; l < 32; l += N) {
            const int is = static_cast<int>(l / 16);
            const auto lo = LoadU8(ql + l + (j % 2) * 32), h = LoadU8(qh + l);
            const auto nib = j < 2 ? hn::And(lo, mask) : hn::ShiftRight<4>(lo);
            const auto hi = hn::And(hn::ShiftRightSame(h, 2 * j), three);
            const auto q6 = hn::Or(nib, hn::ShiftLeft<4>(hi));
            fn(c0 + n + 32 * j + l,
               hn::Mul(hn::ConvertTo(df, hn::Sub(q6, off)), hn::Set(df, d * sc[is + 2 * j])));
          }
        }
      }
    }
  }
}

const uint8_t* RowPtr(const Matrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + r * DTypeRowBytes(w.dtype, w.cols);
}

template <DType kType>
void DequantRowT(const Matrix& w, int64_t r, float* HWY_RESTRICT out) {
  const DF df;
  ForEachVec<kType>(RowPtr(w, r), w.cols, [&](int64_t c, VF v) { hn::StoreU(v, df, out + c); });
}

template <DType kType>
void MatVec(const float* HWY_RESTRICT x, const Matrix& w, const float* bias, float* y,
            ThreadPool& pool) {
  const DF df;
  const bool parallel = w.rows * w.cols >= kMinParallelWeights;
  const int64_t tasks_wanted = parallel ? 4 * static_cast<int64_t>(pool.size()) : 1;
  const int64_t block = std::max<int64_t>(CeilDiv(w.rows, tasks_wanted), 8);
  RunTasks(pool, CeilDiv(w.rows, block), parallel, [&](int64_t task) {
    const int64_t r1 = std::min(w.rows, (task + 1) * block);
    for (int64_t r = task * block; r < r1; ++r) {
      VF acc = hn::Zero(df);
      ForEachVec<kType>(RowPtr(w, r), w.cols,
                        [&](int64_t c, VF v) { acc = hn::MulAdd(v, hn::LoadU(df, x + c), acc); });
      // Reduced as prefill's tile reduces it (Reduce4's lanes do not depend on each other).
      y[r] = hn::GetLane(Reduce4(acc, acc, acc, acc)) + (bias != nullptr ? bias[r] : 0.0f);
    }
  });
}

// out[t] = [x_t . w_0, .., x_t . w_3] for four tokens and four f32 rows of `cols` (multiple of N).
HWY_INLINE void Tile4x4(const float* const* xs, const float* const* ws, int64_t cols, V4* out) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF a[4][4];
  for (auto& row : a) {
    for (VF& v : row) v = hn::Zero(df);
  }
  for (int64_t c = 0; c < cols; c += N) {
    const VF w0 = hn::LoadU(df, ws[0] + c), w1 = hn::LoadU(df, ws[1] + c);
    const VF w2 = hn::LoadU(df, ws[2] + c), w3 = hn::LoadU(df, ws[3] + c);
    for (int t = 0; t < 4; ++t) {
      const VF vx = hn::LoadU(df, xs[t] + c);
      a[t][0] = hn::MulAdd(vx, w0, a[t][0]);
      a[t][1] = hn::MulAdd(vx, w1, a[t][1]);
      a[t][2] = hn::MulAdd(vx, w2, a[t][2]);
      a[t][3] = hn::MulAdd(vx, w3, a[t][3]);
    }
  }
  for (int t = 0; t < 4; ++t) out[t] = Reduce4(a[t][0], a[t][1], a[t][2], a[t][3]);
}

template <DType kType>
void MatMulPrefill(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                   int64_t y_stride, ThreadPool& pool) {
  const D4 d4;
  const int64_t cols = w.cols;
  const bool parallel = w.rows * cols * n >= kMinParallelWeights;
  const int64_t threads = parallel ? pool.size() : 1;
  int64_t block = std::clamp<int64_t>(kPrefillBlockBytes / (cols * 4) / 4 * 4, 4, 128);
  block = std::min(block, std::max<int64_t>(4, CeilDiv(CeilDiv(w.rows, threads), 4) * 4));
  RunTasks(pool, CeilDiv(w.rows, block), parallel, [&](int64_t task) {
    const int64_t r0 = task * block;
    const int64_t nr = std::min(w.rows - r0, block);
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(nr * cols)) scratch.resize(nr * cols);
    float* wb = scratch.data();
    for (int64_t i = 0; i < nr; ++i) DequantRowT<kType>(w, r0 + i, wb + i * cols);
    V4 out[4];
    for (int64_t t = 0; t < n; t += 4) {
      const int64_t nt = std::min<int64_t>(4, n - t);
      const float* xs[4];
      for (int k = 0; k < 4; ++k) xs[k] = x + (t + std::min<int64_t>(k, nt - 1)) * cols;
      for (int64_t i = 0; i < nr; i += 4) {
        const int64_t ni = std::min<int64_t>(4, nr - i);
        const float* ws[4];
        for (int k = 0; k < 4; ++k) ws[k] = wb + (i + std::min<int64_t>(k, ni - 1)) * cols;
        Tile4x4(xs, ws, cols, out);
        float b4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (bias != nullptr) std::copy(bias + r0 + i, bias + r0 + i + ni, b4);
        const V4 bv = hn::LoadU(d4, b4);
        for (int64_t k = 0; k < nt; ++k) {
          float o[4];
          hn::StoreU(hn::Add(out[k], bv), d4, o);
          std::copy(o, o + ni, y + (t + k) * y_stride + r0 + i);
        }
      }
    }
  });
}

template <DType kType>
void MatMulT(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
             int64_t y_stride, ThreadPool& pool) {
  if (n == 1) {
    MatVec<kType>(x, w, bias, y, pool);
  } else {
    MatMulPrefill<kType>(x, n, w, bias, y, y_stride, pool);
  }
}

}  // namespace

void QuantMatMulImpl(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                     int64_t y_stride, ThreadPool& pool) {
  if (n <= 0 || w.rows <= 0) return;
  if (hn::Lanes(DF()) > 16 || w.cols <= 0) return ref::MatMul(x, n, w, bias, y, y_stride, pool);
  VisitQuantized(
      w.dtype, [&](auto t) { MatMulT<decltype(t)::value>(x, n, w, bias, y, y_stride, pool); },
      [&] { ref::MatMul(x, n, w, bias, y, y_stride, pool); });
}

void QuantDequantRowImpl(const Matrix& w, int64_t r, float* out) {
  if (hn::Lanes(DF()) > 16) return ref::QuantDequantRow(w, r, out);
  VisitQuantized(
      w.dtype, [&](auto t) { DequantRowT<decltype(t)::value>(w, r, out); },
      [&] { ref::QuantDequantRow(w, r, out); });
}
#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::kernels::cpu {

HWY_EXPORT(QuantMatMulImpl);
HWY_EXPORT(QuantDequantRowImpl);

void QuantMatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                 int64_t y_stride, ThreadPool& pool) {
  if (HasInt8Path(w.dtype) && HasInt8Kernels()) return Int8MatMul(x, n, w, bias, y, y_stride, pool);
  DequantMatMul(x, n, w, bias, y, y_stride, pool);
}

void DequantMatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                   int64_t y_stride, ThreadPool& pool) {
  HWY_DYNAMIC_DISPATCH(QuantMatMulImpl)(x, n, w, bias, y, y_stride, pool);
}

void QuantDequantRow(const Matrix& w, int64_t r, float* out) {
  HWY_DYNAMIC_DISPATCH(QuantDequantRowImpl)(w, r, out);
}

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE
