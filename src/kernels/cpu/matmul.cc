// Highway MatMul and DequantRow. Weights stay in their file dtype and are widened to f32 on the
// fly; all arithmetic is f32.
//
// n == 1 (decode) is a matrix-vector product and memory bound: each task streams a contiguous block
// of weight rows once, four rows at a time with two accumulators each. A bf16 vector load covers
// 2N columns; the even columns are the low halves of its 32-bit lanes (shift left by 16) and the
// odd columns the high halves (mask), so x is deinterleaved once per call to match.
//
// n > 1 (prefill) is compute bound: each task converts a block of weight rows to f32 in per-thread
// scratch (zero-padded to a multiple of the vector length, as is x) and runs a 4 tokens x 4 rows
// register tile over it for all n tokens. The 16 dot products of a tile are reduced four at a time.
// Long rows go by column chunks, so that a tile's operands stay in L1.
//
// Both paths compute every output with the same operation order whatever the thread count.

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

// x as LoadPair's second operands need it: for bf16, each 2N-column block [c, c+2N) of x is stored
// as its even columns then its odd ones; other types use x as is. Columns past the last full block
// are read from x directly.
template <DType kType>
const float* PrepareDecodeX(const float* x, int64_t cols) {
  if constexpr (kType != DType::kBF16) {
    return x;
  } else {
    const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
    const int64_t c_full = cols / (2 * N) * (2 * N);
    if (c_full == 0) return x;
    float* xd = ThreadScratch(kScratchMatMulX, static_cast<size_t>(c_full));
    for (int64_t c = 0; c < c_full; c += 2 * N) {
      for (int64_t i = 0; i < N; ++i) {
        xd[c + i] = x[c + 2 * i];
        xd[c + N + i] = x[c + 2 * i + 1];
      }
    }
    return xd;
  }
}

