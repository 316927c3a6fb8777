// Scores of block-quantized keys (q4_0 / q8_0 pages, kernels/block_keys.h) on AVX-512 VNNI.
//
// Lanes are keys: a page's keys go 16 at a time, two blocks at a time. Each key's two blocks of
// codes are unpacked to 64 unsigned bytes in one register (16 dwords of four consecutive codes of
// one block), the 16 keys' registers are transposed (dword j of every key in register j), and
// then per query row vpdpbusd adds four codes of all 16 keys times the row's four codes at that
// place, broadcast: eight instructions sum a block for 16 keys, and the float steps of
// BlockKeyScore run once per block for 16 keys, with no horizontal sums. The unpacking and the
// transpose are paid once per page for every row of a tile, so one kernel serves a decode step
// (one row per KV head in MHA) and a prefill tile (up to 32 rows) alike. q4_0 keys of 64-wide
// heads take ScoresQ4Rows64 instead: their rows are short enough for a cheaper unpacking.
//
// Intrinsics with a target attribute for the reasons kernels/cpu/quant_int8.cc gives; CPUs
// without VNNI take the reference, which computes the same integers and float steps.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/block_keys.h"
#include "kernels/cpu/int8_target.h"
#include "kernels/cpu/int8_transpose.h"
#include "kernels/cpu/q4_rows64.h"
#include "kernels/kernels.h"

namespace cachet::kernels::cpu {
namespace {

// Where dword j of a unpacked block pair (or a lone last block, j < 8) comes from: block first +
// BlockOf(j) of the key, codes [At(j), At(j) + 4) of that block. q4_0: low nibbles of both blocks'
// 16 bytes, then their high nibbles; q8_0: the two blocks' 32 codes one after the other.
template <DType kType>
constexpr int BlockOf(int j, bool pair) {
  if (!pair) return 0;
  return kType == DType::kQ4_0 ? (j / 4) % 2 : j / 8;
}
template <DType kType>
constexpr int At(int j, bool pair) {
  if (kType == DType::kQ4_0) return pair ? (j / 8) * 16 + 4 * (j % 4) : (j / 4) * 16 + 4 * (j % 4);
  return 4 * (j % 8);
}

// Blocks b and b + 1 (pair) or b alone of one key row as 64 (32) unsigned codes.
template <DType kType>
CACHET_INT8_TARGET inline __m512i UnpackBlocks(const uint8_t* blk, bool pair) {
  constexpr int kBytes = kType == DType::kQ4_0 ? 18 : 34;
  if constexpr (kType == DType::kQ4_0) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m128i lo_blk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    if (!pair) {
      const __m128i m = _mm_set1_epi8(0x0F);
      const __m256i codes =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(lo_blk, 4), m), _mm_and_si128(lo_blk, m));
      return _mm512_castsi256_si512(codes);
    }
    const __m128i hi_blk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + 2));
    const __m256i both = _mm256_set_m128i(hi_blk, lo_blk);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(both, mask)),
                              _mm256_and_si256(_mm256_srli_epi16(both, 4), mask), 1);
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i a =
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), flip);
    if (!pair) return _mm512_castsi256_si512(a);
    const __m256i b = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kBytes + 2)), flip);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
}

// A pair of q4_0 blocks (b, b + 1) of 16 keys, straight into the transposed form Transpose16
// gives UnpackBlocks' registers (t[j]: dword j of keys 0..15): the raw code bytes are transposed
// first (8 dwords a key, keys t and t + 8 sharing a register) and the nibbles split after, half
// the work of unpacking each key then transposing 16 dwords.
CACHET_INT8_TARGET inline __m256i PairCodesQ4(const uint8_t* k0, int64_t row_bytes, int n, int i) {
  if (i >= n) return _mm256_setzero_si256();
  const uint8_t* blk = k0 + i * row_bytes + 2;
  return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk + 18),
                             reinterpret_cast<const __m128i*>(blk));
}

CACHET_INT8_TARGET inline void UnpackPairQ4T(const uint8_t* k0, int64_t row_bytes, int n,
                                             __m512i* t) {
  __m512i z[8], w[8];
  for (int i = 0; i < 8; ++i) {
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(PairCodesQ4(k0, row_bytes, n, i)),
                              PairCodesQ4(k0, row_bytes, n, i + 8), 1);
  }
  Transpose8x8Halves(z, w);  // w[d]: raw dword d of key i + 8 h at lane i + 8 h
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_and_si512(w[k], mask);
    t[8 + k] = _mm512_and_si512(_mm512_srli_epi16(w[k], 4), mask);
    t[4 + k] = _mm512_and_si512(w[4 + k], mask);
    t[12 + k] = _mm512_and_si512(_mm512_srli_epi16(w[4 + k], 4), mask);
  }
}

// The f16 scales of block blk of 16 keys (rows row_bytes apart; masked lanes read nothing).
CACHET_INT8_TARGET inline __m512 GatherScales(const uint8_t* keys, __m512i offsets, __mmask16 m,
                                              int blk_offset) {
  const __m512i raw =
      _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, offsets, keys + blk_offset, 1);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
}

