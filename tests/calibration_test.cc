// Calibrated KV codecs (issue 18): the statistics `cachet calibrate` fits (eigenvectors, Lloyd-Max
// levels, the bit allotment), the .kvcal file and its checks, the pca codecs against their own
// decoded rows, and inside the engine: attention on pca pages equals attention on the decoded
// rows, the cache is closer to f32 than q4_0's at fewer bytes, saved caches and presses compose,
// and a missing or mismatched calibration is a clear error.
#include "kv/codecs/calibration.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "cachet/calibrate.h"
#include "cachet/engine.h"
#include "cachet/eval/tasks.h"
#include "codec_check.h"
#include "kernels/kernels.h"
#include "kv/codecs/codec.h"
#include "kv/codecs/codec_simd.h"
#include "kv/codecs/rope_table.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "simd_targets.h"
#include "test_util.h"
#include "util/dtype.h"

namespace cachet {
namespace {

using codecs::Codec;
using codecs::Role;
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

// Rows of a known anisotropic distribution: a mean, three strong directions, a weak rest and one
// channel of large spread.
std::vector<float> AnisotropicRows(int n, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> rows(size_t(n) * d);
  for (int t = 0; t < n; ++t) {
    float* x = rows.data() + size_t(t) * d;
    const float a = 4 * g(rng), b = 2 * g(rng), c = g(rng);
    for (int i = 0; i < d; ++i) {
      x[i] = 0.5f + a * std::cos(0.3f * i) / std::sqrt(d / 2.0f) +
             b * std::sin(0.7f * i) / std::sqrt(d / 2.0f) + c * (i % 2 ? 1 : -1) / std::sqrt(d) +
             0.05f * g(rng);
    }
    x[5] += 3 * g(rng);
  }
  return rows;
}

codecs::Calibration BuildSynthetic(int d, uint64_t hash = 7) {
  codecs::CalibrationBuilder b(1, 1, d, 2048);
  const auto k = AnisotropicRows(6000, d, 11), v = AnisotropicRows(6000, d, 12);
  b.AddRows(0, Role::kKey, k);
  b.AddRows(0, Role::kValue, v);
  b.AddChannelRows(0, Role::kKey, k);
  b.AddChannelRows(0, Role::kValue, v);
  auto c = b.Finish(/*outliers=*/2, hash, "synthetic");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(c).value();
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

TEST(Calibration, PcaCodecsBeatTheRandomRotationOnAnisotropicRows) {
  const int d = 64, n = 16;
  const codecs::Calibration c = BuildSynthetic(d);
  const auto rows = AnisotropicRows(n, d, 99);  // held out
  for (auto [pca, rot] : {std::pair{Codec::kPca4, Codec::kRot4}, {Codec::kPca3, Codec::kRot3}}) {
    SCOPED_TRACE(codecs::CodecName(pca));
    const codecs::CalPlan* plan = &c.plan(0, Role::kValue, pca);
    auto mse = [&](Codec codec, const codecs::CalPlan* pl) {
      std::vector<uint8_t> page(codecs::PageBytes(codec, Role::kValue, n, d));
      std::vector<float> back(rows.size());
      codecs::EncodePage(codec, Role::kValue, rows.data(), n, n, d, page.data(), pl);
      codecs::DecodePage(codec, Role::kValue, page.data(), n, n, d, back.data(), pl);
      double e = 0;
      for (size_t i = 0; i < rows.size(); ++i) e += (back[i] - rows[i]) * double(back[i] - rows[i]);
      return e / double(rows.size());
    };
    EXPECT_LT(mse(pca, plan), 0.25 * mse(rot, nullptr));

    // The fused operations read the stored basis: q in the basis scores the centered rows, and
    // the accumulated coordinates turned back give the weighted rows.
    std::vector<uint8_t> page(codecs::PageBytes(pca, Role::kValue, n, d));
    codecs::EncodePage(pca, Role::kValue, rows.data(), n, n, d, page.data(), plan);
    std::vector<float> dec(rows.size()), stored(rows.size());
    codecs::DecodePage(pca, Role::kValue, page.data(), n, n, d, dec.data(), plan);
    codecs::DecodeStored(pca, Role::kValue, page.data(), n, n, d, stored.data(), plan);
    std::vector<float> q(d), qb(d), p(n), dots(n), acc(d, 0.0f), want(d, 0.0f);
    for (int i = 0; i < d; ++i) q[i] = std::sin(0.9f * i);
    qb = q;
    codecs::IntoBasis(pca, plan, qb.data(), d, false);
    codecs::DotKeys(pca, page.data(), n, n, d, qb.data(), dots.data(), plan);
    const codecs::HeadStats& h = c.head(0, Role::kValue);
    for (int t = 0; t < n; ++t) {
      double s = 0;
      for (int i = 0; i < d; ++i) s += q[i] * (dec[t * d + i] - h.mean[i]);
      EXPECT_NEAR(dots[t], s, 1e-3 * (1 + std::fabs(s)));
      p[t] = 1.0f / n;
    }
    codecs::AccumulateValues(pca, page.data(), n, n, d, p.data(), acc.data(), plan);
    codecs::OutOfBasis(pca, plan, acc.data(), d, true);
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i) want[i] += dec[t * d + i] / n;
    for (int i = 0; i < d; ++i) EXPECT_NEAR(acc[i], want[i], 1e-4 * (1 + std::fabs(want[i])));
    // The SIMD decoder (gathers) gives the reference's bits.
    std::vector<float> simd(rows.size());
    codecs::simd::DecodeStored(pca, Role::kValue, page.data(), n, n, d, simd.data(), plan);
    EXPECT_EQ(simd, stored);
    // Into and out of the basis are inverses.
    std::vector<float> x(rows.begin(), rows.begin() + d), y = x;
    codecs::IntoBasis(pca, plan, y.data(), d, true);
    codecs::OutOfBasis(pca, plan, y.data(), d, true);
    for (int i = 0; i < d; ++i) EXPECT_NEAR(y[i], x[i], 1e-4);
  }
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

// Removes the shared calibrations of ctest runs that have ended (their parent pid is gone), so
// repeated runs leave at most the live ones' files in the temporary directory.
void RemoveEndedRunsCalibrations() {
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(::testing::TempDir(), ec)) {
    const std::string name = f.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "kvtiny_test_%d.kvcal", &pid) == 1 && pid > 1 &&
        ::kill(pid, 0) != 0 && errno == ESRCH) {
      std::filesystem::remove(f.path(), ec);
    }
  }
}