// y[r] = w[r] . x + bias[r] for r in [r0, r1), four rows at a time (the last group repeats its last
// row and discards the extra results, so that every row is reduced the same way).
template <DType kType>
void MatVecRows(const float* HWY_RESTRICT xd, const float* HWY_RESTRICT x, const Matrix& w,
                const float* HWY_RESTRICT bias, int64_t r0, int64_t r1, float* HWY_RESTRICT y) {
  const DF df;
  const D4 d4;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const int64_t cols = w.cols;
  const int64_t c_full = cols / (2 * N) * (2 * N);
  const int64_t elem_bytes = DTypeSize(kType);
  const int64_t row_bytes = cols * elem_bytes;
  constexpr int64_t kPrefetchRows = 8;
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = std::min<int64_t>(4, r1 - r);
    const void* p0 = RowPtr(w, r);
    const void* p1 = RowPtr(w, r + std::min<int64_t>(1, nr - 1));
    const void* p2 = RowPtr(w, r + std::min<int64_t>(2, nr - 1));
    const void* p3 = RowPtr(w, r + std::min<int64_t>(3, nr - 1));
    VF a00 = hn::Zero(df), a01 = hn::Zero(df), a10 = hn::Zero(df), a11 = hn::Zero(df);
    VF a20 = hn::Zero(df), a21 = hn::Zero(df), a30 = hn::Zero(df), a31 = hn::Zero(df);
    // Rows kPrefetchRows ahead, fetched into L2 while this group computes: every cache line of
    // them (an iteration reads 2N columns of each row). The hardware prefetcher alone left this
    // loop stalled on DRAM at a third of the streaming bandwidth; prefetching into L1 instead
    // (prefetcht0) held the f16 kernel at 10 GB/s on one core, into L2 it streams at 25.
    const char* ahead = reinterpret_cast<const char*>(p0) + kPrefetchRows * row_bytes;
    const bool prefetch = r + 4 + kPrefetchRows <= r1;
    const int64_t step_bytes = 2 * N * elem_bytes;
    for (int64_t c = 0; c < c_full; c += 2 * N) {
      if (prefetch) {
        const char* a = ahead + c * elem_bytes;
        for (int64_t line = 0; line < step_bytes; line += 64) {
          for (int i = 0; i < 4; ++i) __builtin_prefetch(a + line + i * row_bytes, 0, 2);
        }
      }
      const VF x0 = hn::LoadU(df, xd + c);
      const VF x1 = hn::LoadU(df, xd + c + N);
      VF w0, w1;
      LoadPair<kType>(p0, c, w0, w1);
      a00 = hn::MulAdd(w0, x0, a00);
      a01 = hn::MulAdd(w1, x1, a01);
      LoadPair<kType>(p1, c, w0, w1);
      a10 = hn::MulAdd(w0, x0, a10);
      a11 = hn::MulAdd(w1, x1, a11);
      LoadPair<kType>(p2, c, w0, w1);
      a20 = hn::MulAdd(w0, x0, a20);
      a21 = hn::MulAdd(w1, x1, a21);
      LoadPair<kType>(p3, c, w0, w1);
      a30 = hn::MulAdd(w0, x0, a30);
      a31 = hn::MulAdd(w1, x1, a31);
    }
    V4 sums = Reduce4(hn::Add(a00, a01), hn::Add(a10, a11), hn::Add(a20, a21), hn::Add(a30, a31));
    if (c_full < cols) {
      const void* rows[4] = {p0, p1, p2, p3};
      float tail[4];
      for (int i = 0; i < 4; ++i) {
        float s = 0.0f;
        for (int64_t c = c_full; c < cols; ++c) s += LoadAsF32(rows[i], kType, c) * x[c];
        tail[i] = s;
      }
      sums = hn::Add(sums, hn::LoadU(d4, tail));
    }
    if (nr == 4) {
      if (bias != nullptr) sums = hn::Add(sums, hn::LoadU(d4, bias + r));
      hn::StoreU(sums, d4, y + r);
    } else {
      float b4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (bias != nullptr) std::copy(bias + r, bias + r + nr, b4);
      float out[4];
      hn::StoreU(hn::Add(sums, hn::LoadU(d4, b4)), d4, out);
      std::copy(out, out + nr, y + r);
    }
  }
}

template <DType kType>
void MatVec(const float* x, const Matrix& w, const float* bias, float* y, ThreadPool& pool) {
  const float* xd = PrepareDecodeX<kType>(x, w.cols);
  const bool parallel = w.rows * w.cols >= kMinParallelWeights;
  // A few contiguous blocks per thread: every thread streams whole rows, and a thread slowed down
  // by something else on the machine leaves its later blocks to the others.
  const int64_t tasks_wanted = parallel ? 4 * static_cast<int64_t>(pool.size()) : 1;
  const int64_t block = RoundUp(std::max<int64_t>(CeilDiv(w.rows, tasks_wanted), 16), 4);
  const int64_t n_tasks = CeilDiv(w.rows, block);
  RunTasks(pool, n_tasks, parallel, [&](int64_t task) {
    const int64_t r0 = task * block;
    MatVecRows<kType>(xd, x, w, bias, r0, std::min(w.rows, r0 + block), y);
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
  const int64_t cols_pad = RoundUp(cols, N);

  // x rows, zero-padded to cols_pad unless already a multiple of N.
  const float* xp = x;
  int64_t x_stride = cols;
  if (cols_pad != cols) {
    float* buf = ThreadScratch(kScratchMatMulX, static_cast<size_t>(n * cols_pad));
    for (int64_t t = 0; t < n; ++t) {
      std::copy(x + t * cols, x + (t + 1) * cols, buf + t * cols_pad);
      std::fill(buf + t * cols_pad + cols, buf + (t + 1) * cols_pad, 0.0f);
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
        ConvertRow<kType>(RowPtr(w, r0 + i), cols, cols_pad, buf + i * cols_pad);
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
