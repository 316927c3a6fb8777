// KV codecs: reconstruction error within each codec's bound, fused q.k and p.v equal to
// dequantize-then-compute, exact byte sizes.
#include "kv/codecs/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "kv/codecs/codec_simd.h"
#include "kv/paged_sequence.h"
#include "simd_targets.h"
#include "test_util.h"

namespace cachet::codecs {
namespace {

constexpr Codec kAll[] = {Codec::kF32,  Codec::kF16,     Codec::kBF16,   Codec::kInt8, Codec::kQ8_0,
                          Codec::kQ4_0, Codec::kKivi4,   Codec::kKivi2,  Codec::kRot4, Codec::kRot3,
                          Codec::kRot2, Codec::kRot3Qjl, Codec::kRot2Qjl};

// Rows like real keys: Gaussian with a few large-magnitude outlier channels.
std::vector<float> Rows(int n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * dim);
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < dim; ++c) x[size_t(t) * dim + c] = nd(rng) * (c % 17 == 3 ? 8.0f : 1.0f);
  }
  return x;
}

using testing::RelErr;

double Bound(Codec c) {
  switch (c) {
    case Codec::kF32:
      return 0.0;
    case Codec::kF16:
      return 1e-3;
    case Codec::kBF16:
      return 5e-3;
    case Codec::kInt8:
      return 2e-2;
    case Codec::kQ8_0:
      return 2e-2;
    case Codec::kQ4_0:
      return 0.2;
    case Codec::kKivi4:
      return 0.12;
    case Codec::kKivi2:
      return 0.6;
    case Codec::kRot4:
      return 0.15;
    case Codec::kRot3:
      return 0.25;
    case Codec::kRot2:
      return 0.45;
    case Codec::kRot3Qjl:  // below rot3's measured 0.17 and rot2's 0.30: the residual stage counts
      return 0.15;
    case Codec::kRot2Qjl:
      return 0.27;
    case Codec::kPca4:  // not in kAll: they need a calibration (tests/calibration_test.cc)
    case Codec::kPca3:
    case Codec::kPca2:
    case Codec::kKvq4:
    case Codec::kKvq3:
    case Codec::kKvq2:
    case Codec::kCq4:
    case Codec::kCq2:
    case Codec::kGear4:
      return 0;
  }
  return 0;
}

TEST(Codec, RoundTripWithinBound) {
  for (int dim : {64, 128}) {
    for (Codec c : kAll) {
      for (Role role : {Role::kKey, Role::kValue}) {
        SCOPED_TRACE(std::string(CodecName(c)) + (role == Role::kKey ? " key" : " value") +
                     " dim " + std::to_string(dim));
        ASSERT_TRUE(CheckDim(c, dim).ok());
        const int tokens = 16;
        auto x = Rows(tokens, dim, 7 + dim);
        std::vector<uint8_t> page(PageBytes(c, role, tokens, dim));
        EncodePage(c, role, x.data(), tokens, tokens, dim, page.data());
        std::vector<float> y(x.size());
        DecodePage(c, role, page.data(), tokens, tokens, dim, y.data());
        const double err = RelErr(y, x);
        EXPECT_LE(err, Bound(c));
        if (c != Codec::kF32) {
          EXPECT_GT(err, 0.0);  // the codec really is lossy
        }
      }
    }
  }
}

