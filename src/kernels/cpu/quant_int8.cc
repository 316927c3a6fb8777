// The int8 path (kernels/int8_dot.h) on AVX-512 VNNI: activations quantized to 8 bits per block of
// 32, weight codes times activation codes by vpdpbusd (64 unsigned x signed byte products summed
// four by four into sixteen i32 lanes), each block's integer sum scaled once.
//
// Written with intrinsics rather than Highway: Debian 12's Highway 1.0.3 has no int8 dot-product
// op (SumOfMulQuadAccumulate came later), and its AVX3_DL target does not enable avx512vnni. The
// functions carry their own target attribute and run only when the CPU has the features
// (HasInt8Kernels); elsewhere QuantMatMul keeps the Highway f32 path (kernels/cpu/quant.cc).
// Weights are read in place from the GGUF's blocks, never repacked: they stay memory-mapped.
//
// Decode (one token) is memory bound: a task streams a contiguous block of rows one row at a time,
// two blocks per 512-bit vector; scales are read as f16 straight from the blocks and the offsets
// of q4_0 / q5_0 / q8_0 (o = k dw) go into the integer sum as -k * sum(codes of x).
//
// Prefill is compute bound, and scaling every block of every (row, token) pair costs float ops
// beside the products. So its lanes are 16 weight rows: a task unpacks a tile of 16 rows once
// (dword k of block b of every row in register k), each token's four codes at a place are broadcast
// from memory, and eight vpdpbusd sum a whole block for 16 rows before one scale. 16 tokens' sums
// stay in registers while the tile's blocks pass.
//
// A call of up to kMaxDecodeTokens tokens (a step of a few decoding sequences) goes through decode,
// each token by the matrix-vector rows, the weights still read from DRAM once; more go through
// prefill. Each output's operation order depends only on its row, its token and the path, never on
// the thread count or the other tokens: a token gets the same bits in any call of the same path.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/int8_blocks.h"
#include "kernels/cpu/int8_target.h"
#include "kernels/cpu/int8_transpose.h"
#include "kernels/cpu/scratch.h"
#include "kernels/cpu/tasks.h"
#include "kernels/int8_dot.h"
#include "kernels/kernels.h"

namespace cachet::kernels::cpu {
namespace {

constexpr int64_t kMinParallelWeights = 1 << 16;
// How far ahead of its reads decode prefetches a row: DRAM latency times one core's bandwidth.
// `kernels_bench 1 quant` on the Intel VM, q4_0 from DRAM: 1 KiB 10.0-10.8 GB/s, 2 KiB 10.2-12.3,
// 4 KiB 12.5-13.3, 8-16 KiB no better. On the AMD EPYC Zen 5 VM 8 KiB beats 4 by 4-5% there (q4_0,
// q4_K, q6_K) and Llama-3.2-1B Q4_K_M decodes 3% faster (docs/BENCHMARKS.md, "Decode
// streams").
constexpr int64_t kPrefetchBytes = 8192;
// kInt8MaxDecodeTokens (kernels.h) goes by `kernels_bench 1 quant` (q4_0 5632x2048 from DRAM, 1
// thread, AMD EPYC Zen 5): decode 240-250 us for one token, 330 for two, 470-540 for four (one
// unpacking of the rows shared), 1110-1370 for eight; prefill 1410-1650 us for 8 tokens in 16
// lanes, 1550-1720 for 16.
constexpr int64_t kMaxDecodeTokens = kInt8MaxDecodeTokens;
constexpr int64_t kDecodeRowChunk = 16;  // rows decode takes through every token at once

// ------------------------------------------------------------------------------------------------
// Decode.

// What decode needs of the activation row beyond its codes, per pair of blocks, in the i32 lanes
// of the pair's products ([b x 8, b+1 x 8]): the scales dx, and for q4_0 / q5_0 / q8_0 the integer
// sum's start, -k * sum(codes) of each block in the first lane of that block.
struct DecodeActs {
  const int8_t* q;
  const float* dx2;     // 16 floats per block pair
  const int32_t* off2;  // 16 ints per block pair
  const float* s2;      // q4_1 / q5_1, 16 per block pair: [sx_b, 0 x 7, sx_b+1, 0 x 7]
  const float* d;       // per block, for q4_K's scales
  const float* s;       // per block, for q4_K's offsets
  const float* s16;     // q2_K, per half block: dx_b * the sum of the half's codes
};

#define CACHET_INT8_INLINE CACHET_INT8_TARGET inline __attribute__((always_inline))

// Pair p of a row's blocks for kT tokens: codes times activations, scaled by scale(t), into acc.
template <DType kType, int kT, class Scale>
CACHET_INT8_INLINE void PairProducts(const uint8_t* row, int64_t p, const DecodeActs* a,
                                     const Scale& scale, __m512* acc) {
  const int64_t b = 2 * p;
  _mm_prefetch(reinterpret_cast<const char*>(row + BlockStart<kType>(b) + kPrefetchBytes),
               _MM_HINT_T0);
  const __m512i codes = CodePair<kType>(row, b);
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    const __m512i start = kScaleMinK<kType> || kType == DType::kQ2_K
                              ? _mm512_setzero_si512()
                              : _mm512_load_si512(a[t].off2 + p * 16);
    const __m512i z = _mm512_dpbusd_epi32(start, codes, _mm512_loadu_si512(a[t].q + b * 32));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), scale(t), acc[t]);
  }
}

