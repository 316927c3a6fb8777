// The weight blocks of the int8 kernels (kernels/cpu/quant_int8.cc) as AVX-512 registers: each
// type's 32 unsigned codes of a block (Codes), of two blocks (CodePair), and its scales and offsets
// (RowScales, ScalePair, and the super-block headers of q4_K / q5_K, q6_K and iq4_xs), as
// kernels/int8_dot.h defines them. Included by quant_int8.cc and quant_int8_prefill.cc only.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/cpu/int8_target.h"
#include "kernels/int8_dot.h"

namespace cachet::kernels::cpu {

// 32-value blocks per GGUF block (8 in a q4_K / q5_K / q6_K super-block).
template <DType kType>
constexpr int64_t kSubBlocks = DTypeBlockElems(kType) / kQ8Block;
// Bytes of a 32-value block (q4_K: its share of 144; q6_K's 210 / 8 is no whole number).
template <DType kType>
constexpr int64_t BlockBytes() {
  static_assert(DTypeBlockBytes(kType) % kSubBlocks<kType> == 0);
  return DTypeBlockBytes(kType) / kSubBlocks<kType>;
}
// Where the bytes of 32-value block b begin (inside a q6_K super-block only about: what decode's
// prefetches go by).
template <DType kType>
constexpr int64_t BlockStart(int64_t b) {
  if constexpr (DTypeBlockBytes(kType) % kSubBlocks<kType> == 0) {
    return b * BlockBytes<kType>();
  } else {
    return b * DTypeBlockBytes(kType) / kSubBlocks<kType>;
  }
}

struct HardF16 {
  CACHET_INT8_TARGET static float Load(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
  }
};

// iq4_nl, iq4_xs: nibbles that index a table of levels (kIQ4Values).
template <DType kType>
constexpr bool kIQ4 = kType == DType::kIQ4_NL || kType == DType::kIQ4_XS;

// kIQ4Values + 128 (the unsigned codes), for a byte shuffle in each 128-bit lane.
CACHET_INT8_TARGET inline __m256i IQ4Codes256() {
  const __m128i t = _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59,
                                  -39, -15);  // 129 .. 241 as signed bytes
  return _mm256_broadcastsi128_si256(t);
}

// q4_K and q5_K: the types with a super-block header of 6-bit scales and minimums.
template <DType kType>
constexpr bool kScaleMinK = kType == DType::kQ4_K || kType == DType::kQ5_K;

// The 32 bytes of q4_K / q5_K quants holding sub-blocks b and b ^ 1 (low nibbles: the even one).
template <DType kType>
CACHET_INT8_TARGET inline __m256i KQuants(const uint8_t* row, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      row + (b / 8) * DTypeBlockBytes(kType) + NibblesAt(kType) + ((b % 8) / 2) * 32));
}

// A q5_K super-block's 32 bytes of fifth bits (bit i of byte l: value l of sub-block i).
CACHET_INT8_TARGET inline __m256i Q5KHighBits(const uint8_t* row, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      row + (b / 8) * DTypeBlockBytes(DType::kQ5_K) + FifthBitsAt(DType::kQ5_K)));
}

// q3_K and q2_K: 2-bit codes, four 32-value blocks per 32 bytes (block k at bits 2k).
template <DType kType>
constexpr bool kTwoBit = kType == DType::kQ3_K || kType == DType::kQ2_K;

// The 32 bytes of 2-bit codes holding 32-value block b, and q3_K's 32 bytes of third bits.
template <DType kType>
CACHET_INT8_TARGET inline __m256i TwoBitCodes(const uint8_t* row, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      row + (b / 8) * DTypeBlockBytes(kType) + TwoBitCodesAt(kType) + 32 * ((b % 8) / 4)));
}
CACHET_INT8_TARGET inline __m256i Q3KThirdBits(const uint8_t* row, int64_t b) {
  return _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(row + (b / 8) * DTypeBlockBytes(DType::kQ3_K)));
}