inline int32_t Load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int kRowsPerPass = 32;  // rows whose running scores stay in a stack buffer

// A query row's integer dot products with 16 q4_0 keys' block b0 (i0) and b0 + 1 (i1, kPair),
// offsets included, unrolled with two sums a block: one chain of eight vpdpbusd a block waited on
// their latency (an MHA decode step's q4_0 scoring 1.15x slower; integer sums, so the split changes
// no bit). q8_0 keys keep the loop: unrolled, their decode step was 4% slower (kernels_bench).
template <bool kPair>
CACHET_INT8_TARGET inline void DotsQ4(const __m512i* t, const QueryQ8& q, int b0, __m512i* i0,
                                      __m512i* i1) {
  constexpr DType kType = DType::kQ4_0;
  constexpr int kSums = 2;
  __m512i s[2][kSums];
  for (int c = 0; c < kSums; ++c) s[0][c] = s[1][c] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int j = 0; j < (kPair ? 16 : 8); ++j) {
    const int blk = BlockOf<kType>(j, kPair);
    const __m512i qq = _mm512_set1_epi32(Load4(q.q + (b0 + blk) * 32 + At<kType>(j, kPair)));
    s[blk][j % kSums] = _mm512_dpbusd_epi32(s[blk][j % kSums], t[j], qq);
  }
  for (int blk = 0; blk < (kPair ? 2 : 1); ++blk) {
    (blk == 0 ? *i0 : *i1) = _mm512_add_epi32(_mm512_add_epi32(s[blk][0], s[blk][1]),
                                              _mm512_set1_epi32(-8 * q.sum[b0 + blk]));
  }
}

// Per 128-bit lane j, the sums of the four dwords of a[g] (g = 0..3), at dword 4 j + g.
CACHET_INT8_TARGET inline __m512i LaneSums4(const __m512i* a) {
  const __m512i s01 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i s23 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// q4_0 keys of 64 (36-byte rows, kernels/cpu/q4_rows64.h), 16 at a time: each group of four
// keys' codes of a block come row by row in one register by one permute (128-bit lane j = key j),
// so vpdpbusd against the query block's 16 codes repeated in every lane gives each key four
// partial sums (dword m: codes 4 m .. 4 m + 3 of the low nibbles, and of the high ones against
// the next 16 query codes), which LaneSums4 adds up for the four groups at once. The unpacking is
// a third of the transposing ScoresVnni does; the integer sums, and so the scores, are the same.
CACHET_INT8_TARGET void ScoresQ4Rows64(const uint8_t* keys, int cnt, const QueryQ8* rows,
                                       int n_rows, float scale, float* scores, int s_stride) {
  const Q4Rows64& t = Q4Rows64Tables();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  // LaneSums4 leaves key 4 g + j at dword 4 j + g; this puts it back at 4 g + j.
  const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int j0 = 0; j0 < cnt; j0 += 16) {
    const int n = std::min(16, cnt - j0);
    const uint8_t* k0 = keys + int64_t{j0} * kQ4Row64Bytes;
    __m512 dk0, dk1;
    Q4Scales64(k0, n, t, &dk0, &dk1);
    __m512i c[4][4];  // group g: block 0's low and high nibbles, block 1's
    for (int g = 0; g < 4; ++g) {
      if (4 * g >= n) {
        for (int i = 0; i < 4; ++i) c[g][i] = _mm512_setzero_si512();
        continue;
      }
      __m512i raw[2];
      Q4GroupRows64(k0 + g * kQ4Group64Bytes, std::min(4, n - 4 * g), t, &raw[0], &raw[1]);
      for (int b = 0; b < 2; ++b) {
        c[g][2 * b] = _mm512_and_si512(raw[b], nib);
        c[g][2 * b + 1] = _mm512_and_si512(_mm512_srli_epi16(raw[b], 4), nib);
      }
    }
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    for (int r = 0; r < n_rows; ++r) {
      const QueryQ8& q = rows[r];
      __m512i ints[2];
      for (int b = 0; b < 2; ++b) {
        const __m512i q_lo =
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.q + 32 * b)));
        const __m512i q_hi = _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q.q + 32 * b + 16)));
        __m512i a[4];
        for (int g = 0; g < 4; ++g) {
          a[g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c[g][2 * b], q_lo),
                                     c[g][2 * b + 1], q_hi);
        }
        ints[b] = _mm512_sub_epi32(_mm512_permutexvar_epi32(key_order, LaneSums4(a)),
                                   _mm512_set1_epi32(8 * q.sum[b]));
      }
      // BlockKeyScore's steps, lane-wise.
      const __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(ints[0]), _mm512_set1_ps(q.d[0]));
      const __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(ints[1]), _mm512_set1_ps(q.d[1]));
      const __m512 a = _mm512_fmadd_ps(t1, dk1, _mm512_mul_ps(t0, dk0));
      _mm512_mask_storeu_ps(scores + int64_t{r} * s_stride + j0, m, _mm512_mul_ps(a, vscale));
    }
  }
}