// kvtiny calibrated on a slice of the haystack (pydocs, the first quarter as `cachet calibrate`
// takes it), shared by the engine tests below: made once per process, or read back from an
// earlier test process of the same ctest run (each test runs in its own, ctest is their parent),
// which is checked first.
const std::string& KvtinyCalibration() {
  static const std::string path = [] {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok());
    const std::string p =
        ::testing::TempDir() + "/kvtiny_test_" + std::to_string(::getppid()) + ".kvcal";
    // Tests that start together wait for the first one's calibration instead of each making
    // their own (45 s apiece under ASan). The lock goes with the process.
    struct Lock {
      int fd;
      ~Lock() {
        if (fd >= 0) ::close(fd);
      }
    } lock{::open((p + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600)};
    if (lock.fd >= 0) ::flock(lock.fd, LOCK_EX);
    if (auto c = codecs::LoadCalibration(p);
        c.ok() && c->model_hash == EngineAccess::model_hash(**e) && c->tokens == 2048) {
      return p;
    }
    RemoveEndedRunsCalibrations();
    std::string text = testing::ReadFile(eval::DefaultHaystackDir() + "/pydocs.txt");
    text.resize(text.size() / 4);
    std::vector<int32_t> ids = (*e)->tokenizer().Encode(text);
    ids.resize(2046);
    CalibrateOptions co;
    co.window = 1024;
    co.progress = false;
    auto r = Calibrate(**e, ids, co, p);  // written atomically: parallel tests never see half
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->windows, 2);  // 2 x (BOS + 1023 tokens)
    EXPECT_EQ(r->tokens, 2048);
    EXPECT_GT(r->key_top_share, 0.2);  // keys are far from isotropic (1/8 would be)
    return p;
  }();
  return path;
}

std::unique_ptr<Engine> PcaEngine(const std::string& k, const std::string& v, int sinks = 0,
                                  const std::string& cal = KvtinyCalibration()) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = k;
  o.kv_codec_v = v;
  o.kv_sinks = sinks;
  o.kv_calibration = cal;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

TEST(CalibratedEngine, AttentionOnPcaPagesEqualsAttentionOnDecodedRows) {
  const auto prompt = testing::LoadGolden().back().ids;
  for (const auto& [k, v] : {std::pair{"pca4", "pca3"}, {"f16", "pca2"}, {"pca3", "q4_0"}}) {
    auto e = PcaEngine(k, v, /*sinks=*/4);  // the sink pages (f16) turned into the basis
    ASSERT_NE(e, nullptr);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    const PagedSequence& kv = EngineAccess::kv(*s);
    SCOPED_TRACE(std::string(k) + ":" + v);
    EXPECT_LT(testing::AttendVsDecoded(*e, kv, 5, 1, {150, 201, 202}), 1e-5);
  }
}