// A row of q4_K / q5_K: per super-block its scales once, times the activations' (dw dx of its
// eight sub-blocks in one product), four pairs, and the minimums' share sum_j o_j sx_j.
template <DType kType, int kT>
CACHET_INT8_INLINE void RowScaleMinK(const uint8_t* row, int64_t nb, const DecodeActs* a,
                                     __m512* acc0, __m512* acc1, float* v) {
  const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i step = _mm512_set1_epi32(2);
  __m256 corr[kT];
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) corr[t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    __m256 dw8, o8;
    Q4KScales(row + sb * DTypeBlockBytes(kType), &dw8, &o8);
    // q4_K's odd sub-blocks' codes come 16 times too large (CodePair).
    const __m256 sixteenth = kType == DType::kQ4_K
                                 ? _mm256_setr_ps(1, 0.0625f, 1, 0.0625f, 1, 0.0625f, 1, 0.0625f)
                                 : _mm256_set1_ps(1.0f);
    __m512 dw[kT];
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      corr[t] = _mm256_fmadd_ps(o8, _mm256_loadu_ps(a[t].s + sb * 8), corr[t]);
      dw[t] = _mm512_castps256_ps512(
          _mm256_mul_ps(_mm256_mul_ps(dw8, _mm256_loadu_ps(a[t].d + sb * 8)), sixteenth));
    }
    __m512i idx = lo;
    auto sub = [&](int t) CACHET_INT8_TARGET { return _mm512_permutexvar_ps(idx, dw[t]); };
    PairProducts<kType, kT>(row, 4 * sb, a, sub, acc0);
    idx = _mm512_add_epi32(idx, step);
    PairProducts<kType, kT>(row, 4 * sb + 1, a, sub, acc1);
    idx = _mm512_add_epi32(idx, step);
    PairProducts<kType, kT>(row, 4 * sb + 2, a, sub, acc0);
    idx = _mm512_add_epi32(idx, step);
    PairProducts<kType, kT>(row, 4 * sb + 3, a, sub, acc1);
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t])) - HorizontalSum(corr[t]);
  }
}

