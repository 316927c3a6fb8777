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
// Prefill (more than kMaxDecodeTokens tokens) is in quant_int8_prefill.cc.
//
// A call of up to kMaxDecodeTokens tokens (a step of a few decoding sequences) goes through decode,
// each token by the matrix-vector rows, the weights still read from DRAM once; more go through
// prefill. Each output's operation order depends only on its row, its token and the path, never on
// the thread count or the other tokens: a token gets the same bits in any call of the same path.
#include "kernels/cpu/quant_int8.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/int8_blocks.h"
#include "kernels/cpu/int8_target.h"
#include "kernels/cpu/scratch.h"
#include "kernels/cpu/tasks.h"
#include "kernels/int8_dot.h"
#include "kernels/kernels.h"

namespace cachet::kernels::cpu {
namespace {

// How far ahead of its reads decode prefetches a row: DRAM latency times one core's bandwidth.
// `kernels_bench 1 quant` on the Intel VM, q4_0 from DRAM: 1 KiB 10.0-10.8 GB/s, 2 KiB 10.2-12.3,
// 4 KiB 12.5-13.3, 8-16 KiB no better. On the AMD EPYC Zen 5 VM 8 KiB beats 4 by 4-5% there (q4_0,
// q4_K, q6_K) and Llama-3.2-1B Q4_K_M decodes 3% faster (docs/BENCHMARKS.md, "Decode
// streams").
constexpr int64_t kPrefetchBytes = 8192;
// q8_0 rows go without it (q6_K's too, RowQ6K): the lightest loop per byte, which the hardware
// prefetchers keep fed, and where the prefetch instructions cost more than they bring (Zen 4 VM,
// TinyLlama q8_0 decode 1.06-1.10x faster without, `kernels_bench 1 quant` 21-23 -> 22-25 GB/s
// from DRAM, 31-33 -> 36 from L2: docs/BENCHMARKS.md, "Weights in 2 MiB pages").
template <DType kType>
constexpr bool kPrefetchRows = kType != DType::kQ8_0;
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
  if constexpr (kPrefetchRows<kType>) {
    _mm_prefetch(reinterpret_cast<const char*>(row + BlockStart<kType>(b) + kPrefetchBytes),
                 _MM_HINT_T0);
  }
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

// Super-block sb of a q4_K / q5_K row for kT tokens: dw[t] (low 256 bits) the eight sub-blocks'
// dw x dx, and corr[t] += the minimums' share o x sx. q4_K's odd sub-blocks' codes come 16 times
// too large (CodePair, RowQuadsQ4K), so their dw are divided by 16 (exact).
template <DType kType, int kT>
CACHET_INT8_INLINE void SuperBlockScales(const uint8_t* blk, int64_t sb, const DecodeActs* a,
                                         __m256* corr, __m512* dw) {
  __m256 dw8, o8;
  Q4KScales(blk, &dw8, &o8);
  const __m256 sixteenth = kType == DType::kQ4_K
                               ? _mm256_setr_ps(1, 0.0625f, 1, 0.0625f, 1, 0.0625f, 1, 0.0625f)
                               : _mm256_set1_ps(1.0f);
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    corr[t] = _mm256_fmadd_ps(o8, _mm256_loadu_ps(a[t].s + sb * 8), corr[t]);
    dw[t] = _mm512_castps256_ps512(
        _mm256_mul_ps(_mm256_mul_ps(dw8, _mm256_loadu_ps(a[t].d + sb * 8)), sixteenth));
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
    __m512 dw[kT];
    SuperBlockScales<kType, kT>(row + sb * DTypeBlockBytes(kType), sb, a, corr, dw);
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

// Each token's super-block scales times its activations' dx, once per super-block: lane j of
// out[t] is scale j times the dx of its block (sixteen scales: block j / 2; eight: block j), the
// products the pairs' lanes then take by one permute each.
template <bool kSixteen, int kT>
CACHET_INT8_INLINE void ScalesTimesDx(__m512 sc, const DecodeActs* a, int64_t sb, __m512* out) {
  const __m512i per_block = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    const __m512 d8 = _mm512_castps256_ps512(_mm256_loadu_ps(a[t].d + sb * 8));
    out[t] = _mm512_mul_ps(sc, kSixteen ? _mm512_permutexvar_ps(per_block, d8) : d8);
  }
}

// A row of q3_K, q2_K (sixteen scales per super-block, one per 16 values: pair i's lanes take
// scales 4i .. 4i + 3, four lanes each) or iq4_xs (eight: pair i's take 2i and 2i + 1, eight
// lanes each): per super-block its scales once, times the activations' dx (ScalesTimesDx); q2_K's
// minimums' share sum_h o_h s16_h.
template <DType kType, int kT>
CACHET_INT8_INLINE void RowHalfScales(const uint8_t* row, int64_t nb, const DecodeActs* a,
                                      __m512* acc0, __m512* acc1, float* v) {
  constexpr bool kSixteen = HasHalfScales(kType);
  const __m512i lanes = kSixteen ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 corr[kT];
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) corr[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * DTypeBlockBytes(kType);
    __m512 sc;
    if constexpr (kSixteen) {
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
    __m512 sx[kT];
    ScalesTimesDx<kSixteen, kT>(sc, a, sb, sx);
#pragma GCC unroll 4
    for (int64_t i = 0; i < 4; ++i) {
      const __m512i idx =
          _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>((kSixteen ? 4 : 2) * i)));
      PairProducts<kType, kT>(
          row, 4 * sb + i, a,
          [&](int t) CACHET_INT8_TARGET { return _mm512_permutexvar_ps(idx, sx[t]); },
          i % 2 == 0 ? acc0 : acc1);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t]));
    if constexpr (kType == DType::kQ2_K) v[t] -= HorizontalSum(corr[t]);
  }
}

