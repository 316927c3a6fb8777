// Highway MatMul and DequantRow. Weights stay in their file dtype and are widened to f32 on the
// fly; all arithmetic is f32.
//
// n == 1 (decode) is a matrix-vector product and memory bound: each task streams a contiguous block
// of weight rows once, eight rows at a time (four from DRAM) with one accumulator each, the two
// vectors of each 2N-column block added to it in turn. A bf16 vector load covers
// 2N columns; the even columns are the low halves of its 32-bit lanes (shift left by 16) and the
// odd columns the high halves (mask), so x is deinterleaved once per call to match.
//
// n > 1 (prefill) is compute bound: each task converts a block of weight rows to f32 in per-thread
// scratch and runs a 4 tokens x 4 rows register tile over it for all n tokens. The 16 dot products
// of a tile are reduced four at a time. Long rows go by column chunks, so that a tile's operands
// stay in L1.
//
// Both paths compute every output with the same operation order whatever the thread count, and
// the same as each other: a token's row has the same bits alone (decode) as among any n tokens
// (prefill), so that a batched forward step gives each sequence what it would get alone. Each lane
// of a dot product's single accumulator takes its columns in the same order in both (for bf16,
// prefill stores converted rows and x with each 2N-column block deinterleaved as decode reads it),
// rows are zero-padded to a multiple of 2N in both (decode copies a row's last, partial block),
// and the lanes are summed by the same Reduce4.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/scratch.h"
#include "kernels/cpu/tasks.h"
#include "kernels/kernels.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/matmul.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "kernels/cpu/hwy_util-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// The fallback target for CPUs without SSE4 (HWY_SCALAR with GCC < 12.3): the reference kernels.
void MatMulImpl(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool) {
  ref::MatMul(x, n, w, bias, y, y_stride, pool);
}
void DequantRowImpl(const Matrix& w, int64_t r, float* out) { ref::DequantRow(w, r, out); }
#else
namespace {

// Below this many weights a call runs on the calling thread: waking the pool costs more.
constexpr int64_t kMinParallelWeights = 1 << 16;
// Decode: matrices larger than this (bytes) are taken to stream from DRAM.
constexpr int64_t kDecodeStreamBytes = 8 << 20;
// Prefill tasks: blocks of up to this many weight rows (a multiple of 4), converted to f32 once
// and used for all tokens, so that each x row loaded serves many rows ...
constexpr int64_t kPrefillBlockRows = 128;
// ... and of at most this many bytes as f32 (the per-thread scratch), unless rows are very long.
constexpr int64_t kPrefillBlockBytes = 2 << 20;
// Rows longer than this are processed in chunks of this many columns (a multiple of every N), so
// that the operands of a tile stay in L1 ...
constexpr int64_t kPrefillChunkCols = 512;
// ... by groups of this many tokens (a multiple of 4), whose accumulators wait between chunks.
constexpr int64_t kPrefillTokens = 32;

const char* RowPtr(const Matrix& w, int64_t r) {
  return static_cast<const char*>(w.data) + r * w.cols * static_cast<int64_t>(DTypeSize(w.dtype));
}

// ------------------------------------------------------------------------------------------------
// Conversion of weight rows to f32.

// out[0, cols) = row converted to f32, out[cols, cols_pad) = 0.
template <DType kType>
void ConvertRow(const void* row, int64_t cols, int64_t cols_pad, float* HWY_RESTRICT out) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  if constexpr (kType == DType::kF32) {
    std::memcpy(out, row, sizeof(float) * cols);
    c = cols;
  } else if constexpr (kType == DType::kBF16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dh;
    const hwy::bfloat16_t* p = static_cast<const hwy::bfloat16_t*>(row);
    for (; c + N <= cols; c += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + c)), df, out + c);
  } else {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hwy::float16_t* p = static_cast<const hwy::float16_t*>(row);
    for (; c + N <= cols; c += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + c)), df, out + c);
  }
  for (; c < cols; ++c) out[c] = LoadAsF32(row, kType, c);
  for (; c < cols_pad; ++c) out[c] = 0.0f;
}