// A row of q6_K, q3_K, q2_K (sixteen scales per super-block, one per 16 values: pair p's lanes
// take scales 4p .. 4p + 3, four lanes each) or iq4_xs (eight: pair p's take 2p and 2p + 1,
// eight lanes each): per super-block its scales once, times the activations' dx; q2_K's
// minimums' share sum_h o_h s16_h.
template <DType kType, int kT>
CACHET_INT8_INLINE void RowHalfScales(const uint8_t* row, int64_t nb, const DecodeActs* a,
                                      __m512* acc0, __m512* acc1, float* v) {
  constexpr bool kQ6 = HasHalfScales(kType);
  const __m512i lanes = kQ6 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 corr[kT];
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) corr[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * DTypeBlockBytes(kType);
    __m512 sc;
    if constexpr (kQ6) {
      __m512 mins;
      sc = HalfScaleVec<kType>(blk, &mins);
      if constexpr (kType == DType::kQ2_K) {
#pragma GCC unroll 8
        for (int t = 0; t < kT; ++t) {
          corr[t] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(a[t].s16 + sb * 16), corr[t]);
        }
      }
    } else {
      sc = _mm512_castps256_ps512(IQ4XSScales(blk));
    }
#pragma GCC unroll 4
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t p = 4 * sb + i;
      const __m512 w = _mm512_permutexvar_ps(
          _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>((kQ6 ? 4 : 2) * i))), sc);
      PairProducts<kType, kT>(
          row, p, a,
          [&](int t)
              CACHET_INT8_TARGET { return _mm512_mul_ps(w, _mm512_load_ps(a[t].dx2 + p * 16)); },
          i % 2 == 0 ? acc0 : acc1);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t]));
    if constexpr (kType == DType::kQ2_K) v[t] -= HorizontalSum(corr[t]);
  }
}

// A row of blocks with one scale each (q4_0, q8_0, q5_0, iq4_nl; q4_1 / q5_1 also a minimum:
// their share sum_b m_b sx_b, one lane per block), an odd last block on its own.
template <DType kType, int kT>
CACHET_INT8_INLINE void RowBlocks(const uint8_t* row, int64_t nb, const DecodeActs* a, __m512* acc0,
                                  __m512* acc1, float* v) {
  __m512 corr[kT];
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) corr[t] = _mm512_setzero_ps();
  auto pair_at = [&](int64_t p, __m512* acc) CACHET_INT8_TARGET {
    const __m512 w = ScalePair<kType>(row, 2 * p);
    PairProducts<kType, kT>(
        row, p, a,
        [&](int t)
            CACHET_INT8_TARGET { return _mm512_mul_ps(w, _mm512_load_ps(a[t].dx2 + p * 16)); },
        acc);
    if constexpr (HasBlockMin(kType)) {
      const __m512 m = ScalePair<kType, 2>(row, 2 * p);
#pragma GCC unroll 8
      for (int t = 0; t < kT; ++t) {
        corr[t] = _mm512_fmadd_ps(m, _mm512_load_ps(a[t].s2 + p * 16), corr[t]);
      }
    }
  };
  const int64_t pairs = nb / 2;
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    pair_at(p, acc0);
    pair_at(p + 1, acc1);
  }
  if (p < pairs) pair_at(p, acc0);
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t]));
    if constexpr (HasBlockMin(kType)) v[t] += HorizontalSum(corr[t]);
  }
  if (nb % 2 != 0) {  // the last, unpaired block
    const int64_t b = nb - 1;
    const __m256i codes = Codes<kType>(row, b);
    const float dw = HardF16::Load(row + b * BlockBytes<kType>());
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].q + b * 32));
      const __m256i start = _mm256_castsi128_si256(_mm_cvtsi32_si128(a[t].off2[(b / 2) * 16]));
      const __m256i z = _mm256_dpbusd_epi32(start, codes, x);
      v[t] += HorizontalSum(_mm256_cvtepi32_ps(z)) * (dw * a[t].dx2[(b / 2) * 16]);
      if constexpr (HasBlockMin(kType)) {
        v[t] += HardF16::Load(row + b * BlockBytes<kType>() + 2) * a[t].s2[(b / 2) * 16];
      }
    }
  }
}

