#include "util/dtype.h"

namespace cachet {

const char* DTypeName(DType t) { return t < DType::kCount ? Info(t).name : "?"; }

uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (abs < 0x38800000u) {                                               // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 113 - e + 13
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  uint32_t lsb = (r >> 13) & 1u;
  r += 0xfffu + lsb;
  return static_cast<uint16_t>(sign | (r >> 13));
}

namespace {
// The next f16 toward -inf (bits of a finite or infinite non-NaN value), or toward +inf.
uint16_t NextDown(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;      // +0: the smallest negative subnormal
  return (h & 0x8000u) ? h + 1 : h - 1;  // more negative, or less positive
}
uint16_t NextUp(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;  // -0
  return (h & 0x8000u) ? h - 1 : h + 1;
}
}  // namespace

uint16_t F32ToF16Down(float f) {
  const uint16_t h = F32ToF16(f);
  return F16ToF32(h) > f && h != 0xfc00u ? NextDown(h) : h;
}

uint16_t F32ToF16Up(float f) {
  const uint16_t h = F32ToF16(f);
  return F16ToF32(h) < f && h != 0x7c00u ? NextUp(h) : h;
}

}  // namespace cachet