template <DType kType>
CACHET_INT8_TARGET void ScoresVnni(const uint8_t* keys, int cnt, int hd, const QueryQ8* rows,
                                   int n_rows, float scale, float* scores, int s_stride) {
  constexpr int kBytes = kType == DType::kQ4_0 ? 18 : 34;
  constexpr int32_t kOff = kType == DType::kQ4_0 ? 8 : 128;
  const int nb = hd / 32;
  const int64_t row_bytes = DTypeRowBytes(kType, hd);
  const __m512i offsets =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  alignas(64) float acc[kRowsPerPass][16];
  for (int j0 = 0; j0 < cnt; j0 += 16) {
    const int n = std::min(16, cnt - j0);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    const uint8_t* k0 = keys + j0 * row_bytes;
    for (int r0 = 0; r0 < n_rows; r0 += kRowsPerPass) {
      const int nr = std::min(kRowsPerPass, n_rows - r0);
      for (int b0 = 0; b0 < nb; b0 += 2) {
        const bool pair = b0 + 1 < nb;
        // Issued before the unpacking, which hides their latency.
        const __m512 dk0 = GatherScales(k0, offsets, m, b0 * kBytes);
        const __m512 dk1 = pair ? GatherScales(k0, offsets, m, (b0 + 1) * kBytes) : dk0;
        __m512i t[16];
        if (kType == DType::kQ4_0 && pair) {
          UnpackPairQ4T(k0 + b0 * kBytes, row_bytes, n, t);
        } else {
          for (int i = 0; i < 16; ++i) {
            t[i] = i < n ? UnpackBlocks<kType>(k0 + i * row_bytes + b0 * kBytes, pair)
                         : _mm512_setzero_si512();
          }
          Transpose16(t);
        }
        const int n_dw = pair ? 16 : 8;
        for (int r = 0; r < nr; ++r) {
          const QueryQ8& q = rows[r0 + r];
          __m512i i0, i1;
          if constexpr (kType == DType::kQ4_0) {
            if (pair) {
              DotsQ4<true>(t, q, b0, &i0, &i1);
            } else {
              DotsQ4<false>(t, q, b0, &i0, &i1);
              i1 = i0;
            }
          } else {
            i0 = _mm512_set1_epi32(-kOff * q.sum[b0]);
            i1 = pair ? _mm512_set1_epi32(-kOff * q.sum[b0 + 1]) : i0;
            for (int j = 0; j < n_dw; ++j) {
              const int blk = b0 + BlockOf<kType>(j, pair);
              const __m512i qq = _mm512_set1_epi32(Load4(q.q + blk * 32 + At<kType>(j, pair)));
              if (BlockOf<kType>(j, pair) == 0) {
                i0 = _mm512_dpbusd_epi32(i0, t[j], qq);
              } else {
                i1 = _mm512_dpbusd_epi32(i1, t[j], qq);
              }
            }
          }
          // BlockKeyScore's steps, lane-wise.
          const __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(q.d[b0]));
          __m512 a =
              b0 == 0 ? _mm512_mul_ps(t0, dk0) : _mm512_fmadd_ps(t0, dk0, _mm512_load_ps(acc[r]));
          if (pair) {
            const __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(q.d[b0 + 1]));
            a = _mm512_fmadd_ps(t1, dk1, a);
          }
          _mm512_store_ps(acc[r], a);
        }
      }
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int r = 0; r < nr; ++r) {
        _mm512_mask_storeu_ps(scores + int64_t{r0 + r} * s_stride + j0, m,
                              _mm512_mul_ps(_mm512_load_ps(acc[r]), vscale));
      }
    }
  }
}

}  // namespace

bool HasInt8Kernels();

void QuantizeQuery(const float* q, int head_dim, int8_t* codes, float* d, int32_t* sum) {
  if (!HasInt8Kernels()) return ref::QuantizeQuery(q, head_dim, codes, d, sum);
  float s[64];  // block sums as floats, unused: the integer sums follow
  for (int b0 = 0; b0 < head_dim / 32; b0 += 64) {
    const int nb = std::min(64, head_dim / 32 - b0);
    QuantizeQ8(q + b0 * 32, nb * 32, codes + b0 * 32, d + b0, s);
  }
  for (int b = 0; b < head_dim / 32; ++b) {
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) total += codes[b * 32 + i];
    sum[b] = total;
  }
}

void BlockKeyScores(const uint8_t* keys, DType type, int cnt, int head_dim, const QueryQ8* rows,
                    int n_rows, float scale, float* scores, int s_stride) {
  if (!HasInt8Kernels()) {
    return ref::BlockKeyScores(keys, type, cnt, head_dim, rows, n_rows, scale, scores, s_stride);
  }
  if (type == DType::kQ4_0 && head_dim == 64) {
    ScoresQ4Rows64(keys, cnt, rows, n_rows, scale, scores, s_stride);
  } else if (type == DType::kQ4_0) {
    ScoresVnni<DType::kQ4_0>(keys, cnt, head_dim, rows, n_rows, scale, scores, s_stride);
  } else {
    ScoresVnni<DType::kQ8_0>(keys, cnt, head_dim, rows, n_rows, scale, scores, s_stride);
  }
}

}  // namespace cachet::kernels::cpu