// A row of q6_K, half a super-block (128 values, four 32-value blocks) at a time. One load has
// the half's 64 bytes of low nibbles, values 0-63 in their low four bits and 64-127 in their high
// ones; one broadcast load its 32 bytes of high bit pairs, which two per-qword shifts (one count
// per 256-bit half) put in place: seven operations for 128 codes where CodePair spends twelve.
// Each token's sixteen scales d sc_j dx_b are multiplied once per super-block (ScalesTimesDx).
// No software prefetch: with this loop, `kernels_bench 1 quant` q6_K from DRAM reads 20.8-22.0
// GB/s without, 15.7-21.1 with one a super-block, 18.2-18.8 with four (Zen 4 VM).
template <int kT>
CACHET_INT8_INLINE void RowQ6K(const uint8_t* row, int64_t nb, const DecodeActs* a, __m512* acc0,
                               __m512* acc1, float* v) {
  constexpr int64_t kBytes = DTypeBlockBytes(DType::kQ6_K);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  // Values 0-31 of a half take bits 0-1 of qh, 32-63 bits 2-3, 64-95 bits 4-5, 96-127 bits 6-7.
  const __m512i up_a = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
  const __m512i down_b = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  // Lanes of pair i: scales 4i .. 4i + 3, four lanes each.
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  auto pair = [&](int64_t p, const __m512i codes, const __m512* sc, int i,
                  __m512* acc) CACHET_INT8_TARGET {
    const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(4 * i));
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      const __m512i z = _mm512_dpbusd_epi32(_mm512_load_si512(a[t].off2 + p * 16), codes,
                                            _mm512_loadu_si512(a[t].q + p * 64));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_permutexvar_ps(idx, sc[t]), acc[t]);
    }
  };
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * kBytes;
    __m512 sc[kT];
    ScalesTimesDx<true, kT>(Q6KScales(blk), a, sb, sc);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      const __m512i hi_a = _mm512_and_si512(_mm512_sllv_epi64(qh, up_a), bits45);
      const __m512i hi_b = _mm512_and_si512(_mm512_srlv_epi64(qh, down_b), bits45);
      // (x & 0x0F) | y: ternary-logic table 0xEC over (x, y, 0x0F).
      const __m512i codes_a = _mm512_ternarylogic_epi32(ql, hi_a, low4, 0xEC);
      const __m512i codes_b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hi_b, low4, 0xEC);
      pair(4 * sb + 2 * h, codes_a, sc, 2 * h, acc0);
      pair(4 * sb + 2 * h + 1, codes_b, sc, 2 * h + 1, acc1);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t]));
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

