// Dword transposes of AVX-512 registers, shared by the int8 kernels that put 16 rows' codes in the
// lanes of one register (block keys in kernels/cpu/attention_int8.cc, weight rows in prefill in
// kernels/cpu/quant_int8.cc).
#pragma once

#include "kernels/cpu/int8_target.h"

namespace cachet::kernels::cpu {

// The first two stages of a dword transpose, within each 128-bit lane, of n (8 or 16) rows:
// b[4 i + k], 128-bit lane L, holds element 4 L + k of rows 4 i .. 4 i + 3.
CACHET_INT8_TARGET inline void TransposeLanes4(const __m512i* r, int n, __m512i* b) {
  __m512i a[16];
  for (int i = 0; i < n / 2; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < n / 4; ++i) {
    b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
}

// A 16 x 16 dword transpose: r[i] = dword row i -> r[j] = dword j of rows 0..15.
CACHET_INT8_TARGET inline void Transpose16(__m512i* r) {
  __m512i b[16];
  TransposeLanes4(r, 16, b);
  for (int k = 0; k < 4; ++k) {
    const __m512i s0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88);
    const __m512i s1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xDD);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[4 + k] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// An 8 x 8 dword transpose in each 256-bit half: z[i] holds 8 dwords of row i (low half) and of row
// i + 8 (high half); t[k] gets dword k of rows 0..15 in lane = row.
CACHET_INT8_TARGET inline void Transpose8x8Halves(const __m512i* z, __m512i* t) {
  __m512i b[8];
  TransposeLanes4(z, 8, b);
  const __m512i lo_lanes = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i hi_lanes = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_permutex2var_epi64(b[k], lo_lanes, b[4 + k]);
    t[4 + k] = _mm512_permutex2var_epi64(b[k], hi_lanes, b[4 + k]);
  }
}

}  // namespace cachet::kernels::cpu