using testing::MeanKl;

// A calibration on a repetitive text never sees the model's rows move along most axes; rows that
// do move along them still give finite logits (their scale over the axes' zero deviation was
// infinite: every logit NaN, exit 0).
TEST(CalibratedEngine, RepetitiveCalibrationTextGivesFiniteLogits) {
  testing::TempDir dir;
  const std::string cal = dir.path() + "/flat.kvcal";
  {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok());
    std::string text;
    for (int i = 0; i < 60; ++i) text += "The Lord said unto Moses. ";
    CalibrateOptions co;
    co.progress = false;
    auto r = Calibrate(**e, (*e)->tokenizer().EncodePrompt(text), co, cal);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  for (const char* codec : {"pca4", "pca2"}) {
    auto e = PcaEngine("f32", codec, 0, cal);
    ASSERT_NE(e, nullptr);
    std::vector<float> logits;
    auto s = e->NewSession();
    ASSERT_TRUE(
        s->Eval(e->tokenizer().EncodePrompt("In the beginning God created the heaven"), &logits)
            .ok());
    for (float x : logits) ASSERT_TRUE(std::isfinite(x)) << codec;
  }
}

TEST(CalibratedEngine, PcaKeysAreCloserToF32ThanQ4_0AtFewerBytes) {
  const auto prompt = testing::LoadGolden().back().ids;
  auto f32 = PcaEngine("f32", "f32");
  std::vector<float> ref;
  ASSERT_TRUE(f32->NewSession()->Eval(prompt, &ref, true).ok());
  const int vocab = f32->config().vocab_size;
  auto kl = [&](const std::string& k, const std::string& v, int64_t* bytes) {
    auto e = PcaEngine(k, v);
    std::vector<float> got;
    EXPECT_TRUE(e->NewSession()->Eval(prompt, &got, true).ok());
    *bytes = e->kv_stats().bytes_high_water;
    return MeanKl(ref, got, vocab);
  };
  int64_t pca_bytes = 0, q4_bytes = 0;
  const double pca = kl("pca4", "f16", &pca_bytes), q4 = kl("q4_0", "f16", &q4_bytes);
  EXPECT_GT(pca, 0.0);
  EXPECT_LT(pca, 0.7 * q4) << "pca4 keys " << pca << ", q4_0 keys " << q4;
  EXPECT_LT(pca_bytes, q4_bytes);
}

TEST(CalibratedEngine, KvqKeysStoredBeforeRopeAttendAsDecoded) {
  const auto prompt = testing::LoadGolden().back().ids;
  // Sinks (f16 pages beside kvq ones) are read alike. (q4_0 keys are left out: their fused
  // kernel quantizes the query, 8e-4 from the decoded rows by design.)
  for (const auto& [k, v] : {std::pair{"kvq4", "kvq3"}, {"kvq2", "f16"}, {"rot4", "kvq4"}}) {
    auto e = PcaEngine(k, v, /*sinks=*/4);
    ASSERT_NE(e, nullptr);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    SCOPED_TRACE(std::string(k) + ":" + v);
    EXPECT_LT(testing::AttendVsDecoded(*e, EngineAccess::kv(*s), 5, 1, {150, 201, 202}), 1e-5);
  }
}

TEST(CalibratedEngine, KvqKeysAreCloserToF32ThanQ4_0) {
  // Keys turned back by the wrong angles would be noise: the KL would be far above q4_0's.
  const auto prompt = testing::LoadGolden().back().ids;
  auto f32 = PcaEngine("f32", "f32");
  std::vector<float> ref;
  ASSERT_TRUE(f32->NewSession()->Eval(prompt, &ref, true).ok());
  auto kl = [&](const std::string& k) {
    auto e = PcaEngine(k, "f16");
    std::vector<float> got;
    EXPECT_TRUE(e->NewSession()->Eval(prompt, &got, true).ok());
    return MeanKl(ref, got, f32->config().vocab_size);
  };
  const double kvq = kl("kvq4"), q4 = kl("q4_0");
  EXPECT_GT(kvq, 0.0);
  EXPECT_LT(kvq, 0.6 * q4) << "kvq4 keys " << kvq << ", q4_0 keys " << q4;
}

TEST(CalibratedEngine, KvqKeysFollowTheirTokensToNewPositions) {
  // Shift re-rotates kept keys: kvq decodes them at their old position and stores them back at
  // the new one, so they stay what an f32 cache holds there (to the codec's error).
  const auto prompt = testing::LoadGolden().back().ids;
  auto kvq = PcaEngine("kvq4", "f16");
  auto f32 = PcaEngine("f32", "f32");
  auto a = kvq->NewSession(), b = f32->NewSession();
  for (auto* s : {a.get(), b.get()}) {
    ASSERT_TRUE(s->Eval(std::span(prompt).first(120), nullptr).ok());
    ASSERT_TRUE(s->Shift(10, 50).ok());
  }
  for (int l : {0, 7}) {
    std::vector<float> ka, va, kb, vb;
    std::vector<int32_t> pa, pb;
    EngineAccess::kv(*a).Gather(l, 0, &ka, &va, &pa);
    EngineAccess::kv(*b).Gather(l, 0, &kb, &vb, &pb);
    ASSERT_EQ(pa, pb);
    ASSERT_EQ(pa[50], 50);
    double num = 0, den = 0;
    for (size_t i = 0; i < kb.size(); ++i) {
      num += (ka[i] - kb[i]) * double(ka[i] - kb[i]);
      den += double(kb[i]) * kb[i];
    }
    EXPECT_LT(std::sqrt(num / den), 0.15) << "layer " << l;
  }
}

// keydiff keeping half the tokens, the evicted ones demoted into a cold pool of `codec`.
press::PressOptions HalfDemotedInto(const std::string& codec) {
  press::PressOptions p;
  EXPECT_TRUE(press::ParsePressSpec("keydiff", &p).ok());
  p.ratio = 0.5;
  p.demote = codec;
  return p;
}

// Saves a session holding the prompt, loads it back, and checks the two decode alike.
void ExpectSavedCacheReloads(Engine& e, const std::vector<int32_t>& prompt,
                             const std::string& path) {
  auto s = e.NewSession();
  ASSERT_TRUE(s->Eval(prompt, nullptr).ok());
  ASSERT_TRUE(s->Save(path).ok());
  auto loaded = e.LoadSession(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::vector<float> a, b;
  const std::vector<int32_t> next = {prompt[5], prompt[6]};
  ASSERT_TRUE(s->Eval(next, &a).ok());
  ASSERT_TRUE((*loaded)->Eval(next, &b).ok());
  EXPECT_EQ(a, b);
}

TEST(CalibratedEngine, KvqCachesSaveLoadAndDemote) {
  // A saved kvq cache holds keys before RoPE with their positions: loaded, it decodes alike.
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("kvq4", "kvq3", /*sinks=*/4);
  ExpectSavedCacheReloads(*e, prompt, ::testing::TempDir() + "/kvq_cache.ckv");
  // Evicted tokens demoted into kvq2 from an f16 cache: the cold pool turns its keys by RoPE too.
  auto hot = PcaEngine("f16", "f16");
  auto h = hot->NewSession();
  const press::PressOptions p = HalfDemotedInto("kvq2");
  ASSERT_TRUE(h->EvalPressed(std::span(prompt).first(200), p, nullptr).ok());
  EXPECT_GT(hot->kv_stats().cold_bytes_used, 0);
  std::vector<float> logits, ref;
  ASSERT_TRUE(h->Eval(std::vector<int32_t>{prompt[200]}, &logits).ok());
  // Against the same press demoting into f16 (the cold rows exact): close, not noise.
  auto exact = PcaEngine("f16", "f16");
  auto x = exact->NewSession();
  ASSERT_TRUE(x->EvalPressed(std::span(prompt).first(200), HalfDemotedInto("f16"), nullptr).ok());
  ASSERT_TRUE(x->Eval(std::vector<int32_t>{prompt[200]}, &ref).ok());
  EXPECT_LT(MeanKl(ref, logits, hot->config().vocab_size), 0.1);  // 0.03; unturned keys: 0.33
}

TEST(CalibratedEngine, SavedCachesNeedTheirCalibration) {
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("pca4", "pca3");
  const std::string path = ::testing::TempDir() + "/pca_cache.ckv";
  ExpectSavedCacheReloads(*e, prompt, path);
  auto info = ReadSavedCacheInfo(path);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->codec_k, "pca4");
  EXPECT_EQ(info->calibration.size(), 16u);

  // Another calibration (the same statistics, another model hash, so another file hash).
  auto cal = codecs::LoadCalibration(KvtinyCalibration());
  ASSERT_TRUE(cal.ok());
  const std::string other = ::testing::TempDir() + "/other.kvcal";
  cal->source = "other";
  cal->heads[0].mean[0] += 1e-3f;
  ASSERT_TRUE(codecs::SaveCalibration(*cal, other).ok());
  auto e2 = PcaEngine("pca4", "pca3", 0, other);
  ASSERT_NE(e2, nullptr);
  auto refused = e2->LoadSession(path);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("KV calibration (--kv-calibration) " +
                                            info->calibration + " (this engine: "),
            std::string::npos)
      << refused.status().ToString();
  std::filesystem::remove(other);
}

TEST(CalibratedEngine, MissingOrMismatchedCalibrationIsAClearError) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_codec_k = "pca4";
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--kv-calibration"), std::string::npos);

  auto cal = codecs::LoadCalibration(KvtinyCalibration());
  ASSERT_TRUE(cal.ok());
  cal->model_hash ^= 1;
  const std::string wrong = ::testing::TempDir() + "/wrong_model.kvcal";
  ASSERT_TRUE(codecs::SaveCalibration(*cal, wrong).ok());
  o.kv_calibration = wrong;
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("other weights"), std::string::npos);

  o.kv_codec_k = "f16";
  o.kv_codec_v = "kvq3";
  o.kv_calibration.clear();
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("KV codec kvq3 needs a calibration of this model: "
                                      "--kv-calibration FILE"),
            std::string::npos)
      << e.status().ToString();
  o.kv_codec_k = o.kv_codec_v = "pca4";
  EXPECT_FALSE(codecs::CheckDim(Codec::kKvq4, 20).ok());  // codes pack whole bytes: head_dim % 8

  codecs::Calibration small = BuildSynthetic(32);
  const std::string shape = ::testing::TempDir() + "/wrong_shape.kvcal";
  ASSERT_TRUE(codecs::SaveCalibration(small, shape).ok());
  o.kv_calibration = shape;
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("head_dim 32"), std::string::npos);
  std::filesystem::remove(wrong);
  std::filesystem::remove(shape);
}

TEST(CalibratedEngine, PressesDemoteIntoAPcaCodec) {
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("pca4", "pca4");
  auto s = e->NewSession();
  const press::PressOptions p = HalfDemotedInto("pca2");
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalPressed(prompt, p, &logits).ok());
  EXPECT_GT(e->kv_stats().cold_bytes_used, 0);
  std::vector<float> next;
  ASSERT_TRUE(s->Eval(std::vector<int32_t>{prompt[3]}, &next).ok());
  for (float x : next) ASSERT_TRUE(std::isfinite(x));
  // Demoting into a pca codec without a calibration is refused.
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_codec_k = o.kv_codec_v = "q4_0";
  auto plain = Engine::Create(o);
  ASSERT_TRUE(plain.ok());
  auto s2 = (*plain)->NewSession();
  const Status st = s2->EvalPressed(prompt, p, &logits);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--kv-calibration"), std::string::npos);
}

TEST(CalibratedEngine, RecentWindowAndQuestCompose) {
  const auto prompt = testing::LoadGolden().back().ids;
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = "pca4";
  o.kv_codec_v = "pca3";
  o.kv_window = 32;  // staged pages: f16 until 32 newer tokens follow, then coded whole
  o.kv_calibration = KvtinyCalibration();
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto s = (*e)->NewSession();
  press::PressOptions p;
  ASSERT_TRUE(press::ParsePressSpec("quest", &p).ok());
  p.ratio = 0.5;
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalPressed(std::span(prompt).first(200), p, &logits).ok());
  const PagedSequence& kv = EngineAccess::kv(*s);
  EXPECT_LT(testing::AttendVsDecoded(**e, kv, 2, 0, {120, 199}), 1e-5);
  ASSERT_TRUE(s->Eval(std::vector<int32_t>{prompt[200]}, &logits).ok());  // a Quest decode step
  // Quest's bounds, built from the keys turned back out of the pca basis, bound the keys.
  const int hd = (*e)->config().head_dim, pt = 16;
  for (int l = 0; l < (*e)->config().n_layers; ++l) {
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    kv.Gather(l, 1, &k, &v, &pos);
    const auto bounds = kv.key_bounds(l, 1);
    ASSERT_GE(bounds.size(), size_t(2 * hd * 10)) << "layer " << l;
    for (size_t page = 0; page < bounds.size() / (2 * hd); ++page) {
      for (int r = 0; r < pt; ++r) {
        for (int i = 0; i < hd; ++i) {
          const float x = k[(page * pt + r) * hd + i];
          ASSERT_LE(F16ToF32(bounds[page * 2 * hd + i]), x) << l << " " << page << " " << i;
          ASSERT_GE(F16ToF32(bounds[page * 2 * hd + hd + i]), x) << l << " " << page << " " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace cachet