// The 32 unsigned codes of block b of a weight row.
template <DType kType>
CACHET_INT8_TARGET inline __m256i Codes(const uint8_t* row, int64_t b) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (kTwoBit<kType>) {
    const int k = static_cast<int>(b % 8);
    const __m256i low = _mm256_and_si256(
        _mm256_srl_epi16(TwoBitCodes<kType>(row, b), _mm_cvtsi32_si128(2 * (k % 4))),
        _mm256_set1_epi8(3));
    if constexpr (kType == DType::kQ2_K) return low;
    const __mmask32 third =
        _mm256_test_epi8_mask(Q3KThirdBits(row, b), _mm256_set1_epi8(static_cast<char>(1 << k)));
    return _mm256_mask_add_epi8(low, third, low, _mm256_set1_epi8(4));
  } else if constexpr (kType == DType::kQ6_K) {
    const uint8_t* blk = row + (b / 8) * DTypeBlockBytes(kType);
    const int half = static_cast<int>(b % 8) / 4, k = static_cast<int>(b % 4);
    const __m256i ql =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32 * (k % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i hi =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), 4),
                         _mm256_set1_epi8(0x30));
    return _mm256_or_si256(lo, hi);
  } else if constexpr (HasBlockNibbles(kType)) {
    const uint8_t* blk = row + b * BlockBytes<kType>();
    const __m128i v =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(BlockNibbles<kType>(row, b)));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
    if constexpr (kIQ4<kType>) {
      return _mm256_shuffle_epi8(IQ4Codes256(), nibbles);
    } else if constexpr (!HasFifthBit(kType)) {
      return nibbles;
    } else {  // bit j of qh is code j's fifth bit
      uint32_t qh;
      std::memcpy(&qh, blk + FifthBitsAt(kType), 4);
      return _mm256_mask_add_epi8(nibbles, qh, nibbles, _mm256_set1_epi8(16));
    }
  } else if constexpr (kType == DType::kQ8_0) {
    const __m256i v =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * BlockBytes<kType>() + 2));
    return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    static_assert(kScaleMinK<kType>);
    const __m256i v = KQuants<kType>(row, b);
    const __m256i nibbles = _mm256_and_si256(b % 2 == 0 ? v : _mm256_srli_epi16(v, 4), low4);
    if constexpr (kType == DType::kQ4_K) {
      return nibbles;
    } else {
      const __mmask32 fifth = _mm256_test_epi8_mask(
          Q5KHighBits(row, b), _mm256_set1_epi8(static_cast<char>(1 << (b % 8))));
      return _mm256_mask_add_epi8(nibbles, fifth, nibbles, _mm256_set1_epi8(16));
    }
  }
}