// A row of q4_0, four blocks (72 bytes) at a time. One two-source permute gathers the four
// blocks' 16 code bytes into a register; its low nibbles are codes 0-15 of each block and its high
// nibbles codes 16-31, so two chained vpdpbusd against activations laid out the same way
// (PrepareDecodeActs) sum a whole block in its four lanes. One conversion, one scale product and
// one FMA then serve four blocks where the pair loop spends two of each on two: on the Zen 4 VM
// that loop was bound by those float ops (`kernels_bench 1 quant`, q4_0 from L2, 19 GB/s). A last
// partial group is read by masked loads, its missing blocks zero (codes, scales and activations).
template <int kT>
CACHET_INT8_INLINE void RowQuadsQ4_0(const uint8_t* row, int64_t nb, const DecodeActs* a,
                                     __m512* acc0, __m512* acc1, float* v) {
  constexpr int64_t kBytes = BlockBytes<DType::kQ4_0>();  // 18: an f16 scale, 16 code bytes
  // Word i of the result: code word i % 8 of block i / 8 (blocks are 9 words apart, their codes
  // start at word 1; words 32-35 come from the second source). Words, not bytes: every field of a
  // q4_0 block starts at an even byte, and word permutes need only AVX-512 BW (no VBMI).
  alignas(64) static constexpr uint16_t kCodeIdx[32] = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12,
                                                        13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24,
                                                        25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
  // f16 lane i of the low 256 bits: the scale of block i / 4.
  alignas(64) static constexpr uint16_t kScaleIdx[32] = {0,  0,  0,  0,  9,  9,  9,  9,
                                                         18, 18, 18, 18, 27, 27, 27, 27};
  const __m512i code_idx = _mm512_load_si512(kCodeIdx);
  const __m512i scale_idx = _mm512_load_si512(kScaleIdx);
  const __m512i low = _mm512_set1_epi8(0x0F);
  auto group = [&](int64_t g, __m512i first, __m512i second, __m512* acc) CACHET_INT8_TARGET {
    const __m512i codes = _mm512_permutex2var_epi16(first, code_idx, second);
    const __m512i lo = _mm512_and_si512(codes, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
    const __m512 w =
        _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(scale_idx, first)));
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      const int8_t* x = a[t].q + g * 128;
      __m512i z =
          _mm512_dpbusd_epi32(_mm512_load_si512(a[t].off2 + g * 16), lo, _mm512_load_si512(x));
      z = _mm512_dpbusd_epi32(z, hi, _mm512_load_si512(x + 64));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z),
                               _mm512_mul_ps(w, _mm512_load_ps(a[t].dx2 + g * 16)), acc[t]);
    }
  };
  auto whole = [&](int64_t g, __m512* acc) CACHET_INT8_TARGET {
    const uint8_t* q = row + g * 4 * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchBytes + 64), _MM_HINT_T0);
    const __m512i first = _mm512_loadu_si512(q);
    const __m512i second =
        _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 64)));
    group(g, first, second, acc);
  };
  auto partial = [&](int64_t g, int64_t blocks, __m512* acc) CACHET_INT8_TARGET {
    const __m512i first =
        _mm512_maskz_loadu_epi8((uint64_t{1} << (blocks * kBytes)) - 1, row + g * 4 * kBytes);
    group(g, first, _mm512_setzero_si512(), acc);
  };
  // Even groups into acc0, odd ones into acc1, each call naming its accumulator: chosen through a
  // pointer at run time, the accumulators lived in memory (a store and a reload a group).
  const int64_t full = nb / 4, rest = nb - 4 * full;
  int64_t g = 0;
  for (; g + 2 <= full; g += 2) {
    whole(g, acc0);
    whole(g + 1, acc1);
  }
  if (g < full) {
    whole(g++, acc0);
    if (rest > 0) partial(g, rest, acc1);
  } else if (rest > 0) {
    partial(g, rest, acc0);
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t]));
}

