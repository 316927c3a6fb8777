// q4_0 rows of 64 values (two blocks, 36 bytes a row), as the int8 attention kernels read them:
// four rows (a group, 144 bytes) fit in the 128 bytes of two registers a two-source permute picks
// from, so 16 rows' block scales take four permutes (where a 16-lane gather kept the key scores
// waiting on its 16 loads, 40% of their time), and a group's codes of one block a permute and an
// in-lane byte shuffle.
#pragma once

#include <cstdint>

#include "kernels/cpu/int8_target.h"

namespace cachet::kernels::cpu {

inline constexpr int kQ4Row64Bytes = 36;
inline constexpr int kQ4Group64Bytes = 4 * kQ4Row64Bytes;

// The permutes' indices, built once (Q4Rows64Tables()).
struct Q4Rows64 {
  __m512i scales;  // words: lane 16 b + 4 g + j takes row j's block-b scale (any group g)
  __m512i codes0;  // words of block 0's codes from (group, group + 64): dword 4 d + j = row j's d
  __m512i codes1;  // dwords of block 1's codes from (group + 16, group + 80), the same order
  __m512i bytes;   // in each 128-bit lane, dword m gets byte m of the lane's four dwords
  __m512i rows0;   // block 0's codes row by row: 128-bit lane j = row j's 16 code bytes
  __m512i rows1;   // block 1's, the same
};

CACHET_INT8_TARGET inline Q4Rows64 MakeQ4Rows64() {
  alignas(64) uint16_t sc[32], c0[32], r0[32];
  alignas(64) int32_t c1[16], r1[16];
  for (int i = 0; i < 32; ++i) sc[i] = static_cast<uint16_t>(18 * (i % 4) + 9 * (i / 16));
  for (int d = 0; d < 4; ++d) {
    for (int j = 0; j < 4; ++j) {
      // Row j's block-0 codes start at byte 36 j + 2 (word 18 j + 1); block 1's at 36 j + 20,
      // dword 9 j + 1 past group + 16.
      for (int e = 0; e < 2; ++e) {
        c0[2 * (4 * d + j) + e] = static_cast<uint16_t>(18 * j + 1 + 2 * d + e);
        r0[2 * (4 * j + d) + e] = c0[2 * (4 * d + j) + e];
      }
      c1[4 * d + j] = r1[4 * j + d] = 9 * j + 1 + d;
    }
  }
  Q4Rows64 t;
  t.scales = _mm512_load_si512(sc);
  t.codes0 = _mm512_load_si512(c0);
  t.codes1 = _mm512_load_si512(c1);
  t.rows0 = _mm512_load_si512(r0);
  t.rows1 = _mm512_load_si512(r1);
  t.bytes =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return t;
}

CACHET_INT8_TARGET inline const Q4Rows64& Q4Rows64Tables() {
  static const Q4Rows64 t = MakeQ4Rows64();
  return t;
}

// The first bytes of 64 set (all of them from 64 on).
inline __mmask64 FirstBytes(int n) {
  return n >= 64 ? ~__mmask64{0} : n <= 0 ? 0 : (__mmask64{1} << n) - 1;
}

// The block scales of n <= 16 rows as f32: lane j of d0 and d1 is row j's block-0 and block-1
// scale, zero for j >= n. Reads nothing past row n.
CACHET_INT8_TARGET inline void Q4Scales64(const uint8_t* rows, int n, const Q4Rows64& t, __m512* d0,
                                          __m512* d1) {
  __m512i s = _mm512_setzero_si512();  // word 16 b + j: row j's block-b scale
  for (int g = 0; 4 * g < n; ++g) {
    const uint8_t* base = rows + g * kQ4Group64Bytes;
    const int bytes = (n - 4 * g) * kQ4Row64Bytes;
    __m512i lo, hi;
    if (bytes >= 128) {
      lo = _mm512_loadu_si512(base);
      hi = _mm512_loadu_si512(base + 64);
    } else {  // a group of fewer than four rows: masked loads, zeros past its last
      lo = _mm512_maskz_loadu_epi8(FirstBytes(bytes), base);
      hi = _mm512_maskz_loadu_epi8(FirstBytes(bytes - 64), base + 64);
    }
    s = _mm512_mask_blend_epi16(static_cast<__mmask32>(0x000F000Fu << (4 * g)), s,
                                _mm512_permutex2var_epi16(lo, t.scales, hi));
  }
  *d0 = _mm512_cvtph_ps(_mm512_castsi512_si256(s));
  *d1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(s, 1));
}

// A group's first n (1..4) rows as the permutes take them: l[0], l[1] from the group's start,
// l[2], l[3] 16 bytes on (where block 1's codes of all four rows fit), zeros past row n. Reads
// nothing past row n.
CACHET_INT8_TARGET inline void Q4GroupLoads64(const uint8_t* group, int n, __m512i* l) {
  for (int i = 0; i < 4; ++i) {
    const int at = (i % 2) * 64 + (i / 2) * 16;
    l[i] = n == 4 ? _mm512_loadu_si512(group + at)
                  : _mm512_maskz_loadu_epi8(FirstBytes(n * kQ4Row64Bytes - at), group + at);
  }
}

// The raw code bytes of blocks 0 and 1 of a group's first n rows, transposed: dword i holds byte
// i of the block (codes i and 16 + i in its nibbles) of rows 0..3 in its bytes 0..3, zero for
// rows past n.
CACHET_INT8_TARGET inline void Q4GroupCodes64(const uint8_t* group, int n, const Q4Rows64& t,
                                              __m512i* b0, __m512i* b1) {
  __m512i l[4];
  Q4GroupLoads64(group, n, l);
  *b0 = _mm512_shuffle_epi8(_mm512_permutex2var_epi16(l[0], t.codes0, l[1]), t.bytes);
  *b1 = _mm512_shuffle_epi8(_mm512_permutex2var_epi32(l[2], t.codes1, l[3]), t.bytes);
}

// The same rows' raw code bytes row by row: 128-bit lane j holds row j's 16 bytes of the block.
CACHET_INT8_TARGET inline void Q4GroupRows64(const uint8_t* group, int n, const Q4Rows64& t,
                                             __m512i* b0, __m512i* b1) {
  __m512i l[4];
  Q4GroupLoads64(group, n, l);
  *b0 = _mm512_permutex2var_epi16(l[0], t.rows0, l[1]);
  *b1 = _mm512_permutex2var_epi32(l[2], t.rows1, l[3]);
}

}  // namespace cachet::kernels::cpu