// Codes of blocks b and b + 1 (b even): block b in the low 256 bits. The nibble bytes arrive by
// loads broadcast to every place they fill, which cost no shuffle port, and one mask (q4_K) or one
// per-qword shift and a mask (q4_0) separate the nibbles: the decode loop runs out of vector ports
// (0 and 5) before it runs out of DRAM bandwidth.
template <DType kType>
CACHET_INT8_TARGET inline __m512i CodePair(const uint8_t* row, int64_t b) {
  if constexpr (kType == DType::kQ6_K) {
    // Blocks 0 and 1 (or 2 and 3) of 128 values: the low (high) nibbles of ql's 64 bytes, and
    // bits 0-1 and 2-3 (4-5 and 6-7) of qh's 32 bytes, one shift count per 256-bit half.
    const uint8_t* blk = row + (b / 8) * DTypeBlockBytes(kType);
    const int half = static_cast<int>(b % 8) / 4, j = static_cast<int>(b % 4) / 2;
    const __m512i ql = _mm512_loadu_si512(blk + 64 * half);
    const __m512i lo =
        _mm512_and_si512(j == 0 ? ql : _mm512_srli_epi16(ql, 4), _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half)));
    const __m512i count = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * j)),
                                             _mm256_set1_epi16(static_cast<int16_t>(4 * j + 2)), 1);
    const __m512i hi = _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, count), 4),
                                        _mm512_set1_epi8(0x30));
    return _mm512_or_si512(lo, hi);
  } else if constexpr (kTwoBit<kType>) {
    // Blocks k and k + 1 (k even) are bits 2k and 2k + 2 of the same 32 bytes: one shift count per
    // 256-bit half; q3_K's third bits by one masked byte add, as q5_K's fifth.
    // A per-qword shift (cheaper than a per-word one): the bits it brings down from the next
    // byte fall above the two the mask keeps.
    const int k = static_cast<int>(b % 8);
    const __m512i count =
        _mm512_inserti64x4(_mm512_set1_epi64(2 * (k % 4)), _mm256_set1_epi64x(2 * (k % 4) + 2), 1);
    const __m512i low = _mm512_and_si512(
        _mm512_srlv_epi64(_mm512_broadcast_i64x4(TwoBitCodes<kType>(row, b)), count),
        _mm512_set1_epi8(3));
    if constexpr (kType == DType::kQ2_K) return low;
    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << k)),
                                            _mm256_set1_epi8(static_cast<char>(1 << (k + 1))), 1);
    const __mmask64 third =
        _mm512_test_epi8_mask(_mm512_broadcast_i64x4(Q3KThirdBits(row, b)), bits);
    return _mm512_mask_add_epi8(low, third, low, _mm512_set1_epi8(4));
  } else if constexpr (kType == DType::kQ4_K) {
    // One 32-byte load holds both sub-blocks. The odd one's high nibbles stay in place: its codes
    // count 16 times (exact in the integer sum), and DecodeRows scales it by 1/16 (exact too).
    const __m512i v = _mm512_broadcast_i64x4(KQuants<kType>(row, b));
    return _mm512_and_si512(v, _mm512_inserti64x4(_mm512_set1_epi8(0x0F),
                                                  _mm256_set1_epi8(static_cast<char>(0xF0)), 1));
  } else if constexpr (kType == DType::kQ5_K) {
    // The odd sub-block's nibbles shifted down (its fifth bit would not fit above them), and each
    // sub-block's fifth bits added by one masked byte add.
    const __m512i v = _mm512_broadcast_i64x4(KQuants<kType>(row, b));
    const __m512i nibbles = _mm512_and_si512(
        _mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)), _mm512_set1_epi8(0x0F));
    const int sub = static_cast<int>(b % 8);
    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << sub)),
                                            _mm256_set1_epi8(static_cast<char>(1 << (sub + 1))), 1);
    const __mmask64 fifth =
        _mm512_test_epi8_mask(_mm512_broadcast_i64x4(Q5KHighBits(row, b)), bits);
    return _mm512_mask_add_epi8(nibbles, fifth, nibbles, _mm512_set1_epi8(16));
  } else if constexpr (HasBlockNibbles(kType)) {
    constexpr int64_t kBytes = BlockBytes<kType>();
    const uint8_t* blk = row + b * kBytes;
    const __m512i v = _mm512_mask_broadcast_i32x4(
        _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(BlockNibbles<kType>(row, b)))),
        0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(BlockNibbles<kType>(row, b + 1))));
    const __m512i nibbles = _mm512_and_si512(
        _mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0x0F));
    if constexpr (kIQ4<kType>) {
      return _mm512_shuffle_epi8(_mm512_broadcast_i64x4(IQ4Codes256()), nibbles);
    } else if constexpr (!HasFifthBit(kType)) {
      return nibbles;
    } else {  // the two blocks' qh: bit j of each is its code j's fifth bit
      uint32_t qh0, qh1;
      std::memcpy(&qh0, blk + FifthBitsAt(kType), 4);
      std::memcpy(&qh1, blk + kBytes + FifthBitsAt(kType), 4);
      return _mm512_mask_add_epi8(nibbles, qh0 | (uint64_t{qh1} << 32), nibbles,
                                  _mm512_set1_epi8(16));
    }
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Codes<kType>(row, b)),
                              Codes<kType>(row, b + 1), 1);
  }
}