// y_t[r] (y_t = y + t * y_stride) for rows [r0, r1) of a matrix of nb blocks per row and kT
// tokens. One row at a time, so that a task reads one sequential stream (several rows at once
// measured up to 2x slower: the prefetchers lose track), with two accumulators per token to hide
// the latency of the FMA chain. A row's codes and scales are unpacked once for all kT tokens; each
// token's products, scales and sums go through the same steps in the same order whatever kT is,
// so a token gets the bits it gets alone.
template <DType kType, int kT>
CACHET_INT8_TARGET void DecodeRows(const uint8_t* base, int64_t row_bytes, int64_t nb, int64_t r0,
                                   int64_t r1, const DecodeActs* a, const float* bias, float* y,
                                   int64_t y_stride) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = base + r * row_bytes;
    __m512 acc0[kT], acc1[kT];
    float v[kT];
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
    if constexpr (kScaleMinK<kType>) {
      RowScaleMinK<kType, kT>(row, nb, a, acc0, acc1, v);
    } else if constexpr (HasHalfScales(kType) || kType == DType::kIQ4_XS) {
      RowHalfScales<kType, kT>(row, nb, a, acc0, acc1, v);
    } else {
      RowBlocks<kType, kT>(row, nb, a, acc0, acc1, v);
    }
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) y[t * y_stride + r] = v[t] + (bias != nullptr ? bias[r] : 0.0f);
  }
}

// Floats of scratch one token's decode activations take (codes, dx2, off2, s2, d, s, s16).
int64_t DecodeActsFloats(int64_t cols) {
  const int64_t nb = cols / kQ8Block, pairs = CeilDiv(nb, 2);
  return RoundUp(cols, 64) / 4 + 48 * pairs + 4 * RoundUp(nb, 16);
}

// Lays out one token's activations for DecodeRows in buf (DecodeActsFloats(cols), 64-byte aligned).
template <DType kType>
CACHET_INT8_TARGET DecodeActs PrepareDecodeActs(const float* x, int64_t cols, float* buf) {
  const int64_t nb = cols / kQ8Block, pairs = CeilDiv(nb, 2);
  const int64_t code_floats = RoundUp(cols, 64) / 4;
  int8_t* q = reinterpret_cast<int8_t*>(buf);
  float* dx2 = buf + code_floats;
  int32_t* off2 = reinterpret_cast<int32_t*>(dx2 + 16 * pairs);
  float* s2 = reinterpret_cast<float*>(off2 + 16 * pairs);
  float* d = s2 + 16 * pairs;
  float* s = d + RoundUp(nb, 16);
  float* s16 = s + RoundUp(nb, 16);
  QuantizeQ8(x, cols, q, d, s);
  for (int64_t b = 0; b < nb; ++b) {
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q[b * 32 + j];
    const int64_t pair = (b / 2) * 16;
    const int half = static_cast<int>(b % 2);
    std::fill(dx2 + pair + 8 * half, dx2 + pair + 8 * half + 8, d[b]);
    std::fill(off2 + pair + 8 * half, off2 + pair + 8 * half + 8, 0);
    if constexpr (HasHalfScales(kType)) {  // per 16 values: their four lanes share a scale
      int32_t first = 0;
      for (int j = 0; j < 16; ++j) first += q[b * 32 + j];
      if constexpr (kType == DType::kQ2_K) {
        s16[2 * b] = d[b] * static_cast<float>(first);
        s16[2 * b + 1] = d[b] * static_cast<float>(sum - first);
      } else {
        off2[pair + 8 * half] = -HalfOffset(kType) * first;
        off2[pair + 8 * half + 4] = -HalfOffset(kType) * (sum - first);
      }
    } else if constexpr (HasBlockMin(kType)) {  // only q4_1 / q5_1 read s2
      std::fill(s2 + pair + 8 * half, s2 + pair + 8 * half + 8, 0.0f);
      s2[pair + 8 * half] = s[b];
    } else if constexpr (!kScaleMinK<kType>) {
      off2[pair + 8 * half] = -Int8Offset(kType) * sum;
    }
  }
  return DecodeActs{q, dx2, off2, s2, d, s, s16};
}

// Tokens that share one unpacking of a weight row (DecodeRows). 8 measured no better: q4_K 10%
// faster at 8 tokens, q8_0 10% slower (its accumulators and activations spill).
constexpr int kDecodeShare = 4;