TEST(Codec, FusedOpsEqualDequantizeThenCompute) {
  const int dim = 64, tokens = 16;
  for (Codec c : kAll) {
    SCOPED_TRACE(CodecName(c));
    for (int n : {1, 5, 16}) {
      auto x = Rows(tokens, dim, 3);
      auto q = Rows(1, dim, 4);
      std::vector<float> p(tokens);
      for (int t = 0; t < tokens; ++t) p[t] = 0.1f + 0.05f * t;
      // Keys.
      std::vector<uint8_t> kp(PageBytes(c, Role::kKey, tokens, dim));
      EncodePage(c, Role::kKey, x.data(), n, tokens, dim, kp.data());
      std::vector<float> k(size_t(n) * dim), scores(n), want(n);
      DecodePage(c, Role::kKey, kp.data(), n, tokens, dim, k.data());
      std::vector<float> qr = q;
      if (IsRotated(c)) Rotate(qr.data(), dim);
      DotKeys(c, kp.data(), n, tokens, dim, qr.data(), scores.data());
      for (int t = 0; t < n; ++t) {
        double s = 0;
        for (int i = 0; i < dim; ++i) s += double(q[i]) * k[size_t(t) * dim + i];
        want[t] = static_cast<float>(s);
      }
      EXPECT_LT(RelErr(scores, want), 1e-5) << "n " << n;
      // Values.
      std::vector<uint8_t> vp(PageBytes(c, Role::kValue, tokens, dim));
      EncodePage(c, Role::kValue, x.data(), n, tokens, dim, vp.data());
      std::vector<float> v(size_t(n) * dim), acc(dim, 0.0f), ref(dim, 0.0f);
      DecodePage(c, Role::kValue, vp.data(), n, tokens, dim, v.data());
      AccumulateValues(c, vp.data(), n, tokens, dim, p.data(), acc.data());
      if (IsRotated(c)) Unrotate(acc.data(), dim);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < dim; ++i) ref[i] += p[t] * v[size_t(t) * dim + i];
      }
      EXPECT_LT(RelErr(acc, ref), 1e-5) << "n " << n;
    }
  }
}

TEST(Codec, BytesPerValue) {
  // llama.cpp's block sizes: q8_0 34 bytes and q4_0 18 bytes per 32 values.
  EXPECT_EQ(PageBytes(Codec::kQ8_0, Role::kKey, 16, 64), 16u * 2 * 34);
  EXPECT_EQ(PageBytes(Codec::kQ4_0, Role::kValue, 16, 64), 16u * 2 * 18);
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kF16, Role::kKey, 16, 64), 16.0);
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kQ8_0, Role::kKey, 16, 64), 8.5);
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kQ4_0, Role::kKey, 16, 64), 4.5);
  // KIVI-4 keys: per channel f16 min+scale over the page, 4-bit codes.
  EXPECT_EQ(PageBytes(Codec::kKivi4, Role::kKey, 32, 64), 64u * 4 + 32 * 32);
  // rot3: an f16 scale and 3-bit codes per token (3.25 bits at 64 channels).
  EXPECT_EQ(PageBytes(Codec::kRot3, Role::kKey, 16, 64), 16u * (2 + 24));
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kRot3, Role::kKey, 16, 64), 3.25);
  // rot3+qjl: rot3's row, 64 sign bits and the f16 residual norm.
  EXPECT_EQ(PageBytes(Codec::kRot3Qjl, Role::kValue, 16, 64), 16u * (2 + 24 + 8 + 2));
  EXPECT_EQ(PageBytes(Codec::kRot2Qjl, Role::kKey, 16, 128), 16u * (2 + 32 + 16 + 2));
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kRot3Qjl, Role::kKey, 16, 64), 4.5);
  EXPECT_DOUBLE_EQ(BitsPerValue(Codec::kRot2Qjl, Role::kKey, 16, 64), 3.5);
}