// ------------------------------------------------------------------------------------------------
// Decode: matrix-vector.

// Stops the compiler from folding a load into each of its two users (the shift and the mask below
// would otherwise each read the weights from memory): ~10% on L2-resident decode with AVX-512.
template <class V>
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// Loads 2N weights of a row starting at column c (even) as two f32 vectors. bf16: w0 = the even
// columns, w1 = the odd ones; f16/f32: w0 = columns [c, c+N), w1 = [c+N, c+2N).
template <DType kType>
HWY_INLINE void LoadPair(const void* row, int64_t c, VF& w0, VF& w1) {
  const DF df;
  if constexpr (kType == DType::kBF16) {
    const hn::Repartition<uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> du32;
    auto u = hn::BitCast(du32, hn::LoadU(d16, static_cast<const uint16_t*>(row) + c));
    KeepInRegister(u);
    w0 = hn::BitCast(df, hn::ShiftLeft<16>(u));
    w1 = hn::BitCast(df, hn::And(u, hn::Set(du32, 0xFFFF0000u)));
  } else if constexpr (kType == DType::kF16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hwy::float16_t* p = static_cast<const hwy::float16_t*>(row) + c;
    w0 = hn::PromoteTo(df, hn::LoadU(dh, p));
    w1 = hn::PromoteTo(df, hn::LoadU(dh, p + hn::Lanes(df)));
  } else {
    const float* p = static_cast<const float*>(row) + c;
    w0 = hn::LoadU(df, p);
    w1 = hn::LoadU(df, p + hn::Lanes(df));
  }
}

// Columns per decode iteration and per padded row: 2N (one LoadPair).
HWY_INLINE int64_t PairCols() { return 2 * static_cast<int64_t>(hn::Lanes(DF())); }

// x as LoadPair's second operands need it, in out[0, cols_pad) (cols_pad a multiple of 2N, the
// columns past cols zero): for bf16, each 2N-column block [c, c+2N) is stored as its even columns
// then its odd ones; other types are copied as they are.
template <DType kType>
void PrepareX(const float* HWY_RESTRICT x, int64_t cols, int64_t cols_pad,
              float* HWY_RESTRICT out) {
  if constexpr (kType == DType::kBF16) {
    const int64_t N = PairCols() / 2;
    for (int64_t c = 0; c < cols_pad; c += 2 * N) {
      for (int64_t i = 0; i < N; ++i) {
        const int64_t even = c + 2 * i, odd = even + 1;
        out[c + i] = even < cols ? x[even] : 0.0f;
        out[c + N + i] = odd < cols ? x[odd] : 0.0f;
      }
    }
  } else {
    std::copy(x, x + cols, out);
    std::fill(out + cols, out + cols_pad, 0.0f);
  }
}

// Whether x must be copied by PrepareX, or is used in place.
template <DType kType>
bool NeedsPreparedX(int64_t cols, int64_t cols_pad) {
  return kType == DType::kBF16 || cols != cols_pad;
}

// The last, partial 2N-column block of a row (columns [c_full, cols)), copied zero-padded to 2N
// elements of its dtype (zero bits are +0 in f32, f16 and bf16), so that LoadPair can read it.
// (Not over-aligned: a stack object aligned beyond 16 bytes makes the decode loop's function
// realign its stack, which cost f16 decode from DRAM 15-20%.)
struct TailBlock {
  uint8_t bytes[2 * HWY_MAX_BYTES];
};
template <DType kType>
HWY_INLINE const void* CopyTail(const void* row, int64_t c_full, int64_t cols, TailBlock* tail) {
  const int64_t elem = DTypeSize(kType);
  std::memset(tail->bytes, 0, sizeof(tail->bytes));
  std::memcpy(tail->bytes, static_cast<const char*>(row) + c_full * elem,
              static_cast<size_t>((cols - c_full) * elem));
  return tail->bytes;
}

