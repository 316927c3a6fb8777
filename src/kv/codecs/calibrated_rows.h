// The calibrated codecs' rows (pca*, kvq*: codec.h, calibration.h): each row coded by its
// (layer, KV head, role)'s plan. codec.cc's row switch calls these; the SIMD decoder
// (codec_simd.cc) reads the same layout.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kv/codecs/calibration.h"

namespace cachet::codecs {

// x <- A x on a head's principal axes (A: h.axes), x - mean first when centered: how pca rows
// are coded and queries scored (IntoBasis).
void ProjectOnAxes(const HeadStats& h, float* x, int dim, bool centered);
// pca: an f16 row scale, then each axis's bits[i]-bit code (stored basis: the plan's axes).
void EncodePcaRow(const CalPlan& p, const float* x, uint8_t* out);
void DecodePcaRow(const CalPlan& p, const uint8_t* in, float* c);
// kvq: rows as the codec stores them (keys before RoPE).
void EncodeKvqRow(const CalPlan& p, const float* x, uint8_t* out);
void DecodeKvqRow(const CalPlan& p, const uint8_t* in, float* x);

// A kvq row: where its packed codes start, its scale, its outliers' code step at `bits` (in z).
inline constexpr int kKvqChannelBits =
    9;  // an outlier entry: the channel, then its code's high bits
inline constexpr size_t kKvqScaleBytes = 1;
size_t KvqCodesOffset(int dim);
extern const std::array<float, 256> kKvqScales;
inline float KvqRowScale(const uint8_t* row) { return kKvqScales[row[0]]; }
float KvqOutlierStep(float zmax, int bits);

// A kvq plan's outliers written over a decoded row (its other channels decoded), the plan's arrays
// looked up once for a page's rows: decoders call Apply per row.
class KvqOutlierPatch {
 public:
  explicit KvqOutlierPatch(const CalPlan& p);
  // The row's j-th outlier: its channel (in *ch) and value.
  float Value(const uint8_t* row, int j, int* ch) const {
    const uint16_t e = Entry(row, j);
    const int c = *ch = e & ((1 << kKvqChannelBits) - 1);
    const int at = byte_at_[c];
    uint32_t w = 0;  // the word holding its low bits, read within the row
    if (at + 4 <= row_bytes_) {
      std::memcpy(&w, row + at, 4);
    } else {
      for (int b = 0; at + b < row_bytes_; ++b) w |= uint32_t{row[at + b]} << (8 * b);
    }
    return Of(e, c, int((w >> shift_[c]) & mask_[c]));
  }
  // The same for a row whose channels all have 4 bits, packed from `codes` on: an outlier's low
  // bits are its channel's nibble, no lookup of where its code sits.
  float NibbleValue(const uint8_t* row, const uint8_t* codes, int j, int* ch) const {
    const uint16_t e = Entry(row, j);
    const int c = *ch = e & ((1 << kKvqChannelBits) - 1);
    return Of(e, c, (codes[c / 2] >> (4 * (c & 1))) & 15);
  }
  void Apply(const uint8_t* row, float* x) const {
    for (int j = 0; j < n_; ++j) {
      int ch;
      const float v = Value(row, j, &ch);
      x[ch] = v;
    }
  }

 private:
  static uint16_t Entry(const uint8_t* row, int j) {
    uint16_t e;
    std::memcpy(&e, row + kKvqScaleBytes + 2 * j, 2);
    return e;
  }
  // Channel c's value from its entry e and the low bits of its code.
  float Of(uint16_t e, int c, int low) const {
    const int code = ((e >> kKvqChannelBits) << bits_[c]) | low;
    return mean_[c] + scale_[c] * (code * step_[c] - zmax_);
  }
  const float *mean_, *scale_, *step_;
  const int32_t *byte_at_, *shift_, *mask_;
  const uint8_t* bits_;
  float zmax_;
  int n_, row_bytes_;
};

}  // namespace cachet::codecs