// A row of q4_K, four sub-blocks at a time, as RowQuadsQ4_0 reads q4_0: the activations in the
// same layout, each sub-block summed in four lanes by two chained vpdpbusd. A super-block's 128
// code bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high) in bytes 32i .. 32i + 31, so one
// 64-byte load has four sub-blocks, and a 128-bit lane shuffle puts bytes 0-15 and 32-47 (then
// 16-31 and 48-63) each twice in a register, whose mask keeps the low nibbles in the first copy and
// the high ones, 16 times too large (exact in the integer sum), in the second.
template <int kT>
CACHET_INT8_INLINE void RowQuadsQ4K(const uint8_t* row, int64_t nb, const DecodeActs* a,
                                    __m512* acc0, __m512* acc1, float* v) {
  constexpr DType kType = DType::kQ4_K;
  const __m512i nibbles =
      _mm512_set_epi64(int64_t(0xF0F0F0F0F0F0F0F0ull), int64_t(0xF0F0F0F0F0F0F0F0ull),
                       0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F, int64_t(0xF0F0F0F0F0F0F0F0ull),
                       int64_t(0xF0F0F0F0F0F0F0F0ull), 0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F);
  const __m512i spread0 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread1 = _mm512_add_epi32(spread0, _mm512_set1_epi32(4));
  __m256 corr[kT];
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) corr[t] = _mm256_setzero_ps();
  auto group = [&](const uint8_t* qs, int64_t g, const __m512* dw, __m512i spread,
                   __m512* acc) CACHET_INT8_TARGET {
    _mm_prefetch(reinterpret_cast<const char*>(qs + kPrefetchBytes), _MM_HINT_T0);
    const __m512i c = _mm512_loadu_si512(qs);
    const __m512i lo = _mm512_and_si512(_mm512_shuffle_i64x2(c, c, 0xA0), nibbles);  // 0 0 2 2
    const __m512i hi = _mm512_and_si512(_mm512_shuffle_i64x2(c, c, 0xF5), nibbles);  // 1 1 3 3
#pragma GCC unroll 8
    for (int t = 0; t < kT; ++t) {
      const int8_t* x = a[t].q + g * 128;
      __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(x));
      z = _mm512_dpbusd_epi32(z, hi, _mm512_load_si512(x + 64));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_permutexvar_ps(spread, dw[t]), acc[t]);
    }
  };
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* blk = row + sb * DTypeBlockBytes(kType);
    __m512 dw[kT];
    SuperBlockScales<kType, kT>(blk, sb, a, corr, dw);
    group(blk + 16, 2 * sb, dw, spread0, acc0);
    group(blk + 80, 2 * sb + 1, dw, spread1, acc1);
  }