// Prefill's f32 copy of a weight row: out[0, RoundUp(cols, 2N)) holds, per 2N-column block,
// LoadPair's w0 then w1 (for bf16 the block's even columns then its odd ones, else the columns in
// order), with the columns past cols zero.
template <DType kType>
void ConvertRowForTile(const void* row, int64_t cols, float* HWY_RESTRICT out) {
  const DF df;
  const int64_t step = PairCols(), N = step / 2;
  const int64_t c_full = cols / step * step;
  VF w0, w1;
  for (int64_t c = 0; c < c_full; c += step) {
    LoadPair<kType>(row, c, w0, w1);
    hn::StoreU(w0, df, out + c);
    hn::StoreU(w1, df, out + c + N);
  }
  if (c_full < cols) {
    TailBlock tail;
    LoadPair<kType>(CopyTail<kType>(row, c_full, cols, &tail), 0, w0, w1);
    hn::StoreU(w0, df, out + c_full);
    hn::StoreU(w1, df, out + c_full + N);
  }
}

// y[r] = w[r] . x + bias[r] for r in [r0, r1), kDecodeRows rows at a time (the last group repeats
// its last row and discards the extra results, so that every row is reduced the same way). xd is
// x as PrepareX leaves it (or x itself when it needs no copy). kTail: whether rows end with a
// partial 2N-column block (a separate instantiation, so that rows without one run the plain loop).
template <DType kType, int64_t kDecodeRows, bool kTail>
void MatVecRows(const float* HWY_RESTRICT xd, const Matrix& w, const float* HWY_RESTRICT bias,
                int64_t r0, int64_t r1, float* HWY_RESTRICT y) {
  const DF df;
  const D4 d4;
  const int64_t step = PairCols(), N = step / 2;
  const int64_t cols = w.cols;
  const int64_t c_full = cols / step * step;
  const int64_t elem_bytes = DTypeSize(kType);
  const int64_t row_bytes = cols * elem_bytes;
  constexpr int64_t kPrefetchRows = 8;
  for (int64_t r = r0; r < r1; r += kDecodeRows) {
    const int64_t nr = std::min<int64_t>(kDecodeRows, r1 - r);
    const void* p[kDecodeRows];
    for (int64_t i = 0; i < kDecodeRows; ++i) p[i] = RowPtr(w, r + std::min<int64_t>(i, nr - 1));
    // The rows' last, partial blocks, copied before the accumulators are live.
    TailBlock tails[kTail ? kDecodeRows : 1];
    const void* tail_rows[kDecodeRows];
    if constexpr (kTail) {
      for (int64_t i = 0; i < kDecodeRows; ++i) {
        tail_rows[i] = CopyTail<kType>(p[i], c_full, cols, &tails[i]);
      }
    }
    VF a0 = hn::Zero(df), a1 = hn::Zero(df), a2 = hn::Zero(df), a3 = hn::Zero(df);
    VF a4 = hn::Zero(df), a5 = hn::Zero(df), a6 = hn::Zero(df), a7 = hn::Zero(df);  // 8 rows
    // One 2N-column block of every row of the group: w0 . x0 then w1 . x1 into its accumulator.
    auto block = [&](const void* const* rows, int64_t c, const float* HWY_RESTRICT xc) {
      const VF x0 = hn::LoadU(df, xc);
      const VF x1 = hn::LoadU(df, xc + N);
      VF w0, w1;
      LoadPair<kType>(rows[0], c, w0, w1);
      a0 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a0));
      if constexpr (kDecodeRows == 1) return;
      LoadPair<kType>(rows[1], c, w0, w1);
      a1 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a1));
      LoadPair<kType>(rows[2], c, w0, w1);
      a2 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a2));
      LoadPair<kType>(rows[3], c, w0, w1);
      a3 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a3));
      if constexpr (kDecodeRows == 4) return;
      LoadPair<kType>(rows[4], c, w0, w1);
      a4 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a4));
      LoadPair<kType>(rows[5], c, w0, w1);
      a5 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a5));
      LoadPair<kType>(rows[6], c, w0, w1);
      a6 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a6));
      LoadPair<kType>(rows[7], c, w0, w1);
      a7 = hn::MulAdd(w1, x1, hn::MulAdd(w0, x0, a7));
    };
    // Rows kPrefetchRows ahead, fetched into L2 while this group computes: every cache line of
    // them (an iteration reads 2N columns of each row). The hardware prefetcher alone left this
    // loop stalled on DRAM at a third of the streaming bandwidth; prefetching into L1 instead
    // (prefetcht0) held the f16 kernel at 10 GB/s on one core, into L2 it streams at 25.
    const char* ahead = static_cast<const char*>(p[0]) + kPrefetchRows * row_bytes;
    const bool prefetch = r + kDecodeRows + kPrefetchRows <= r1;
    const int64_t step_bytes = step * elem_bytes;
    for (int64_t c = 0; c < c_full; c += step) {
      if (prefetch) {
        const char* pa = ahead + c * elem_bytes;
        for (int64_t line = 0; line < step_bytes; line += 64) {
          for (int64_t i = 0; i < kDecodeRows; ++i) {
            __builtin_prefetch(pa + line + i * row_bytes, 0, 2);
          }
        }
      }
      block(p, c, xd + c);
    }
    if constexpr (kTail) block(tail_rows, 0, xd + c_full);  // zero-padded as prefill pads it
    V4 sums[2] = {Reduce4(a0, a1, a2, a3), Reduce4(a0, a1, a2, a3)};
    if constexpr (kDecodeRows == 8) sums[1] = Reduce4(a4, a5, a6, a7);
    for (int64_t h = 0; h < 2 && 4 * h < nr; ++h) {
      const int64_t rh = r + 4 * h, nh = std::min<int64_t>(4, nr - 4 * h);
      if (nh == 4) {
        const V4 b4 = bias != nullptr ? hn::LoadU(d4, bias + rh) : hn::Zero(d4);
        hn::StoreU(hn::Add(sums[h], b4), d4, y + rh);
      } else {
        float b4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (bias != nullptr) std::copy(bias + rh, bias + rh + nh, b4);
        float out[4];
        hn::StoreU(hn::Add(sums[h], hn::LoadU(d4, b4)), d4, out);
        std::copy(out, out + nh, y + rh);
      }
    }
  }
}