// n <= kMaxDecodeTokens tokens by DecodeRows, up to kDecodeShare at once, so each gets the bits it
// gets alone. The weights still stream from DRAM once: a task takes kDecodeRowChunk rows at a time
// through every token, and the later tokens read them from L1/L2.
template <DType kType>
CACHET_INT8_TARGET void Decode(const float* x, int64_t n, const Matrix& w, const float* bias,
                               float* y, int64_t y_stride, ThreadPool& pool) {
  const int64_t nb = w.cols / kQ8Block, per_token = DecodeActsFloats(w.cols);
  float* buf = ThreadScratch(kScratchInt8Acts, n * per_token);
  DecodeActs acts[kMaxDecodeTokens];
  for (int64_t t = 0; t < n; ++t) {
    acts[t] = PrepareDecodeActs<kType>(x + t * w.cols, w.cols, buf + t * per_token);
  }
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = DTypeRowBytes(kType, w.cols);
  const bool parallel = w.rows * w.cols >= kMinParallelWeights;
  const int64_t threads = parallel ? pool.size() : 1;
  // A few contiguous row blocks per thread, so that the pool balances a slow core.
  const int64_t block = std::max<int64_t>(CeilDiv(w.rows, 4 * threads), 4);
  RunTasks(pool, CeilDiv(w.rows, block), parallel, [&](int64_t task) {
    const int64_t r_end = std::min(w.rows, (task + 1) * block);
    for (int64_t r0 = task * block; r0 < r_end; r0 += kDecodeRowChunk) {
      const int64_t r1 = std::min(r_end, r0 + kDecodeRowChunk);
      for (int64_t t = 0; t < n; t += kDecodeShare) {
        const DecodeActs* at = acts + t;
        float* yt = y + t * y_stride;
        switch (std::min<int64_t>(kDecodeShare, n - t)) {
          case 1:
            DecodeRows<kType, 1>(base, row_bytes, nb, r0, r1, at, bias, yt, y_stride);
            break;
          case 2:
            DecodeRows<kType, 2>(base, row_bytes, nb, r0, r1, at, bias, yt, y_stride);
            break;
          case 3:
            DecodeRows<kType, 3>(base, row_bytes, nb, r0, r1, at, bias, yt, y_stride);
            break;
          default:
            DecodeRows<kType, 4>(base, row_bytes, nb, r0, r1, at, bias, yt, y_stride);
            break;
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Prefill.

constexpr int kTileRows = 16;    // weight rows in the lanes of a register
constexpr int kTileTokens = 16;  // tokens whose accumulators a tile keeps in registers

// The types whose offset o is a whole multiple of dw (q4_0, q5_0, q8_0, iq4_nl, iq4_xs): it goes
// into the integer sums as -Int8Offset x the activations' codes.
template <DType kType>
constexpr bool kIntOffset = !HasHalfScales(kType) && !HasBlockMin(kType) && !kScaleMinK<kType>;

// Activations of n tokens, padded with zero tokens to whole tiles: token t's codes at q + t *
// stride, its block scales dx at d + t * nb and sums sx at s + t * nb, and integer offsets at
// off[(t * nb + b) * 2 + h]: for the types with half scales the codes of half h of block b summed
// times the half's offset (q2_K: times 1, for its minimums); for kIntOffset types, at h = 0,
// -Int8Offset times the block's codes summed (the start of its integer sum).
struct PrefillActs {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* off;
  int64_t nb;
  int64_t stride;  // cols and a line more: codes a multiple of 4 KiB apart would share L1 sets
};

// Floats of a tile's packed weights: codes (block b's 8 registers at b * 128 floats), then scales
// (field f of block b: 16 floats, one per row, at (f * nb + b) * 16), then each row's RowScales.
template <DType kType>
constexpr int64_t TileFloats(int64_t nb) {
  return nb * 128 + 2 * kScaleFields<kType> * nb * kTileRows;
}

// Rows [r0, r0 + nr) of the matrix as a tile: dword k of block b of row r0 + i in lane i of
// register k, the scales likewise (rows past nr repeat the last one).
template <DType kType>
CACHET_INT8_TARGET void PackTile(const uint8_t* base, int64_t row_bytes, int64_t nb, int64_t r0,
                                 int nr, float* tile) {
  uint8_t* codes = reinterpret_cast<uint8_t*>(tile);
  float* scales = tile + nb * 128;
  float* row_scales = scales + kScaleFields<kType> * nb * kTileRows;
  constexpr int64_t kFields = kScaleFields<kType>;
  // Row by row first (one stream from DRAM at a time), then each block's 16 x 32 codes transposed.
  for (int i = 0; i < kTileRows; ++i) {
    const uint8_t* row = base + (r0 + std::min(i, nr - 1)) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes + b * 512 + i * 32),
                         Codes<kType>(row, b));
    }
    RowScales<kType>(row, nb, row_scales + i * kFields * nb);
  }
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = codes + b * 512;
    __m512i z[8], t[8];
    for (int i = 0; i < 8; ++i) {
      z[i] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + i * 32))),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + (i + 8) * 32)), 1);
    }
    Transpose8x8Halves(z, t);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(blk + k * 64, t[k]);
  }
  // The scales likewise, 16 fields at a time.
  const int64_t fields = kFields * nb;
  int64_t f = 0;
  for (; f + 16 <= fields; f += 16) {
    __m512i r[kTileRows];
    for (int i = 0; i < kTileRows; ++i) r[i] = _mm512_loadu_si512(row_scales + i * fields + f);
    Transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(scales + (f + j) * kTileRows, r[j]);
  }
  for (; f < fields; ++f) {
    for (int i = 0; i < kTileRows; ++i) scales[f * kTileRows + i] = row_scales[i * fields + f];
  }
}

