// Weighted sums of q4_0 value rows (acc += sum_j p_j v_j) on AVX-512 VNNI, for heads of 64.
//
// A value is s_jb * (c - 8): per key j and block b an f16 scale and 4-bit codes c. The float path
// (kernels/cpu/attention_page-inl.h) broadcasts each key's weight p_j * s_jb and widens its codes
// to floats, about 24 instructions a key. Here the weights of a page's keys are rounded to 8 bits,
// per 16 keys and block against their largest magnitude W: q_j = round(127 * w_j / W). Then lanes
// are dimensions and each dword holds four keys' codes of that dimension, so one vpdpbusd adds four
// keys times their weights for 16 dimensions:
//   acc_d += W / 127 * (sum_j q_j c_jd - 8 * sum_j q_j)
// The integer sums are exact; a weight is off by at most W / 254, which adds (in quadrature) a few
// percent to the error q4_0's own rounding of the values makes (docs/BENCHMARKS.md measures it).
// Every key's weight is rounded, masked ones (weight 0) included, and a group past a page's last
// key reads zeros: the same visible keys give the same sums whatever the page's count (a prompt
// evaluated alone and then continued equals it evaluated with its continuation).
//
// Rows of two blocks are read group by group as kernels/cpu/q4_rows64.h says. Wider heads keep the
// float path: four of their rows span more than a permute's 128 bytes.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/int8_target.h"
#include "kernels/cpu/q4_rows64.h"
#include "kernels/kernels.h"

namespace cachet::kernels::cpu {
namespace {

constexpr int kDim = 64;
constexpr int kMaxRows = 4;  // tile rows sharing one transposed group: 4 x 4 sums + 4 codes

// One tile row's 8-bit weights of up to 16 keys, per block: q (a group's four in one dword, zero
// past the last key), their sum and W / 127.
struct RowWeights {
  alignas(16) int8_t q[2][16];
  int32_t sum[2];
  float step[2];
};

CACHET_INT8_TARGET inline void RoundWeights(const float* p, __mmask16 live, __m512 s0, __m512 s1,
                                            RowWeights* out) {
  const __m512 pv = _mm512_maskz_loadu_ps(live, p);
  __m128i q8[2];
  for (int b = 0; b < 2; ++b) {
    const __m512 w = _mm512_mul_ps(pv, b == 0 ? s0 : s1);
    const float top = _mm512_reduce_max_ps(_mm512_abs_ps(w));
    // 127 / top to 14 bits: a weight rounds to at most 127.01, whose nearest integer is 127.
    // Blocks whose weights are all under 1e-30 (next to a running maximum's 1) count as empty:
    // 127 / top stays finite.
    const __m128 inv = _mm_maskz_rcp14_ss(top > 1e-30f ? 1 : 0, _mm_setzero_ps(), _mm_set_ss(top));
    const __m512i q =
        _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(127.0f * _mm_cvtss_f32(inv))));
    q8[b] = _mm512_cvtepi32_epi8(q);
    _mm_store_si128(reinterpret_cast<__m128i*>(out->q[b]), q8[b]);
    out->step[b] = top / 127.0f;
  }
  // The weights' sums: biased to unsigned bytes, summed by vpsadbw in halves of eight.
  const __m256i both =
      _mm256_xor_si256(_mm256_set_m128i(q8[1], q8[0]), _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i halves = _mm256_sad_epu8(both, _mm256_setzero_si256());
  const __m256i sums = _mm256_add_epi64(halves, _mm256_shuffle_epi32(halves, 0x4E));
  out->sum[0] = _mm256_extract_epi32(sums, 0) - 16 * 128;
  out->sum[1] = _mm256_extract_epi32(sums, 4) - 16 * 128;
}

// acc[r] += the rows' weights times n rows' values, group by group.
template <int kRows>
CACHET_INT8_TARGET void GroupSums(const uint8_t* rows, int n, const RowWeights* w,
                                  const Q4Rows64& t, float* const* acc) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i sums[kRows][4];
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < 4; ++i) sums[r][i] = _mm512_setzero_si512();
  }
  for (int g = 0; 4 * g < n; ++g) {
    __m512i raw[2];
    Q4GroupCodes64(rows + g * kQ4Group64Bytes, std::min(4, n - 4 * g), t, &raw[0], &raw[1]);
    __m512i codes[4];  // dims 0-15, 16-31 (block 0's low and high nibbles), 32-47, 48-63
    for (int b = 0; b < 2; ++b) {
      codes[2 * b] = _mm512_and_si512(raw[b], nib);
      codes[2 * b + 1] = _mm512_and_si512(_mm512_srli_epi16(raw[b], 4), nib);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      for (int b = 0; b < 2; ++b) {
        int32_t four;
        std::memcpy(&four, w[r].q[b] + 4 * g, 4);
        const __m512i q = _mm512_set1_epi32(four);
        sums[r][2 * b] = _mm512_dpbusd_epi32(sums[r][2 * b], codes[2 * b], q);
        sums[r][2 * b + 1] = _mm512_dpbusd_epi32(sums[r][2 * b + 1], codes[2 * b + 1], q);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < 4; ++i) {
      const int b = i / 2;
      const __m512i exact = _mm512_sub_epi32(sums[r][i], _mm512_set1_epi32(8 * w[r].sum[b]));
      float* a = acc[r] + 16 * i;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(w[r].step[b]),
                                          _mm512_loadu_ps(a)));
    }
  }
}

CACHET_INT8_TARGET void Sums64(const uint8_t* v, int cnt, int rows, const float* p, int p_stride,
                               float* acc) {
  const Q4Rows64& t = Q4Rows64Tables();
  for (int j0 = 0; j0 < cnt; j0 += 16) {
    const int n = std::min(16, cnt - j0);
    const uint8_t* page = v + int64_t{j0} * kQ4Row64Bytes;
    __m512 s0, s1;
    Q4Scales64(page, n, t, &s0, &s1);
    const auto live = static_cast<__mmask16>((1u << n) - 1);
    for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int nr = std::min(kMaxRows, rows - r0);
      RowWeights w[kMaxRows];
      float* a[kMaxRows];
      for (int r = 0; r < nr; ++r) {
        RoundWeights(p + int64_t{r0 + r} * p_stride + j0, live, s0, s1, &w[r]);
        a[r] = acc + int64_t{r0 + r} * kDim;
      }
      switch (nr) {
        case 1:
          GroupSums<1>(page, n, w, t, a);
          break;
        case 2:
          GroupSums<2>(page, n, w, t, a);
          break;
        case 3:
          GroupSums<3>(page, n, w, t, a);
          break;
        default:
          GroupSums<4>(page, n, w, t, a);
          break;
      }
    }
  }
}

}  // namespace

bool Q4ValueSums(const uint8_t* v, int cnt, int head_dim, int rows, const float* p, int p_stride,
                 float* acc) {
  if (head_dim != kDim || !HasInt8Kernels()) return false;
  Sums64(v, cnt, rows, p, p_stride, acc);
  return true;
}

}  // namespace cachet::kernels::cpu