// The eight sub-block scales d * sc_j and minimums dmin * m_j of a q4_K super-block, unpacked
// from their 6-bit fields (ScaleMinK4) four at a time in the dwords of one register: scales 0-3
// are the low 6 bits of dword 0, scales 4-7 the low nibbles of dword 2 with the top 2 bits of
// dword 0 above them, minimums likewise from dwords 1 and 2 (high nibbles). The 16 bytes read
// from the block's byte 4 on end inside it (its 12 bytes of fields, then codes).
CACHET_INT8_TARGET inline void Q4KScales(const uint8_t* blk, __m256* dw, __m256* o) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i low = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i top =
      _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                    _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i bytes = _mm_or_si128(low, top);  // scales 0-7, then minimums 0-7
  *dw = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                      _mm256_set1_ps(HardF16::Load(blk)));
  *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                     _mm256_set1_ps(HardF16::Load(blk + 2)));
}

// The eight sub-block scales d * (ls_j - 32) of an iq4_xs super-block: ls_j's low 4 bits are bits
// 4j.. of the u32 at byte 4, its high 2 bits 2j.. of the u16 at byte 2.
CACHET_INT8_TARGET inline __m256 IQ4XSScales(const uint8_t* blk) {
  uint16_t h;
  uint32_t l;
  std::memcpy(&h, blk + 2, 2);
  std::memcpy(&l, blk + 4, 4);
  const __m256i lo =
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(l)),
                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                       _mm256_set1_epi32(0xF));
  const __m256i hi = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
      _mm256_set1_epi32(3));
  const __m256i ls =
      _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(HardF16::Load(blk)));
}

// The sixteen scales d * sc_j of a q6_K super-block, one per 16 values.
CACHET_INT8_TARGET inline __m512 Q6KScales(const uint8_t* blk) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                       _mm512_set1_ps(HardF16::Load(blk + 208)));
}

// The sixteen scales d * (sc_j - 32) of a q3_K super-block: sc_j's low 4 bits are the low (j < 8)
// or high nibble of byte j % 8, its high 2 bits bits 2 (j / 4).. of byte 8 + j % 4 (Q3KScale), so
// the u32 of bytes 8-11 shifted by 2 (j / 4) holds them for four j at once.
CACHET_INT8_TARGET inline __m512 Q3KScales(const uint8_t* blk) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 96));
  uint32_t h;
  std::memcpy(&h, blk + 104, 4);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, _mm_set1_epi8(0x0F)),
                                         _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)));
  const __m128i high = _mm_and_si128(
      _mm_srlv_epi32(_mm_set1_epi32(static_cast<int32_t>(h)), _mm_setr_epi32(0, 2, 4, 6)),
      _mm_set1_epi8(3));
  const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                       _mm512_set1_ps(HardF16::Load(blk + 108)));
}

// The sixteen scales d * sc_j and minimums dmin * m_j of a q2_K super-block (the low and high
// nibbles of its first 16 bytes).
CACHET_INT8_TARGET inline void Q2KScales(const uint8_t* blk, __m512* dw, __m512* o) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  *dw = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))),
                      _mm512_set1_ps(HardF16::Load(blk + 80)));
  *o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)),
                     _mm512_set1_ps(HardF16::Load(blk + 82)));
}

// The sixteen per-16-value scales of a q6_K / q3_K / q2_K super-block, in order (block k's halves
// are 2k and 2k + 1), and q2_K's minimums in o.
template <DType kType>
CACHET_INT8_TARGET inline __m512 HalfScaleVec(const uint8_t* blk, __m512* o) {
  if constexpr (kType == DType::kQ6_K) {
    return Q6KScales(blk);
  } else if constexpr (kType == DType::kQ3_K) {
    return Q3KScales(blk);
  } else {
    static_assert(kType == DType::kQ2_K);
    __m512 dw;
    Q2KScales(blk, &dw, o);
    return dw;
  }
}

// Floats of RowScales per 32-value block: dw and o; q2_K dw and o of each half.
template <DType kType>
constexpr int64_t kScaleFields = kType == DType::kQ2_K ? 4 : 2;