// out[t] (16 rows of token t0 + t) over all blocks, for kTileTokens tokens.
// [ahead, ahead + ahead_bytes) is fetched into the cache on the way, a share per block: the next
// tile's rows, so that packing them does not wait on DRAM.
template <DType kType>
CACHET_INT8_TARGET void PrefillTile(const float* tile, const PrefillActs& a, int64_t t0,
                                    const uint8_t* ahead, int64_t ahead_bytes, __m512* out) {
  const int64_t nb = a.nb;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(tile);
  const float* scales = tile + nb * 128;
  const int64_t stride = a.stride;
  const int8_t* q = a.q + t0 * stride;
  const float* d = a.d + t0 * nb;
  const float* s = a.s + t0 * nb;
  const int32_t* off = a.off + t0 * nb * 2;
  __m512 acc[kTileTokens];
#pragma GCC unroll 16
  for (int j = 0; j < kTileTokens; ++j) acc[j] = _mm512_setzero_ps();
  // sum += w times codes k of token j, block b, broadcast from memory (a load, no shuffle uop; the
  // same speed as vpdpbusd's own {1to16} operand here).
  auto dot = [&](__m512i sum, __m512i w, int j, int64_t b, int k) CACHET_INT8_TARGET {
    int32_t v;
    std::memcpy(&v, q + j * stride + b * 32 + 4 * k, 4);
    return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(v));
  };
  int64_t ahead_at = 0;
  for (int64_t b = 0; b < nb; ++b) {
    for (; ahead_at < ahead_bytes && ahead_at * nb < ahead_bytes * (b + 1); ahead_at += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + ahead_at), _MM_HINT_T0);
    }
    __m512i w[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) w[k] = _mm512_load_si512(codes + b * 512 + k * 64);
    const __m512 dw = _mm512_load_ps(scales + b * kTileRows);
    const __m512 o = _mm512_load_ps(scales + (nb + b) * kTileRows);