// QJL exists to remove the inner-product bias of Lloyd-Max levels (their reconstruction is
// shrunk towards zero, so q.k_hat underestimates q.k when q is aligned with k) and to cut the
// error. Over thousands of (q, k) pairs with q correlated with k, rotN+qjl's mean signed error of
// q.k_hat - q.k must be a small fraction of rotN's and its RMS error lower.
TEST(Codec, QjlDotProductsAreNearlyUnbiased) {
  const int dim = 64, pairs = 4000;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto [plain, qjl] :
       {std::pair{Codec::kRot3, Codec::kRot3Qjl}, std::pair{Codec::kRot2, Codec::kRot2Qjl}}) {
    SCOPED_TRACE(CodecName(qjl));
    double mean[2] = {0, 0}, rms[2] = {0, 0};
    auto k = Rows(pairs, dim, 23);
    for (int p = 0; p < pairs; ++p) {
      const float* kp = k.data() + size_t(p) * dim;
      std::vector<float> q(dim);
      double kk = 0, qk = 0, qq = 0;
      for (int i = 0; i < dim; ++i) kk += double(kp[i]) * kp[i];
      for (int i = 0; i < dim; ++i) q[i] = kp[i] / std::sqrt(float(kk)) + 0.1f * nd(rng);
      for (int i = 0; i < dim; ++i) qk += double(q[i]) * kp[i], qq += double(q[i]) * q[i];
      std::vector<float> qr = q;
      Rotate(qr.data(), dim);
      for (int j = 0; j < 2; ++j) {
        const Codec c = j == 0 ? plain : qjl;
        std::vector<uint8_t> page(PageBytes(c, Role::kKey, 1, dim));
        EncodePage(c, Role::kKey, kp, 1, 1, dim, page.data());
        float score;
        DotKeys(c, page.data(), 1, 1, dim, qr.data(), &score);
        const double e = (score - qk) / std::sqrt(qq * kk);  // relative to |q||k|
        mean[j] += e / pairs;
        rms[j] += e * e / pairs;
      }
    }
    rms[0] = std::sqrt(rms[0]), rms[1] = std::sqrt(rms[1]);
    // Measured: rot3 mean -0.023 rms 0.027, +qjl 0.0005 and 0.016; rot2 -0.075 and 0.079, +qjl
    // 0.001 and 0.029. A residual scale off by 2x either way keeps >= 49% of the bias, the
    // least-squares scale (2 / pi of this one) 19%.
    EXPECT_LT(mean[0], 0.0);  // the shrinkage QJL corrects
    EXPECT_LT(std::fabs(mean[1]), 0.15 * std::fabs(mean[0]));
    EXPECT_LT(rms[1], 0.8 * rms[0]);
    // The residual stage only appends: a rotN+qjl row starts with the rotN row.
    std::vector<uint8_t> a(PageBytes(plain, Role::kKey, 1, dim)),
        b(PageBytes(qjl, Role::kKey, 1, dim));
    EncodePage(plain, Role::kKey, k.data(), 1, 1, dim, a.data());
    EncodePage(qjl, Role::kKey, k.data(), 1, 1, dim, b.data());
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
  }
}

TEST(Codec, RotationIsOrthogonal) {
  auto x = Rows(1, 128, 11);
  std::vector<float> y = x;
  Rotate(y.data(), 128);
  double nx = 0, ny = 0;
  for (int i = 0; i < 128; ++i) nx += x[i] * x[i], ny += y[i] * y[i];
  EXPECT_NEAR(nx, ny, 1e-3 * nx);
  Unrotate(y.data(), 128);
  EXPECT_LT(RelErr(y, x), 1e-6);
}

TEST(Codec, NamesAndDimChecks) {
  EXPECT_EQ(ParseCodec("kivi2").value(), Codec::kKivi2);
  auto bad = ParseCodec("int3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("rot3"), std::string::npos);
  for (Codec c : {Codec::kQ4_0, Codec::kCq4, Codec::kCq2, Codec::kGear4}) {  // blocks of 32
    EXPECT_FALSE(CheckDim(c, 80).ok()) << CodecName(c);
    EXPECT_TRUE(CheckDim(c, 96).ok()) << CodecName(c);
    EXPECT_EQ(ParseCodec(CodecName(c)).value(), c);
  }
  EXPECT_FALSE(CheckDim(Codec::kRot4, 96).ok());
  EXPECT_FALSE(CheckDim(Codec::kRot3Qjl, 96).ok());
  EXPECT_TRUE(CheckDim(Codec::kRot2Qjl, 128).ok());
  for (Codec c : {Codec::kRot3Qjl, Codec::kRot2Qjl}) {
    EXPECT_EQ(ParseCodec(CodecName(c)).value(), c);
    EXPECT_NE(CodecNames().find(CodecName(c)), std::string::npos);
    EXPECT_TRUE(IsRotated(c));
    EXPECT_FALSE(NeedsFullPage(c, Role::kKey));
  }
  EXPECT_STREQ(CodecName(Codec::kRot3Qjl), "rot3+qjl");
  EXPECT_TRUE(CheckDim(Codec::kInt8, 80).ok());
}

}  // namespace
}  // namespace cachet::codecs