template <DType kType>
void MatVec(const float* x, const Matrix& w, const float* bias, float* y, ThreadPool& pool) {
  const int64_t cols_pad = RoundUp(w.cols, PairCols());
  const float* xd = x;
  if (NeedsPreparedX<kType>(w.cols, cols_pad)) {
    float* buf = ThreadScratch(kScratchMatMulX, static_cast<size_t>(cols_pad));
    PrepareX<kType>(x, w.cols, cols_pad, buf);
    xd = buf;
  }
  const bool parallel = w.rows * w.cols >= kMinParallelWeights;
  // A few contiguous blocks per thread: every thread streams whole rows, and a thread slowed down
  // by something else on the machine leaves its later blocks to the others.
  const int64_t tasks_wanted = parallel ? 4 * static_cast<int64_t>(pool.size()) : 1;
  const int64_t block = RoundUp(std::max<int64_t>(CeilDiv(w.rows, tasks_wanted), 16), 8);
  const int64_t n_tasks = CeilDiv(w.rows, block);
  // Rows in groups of eight (eight FMA chains) while the matrix is cache resident, one at a time
  // when it streams from DRAM: one sequential stream, as the int8 kernels read theirs. On the Zen 5
  // VM a TinyLlama-shaped f16 model decoded 1.20x faster this way than four rows at a time on one
  // thread (docs/BENCHMARKS.md, "Decode streams"; four had been 10% faster than eight on the Intel
  // VM). Rows ending in a partial block still go four at a time, streamed or not (not measured).
  // A row's result does not depend on its group.
  const bool streams = w.rows * w.cols * DTypeSize(kType) > kDecodeStreamBytes;
  RunTasks(pool, n_tasks, parallel, [&](int64_t task) {
    const int64_t r0 = task * block, r1 = std::min(w.rows, r0 + block);
    if (cols_pad != w.cols) {
      MatVecRows<kType, 4, true>(xd, w, bias, r0, r1, y);
    } else if (streams) {
      MatVecRows<kType, 1, false>(xd, w, bias, r0, r1, y);
    } else {
      MatVecRows<kType, 8, false>(xd, w, bias, r0, r1, y);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Prefill: matrix-matrix.

// One 4 tokens x 4 weight rows tile over columns [k0, k1) (multiples of N) of f32 rows. The 16
// accumulators start from zero if `first`, else from acc (16 vectors); if `last`, the dot products
// are reduced into out[t] = [x_t . w_0, x_t . w_1, x_t . w_2, x_t . w_3], else saved in acc.
// Splitting the columns this way does not change the arithmetic.
HWY_INLINE void Tile4x4(const float* HWY_RESTRICT x0, const float* HWY_RESTRICT x1,
                        const float* HWY_RESTRICT x2, const float* HWY_RESTRICT x3,
                        const float* HWY_RESTRICT w0, const float* HWY_RESTRICT w1,
                        const float* HWY_RESTRICT w2, const float* HWY_RESTRICT w3, int64_t k0,
                        int64_t k1, bool first, bool last, float* HWY_RESTRICT acc, V4* out) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  VF a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33;
  if (first) {
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = hn::Zero(df);
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = hn::Zero(df);
  } else {
    a00 = hn::Load(df, acc + 0 * N), a01 = hn::Load(df, acc + 1 * N);
    a02 = hn::Load(df, acc + 2 * N), a03 = hn::Load(df, acc + 3 * N);
    a10 = hn::Load(df, acc + 4 * N), a11 = hn::Load(df, acc + 5 * N);
    a12 = hn::Load(df, acc + 6 * N), a13 = hn::Load(df, acc + 7 * N);
    a20 = hn::Load(df, acc + 8 * N), a21 = hn::Load(df, acc + 9 * N);
    a22 = hn::Load(df, acc + 10 * N), a23 = hn::Load(df, acc + 11 * N);
    a30 = hn::Load(df, acc + 12 * N), a31 = hn::Load(df, acc + 13 * N);
    a32 = hn::Load(df, acc + 14 * N), a33 = hn::Load(df, acc + 15 * N);
  }
  for (int64_t c = k0; c < k1; c += N) {
    const VF vw0 = hn::LoadU(df, w0 + c);
    const VF vw1 = hn::LoadU(df, w1 + c);
    const VF vw2 = hn::LoadU(df, w2 + c);
    const VF vw3 = hn::LoadU(df, w3 + c);
    VF vx = hn::LoadU(df, x0 + c);
    a00 = hn::MulAdd(vx, vw0, a00);
    a01 = hn::MulAdd(vx, vw1, a01);
    a02 = hn::MulAdd(vx, vw2, a02);
    a03 = hn::MulAdd(vx, vw3, a03);
    vx = hn::LoadU(df, x1 + c);
    a10 = hn::MulAdd(vx, vw0, a10);
    a11 = hn::MulAdd(vx, vw1, a11);
    a12 = hn::MulAdd(vx, vw2, a12);
    a13 = hn::MulAdd(vx, vw3, a13);
    vx = hn::LoadU(df, x2 + c);
    a20 = hn::MulAdd(vx, vw0, a20);
    a21 = hn::MulAdd(vx, vw1, a21);
    a22 = hn::MulAdd(vx, vw2, a22);
    a23 = hn::MulAdd(vx, vw3, a23);
    vx = hn::LoadU(df, x3 + c);
    a30 = hn::MulAdd(vx, vw0, a30);
    a31 = hn::MulAdd(vx, vw1, a31);
    a32 = hn::MulAdd(vx, vw2, a32);
    a33 = hn::MulAdd(vx, vw3, a33);
  }
  if (last) {
    out[0] = Reduce4(a00, a01, a02, a03);
    out[1] = Reduce4(a10, a11, a12, a13);
    out[2] = Reduce4(a20, a21, a22, a23);
    out[3] = Reduce4(a30, a31, a32, a33);
  } else {
    hn::Store(a00, df, acc + 0 * N), hn::Store(a01, df, acc + 1 * N);
    hn::Store(a02, df, acc + 2 * N), hn::Store(a03, df, acc + 3 * N);
    hn::Store(a10, df, acc + 4 * N), hn::Store(a11, df, acc + 5 * N);
    hn::Store(a12, df, acc + 6 * N), hn::Store(a13, df, acc + 7 * N);
    hn::Store(a20, df, acc + 8 * N), hn::Store(a21, df, acc + 9 * N);
    hn::Store(a22, df, acc + 10 * N), hn::Store(a23, df, acc + 11 * N);
    hn::Store(a30, df, acc + 12 * N), hn::Store(a31, df, acc + 13 * N);
    hn::Store(a32, df, acc + 14 * N), hn::Store(a33, df, acc + 15 * N);
  }
}

// y[t][r0 + i] for tokens t of a tile (nt of 4 valid) and rows i of a tile (ni of 4 valid).
HWY_INLINE void StoreTile(const V4* out, int64_t nt, int64_t ni, const float* bias, int64_t r,
                          float* y, int64_t y_stride) {
  const D4 d4;
  if (ni == 4) {
    const V4 b4 = bias != nullptr ? hn::LoadU(d4, bias + r) : hn::Zero(d4);
    for (int64_t k = 0; k < nt; ++k) hn::StoreU(hn::Add(out[k], b4), d4, y + k * y_stride + r);
  } else {
    float b4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias != nullptr) std::copy(bias + r, bias + r + ni, b4);
    for (int64_t k = 0; k < nt; ++k) {
      float o[4];
      hn::StoreU(hn::Add(out[k], hn::LoadU(d4, b4)), d4, o);
      std::copy(o, o + ni, y + k * y_stride + r);
    }
  }
}

template <DType kType>
void MatMulPrefill(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                   int64_t y_stride, ThreadPool& pool) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t cols = w.cols;
  const int64_t cols_pad = RoundUp(cols, PairCols());

  // x rows as decode reads them (PrepareX), unless they are usable in place.
  const float* xp = x;
  int64_t x_stride = cols;
  if (NeedsPreparedX<kType>(cols, cols_pad)) {
    float* buf = ThreadScratch(kScratchMatMulX, static_cast<size_t>(n * cols_pad));
    for (int64_t t = 0; t < n; ++t) {
      PrepareX<kType>(x + t * cols, cols, cols_pad, buf + t * cols_pad);
    }
    xp = buf;
    x_stride = cols_pad;
  }
  // f32 weights whose rows need no padding are used in place.
  const bool convert = kType != DType::kF32 || cols_pad != cols;

  const bool parallel = w.rows * cols * n >= kMinParallelWeights;
  const int64_t threads = parallel ? pool.size() : 1;
  int64_t block =
      std::clamp<int64_t>(kPrefillBlockBytes / (cols_pad * 4) / 4 * 4, 16, kPrefillBlockRows);
  block = std::min(block, RoundUp(CeilDiv(w.rows, threads), 4));
  const int64_t n_tasks = CeilDiv(w.rows, block);
  // Long rows are processed in column chunks so that a tile's x and w rows stay in L1; the tiles'
  // accumulators wait in per-thread scratch between chunks (a group of kPrefillTokens tokens).
  const int64_t n_chunks = CeilDiv(cols_pad, kPrefillChunkCols);
  const int64_t tok_step = n_chunks == 1 ? n : kPrefillTokens;

  RunTasks(pool, n_tasks, parallel, [&](int64_t task) {
    const int64_t r0 = task * block;
    const int64_t nr = std::min(w.rows - r0, block);
    const float* wb;
    int64_t w_stride;
    if (convert) {
      float* buf = ThreadScratch(kScratchMatMulW, static_cast<size_t>(nr * cols_pad));
      for (int64_t i = 0; i < nr; ++i) {
        ConvertRowForTile<kType>(RowPtr(w, r0 + i), cols, buf + i * cols_pad);
      }
      wb = buf;
      w_stride = cols_pad;
    } else {
      wb = static_cast<const float*>(w.data) + r0 * cols;
      w_stride = cols;
    }
    const int64_t row_tiles = CeilDiv(nr, 4);
    float* acc = nullptr;
    if (n_chunks > 1) {
      acc = ThreadScratch(kScratchMatMulAcc,
                          static_cast<size_t>(CeilDiv(tok_step, 4) * row_tiles * 16 * N));
    }
    V4 out[4];
    for (int64_t t0 = 0; t0 < n; t0 += tok_step) {
      const int64_t t1 = std::min(n, t0 + tok_step);
      for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
        const int64_t k0 = chunk * kPrefillChunkCols;
        const int64_t k1 = std::min(cols_pad, k0 + kPrefillChunkCols);
        const bool first = chunk == 0, last = chunk == n_chunks - 1;
        for (int64_t t = t0; t < t1; t += 4) {
          const int64_t nt = std::min<int64_t>(4, t1 - t);
          const float* x0 = xp + t * x_stride;
          const float* x1 = xp + (t + std::min<int64_t>(1, nt - 1)) * x_stride;
          const float* x2 = xp + (t + std::min<int64_t>(2, nt - 1)) * x_stride;
          const float* x3 = xp + (t + std::min<int64_t>(3, nt - 1)) * x_stride;
          float* acc_t = acc != nullptr ? acc + (t - t0) / 4 * row_tiles * 16 * N : nullptr;
          for (int64_t i = 0; i < nr; i += 4) {
            const int64_t ni = std::min<int64_t>(4, nr - i);
            const float* w0 = wb + i * w_stride;
            const float* w1 = wb + (i + std::min<int64_t>(1, ni - 1)) * w_stride;
            const float* w2 = wb + (i + std::min<int64_t>(2, ni - 1)) * w_stride;
            const float* w3 = wb + (i + std::min<int64_t>(3, ni - 1)) * w_stride;
            float* acc_tile = acc_t != nullptr ? acc_t + i / 4 * 16 * N : nullptr;
            Tile4x4(x0, x1, x2, x3, w0, w1, w2, w3, k0, k1, first, last, acc_tile, out);
            if (last) StoreTile(out, nt, ni, bias, r0 + i, y + t * y_stride, y_stride);
          }
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

void MatMulImpl(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool) {
  if (n <= 0 || w.rows <= 0) return;
  if (w.cols <= 0) {  // empty dot products
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < w.rows; ++r) y[t * y_stride + r] = bias != nullptr ? bias[r] : 0.0f;
    }
    return;
  }
  switch (w.dtype) {
    case DType::kF32:
      return MatMulT<DType::kF32>(x, n, w, bias, y, y_stride, pool);
    case DType::kF16:
      return MatMulT<DType::kF16>(x, n, w, bias, y, y_stride, pool);
    case DType::kBF16:
      return MatMulT<DType::kBF16>(x, n, w, bias, y, y_stride, pool);
    default:  // quantized: QuantMatMul (kernels/cpu/quant.cc)
      return QuantMatMul(x, n, w, bias, y, y_stride, pool);
  }
}

void DequantRowImpl(const Matrix& w, int64_t r, float* out) {
  switch (w.dtype) {
    case DType::kF32:
      return ConvertRow<DType::kF32>(RowPtr(w, r), w.cols, w.cols, out);
    case DType::kF16:
      return ConvertRow<DType::kF16>(RowPtr(w, r), w.cols, w.cols, out);
    case DType::kBF16:
      return ConvertRow<DType::kBF16>(RowPtr(w, r), w.cols, w.cols, out);
    default:  // quantized
      return QuantDequantRow(w, r, out);
  }
}
#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::kernels::cpu {

HWY_EXPORT(MatMulImpl);
HWY_EXPORT(DequantRowImpl);

void MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
            int64_t y_stride, ThreadPool& pool) {
  HWY_DYNAMIC_DISPATCH(MatMulImpl)(x, n, w, bias, y, y_stride, pool);
}

void DequantRow(const Matrix& w, int64_t r, float* out) {
  HWY_DYNAMIC_DISPATCH(DequantRowImpl)(w, r, out);
}

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE
