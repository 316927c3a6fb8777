// Calibrated KV codecs (issue 18): the statistics `cachet calibrate` fits (eigenvectors, Lloyd-Max
// levels, the bit allotment), the .kvcal file and its checks, and the pca, kvq and cq4 codecs
// against their own decoded rows and the SIMD decoders against the scalar ones. Inside the
// engine: tests/calibrated_engine_test.cc.
#include "kv/codecs/calibration.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "calibration_fixture.h"
#include "kernels/kernels.h"
#include "kv/codecs/codec.h"
#include "kv/codecs/codec_simd.h"
#include "kv/codecs/rope_table.h"
#include "simd_targets.h"
#include "test_util.h"
#include "util/dtype.h"

namespace cachet {
namespace {

using codecs::Codec;
using codecs::Role;
using testing::AnisotropicRows;
using testing::BuildSynthetic;
using testing::KernelTargets;
using testing::ScopedTarget;
using testing::TargetString;

TEST(Calibration, SymmetricEigenFindsOrthonormalEigenvectors) {
  const int n = 7;
  std::mt19937 rng(3);
  std::normal_distribution<double> g;
  std::vector<double> b(n * n), a(n * n, 0.0);
  for (double& x : b) x = g(rng);
  for (int i = 0; i < n; ++i)  // a = b b^T: symmetric, positive semi-definite
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < n; ++k) a[i * n + j] += b[i * n + k] * b[j * n + k];
  std::vector<double> values, vectors;
  codecs::SymmetricEigen(a, n, &values, &vectors);
  for (int r = 0; r < n; ++r) {
    if (r > 0) {
      EXPECT_GE(values[r - 1], values[r]);
    }
    for (int i = 0; i < n; ++i) {  // A v = lambda v
      double av = 0;
      for (int k = 0; k < n; ++k) av += a[i * n + k] * vectors[r * n + k];
      EXPECT_NEAR(av, values[r] * vectors[r * n + i], 1e-9);
    }
    for (int s = 0; s < n; ++s) {
      double dot = 0;
      for (int k = 0; k < n; ++k) dot += vectors[r * n + k] * vectors[s * n + k];
      EXPECT_NEAR(dot, r == s ? 1.0 : 0.0, 1e-9);
    }
  }
}

TEST(Calibration, FitLevelsOnGaussianSamplesGivesLloydMax) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> z(200000);
  for (float& x : z) x = g(rng);
  std::sort(z.begin(), z.end());
  float lv[16];
  // Lloyd-Max of N(0, 1): 2 bits +-0.4528, +-1.5104 (MSE 0.1175); 4 bits MSE 0.009497.
  EXPECT_NEAR(codecs::FitLevels(z, 2, lv), 0.1175, 3e-3);
  EXPECT_NEAR(lv[0], -1.5104, 0.02);
  EXPECT_NEAR(lv[1], -0.4528, 0.02);
  EXPECT_NEAR(lv[2], 0.4528, 0.02);
  EXPECT_NEAR(lv[3], 1.5104, 0.02);
  EXPECT_NEAR(codecs::FitLevels(z, 4, lv), 0.009497, 5e-4);
  for (int i = 1; i < 16; ++i) EXPECT_LT(lv[i - 1], lv[i]);
}

TEST(Calibration, StatisticsAndBitsFollowTheVariance) {
  const int d = 64;
  const codecs::Calibration c = BuildSynthetic(d);
  const codecs::HeadStats& h = c.head(0, Role::kKey);
  EXPECT_NEAR(h.mean[10], 0.5, 0.15);
  EXPECT_EQ(h.outliers.size(), 2u);
  EXPECT_EQ(h.outliers[0], 5);  // the channel of large spread
  // Four axes carry the variance (3 directions + the spread channel), the rest is noise.
  double top = 0, all = 0;
  for (int i = 0; i < d; ++i) (i < 4 ? top : all) += h.variance[i];
  EXPECT_GT(top / (top + all), 0.95);
  for (int bits = 2; bits <= 4; ++bits) {
    const Codec codec = bits == 4 ? Codec::kPca4 : bits == 3 ? Codec::kPca3 : Codec::kPca2;
    const codecs::CalPlan& p = c.plan(0, Role::kKey, codec);
    int sum = 0;
    for (int i = 0; i < d; ++i) sum += p.bits[i];
    EXPECT_EQ(sum, bits * d);
    EXPECT_GT(p.bits[0], p.bits[d - 1]);
    EXPECT_EQ(codecs::CalBits(codec), bits);
    EXPECT_EQ(codecs::PageBytes(codec, Role::kKey, 16, d), 16u * (2 + bits * d / 8));
  }
}

// Mean square error of n rows coded into a page and decoded.
double RoundTripMse(Codec c, Role role, const codecs::CalPlan* plan, const std::vector<float>& rows,
                    int n, int d) {
  std::vector<uint8_t> page(codecs::PageBytes(c, role, n, d));
  std::vector<float> back(rows.size());
  codecs::EncodePage(c, role, rows.data(), n, n, d, page.data(), plan);
  codecs::DecodePage(c, role, page.data(), n, n, d, back.data(), plan);
  double e = 0;
  for (size_t i = 0; i < rows.size(); ++i) e += (back[i] - rows[i]) * double(back[i] - rows[i]);
  return e / double(rows.size());
}

// A calibrated codec's fused operations read the basis it stores rows in: a query turned into it
// scores the page's rows less the plan's mean, the weighted sum of its rows turned back is the
// weighted decoded rows, the SIMD decoder gives the scalar decoder's bits, and into and out of
// the basis are inverses.
void ExpectFusedOpsReadTheBasis(Codec c, Role role, const codecs::CalPlan* plan,
                                const std::vector<float>& rows, int n, int d, double dot_tol) {
  std::vector<uint8_t> page(codecs::PageBytes(c, role, n, d));
  codecs::EncodePage(c, role, rows.data(), n, n, d, page.data(), plan);
  std::vector<float> dec(rows.size()), stored(rows.size()), simd(rows.size());
  codecs::DecodePage(c, role, page.data(), n, n, d, dec.data(), plan);
  codecs::DecodeStored(c, role, page.data(), n, n, d, stored.data(), plan);
  std::vector<float> q(d), qb(d), p(n), dots(n), acc(d, 0.0f), want(d, 0.0f);
  for (int i = 0; i < d; ++i) q[i] = std::sin(0.9f * i);
  qb = q;
  codecs::IntoBasis(c, plan, qb.data(), d, codecs::BasisVec::kQuery);
  codecs::DotKeys(c, page.data(), n, n, d, qb.data(), dots.data(), plan);
  const std::vector<float>& mean = plan->stats->mean;
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int i = 0; i < d; ++i) s += q[i] * (dec[t * d + i] - mean[i]);
    EXPECT_NEAR(dots[t], s, dot_tol * (1 + std::fabs(s)));
    p[t] = 1.0f / n;
  }
  codecs::AccumulateValues(c, page.data(), n, n, d, p.data(), acc.data(), plan);
  codecs::OutOfBasis(c, plan, acc.data(), d, true);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) want[i] += dec[t * d + i] / n;
  for (int i = 0; i < d; ++i) EXPECT_NEAR(acc[i], want[i], 1e-4 * (1 + std::fabs(want[i])));
  codecs::simd::DecodeStored(c, role, page.data(), n, n, d, simd.data(), plan);
  EXPECT_EQ(simd, stored);
  std::vector<float> y(rows.begin(), rows.begin() + d);
  codecs::IntoBasis(c, plan, y.data(), d, codecs::BasisVec::kRow);
  codecs::OutOfBasis(c, plan, y.data(), d, true);
  for (int i = 0; i < d; ++i) EXPECT_NEAR(y[i], rows[i], 1e-4 * (1 + std::fabs(rows[i])));
}

TEST(Calibration, PcaCodecsBeatTheRandomRotationOnAnisotropicRows) {
  const int d = 64, n = 16;
  const codecs::Calibration c = BuildSynthetic(d);
  const auto rows = AnisotropicRows(n, d, 99);  // held out
  for (auto [pca, rot] : {std::pair{Codec::kPca4, Codec::kRot4}, {Codec::kPca3, Codec::kRot3}}) {
    SCOPED_TRACE(codecs::CodecName(pca));
    const codecs::CalPlan* plan = &c.plan(0, Role::kValue, pca);
    EXPECT_LT(RoundTripMse(pca, Role::kValue, plan, rows, n, d),
              0.25 * RoundTripMse(rot, Role::kValue, nullptr, rows, n, d));
    ExpectFusedOpsReadTheBasis(pca, Role::kValue, plan, rows, n, d, 1e-3);
  }
}

// cq4: each channel less its mean, over the root of its deviation, in q4_0 blocks. The page holds
// q4_0's encoding of those rows (attention reads it as q4_0), at q4_0's bytes; on rows with a mean
// and a channel of large spread it comes back closer than q4_0; a query turned into the basis
// scores the centered rows, and the weighted sum turned back is the weighted rows.
TEST(Calibration, Cq4IsQ4_0OfTheCenteredScaledChannels) {
  const int d = 64, n = 16;
  const codecs::Calibration c = BuildSynthetic(d);
  const auto rows = AnisotropicRows(n, d, 99);  // held out
  const Codec cq4 = Codec::kCq4;
  const codecs::CalPlan* plan = &c.plan(0, Role::kKey, cq4);
  ASSERT_EQ(codecs::PageBytes(cq4, Role::kKey, n, d),
            codecs::PageBytes(Codec::kQ4_0, Role::kKey, n, d));
  std::vector<uint8_t> page(codecs::PageBytes(cq4, Role::kKey, n, d)), q4(page.size());
  codecs::EncodePage(cq4, Role::kKey, rows.data(), n, n, d, page.data(), plan);
  std::vector<float> basis = rows;
  for (int t = 0; t < n; ++t) {
    codecs::IntoBasis(cq4, plan, basis.data() + t * d, d, codecs::BasisVec::kRow);
  }
  codecs::EncodePage(Codec::kQ4_0, Role::kKey, basis.data(), n, n, d, q4.data());
  EXPECT_EQ(page, q4);
  const codecs::HeadStats& h = c.head(0, Role::kKey);
  for (int i = 0; i < d; ++i) {
    std::vector<float> unit(d, 0.0f);
    unit[i] = 1.0f;
    codecs::IntoBasis(cq4, plan, unit.data(), d, codecs::BasisVec::kQuery);
    EXPECT_NEAR(unit[i], std::sqrt(h.channel_std[i]), 1e-6);
  }
  EXPECT_LT(RoundTripMse(cq4, Role::kKey, plan, rows, n, d),
            0.5 * RoundTripMse(Codec::kQ4_0, Role::kKey, nullptr, rows, n, d));
  ExpectFusedOpsReadTheBasis(cq4, Role::kKey, plan, rows, n, d, 1e-4);
}

// cq2: cq4's centered, scaled channels in blocks of 32 with an f16 scale and 2-bit Lloyd-Max
// codes (2.5 bits a value). On rows with a mean and a channel of large spread its error is about
// half rot2's (the random rotation, 2.25 bits at d 64: 0.53x measured), the mean being what rot2
// spends its levels on.
TEST(Calibration, Cq2IsTwoBitLevelsOfTheCenteredScaledChannels) {
  const int d = 64, n = 16;
  const codecs::Calibration c = BuildSynthetic(d);
  const auto rows = AnisotropicRows(n, d, 99);  // held out
  const Codec cq2 = Codec::kCq2;
  const codecs::CalPlan* plan = &c.plan(0, Role::kValue, cq2);
  EXPECT_EQ(codecs::PageBytes(cq2, Role::kValue, n, d), size_t(n) * d / 32 * 10);
  EXPECT_DOUBLE_EQ(codecs::BitsPerValue(cq2, Role::kValue, n, d), 2.5);
  EXPECT_EQ(codecs::BasisOf(cq2), codecs::Basis::kChannels);
  // The stored rows are the channels' basis: each value one of its block's four levels.
  std::vector<uint8_t> page(codecs::PageBytes(cq2, Role::kValue, n, d));
  codecs::EncodePage(cq2, Role::kValue, rows.data(), n, n, d, page.data(), plan);
  std::vector<float> stored(rows.size());
  codecs::DecodeStored(cq2, Role::kValue, page.data(), n, n, d, stored.data(), plan);
  const float* levels = codecs::Cq2Levels();
  for (int b = 0; b < n * d / 32; ++b) {
    uint16_t h;
    std::memcpy(&h, page.data() + b * 10, 2);
    for (int i = 0; i < 32; ++i) {
      const int code = (page[b * 10 + 2 + i % 8] >> (2 * (i / 8))) & 3;
      ASSERT_EQ(stored[b * 32 + i], F16ToF32(h) * levels[code]) << "block " << b << " value " << i;
    }
  }
  EXPECT_LT(RoundTripMse(cq2, Role::kValue, plan, rows, n, d),
            0.65 * RoundTripMse(Codec::kRot2, Role::kValue, nullptr, rows, n, d));
  ExpectFusedOpsReadTheBasis(cq2, Role::kValue, plan, rows, n, d, 1e-4);
}

// gear4: q4_0's blocks and the coordinates of their error on kGearRank calibrated axes. The row
// decodes to q4_0's plus the correction, whose error along those axes is left at the int8
// coordinates' rounding; on keys the axes are the ones the queries read most.
TEST(Calibration, Gear4CorrectsQ4_0AlongTheAxesTheQueriesRead) {
  const int d = 64, n = 16;
  const codecs::Calibration c = BuildSynthetic(d);
  const auto rows = AnisotropicRows(n, d, 99);  // held out
  const Codec gear = Codec::kGear4;
  const codecs::CalPlan* plan = &c.plan(0, Role::kKey, gear);
  const codecs::HeadStats& h = c.head(0, Role::kKey);
  ASSERT_EQ(plan->gear_axes.size(), size_t(codecs::kGearRank) * d);
  // The axes are the principal axes of largest query weight, in that order.
  std::vector<float> w = h.weight;
  std::sort(w.begin(), w.end(), std::greater<>());
  for (int j = 0; j < codecs::kGearRank; ++j) {
    int axis = -1;
    for (int i = 0; i < d && axis < 0; ++i) {
      if (std::equal(h.axes.begin() + i * d, h.axes.begin() + (i + 1) * d,
                     plan->gear_axes.begin() + j * d))
        axis = i;
    }
    ASSERT_GE(axis, 0) << "gear axis " << j << " is not a principal axis";
    EXPECT_EQ(h.weight[axis], w[j]);
  }
  EXPECT_EQ(codecs::PageBytes(gear, Role::kKey, n, d),
            codecs::PageBytes(Codec::kQ4_0, Role::kKey, n, d) + n * (codecs::kGearRank + 2));
  std::vector<uint8_t> page(codecs::PageBytes(gear, Role::kKey, n, d));
  codecs::EncodePage(gear, Role::kKey, rows.data(), n, n, d, page.data(), plan);
  std::vector<float> back(rows.size()), q4(rows.size());
  codecs::DecodePage(gear, Role::kKey, page.data(), n, n, d, back.data(), plan);
  std::vector<uint8_t> q4_page(codecs::PageBytes(Codec::kQ4_0, Role::kKey, n, d));
  codecs::EncodePage(Codec::kQ4_0, Role::kKey, rows.data(), n, n, d, q4_page.data());
  codecs::DecodePage(Codec::kQ4_0, Role::kKey, q4_page.data(), n, n, d, q4.data());
  for (int t = 0; t < n; ++t) {
    const size_t rb = codecs::RowStride(gear, d);
    EXPECT_TRUE(std::equal(q4_page.begin() + t * codecs::RowStride(Codec::kQ4_0, d),
                           q4_page.begin() + (t + 1) * codecs::RowStride(Codec::kQ4_0, d),
                           page.begin() + t * rb));
    for (int j = 0; j < codecs::kGearRank; ++j) {
      double before = 0, after = 0;
      for (int i = 0; i < d; ++i) {
        const float a = plan->gear_axes[j * d + i];
        before += a * (rows[t * d + i] - q4[t * d + i]);
        after += a * (rows[t * d + i] - back[t * d + i]);
      }
      EXPECT_LT(std::fabs(after), 0.02 * std::fabs(before) + 1e-3) << "row " << t << " axis " << j;
    }
  }
  EXPECT_LT(RoundTripMse(gear, Role::kKey, plan, rows, n, d),
            RoundTripMse(Codec::kQ4_0, Role::kKey, nullptr, rows, n, d));
}

TEST(Calibration, SimdDecodingMatchesTheReferenceOnAwkwardShapes) {
  for (int d : {24, 40, 72, 128}) {
    const codecs::Calibration c = BuildSynthetic(d);
    const int n = 13;
    const auto rows = AnisotropicRows(n, d, 5);
    for (Codec pca : {Codec::kPca4, Codec::kPca3, Codec::kPca2}) {
      for (Role role : {Role::kKey, Role::kValue}) {
        SCOPED_TRACE(std::string(codecs::CodecName(pca)) + " dim " + std::to_string(d));
        const codecs::CalPlan* plan = &c.plan(0, role, pca);
        std::vector<uint8_t> page(codecs::PageBytes(pca, role, n, d));
        codecs::EncodePage(pca, role, rows.data(), n, n, d, page.data(), plan);
        std::vector<float> ref(rows.size()), simd(rows.size());
        codecs::DecodeStored(pca, role, page.data(), n, n, d, ref.data(), plan);
        codecs::simd::DecodeStored(pca, role, page.data(), n, n, d, simd.data(), plan);
        EXPECT_EQ(simd, ref);
      }
    }
  }
}

// Rows with a few channels far wider than the rest and now and then a spike: what keys look like.
// Rows whose every `wide`-th channel (from channel 2) spreads `spread` times the others, with
// spikes.
std::vector<float> SpikyRows(int n, int d, uint32_t seed, int wide = 13, float spread = 6.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> rows(size_t(n) * d);
  for (int t = 0; t < n; ++t) {
    const float row_scale = 0.5f + 0.1f * (t % 11);
    for (int i = 0; i < d; ++i) {
      rows[size_t(t) * d + i] =
          0.3f * (i % 5) + row_scale * g(rng) * (i % wide == 2 ? spread : 1.0f);
    }
    if (t % 7 == 3) rows[size_t(t) * d + (t * 5) % d] += 40.0f;
  }
  return rows;
}

// A one-table calibration whose K and V rows (as cached and as kvq stores them) are `train`.
Result<codecs::Calibration> SpikyCalibration(const std::vector<float>& train, int d) {
  codecs::CalibrationBuilder b(1, 1, d, 2048);
  for (Role role : {Role::kKey, Role::kValue}) {
    b.AddRows(0, role, train);
    b.AddChannelRows(0, role, train);
  }
  return b.Finish(2, 7, "spiky");
}

// Keys of mixed widths, a few channels past 5 bits (what kvtiny's kvq4 and pca4 keys look like):
// the SIMD decoder (on AVX-512 the lanes reader, the wide channels apart) gives the scalar
// decoder's rows.
TEST(Calibration, MixedWidthsDecodeAsTheScalarDecoder) {
  for (int d : {64, 96, 128}) {  // (96: kvq rows through DecodeCalLanes, not made in registers)
    auto cal = SpikyCalibration(SpikyRows(4000, d, 3, 37, 40.0f), d);
    ASSERT_TRUE(cal.ok()) << cal.status().ToString();
    for (Codec c : {Codec::kKvq4, Codec::kPca4}) {
      SCOPED_TRACE(std::string(codecs::CodecName(c)) + " dim " + std::to_string(d));
      const codecs::CalPlan& plan = cal->plan(0, Role::kKey, c);
      ASSERT_FALSE(plan.uniform);
      ASSERT_TRUE(plan.lanes_ok);
      ASSERT_FALSE(plan.wide.empty());
      const int n = 37;
      const auto rows = SpikyRows(n, d, 78, 37, 40.0f);
      std::vector<uint8_t> page(codecs::PageBytes(c, Role::kKey, n, d));
      codecs::EncodePage(c, Role::kKey, rows.data(), n, n, d, page.data(), &plan);
      std::vector<float> ref(rows.size()), simd(rows.size());
      codecs::DecodeStored(c, Role::kKey, page.data(), n, n, d, ref.data(), &plan);
      for (int64_t target : KernelTargets()) {
        ScopedTarget scoped(target);
        std::fill(simd.begin(), simd.end(), 0.0f);
        codecs::simd::DecodeStored(c, Role::kKey, page.data(), n, n, d, simd.data(), &plan);
        if (c == Codec::kPca4) {  // r (sigma level) either way: the same bits
          EXPECT_EQ(simd, ref) << TargetString(target);
          continue;
        }
        for (size_t i = 0; i < ref.size(); ++i) {  // (+ mean: the compiler may fuse the scalar's)
          ASSERT_NEAR(simd[i], ref[i], 1e-5f * (1 + std::fabs(ref[i])))
              << "at " << i << TargetString(target);
        }
        // Turned by RoPE in the decoder, the wide channels and outliers patched through it.
        std::vector<float> inv(d / 2);
        for (int j = 0; j < d / 2; ++j) inv[j] = 1.0f / std::pow(10000.0f, 2.0f * j / d);
        const codecs::RopeTable rope(inv, 64);
        std::vector<int32_t> pos(n);
        for (int t = 0; t < n; ++t) pos[t] = 5 + 2 * t;  // some past the table
        std::vector<float> turned = ref;
        rope.Turn(turned.data(), n, d, pos.data(), false);
        codecs::simd::DecodeStored(c, Role::kKey, page.data(), n, n, d, simd.data(), &plan, &rope,
                                   pos.data());
        for (size_t i = 0; i < ref.size(); ++i) {
          ASSERT_NEAR(simd[i], turned[i], 1e-5f * (1 + std::fabs(turned[i])))
              << "turned, at " << i << TargetString(target);
        }
      }
    }
  }
}

TEST(Calibration, KvqCodesChannelsAndKeepsOutliers) {
  for (int d : {24, 40, 64, 72, 128}) {
    auto cal = SpikyCalibration(SpikyRows(4000, d, 3), d);
    ASSERT_TRUE(cal.ok()) << cal.status().ToString();
    const int n = 29;
    const auto rows = SpikyRows(n, d, 77);  // held out
    for (auto [kvq, q] : {std::pair{Codec::kKvq4, Codec::kQ4_0},
                          {Codec::kKvq3, Codec::kRot3},
                          {Codec::kKvq2, Codec::kRot2}}) {
      if (d % 32 != 0 && q == Codec::kQ4_0) q = Codec::kRot4;
      if ((d & (d - 1)) != 0 && codecs::IsRotated(q)) {
        q = Codec::kF16;  // no peer at this width
      }
      SCOPED_TRACE(std::string(codecs::CodecName(kvq)) + " dim " + std::to_string(d));
      const codecs::CalPlan* plan = &cal->plan(0, Role::kKey, kvq);
      EXPECT_EQ(codecs::PageBytes(kvq, Role::kKey, n, d),
                size_t(n) * (1 + 2 * codecs::KvqOutliers(d) + d * codecs::CalBits(kvq) / 8));
      std::vector<uint8_t> page(codecs::PageBytes(kvq, Role::kKey, n, d));
      codecs::EncodePage(kvq, Role::kKey, rows.data(), n, n, d, page.data(), plan);
      std::vector<float> ref(rows.size()), simd(rows.size());
      codecs::DecodePage(kvq, Role::kKey, page.data(), n, n, d, ref.data(), plan);
      codecs::simd::DecodeStored(kvq, Role::kKey, page.data(), n, n, d, simd.data(), plan);
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(simd[i], ref[i], 1e-5f * (1 + std::fabs(ref[i]))) << i;
      }
      // Keys stored before RoPE: the SIMD decoder turns each row as RopeTable::Turn does, at
      // positions in its table and past it.
      std::vector<float> inv(d / 2);
      for (int j = 0; j < d / 2; ++j) inv[j] = 1.0f / std::pow(10000.0f, 2.0f * j / d);
      const codecs::RopeTable rope(inv, 20);
      std::vector<int32_t> pos(n);
      for (int t = 0; t < n; ++t) pos[t] = t * 3;
      std::vector<float> turned = ref;
      rope.Turn(turned.data(), n, d, pos.data(), false);
      codecs::simd::DecodeStored(kvq, Role::kKey, page.data(), n, n, d, simd.data(), plan, &rope,
                                 pos.data());
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(simd[i], turned[i], 1e-5f * (1 + std::fabs(turned[i]))) << i;
      }
      double e = 0, e_peer = 0;
      std::vector<uint8_t> peer(codecs::PageBytes(q, Role::kKey, n, d));
      std::vector<float> back(rows.size());
      codecs::EncodePage(q, Role::kKey, rows.data(), n, n, d, peer.data());
      codecs::DecodePage(q, Role::kKey, peer.data(), n, n, d, back.data());
      for (size_t i = 0; i < rows.size(); ++i) {
        e += (ref[i] - rows[i]) * double(ref[i] - rows[i]);
        e_peer += (back[i] - rows[i]) * double(back[i] - rows[i]);
      }
      if (q != Codec::kF16) {
        EXPECT_LT(e, 0.7 * e_peer) << "vs " << codecs::CodecName(q);
      }
      // A spike is an outlier: kept to its code's step, not clipped to the widest level.
      for (int t = 3; t < n; t += 7) {
        const size_t at = size_t(t) * d + (t * 5) % d;
        EXPECT_NEAR(ref[at], rows[at], 0.02 * std::fabs(rows[at])) << "row " << t;
      }
    }
  }
}