#pragma GCC unroll 16
    for (int j = 0; j < kTileTokens; ++j) {
      const __m512 dx = _mm512_set1_ps(d[j * nb + b]);
      if constexpr (HasHalfScales(kType)) {
        // q6_K, q3_K, q2_K: each half of the block has its own scale (dw is the first half's, o
        // the second's; q2_K: its minimums after them) and the codes' offsets inside the sums.
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int k = 4 * h; k < 4 * h + 4; ++k) sum = dot(sum, w[k], j, b, k);
          const __m512 dwh = h == 0 ? dw : o;
          const __m512i oi = _mm512_set1_epi32(off[(j * nb + b) * 2 + h]);
          if constexpr (kType == DType::kQ2_K) {
            const __m512 oh = _mm512_load_ps(scales + ((2 + h) * nb + b) * kTileRows);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dwh, dx), acc[j]);
            acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(oi), _mm512_mul_ps(oh, dx), acc[j]);
          } else {
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, oi)),
                                     _mm512_mul_ps(dwh, dx), acc[j]);
          }
        }
      } else {
        // The offset of q4_0 / q5_0 / q8_0 / iq4_nl (o = k dw) starts the integer sum, as in
        // decode; the other types' o (minimums) is a float step of its own.
        __m512i sum =
            kIntOffset<kType> ? _mm512_set1_epi32(off[(j * nb + b) * 2]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) sum = dot(sum, w[k], j, b, k);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, dx), acc[j]);
        if constexpr (!kIntOffset<kType>) {
          acc[j] = _mm512_fnmadd_ps(o, _mm512_set1_ps(s[j * nb + b]), acc[j]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < kTileTokens; ++j) out[j] = acc[j];
}

// The sums of each 16 codes of a row of cols (a multiple of 32) int8 codes: 2 cols / 32 of them.
CACHET_INT8_TARGET inline void HalfSums(const int8_t* q, int64_t cols, int32_t* out) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t c = 0; c < cols; c += 64) {
    const __mmask64 m = cols - c >= 64 ? ~__mmask64{0} : (__mmask64{1} << (cols - c)) - 1;
    __m512i v =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_maskz_loadu_epi8(m, q + c));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));  // a lane's sum in its dwords
    const __mmask16 firsts = cols - c >= 64 ? 0x1111 : 0x0011;
    _mm512_mask_compressstoreu_epi32(out + c / 16, firsts, v);
  }
}

