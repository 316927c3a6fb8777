// The int8 path's prefill (kernels/cpu/quant_int8.cc has decode and the overview). Prefill is
// compute bound, and scaling every block of every (row, token) pair costs float ops beside the
// products. So its lanes are 16 weight rows: a task unpacks a tile of 16 rows once (dword k of
// block b of every row in register k), each token's four codes at a place are broadcast from
// memory, and eight vpdpbusd sum a whole block for 16 rows before one scale. 16 tokens' sums stay
// in registers while the tile's blocks pass.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/int8_blocks.h"
#include "kernels/cpu/int8_target.h"
#include "kernels/cpu/int8_transpose.h"
#include "kernels/cpu/quant_int8.h"
#include "kernels/cpu/scratch.h"
#include "kernels/cpu/tasks.h"
#include "kernels/int8_dot.h"
#include "kernels/kernels.h"

namespace cachet::kernels::cpu {
namespace {

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
  RunTasks(pool, n_pad / kTileTokens, n * cols >= kInt8MinParallelWeights, [&](int64_t g) {
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
  const bool parallel = w.rows * cols * n >= kInt8MinParallelWeights;
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

}  // namespace

void Int8Prefill(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                 int64_t y_stride, ThreadPool& pool) {
  VisitQuantized(
      w.dtype, [&](auto t) { Prefill<decltype(t)::value>(x, n, w, bias, y, y_stride, pool); },
      [&] { ref::MatMul(x, n, w, bias, y, y_stride, pool); });
}

}  // namespace cachet::kernels::cpu