TEST(Calibration, KvqPagesOfOneWidthDecodeAlikeOnTheFastPath) {
  // Channels of equal spread get equal bits: the SIMD decoder's uniform path (codes unpacked at
  // once, levels looked up in a vector) against the scalar reference, whole vectors and tails.
  for (int d : {16, 24, 40, 64, 72, 128}) {
    std::mt19937 rng(5);
    std::normal_distribution<float> g;
    auto rows_of = [&](int n) {
      std::vector<float> r(size_t(n) * d);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < d; ++i) r[size_t(t) * d + i] = 0.1f * (i % 7) + g(rng);
      }
      return r;
    };
    codecs::CalibrationBuilder b(1, 1, d, 2048);
    const auto train = rows_of(3000);
    for (Role role : {Role::kKey, Role::kValue}) {
      b.AddRows(0, role, train);
      b.AddChannelRows(0, role, train);
    }
    auto cal = b.Finish(0, 7, "even");
    ASSERT_TRUE(cal.ok()) << cal.status().ToString();
    const int n = 21;
    const auto rows = rows_of(n);
    for (Codec kvq : {Codec::kKvq4, Codec::kKvq3, Codec::kKvq2}) {
      SCOPED_TRACE(std::string(codecs::CodecName(kvq)) + " dim " + std::to_string(d));
      const codecs::CalPlan& plan = cal->plan(0, Role::kValue, kvq);
      ASSERT_TRUE(plan.uniform);
      std::vector<uint8_t> page(codecs::PageBytes(kvq, Role::kValue, n, d));
      codecs::EncodePage(kvq, Role::kValue, rows.data(), n, n, d, page.data(), &plan);
      std::vector<float> ref(rows.size()), simd(rows.size());
      codecs::DecodeStored(kvq, Role::kValue, page.data(), n, n, d, ref.data(), &plan);
      for (int64_t target : KernelTargets()) {  // (4 bits: unpacked from the row into lanes)
        ScopedTarget scoped(target);
        codecs::simd::DecodeStored(kvq, Role::kValue, page.data(), n, n, d, simd.data(), &plan);
        for (size_t i = 0; i < ref.size(); ++i) {
          ASSERT_NEAR(simd[i], ref[i], 1e-5f * (1 + std::fabs(ref[i])))
              << i << TargetString(target);
        }
      }
      // Keys of one width, turned by their RoPE inside the decoder (kvq4 at 64 and 128: the row
      // made in registers, its outliers blended in before the turn), at positions in the table
      // and past it.
      const codecs::CalPlan& kplan = cal->plan(0, Role::kKey, kvq);
      ASSERT_TRUE(kplan.uniform);
      std::vector<uint8_t> kpage(codecs::PageBytes(kvq, Role::kKey, n, d));
      codecs::EncodePage(kvq, Role::kKey, rows.data(), n, n, d, kpage.data(), &kplan);
      std::vector<float> turned(rows.size());
      codecs::DecodeStored(kvq, Role::kKey, kpage.data(), n, n, d, turned.data(), &kplan);
      std::vector<float> inv(d / 2);
      for (int j = 0; j < d / 2; ++j) inv[j] = 1.0f / std::pow(10000.0f, 2.0f * j / d);
      const codecs::RopeTable rope(inv, 30);
      std::vector<int32_t> pos(n);
      for (int t = 0; t < n; ++t) pos[t] = 7 + 3 * t;
      rope.Turn(turned.data(), n, d, pos.data(), false);
      for (int64_t target : KernelTargets()) {
        ScopedTarget scoped(target);
        codecs::simd::DecodeStored(kvq, Role::kKey, kpage.data(), n, n, d, simd.data(), &kplan,
                                   &rope, pos.data());
        for (size_t i = 0; i < ref.size(); ++i) {
          ASSERT_NEAR(simd[i], turned[i], 1e-5f * (1 + std::fabs(turned[i])))
              << "keys, at " << i << TargetString(target);
        }
      }
      double err = 0, var = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        err += (ref[i] - rows[i]) * double(ref[i] - rows[i]);
        var += double(rows[i] - 0.1f * ((i % d) % 7)) * (rows[i] - 0.1f * ((i % d) % 7));
      }
      // Lloyd-Max on N(0, 1): 0.0095 / 0.035 / 0.12 of the variance at 4 / 3 / 2 bits.
      EXPECT_LT(err / var, 1.6 * (kvq == Codec::kKvq4   ? 0.0095
                                  : kvq == Codec::kKvq3 ? 0.035
                                                        : 0.12));
    }
  }
}

