// q4_0 value sums with 8-bit weights (kernels/cpu/value_sums_int8.cc) against exact sums: on every
// shape the kernel takes (key counts around its groups of 4 and pages of 16, row blocks of 4 and a
// remainder, weights of both signs, rows with no weight at all) each output is within the bound
// the weights' rounding allows, computed from the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "util/dtype.h"

namespace cachet::kernels {
namespace {

constexpr int kDim = 64, kRowBytes = 36;

// A page of cnt q4_0 value rows with random values (block scales of both signs, as q4_0 stores
// them) and their decoded values.
struct ValueRows {
  std::vector<uint8_t> q;
  std::vector<float> v;  // decoded, [cnt][64]
};

ValueRows MakeRows(int cnt, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f), mag(0.05f, 4.0f);
  ValueRows r;
  r.q.resize(size_t(cnt) * kRowBytes);
  r.v.resize(size_t(cnt) * kDim);
  std::vector<float> x(kDim);
  for (int j = 0; j < cnt; ++j) {
    const float m = mag(rng);  // rows of different sizes: their scales differ
    for (float& f : x) f = m * u(rng);
    ref::QuantizeRow(DType::kQ4_0, x.data(), kDim, r.q.data() + size_t(j) * kRowBytes);
    ref::QuantDequantRow({r.q.data(), DType::kQ4_0, cnt, kDim}, j, r.v.data() + size_t(j) * kDim);
  }
  return r;
}

float Scale(const ValueRows& r, int j, int b) {
  uint16_t h;
  std::memcpy(&h, r.q.data() + size_t(j) * kRowBytes + 18 * b, 2);
  return F16ToF32(h);
}

TEST(KernelsCpu, Q4ValueSumsWithinWeightRounding) {
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> w01(0.0f, 1.0f);
  for (int cnt : {1, 3, 4, 5, 15, 16, 17, 31, 32, 40}) {
    for (int rows : {1, 2, 3, 4, 5, 9}) {
      const std::string what = "keys=" + std::to_string(cnt) + " rows=" + std::to_string(rows);
      const ValueRows vr = MakeRows(cnt, rng);
      const int p_stride = cnt + 5;
      std::vector<float> p(size_t(rows) * p_stride, 0.0f);
      for (int r = 0; r < rows; ++r) {
        if (r == 2) continue;  // a row that sees no key of the page: its sums stay as they were
        for (int j = 0; j < cnt; ++j) {
          // Softmax weights: one key near 1, the others spread over orders of magnitude.
          const float e = w01(rng);
          p[size_t(r) * p_stride + j] = j == r % cnt ? 1.0f : std::exp(-12.0f * e);
          // A row far below the running maximum: weights of 1e-36 and less, whose reciprocal
          // would overflow (taken as none; the sums stay finite).
          if (r == 3) p[size_t(r) * p_stride + j] = 1e-36f * e;
        }
      }
      std::vector<float> acc = [&] {
        std::vector<float> a(size_t(rows) * kDim);
        for (float& f : a) f = w01(rng);
        return a;
      }();
      std::vector<float> got = acc;
      const bool ran =
          cpu::Q4ValueSums(vr.q.data(), cnt, kDim, rows, p.data(), p_stride, got.data());
      ASSERT_EQ(ran, cpu::HasInt8Kernels()) << what;
      if (!ran) {
        ASSERT_EQ(got, acc) << what << ": nothing done where the kernel does not run";
        continue;
      }
      for (int r = 0; r < rows; ++r) {
        for (int d = 0; d < kDim; ++d) {
          const int b = d / 32;
          double exact = acc[size_t(r) * kDim + d], bound = 1e-5 * (1.0 + std::fabs(exact));
          for (int j0 = 0; j0 < cnt; j0 += 16) {
            // Each 16 keys' weights are rounded against their largest.
            const int end = std::min(cnt, j0 + 16);
            double top = 0;
            for (int j = j0; j < end; ++j) {
              top = std::max(top, std::fabs(double(p[size_t(r) * p_stride + j]) * Scale(vr, j, b)));
            }
            for (int j = j0; j < end; ++j) {
              const double pj = p[size_t(r) * p_stride + j], v = vr.v[size_t(j) * kDim + d];
              exact += pj * v;
              const double code = std::fabs(v / Scale(vr, j, b));  // |c - 8|
              // The weight p * s of the code, rounded, is off by at most top / 254; floats add a
              // little on top.
              bound += top / 254.0 * code + 1e-6 * std::fabs(pj * v);
            }
          }
          ASSERT_TRUE(std::isfinite(got[size_t(r) * kDim + d])) << what << " row " << r;
          ASSERT_NEAR(got[size_t(r) * kDim + d], exact, bound)
              << what << " row " << r << " dim " << d;
        }
      }
    }
  }
}

// Wider heads keep the float path: the call declines and changes nothing.
TEST(KernelsCpu, Q4ValueSumsDeclinesOtherWidths) {
  std::vector<uint8_t> q(4 * 72, 0);
  std::vector<float> p(16, 0.5f), acc(128, 1.0f);
  EXPECT_FALSE(cpu::Q4ValueSums(q.data(), 4, 128, 1, p.data(), 16, acc.data()));
  EXPECT_EQ(acc, std::vector<float>(128, 1.0f));
}

}  // namespace
}  // namespace cachet::kernels