namespace cachet::codecs {
namespace {

TEST(Codec, SimdDecodeEqualsReference) {
  for (int dim : {64, 128, 96, 4, 2}) {  // 4, 2: rotation codecs' rows shorter than a vector
    for (Codec c : kAll) {
      if (!CheckDim(c, dim).ok()) continue;
      for (Role role : {Role::kKey, Role::kValue}) {
        SCOPED_TRACE(std::string(CodecName(c)) + " dim " + std::to_string(dim));
        const int tokens = 16;
        auto x = Rows(tokens, dim, 5);
        std::vector<uint8_t> page(PageBytes(c, role, tokens, dim));
        EncodePage(c, role, x.data(), tokens, tokens, dim, page.data());
        for (int n : {1, 7, 16}) {
          std::vector<float> want(size_t(n) * dim), got(size_t(n) * dim, -1.0f);
          DecodeStored(c, role, page.data(), n, tokens, dim, want.data());
          for (int64_t target : testing::KernelTargets()) {
            testing::ScopedTarget scoped(target);
            simd::DecodeStored(c, role, page.data(), n, tokens, dim, got.data());
            EXPECT_EQ(got, want) << "n " << n << testing::TargetString(target);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace cachet::codecs

namespace cachet {
namespace {

// AttnObserve through PagedSequence::Attend on codec layouts: the gathered key weights equal those
// of ref::ContiguousAttention over the decoded K/V (PagedSequence::Gather), two observes with
// different min_pos at once, and observing leaves the outputs unchanged.
TEST(CodecLayoutAttend, ObserveMatchesContiguousOverDecodedKv) {
  using codecs::Codec;
  struct Case {
    Codec k, v;
    int sinks;
  };
  const Case cases[] = {{Codec::kQ8_0, Codec::kQ8_0, 0},
                        {Codec::kF16, Codec::kF16, 0},           // read in place
                        {Codec::kQ8_0, Codec::kF16, 16},         // first page raw
                        {Codec::kKivi4, Codec::kQ8_0, 0},        // staged: last partial page raw
                        {Codec::kRot4, Codec::kRot4, 0},         // rotated basis
                        {Codec::kRot3Qjl, Codec::kRot2Qjl, 0}};  // rotated, decoded with S^T
  const int hd = 64, pt = 16, n_heads = 4;
  const float scale = 2.0f / std::sqrt(float(hd));
  for (const Case& c : cases) {
    for (int n_keys : {1, 17, 77}) {
      SCOPED_TRACE(std::string(codecs::CodecName(c.k)) + "/" + codecs::CodecName(c.v) + " sinks " +
                   std::to_string(c.sinks) + " keys " + std::to_string(n_keys));
      std::mt19937 rng(21 + n_keys);
      KvLayout lay{1, 1, hd, pt, c.k, c.v, c.sinks};
      ASSERT_FALSE(lay.plain());
      PagePool pool(lay, size_t{1} << 22);
      PagedSequence seq(pool);
      // Gapped, shuffled positions.
      std::vector<int32_t> pos(n_keys);
      int32_t next = 10;
      for (int32_t& x : pos) {
        x = next;
        next += 1 + int32_t(rng() % 4);
      }
      std::shuffle(pos.begin(), pos.end(), rng);
      const int32_t last = next;
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      ASSERT_TRUE(seq.Reserve(n_keys).ok());
      for (int j = 0; j < n_keys; ++j) {
        std::vector<float> k(hd), v(hd);
        for (float& x : k) x = u(rng);
        for (float& x : v) x = u(rng);
        seq.Append(0, 0, k.data(), v.data(), pos[j]);
      }
      seq.CommitTokens(n_keys);
      std::vector<float> dk, dv;
      std::vector<int32_t> dpos;
      seq.Gather(0, 0, &dk, &dv, &dpos);
      ASSERT_EQ(dpos, pos);

      // Prefill (14 tokens: two tiles of rows, one row seeing no key) and decode (1 token).
      const std::vector<std::vector<int32_t>> batches = {
          {5, 10, last / 2, last - 1, 11, last / 3, last, 7, last / 2 + 1, last / 4, last - 2, 12,
           last + 50, last / 2},
          {last}};
      for (const std::vector<int32_t>& q_pos : batches) {
        const int n_tok = int(q_pos.size());
        const int64_t stride = int64_t(n_heads) * hd;
        std::vector<float> q(size_t(n_tok) * stride);
        for (float& x : q) x = u(rng);
        const int32_t min_pos[2] = {n_tok == 1 ? 0 : 5, n_tok == 1 ? last + 1 : last / 2 + 1};
        auto run = [&](bool codec, std::vector<float>* out, std::vector<float>* w, bool observe) {
          out->assign(q.size(), 0.0f);
          kernels::AttnObserve obs[2];
          for (int i = 0; i < 2; ++i) {
            w[i].assign(n_keys, 0.0f);
            obs[i] = {min_pos[i], w[i].data()};
          }
          kernels::AttnBatch b;
          b.q = q.data();
          b.q_stride = stride;
          b.out = out->data();
          b.out_stride = stride;
          b.q_pos = q_pos.data();
          b.n_tok = n_tok;
          b.n_heads = n_heads;
          b.scale = scale;
          if (observe) {
            b.observe = obs;
            b.n_observe = 2;
          }
          if (codec) {
            seq.Attend(0, 0, b);
          } else {
            kernels::ref::ContiguousAttention(b, dk.data(), dv.data(), dpos.data(), n_keys, hd);
          }
        };
        std::vector<float> out_plain, out_obs, out_ref, w_none[2], w_got[2], w_ref[2];
        run(true, &out_plain, w_none, false);
        run(true, &out_obs, w_got, true);
        run(false, &out_ref, w_ref, true);
        EXPECT_EQ(out_obs, out_plain) << "n_tok " << n_tok;
        // q8_0 keys are scored with the query quantized to 8 bits (kernels/block_keys.h), which
        // the f32 reference over decoded keys does not do.
        const bool block_keys = c.k == Codec::kQ8_0;
        const double out_tol = block_keys ? 6e-3 : 1e-4, w_tol = block_keys ? 2e-3 : 1e-5;
        for (size_t i = 0; i < out_obs.size(); ++i) {
          ASSERT_NEAR(out_obs[i], out_ref[i], out_tol) << "n_tok " << n_tok << " i " << i;
        }
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < n_keys; ++j) {
            ASSERT_NEAR(w_got[i][j], w_ref[i][j], w_tol * std::max(1.0f, w_ref[i][j]))
                << "n_tok " << n_tok << " observe " << i << " key " << j;
          }
          EXPECT_EQ(w_none[i], std::vector<float>(n_keys, 0.0f));
        }
        if (n_tok == 1) {
          EXPECT_EQ(w_got[1], std::vector<float>(n_keys, 0.0f));  // min_pos past the token
        }
      }
    }
  }
}

}  // namespace
}  // namespace cachet