TEST(Calibration, RopeTableTurnsAsTheModelAndBack) {
  const int dim = 16;
  std::vector<float> inv(dim / 2);
  for (int j = 0; j < dim / 2; ++j) inv[j] = 1.0f / std::pow(10000.0f, 2.0f * j / dim);
  const codecs::RopeTable rope(inv, 100);
  const std::vector<int32_t> pos = {0, 7, 99, 100, 5000};  // the last two past the table
  std::vector<float> x(pos.size() * dim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.3f * i) + 0.1f;
  std::vector<float> y = x;
  rope.Turn(y.data(), int(pos.size()), dim, pos.data(), false);
  for (size_t t = 0; t < pos.size(); ++t) {
    std::vector<float> want(x.begin() + t * dim, x.begin() + (t + 1) * dim), cs(dim);
    for (int j = 0; j < dim / 2; ++j) {
      const float angle = static_cast<float>(pos[t]) * inv[j];
      cs[j] = float(std::cos(double(angle)));
      cs[dim / 2 + j] = float(std::sin(double(angle)));
    }
    kernels::ref::RopeRotateHalf(want.data(), 1, dim, cs.data(), cs.data() + dim / 2);
    for (int i = 0; i < dim; ++i) EXPECT_NEAR(y[t * dim + i], want[i], 1e-5) << pos[t];
  }
  rope.Turn(y.data(), int(pos.size()), dim, pos.data(), true);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
}

TEST(Calibration, FileRoundTripsAndDamageIsNamed) {
  const std::string dir = ::testing::TempDir() + "/cachet_kvcal";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/a.kvcal";
  const codecs::Calibration c = BuildSynthetic(32, 1234);
  ASSERT_TRUE(codecs::SaveCalibration(c, path).ok());
  auto back = codecs::LoadCalibration(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->Hash(), c.Hash());
  EXPECT_EQ(back->model_hash, 1234u);
  EXPECT_EQ(back->source, "synthetic");
  EXPECT_EQ(back->plan(0, Role::kKey, Codec::kPca3).bits, c.plan(0, Role::kKey, Codec::kPca3).bits);

  const std::string bytes = testing::ReadFile(path);
  auto write = [&](const std::string& b) {
    std::ofstream(dir + "/bad.kvcal", std::ios::binary | std::ios::trunc) << b;
    return codecs::LoadCalibration(dir + "/bad.kvcal").status();
  };
  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x40;
  EXPECT_NE(write(flipped).message().find("checksum"), std::string::npos);
  EXPECT_NE(write(bytes.substr(0, bytes.size() - 100)).message().find("checksum"),
            std::string::npos);
  EXPECT_NE(write("not a calibration file at all").message().find("CKVCAL"), std::string::npos);
  EXPECT_EQ(codecs::LoadCalibration(dir + "/none.kvcal").status().code(), StatusCode::kNotFound);
  // A file of an older format (before the kvq statistics), checksummed right, asks for a new one.
  std::string old = bytes;
  const uint32_t v2 = 2;
  std::memcpy(old.data() + 8, &v2, 4);  // after the 8-byte magic
  const uint64_t sum = XXH3_64bits(old.data(), old.size() - 8);
  std::memcpy(old.data() + old.size() - 8, &sum, 8);
  EXPECT_NE(
      write(old).message().find("version 2, this build reads 3 (run `cachet calibrate` again)"),
      std::string::npos)
      << write(old).ToString();
}

}  // namespace
}  // namespace cachet