#pragma GCC unroll 8
  for (int t = 0; t < kT; ++t) {
    v[t] = HorizontalSum(_mm512_add_ps(acc0[t], acc1[t])) - HorizontalSum(corr[t]);
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
    if constexpr (kType == DType::kQ4_K) {
      RowQuadsQ4K<kT>(row, nb, a, acc0, acc1, v);
    } else if constexpr (kScaleMinK<kType>) {
      RowScaleMinK<kType, kT>(row, nb, a, acc0, acc1, v);
    } else if constexpr (kType == DType::kQ6_K) {
      RowQ6K<kT>(row, nb, a, acc0, acc1, v);
    } else if constexpr (HasHalfScales(kType) || kType == DType::kIQ4_XS) {
      RowHalfScales<kType, kT>(row, nb, a, acc0, acc1, v);
    } else if constexpr (kType == DType::kQ4_0) {
      RowQuadsQ4_0<kT>(row, nb, a, acc0, acc1, v);
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
  return RoundUp(cols, 128) / 4 + 48 * pairs + 4 * RoundUp(nb, 16);
}

// The activations of RowQuadsQ4_0 and RowQuadsQ4K, per group g of four blocks: 128 code bytes at
// q + 128 g, codes 0-15 of each block then codes 16-31 of each, rearranged in place (a group's
// codes take the same 128 bytes either way; blocks past nb are zero). For q4_0 also, in the sixteen
// lanes at dx4 + 16 g and off4 + 16 g, each block's scale in its four lanes and its integer sum's
// start, -8 x the sum of its codes, in the first of them (q4_K reads d and s instead).
template <DType kType>
CACHET_INT8_TARGET DecodeActs PrepareQuadActs(int8_t* q, const float* d, int64_t cols, float* dx4,
                                              int32_t* off4, const float* s) {
  const int64_t nb = cols / kQ8Block, groups = CeilDiv(nb, 4);
  std::fill(q + cols, q + groups * 128, int8_t{0});
  for (int64_t g = 0; g < groups; ++g) {
    int8_t* c = q + g * 128;
    int8_t natural[128];
    std::memcpy(natural, c, sizeof(natural));
    for (int k = 0; k < 4; ++k) {
      std::memcpy(c + 16 * k, natural + 32 * k, 16);
      std::memcpy(c + 64 + 16 * k, natural + 32 * k + 16, 16);
      if constexpr (kType == DType::kQ4_0) {
        const int64_t b = 4 * g + k;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) sum += natural[32 * k + j];
        std::fill(dx4 + g * 16 + 4 * k, dx4 + g * 16 + 4 * k + 4, b < nb ? d[b] : 0.0f);
        std::fill(off4 + g * 16 + 4 * k, off4 + g * 16 + 4 * k + 4, 0);
        off4[g * 16 + 4 * k] = -Int8Offset(kType) * sum;
      }
    }
  }
  return DecodeActs{q, dx4, off4, nullptr, d, s, nullptr};
}

// Lays out one token's activations for DecodeRows in buf (DecodeActsFloats(cols), 64-byte aligned).
template <DType kType>
CACHET_INT8_TARGET DecodeActs PrepareDecodeActs(const float* x, int64_t cols, float* buf) {
  const int64_t nb = cols / kQ8Block, pairs = CeilDiv(nb, 2);
  const int64_t code_floats = RoundUp(cols, 128) / 4;  // PrepareQuadActs: whole groups of 4 blocks
  int8_t* q = reinterpret_cast<int8_t*>(buf);
  float* dx2 = buf + code_floats;
  int32_t* off2 = reinterpret_cast<int32_t*>(dx2 + 16 * pairs);
  float* s2 = reinterpret_cast<float*>(off2 + 16 * pairs);
  float* d = s2 + 16 * pairs;
  float* s = d + RoundUp(nb, 16);
  float* s16 = s + RoundUp(nb, 16);
  QuantizeQ8(x, cols, q, d, s);
  if constexpr (kType == DType::kQ4_0 || kType == DType::kQ4_K) {
    return PrepareQuadActs<kType>(q, d, cols, dx2, off2, s);
  }
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
  const bool parallel = w.rows * w.cols >= kInt8MinParallelWeights;
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

// Decode's matrix-vector rows while weights dominate (a batch of decoding sequences), prefill's
// token lanes beyond (quant_int8_prefill.cc).
void Int8MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool) {
  if (n <= 0 || w.rows <= 0) return;
  if (n > kInt8MaxDecodeTokens) return Int8Prefill(x, n, w, bias, y, y_stride, pool);
  VisitQuantized(
      w.dtype, [&](auto t) { Decode<decltype(t)::value>(x, n, w, bias, y, y_stride, pool); },
      [&] { ref::MatMul(x, n, w, bias, y, y_stride, pool); });
}

}  // namespace cachet::kernels::cpu