// The scales of a row of nb blocks, field f of block b at sc[f * nb + b]: dw, then o (q6_K, q3_K:
// the first half's dw, then the second's; q2_K: the halves' dw, then their o).
template <DType kType>
CACHET_INT8_TARGET void RowScales(const uint8_t* row, int64_t nb, float* sc) {
  float* dw = sc;
  float* o = sc + nb;
  if constexpr (HasHalfScales(kType)) {
    const __m512i evens = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      __m512 mins = _mm512_setzero_ps();
      const __m512 split = _mm512_permutexvar_ps(
          evens, HalfScaleVec<kType>(row + sb * DTypeBlockBytes(kType), &mins));
      _mm256_storeu_ps(dw + sb * 8, _mm512_castps512_ps256(split));
      _mm256_storeu_ps(o + sb * 8, _mm512_extractf32x8_ps(split, 1));
      if constexpr (kType == DType::kQ2_K) {
        const __m512 m = _mm512_permutexvar_ps(evens, mins);
        _mm256_storeu_ps(sc + 2 * nb + sb * 8, _mm512_castps512_ps256(m));
        _mm256_storeu_ps(sc + 3 * nb + sb * 8, _mm512_extractf32x8_ps(m, 1));
      }
    }
  } else if constexpr (kType == DType::kIQ4_XS) {
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const __m256 d8 = IQ4XSScales(row + sb * DTypeBlockBytes(kType));
      _mm256_storeu_ps(dw + sb * 8, d8);
      _mm256_storeu_ps(o + sb * 8, _mm256_mul_ps(d8, _mm256_set1_ps(128.0f)));
    }
  } else if constexpr (kScaleMinK<kType>) {
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      __m256 d8, o8;
      Q4KScales(row + sb * DTypeBlockBytes(kType), &d8, &o8);
      _mm256_storeu_ps(dw + sb * 8, d8);
      _mm256_storeu_ps(o + sb * 8, o8);
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      dw[b] = HardF16::Load(row + b * BlockBytes<kType>());
      o[b] = HasBlockMin(kType) ? -HardF16::Load(row + b * BlockBytes<kType>() + 2)
                                : static_cast<float>(Int8Offset(kType)) * dw[b];
    }
  }
}

// The f16 scales of blocks b and b + 1 (q4_0, q5_0, q8_0, q4_1, q5_1) in the lanes of their
// products, [dw_b x 8, dw_b+1 x 8]: each 128-bit lane of one 32-byte window holds one of them (q4_0
// blocks are 18 bytes apart; q8_0's 34 take two 16-byte loads), and one in-lane byte shuffle
// spreads it. kField 2: the f16 minimums of q4_1 / q5_1 instead.
template <DType kType, int kField = 0>
CACHET_INT8_TARGET inline __m512 ScalePair(const uint8_t* row, int64_t b) {
  const uint8_t* p = row + b * BlockBytes<kType>() + kField;
  __m256i w;  // the scale of block b at byte 0, that of b + 1 at byte 16 + kHigh
  constexpr int kHigh = kType == DType::kQ8_0 ? 0 : BlockBytes<kType>() - 16;
  if constexpr (kType != DType::kQ8_0) {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    w = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + BlockBytes<kType>())), 1);
  }
  const __m256i spread =
      _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, kHigh, kHigh + 1, kHigh,
                       kHigh + 1, kHigh, kHigh + 1, kHigh, kHigh + 1, kHigh, kHigh + 1, kHigh,
                       kHigh + 1, kHigh, kHigh + 1, kHigh, kHigh + 1);
  return _mm512_cvtph_ps(_mm256_shuffle_epi8(w, spread));
}

// Always inlined: as a call, decode paid it once a row and reloaded its constants after it.
CACHET_INT8_TARGET inline __attribute__((always_inline)) float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

CACHET_INT8_TARGET inline __attribute__((always_inline)) float HorizontalSum(__m512 v) {
  return HorizontalSum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

}  // namespace cachet::kernels::cpu
