// The calibrated codecs' rows (pca*, kvq*: codec.h, calibration.h): each row coded by its
// (layer, KV head, role)'s plan. codec.cc's row switch calls these; the SIMD decoder
// (codec_simd.cc) reads the same layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/codecs/calibration.h"

namespace cachet::codecs {

// pca: an f16 row scale, then each axis's bits[i]-bit code (stored basis: the plan's axes).
void EncodePcaRow(const CalPlan& p, const float* x, uint8_t* out);
void DecodePcaRow(const CalPlan& p, const uint8_t* in, float* c);
// kvq: rows as the codec stores them (keys before RoPE).
void EncodeKvqRow(const CalPlan& p, const float* x, uint8_t* out);
void DecodeKvqRow(const CalPlan& p, const uint8_t* in, float* x);

// A kvq row: where its packed codes start, its scale, its outliers' code step at `bits` (in z),
// and its outliers written over x (its other channels decoded; padded: 3 bytes past the row
// may be read).
size_t KvqCodesOffset(int dim);
float KvqRowScale(const uint8_t* row);
float KvqOutlierStep(float zmax, int bits);
void PatchKvqOutliers(const CalPlan& p, const uint8_t* row, float* x, bool padded);

}  // namespace cachet::codecs