template <DType kType>
CACHET_INT8_TARGET void Prefill(const float* x, int64_t n, const Matrix& w, const float* bias,
                                float* y, int64_t y_stride, ThreadPool& pool) {
  const int64_t cols = w.cols, nb = cols / kQ8Block;
  const int64_t n_pad = RoundUp(n, kTileTokens);
  // Codes (n_pad * stride bytes), dx and sx (n_pad * nb floats each), the halves' offsets.
  const int64_t stride = RoundUp(cols, 64) + 64;
  const int64_t code_floats = n_pad * stride / 4;
  float* buf = ThreadScratch(kScratchInt8Acts, code_floats + 4 * n_pad * nb);
  int8_t* aq = reinterpret_cast<int8_t*>(buf);
  float* adx = buf + code_floats;
  float* as = adx + n_pad * nb;
  int32_t* aoff = reinterpret_cast<int32_t*>(as + n_pad * nb);
  const PrefillActs a{aq, adx, as, aoff, nb, stride};
  RunTasks(pool, n_pad / kTileTokens, n * cols >= kMinParallelWeights, [&](int64_t g) {
    for (int64_t t = g * kTileTokens; t < (g + 1) * kTileTokens; ++t) {
      int8_t* q = aq + t * stride;
      if (t >= n) {
        std::memset(q, 0, cols);
        std::fill(adx + t * nb, adx + (t + 1) * nb, 0.0f);
        std::fill(as + t * nb, as + (t + 1) * nb, 0.0f);
        std::fill(aoff + t * nb * 2, aoff + (t + 1) * nb * 2, 0);
        continue;
      }
      QuantizeQ8(x + t * cols, cols, q, adx + t * nb, as + t * nb);
      int32_t* off = aoff + t * nb * 2;
      if constexpr (HasHalfScales(kType) || kIntOffset<kType>) HalfSums(q, cols, off);
      for (int64_t b = 0; b < nb; ++b) {
        if constexpr (HasHalfScales(kType)) {
          constexpr int32_t kOff = kType == DType::kQ2_K ? 1 : HalfOffset(kType);
          off[2 * b] *= kOff;
          off[2 * b + 1] *= kOff;
        } else if constexpr (kIntOffset<kType>) {
          off[2 * b] = -Int8Offset(kType) * (off[2 * b] + off[2 * b + 1]);
        }
      }
    }
  });

  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = DTypeRowBytes(kType, cols);
  const bool parallel = w.rows * cols * n >= kMinParallelWeights;
  const int64_t threads = parallel ? pool.size() : 1;
  // A task packs and computes its tiles in turn, fetching the next one's rows as it computes, so
  // only its first waits on DRAM: two tasks per thread, enough for the pool to even out a slow
  // core.
  const int64_t block = RoundUp(CeilDiv(w.rows, 2 * threads), kTileRows);
  RunTasks(pool, CeilDiv(w.rows, block), parallel, [&](int64_t task) CACHET_INT8_TARGET {
    float* tile = ThreadScratch(kScratchInt8Scales, TileFloats<kType>(nb));
    const int64_t r_end = std::min(w.rows, (task + 1) * block);
    for (int64_t r0 = task * block; r0 < r_end; r0 += kTileRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, r_end - r0));
      const __mmask16 rows_mask = static_cast<__mmask16>((1u << nr) - 1);
      PackTile<kType>(base, row_bytes, nb, r0, nr, tile);
      const __m512 vb =
          bias != nullptr ? _mm512_maskz_loadu_ps(rows_mask, bias + r0) : _mm512_setzero_ps();
      // The next tile's rows, fetched while the last tokens are computed (earlier, the tokens'
      // codes streaming through would evict them again).
      const uint8_t* next = base + (r0 + nr) * row_bytes;
      const int64_t next_bytes = std::min<int64_t>(kTileRows, r_end - r0 - nr) * row_bytes;
      for (int64_t t0 = 0; t0 < n; t0 += kTileTokens) {
        __m512 acc[kTileTokens];
        PrefillTile<kType>(tile, a, t0, next, t0 + kTileTokens >= n ? next_bytes : 0, acc);
        for (int j = 0; j < kTileTokens && t0 + j < n; ++j) {
          _mm512_mask_storeu_ps(y + (t0 + j) * y_stride + r0, rows_mask, _mm512_add_ps(acc[j], vb));
        }
      }
    }
  });
}

// Which path takes n tokens: decode's matrix-vector rows while weights dominate (a batch of
// decoding sequences), prefill's token lanes beyond (padded to a multiple of 16).
template <DType kType>
void Dispatch(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
              int64_t y_stride, ThreadPool& pool) {
  if (n <= kMaxDecodeTokens) return Decode<kType>(x, n, w, bias, y, y_stride, pool);
  return Prefill<kType>(x, n, w, bias, y, y_stride, pool);
}

}  // namespace

bool HasInt8Kernels() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
  }();
  return has;
}

CACHET_INT8_TARGET void QuantizeQ8(const float* x, int64_t cols, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < cols / kQ8Block; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + b * 32 + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float db = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      // Rounds to nearest even, as the reference's nearbyint.
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
      sum = _mm256_add_epi32(sum, c);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + b * 32 + 8 * k),
                       _mm256_maskz_cvtsepi32_epi8(0xFF, c));
    }
    d[b] = db;
    s[b] = db * HorizontalSum(_mm256_cvtepi32_ps(sum));
  }
}

void Int8MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool) {
  if (n <= 0 || w.rows <= 0) return;
  VisitQuantized(
      w.dtype, [&](auto t) { Dispatch<decltype(t)::value>(x, n, w, bias, y, y_stride, pool); },
      [&] { ref::MatMul(x, n, w, bias, y, y_stride, pool); });
}

}  // namespace cachet::kernels::cpu
