// Quantized weight kernels (q8_0, q5_0, q5_1, q4_0, q4_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl,
// iq4_xs): the reference quantizers against the values they encode, ref::MatMul against
// double-precision math over the reference dequantization, and every cpu:: MatMul / DequantRow
// (each compiled SIMD target this CPU has) against ref::.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "simd_targets.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace cachet::kernels {
namespace {

constexpr DType kQuantTypes[] = {DType::kQ8_0, DType::kQ5_0, DType::kQ5_1,   DType::kQ4_0,
                                 DType::kQ4_1, DType::kQ4_K, DType::kQ5_K,   DType::kQ6_K,
                                 DType::kQ3_K, DType::kQ2_K, DType::kIQ4_NL, DType::kIQ4_XS};

double NormErr(const float* a, const float* b, size_t n) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    ref += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(diff)) return INFINITY;
  return ref == 0.0 ? std::sqrt(diff) : std::sqrt(diff / ref);
}

std::vector<float> RandomVec(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct QuantMatrix {
  std::vector<float> source;   // what was quantized
  std::vector<float> deq;      // ref dequantization, rows * cols
  std::vector<uint8_t> bytes;  // the blocks
  Matrix m;
};

QuantMatrix MakeMatrix(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  QuantMatrix q;
  q.source = RandomVec(rows * cols, rng);
  const int64_t rb = DTypeRowBytes(t, cols);
  q.bytes.resize(rows * rb);
  for (int64_t r = 0; r < rows; ++r) {
    ref::QuantizeRow(t, q.source.data() + r * cols, cols, q.bytes.data() + r * rb);
  }
  q.m = Matrix{q.bytes.data(), t, rows, cols};
  q.deq.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) ref::DequantRow(q.m, r, q.deq.data() + r * cols);
  return q;
}

using testing::ScopedTarget;

TEST(QuantKernels, RowBytesAndBlockSizes) {
  EXPECT_EQ(DTypeRowBytes(DType::kQ8_0, 64), 68);
  EXPECT_EQ(DTypeRowBytes(DType::kQ4_0, 32), 18);
  EXPECT_EQ(DTypeRowBytes(DType::kQ5_0, 896), 616);
  EXPECT_EQ(DTypeRowBytes(DType::kQ4_K, 512), 288);
  EXPECT_EQ(DTypeRowBytes(DType::kQ6_K, 256), 210);
  EXPECT_EQ(DTypeRowBytes(DType::kQ5_K, 512), 352);
  EXPECT_EQ(DTypeRowBytes(DType::kQ4_1, 64), 40);
  EXPECT_EQ(DTypeRowBytes(DType::kQ5_1, 896), 672);
  EXPECT_EQ(DTypeRowBytes(DType::kQ4_K, 384), -1);
  EXPECT_EQ(DTypeRowBytes(DType::kF16, 3), 6);
}

// The reference quantizers reproduce their input to within the format's resolution; the k-quants'
// fitted scales (llama.cpp's least-squares search) below what mapping each sub-block's range gave:
// q4_K 0.079, q5_K 0.039, q6_K 0.019, q3_K 0.154, q2_K 0.327.
TEST(QuantKernels, ReferenceRoundTripError) {
  std::mt19937 rng(1);
  const std::pair<DType, double> kBounds[] = {
      {DType::kQ8_0, 0.01},   {DType::kQ5_0, 0.08},   {DType::kQ4_0, 0.15},  {DType::kQ4_K, 0.075},
      {DType::kQ5_K, 0.0375}, {DType::kQ6_K, 0.0182}, {DType::kQ4_1, 0.12},  {DType::kQ5_1, 0.06},
      {DType::kIQ4_NL, 0.15}, {DType::kIQ4_XS, 0.15}, {DType::kQ3_K, 0.152}, {DType::kQ2_K, 0.30}};
  for (auto [t, bound] : kBounds) {
    QuantMatrix q = MakeMatrix(t, 8, 512, rng);
    const double err = NormErr(q.deq.data(), q.source.data(), q.deq.size());
    EXPECT_LT(err, bound) << DTypeName(t);
    EXPECT_GT(err, 0.0) << DTypeName(t);
  }
}

// Hand-built blocks decode as llama.cpp's layouts say.
TEST(QuantKernels, ReferenceDequantKnownBlocks) {
  // q8_0: d = 0.5, q = -3..28
  std::vector<uint8_t> b(34);
  const uint16_t half = F32ToF16(0.5f);
  std::memcpy(b.data(), &half, 2);
  for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 3));
  float y[256];
  ref::DequantRow(Matrix{b.data(), DType::kQ8_0, 1, 32}, 0, y);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], 0.5f * (j - 3));
  // q4_0: d = 2, qs[j] = lo j, hi 15 - j
  std::vector<uint8_t> c(18);
  const uint16_t two = F32ToF16(2.0f);
  std::memcpy(c.data(), &two, 2);
  for (int j = 0; j < 16; ++j) c[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  ref::DequantRow(Matrix{c.data(), DType::kQ4_0, 1, 32}, 0, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * (j - 8));
    EXPECT_EQ(y[j + 16], 2.0f * (7 - j));
  }
  // q5_0: d = 0.25, qs[j] = lo j, hi 15 - j, the fifth bit on for codes 3 and 20 only
  std::vector<uint8_t> c5(22);
  const uint16_t quarter = F32ToF16(0.25f);
  std::memcpy(c5.data(), &quarter, 2);
  const uint32_t qh = (1u << 3) | (1u << 20);
  std::memcpy(c5.data() + 2, &qh, 4);
  for (int j = 0; j < 16; ++j) c5[6 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  ref::DequantRow(Matrix{c5.data(), DType::kQ5_0, 1, 32}, 0, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.25f * (j + (j == 3 ? 16 : 0) - 16)) << j;
    EXPECT_EQ(y[j + 16], 0.25f * (15 - j + (j + 16 == 20 ? 16 : 0) - 16)) << j + 16;
  }
  // q4_1: d = 2, m = -3, qs[j] = lo j, hi 15 - j: x = 2 q - 3; q5_1 the same with the fifth bit
  // on for codes 3 and 20 only.
  std::vector<uint8_t> c41(20), c51(24);
  const uint16_t minus3 = F32ToF16(-3.0f);
  for (std::vector<uint8_t>* c : {&c41, &c51}) {
    std::memcpy(c->data(), &two, 2);
    std::memcpy(c->data() + 2, &minus3, 2);
  }
  std::memcpy(c51.data() + 4, &qh, 4);
  for (int j = 0; j < 16; ++j) {
    c41[4 + j] = c51[8 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  }
  ref::DequantRow(Matrix{c41.data(), DType::kQ4_1, 1, 32}, 0, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * j - 3.0f) << j;
    EXPECT_EQ(y[j + 16], 2.0f * (15 - j) - 3.0f) << j + 16;
  }
  ref::DequantRow(Matrix{c51.data(), DType::kQ5_1, 1, 32}, 0, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * (j + (j == 3 ? 16 : 0)) - 3.0f) << j;
    EXPECT_EQ(y[j + 16], 2.0f * (15 - j + (j + 16 == 20 ? 16 : 0)) - 3.0f) << j + 16;
  }
  // iq4_nl: d = 0.5, qs[j] = lo j, hi 15 - j: x = 0.5 * level; iq4_xs: d = 0.25, sub-block s
  // has the 6-bit scale 32 + s + 1 (x = 0.25 * (s + 1) * level), each sub-block's bytes those.
  static constexpr int kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};
  std::vector<uint8_t> n4(18);
  std::memcpy(n4.data(), &half, 2);
  for (int j = 0; j < 16; ++j) n4[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  ref::DequantRow(Matrix{n4.data(), DType::kIQ4_NL, 1, 32}, 0, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * kLevels[j]) << j;
    EXPECT_EQ(y[j + 16], 0.5f * kLevels[15 - j]) << j + 16;
  }
  std::vector<uint8_t> x4(136, 0);
  std::memcpy(x4.data(), &quarter, 2);
  uint16_t scales_h = 0;
  for (int s = 0; s < 8; ++s) {
    const int ls = 32 + s + 1;
    scales_h |= static_cast<uint16_t>((ls >> 4) << (2 * s));
    x4[4 + s / 2] |= static_cast<uint8_t>((ls & 0xF) << (4 * (s % 2)));
    for (int j = 0; j < 16; ++j) x4[8 + 16 * s + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  }
  std::memcpy(x4.data() + 2, &scales_h, 2);
  ref::DequantRow(Matrix{x4.data(), DType::kIQ4_XS, 1, 256}, 0, y);
  for (int i = 0; i < 256; ++i) {
    const int s = i / 32, j = i % 32;
    EXPECT_EQ(y[i], 0.25f * static_cast<float>(s + 1) * kLevels[j < 16 ? j : 31 - j]) << i;
  }
  // q6_K: d = 1, every scale 2, every q = 63 (ql 0xFF, qh 0xFF) -> 2 * 31
  std::vector<uint8_t> k6(210, 0xFF);
  for (int s = 0; s < 16; ++s) k6[192 + s] = 2;
  const uint16_t one = F32ToF16(1.0f);
  std::memcpy(k6.data() + 208, &one, 2);
  ref::DequantRow(Matrix{k6.data(), DType::kQ6_K, 1, 256}, 0, y);
  for (int j = 0; j < 256; ++j) EXPECT_EQ(y[j], 62.0f) << j;
  // q4_K: d = 1, dmin = 1, sub-block s has scale s + 1 and min 2s (6-bit packing), q = 1
  std::vector<uint8_t> k4(144, 0x11);
  std::memcpy(k4.data(), &one, 2);
  std::memcpy(k4.data() + 2, &one, 2);
  uint8_t* sc = k4.data() + 4;
  std::memset(sc, 0, 12);
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = static_cast<uint8_t>(j + 1 + (j >= 4 ? 40 : 0)),
                  lm = static_cast<uint8_t>(2 * j + (j >= 4 ? 33 : 0));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  ref::DequantRow(Matrix{k4.data(), DType::kQ4_K, 1, 256}, 0, y);
  for (int j = 0; j < 256; ++j) {
    const int s = j / 32;
    EXPECT_EQ(y[j], static_cast<float>(s + 1 + (s >= 4 ? 40 : 0)) - (2.0f * s + (s >= 4 ? 33 : 0)))
        << j;
  }
  // q5_K: q4_K's header, then qh: value l of sub-block s has its fifth bit when l == s (bit s of
  // qh[s]), so its code is 17; every other code is 1.
  std::vector<uint8_t> k5(176, 0x11);
  std::memcpy(k5.data(), k4.data(), 16);
  std::memset(k5.data() + 16, 0, 32);
  for (int s = 0; s < 8; ++s) k5[16 + s] |= static_cast<uint8_t>(1 << s);
  ref::DequantRow(Matrix{k5.data(), DType::kQ5_K, 1, 256}, 0, y);
  for (int j = 0; j < 256; ++j) {
    const int s = j / 32, code = j % 32 == s ? 17 : 1;
    EXPECT_EQ(y[j], static_cast<float>(code * (s + 1 + (s >= 4 ? 40 : 0))) -
                        (2.0f * s + (s >= 4 ? 33 : 0)))
        << j;
  }
}

// q3_K and q2_K: 2-bit codes, four 32-value blocks per 32 bytes, q3_K's third bits and 6-bit
// scales.
TEST(QuantKernels, ReferenceDequantTwoBitBlocks) {
  const uint16_t one = F32ToF16(1.0f), half = F32ToF16(0.5f);
  // Block k's code l: low bits (l + k) % 4; q3_K's third bit set only where l == k.
  auto low_code = [](int k, int l) { return (l + k) % 4; };
  std::vector<uint8_t> k3(110, 0);
  for (int k = 0; k < 8; ++k) {
    for (int l = 0; l < 32; ++l) {
      k3[32 + 32 * (k / 4) + l] |= static_cast<uint8_t>(low_code(k, l) << (2 * (k % 4)));
      if (l == k) k3[l] |= static_cast<uint8_t>(1 << k);
    }
  }
  // Half s has the scale s - 8: stored 24 + s, low 4 bits in nibble s / 8 of byte s % 8, high 2
  // in bits 2 (s / 4) of byte 8 + s % 4.
  for (int s = 0; s < 16; ++s) {
    const int ls = 24 + s;
    k3[96 + s % 8] |= static_cast<uint8_t>((ls & 0xF) << (s < 8 ? 0 : 4));
    k3[96 + 8 + s % 4] |= static_cast<uint8_t>((ls >> 4) << (2 * (s / 4)));
  }
  std::memcpy(k3.data() + 108, &one, 2);
  float y[256];
  ref::DequantRow(Matrix{k3.data(), DType::kQ3_K, 1, 256}, 0, y);
  for (int i = 0; i < 256; ++i) {
    const int k = i / 32, l = i % 32, s = 2 * k + l / 16;
    const int v = low_code(k, l) + (l == k ? 4 : 0) - 4;
    EXPECT_EQ(y[i], static_cast<float>((s - 8) * v)) << i;
  }
  // q2_K: d = 1, dmin = 0.5, half s has scale s and minimum 15 - s.
  std::vector<uint8_t> k2(84, 0);
  for (int s = 0; s < 16; ++s) k2[s] = static_cast<uint8_t>(s | ((15 - s) << 4));
  for (int k = 0; k < 8; ++k) {
    for (int l = 0; l < 32; ++l) {
      k2[16 + 32 * (k / 4) + l] |= static_cast<uint8_t>(low_code(k, l) << (2 * (k % 4)));
    }
  }
  std::memcpy(k2.data() + 80, &one, 2);
  std::memcpy(k2.data() + 82, &half, 2);
  ref::DequantRow(Matrix{k2.data(), DType::kQ2_K, 1, 256}, 0, y);
  for (int i = 0; i < 256; ++i) {
    const int k = i / 32, l = i % 32, s = 2 * k + l / 16;
    EXPECT_EQ(y[i], static_cast<float>(s * low_code(k, l)) - 0.5f * static_cast<float>(15 - s))
        << i;
  }
}

// ref::MatMul equals double-precision math over the reference dequantization.
TEST(QuantKernels, ReferenceMatMulMatchesDequantizedMath) {
  std::mt19937 rng(2);
  ThreadPool pool(1);
  for (DType t : kQuantTypes) {
    const int64_t cols = DTypeBlockElems(t) * 2, rows = 17, n = 3;
    QuantMatrix q = MakeMatrix(t, rows, cols, rng);
    std::vector<float> x = RandomVec(n * cols, rng), y(n * rows), expect(n * rows);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0;
        for (int64_t c = 0; c < cols; ++c) s += double(x[i * cols + c]) * q.deq[r * cols + c];
        expect[i * rows + r] = static_cast<float>(s);
      }
    }
    ref::MatMul(x.data(), n, q.m, nullptr, y.data(), rows, pool);
    EXPECT_LT(NormErr(y.data(), expect.data(), y.size()), 1e-5) << DTypeName(t);
  }
}

TEST(QuantKernels, CpuDequantRowMatchesReference) {
  std::mt19937 rng(3);
  for (int64_t target : testing::KernelTargets()) {
    ScopedTarget st(target);
    for (DType t : kQuantTypes) {
      for (int64_t blocks : {1, 3}) {
        const int64_t cols = DTypeBlockElems(t) * blocks;
        QuantMatrix q = MakeMatrix(t, 5, cols, rng);
        std::vector<float> got(cols);
        for (int64_t r = 0; r < 5; ++r) {
          cpu::DequantRow(q.m, r, got.data());
          EXPECT_LT(NormErr(got.data(), q.deq.data() + r * cols, cols), 1e-6)
              << DTypeName(t) << " cols=" << cols << " target=" << hwy::TargetName(target);
        }
      }
    }
  }
}

TEST(QuantKernels, CpuMatMulMatchesReference) {
  std::mt19937 rng(4);
  ThreadPool pool1(1), pool3(3);
  for (int64_t target : testing::KernelTargets()) {
    ScopedTarget st(target);
    for (DType t : kQuantTypes) {
      const int64_t be = DTypeBlockElems(t);
      for (int64_t rows : {1, 3, 17, 97}) {
        for (int64_t cols : {be, 2 * be, be == 32 ? int64_t{384} : int64_t{1024}}) {
          QuantMatrix q = MakeMatrix(t, rows, cols, rng);
          const std::vector<float> bias = RandomVec(rows, rng);
          for (int64_t n : {1, 2, 5, 17}) {
            const std::vector<float> x = RandomVec(n * cols, rng);
            const int64_t stride = rows + 3;
            std::vector<float> expect(n * stride, 7.0f);
            ref::MatMul(x.data(), n, q.m, bias.data(), expect.data(), stride, pool1);
            for (ThreadPool* pool : {&pool1, &pool3}) {
              std::vector<float> got(n * stride, 7.0f);
              cpu::DequantMatMul(x.data(), n, q.m, bias.data(), got.data(), stride, *pool);
              const std::string what = std::string(DTypeName(t)) + " rows=" + std::to_string(rows) +
                                       " cols=" + std::to_string(cols) + " n=" + std::to_string(n) +
                                       " threads=" + std::to_string(pool->size()) +
                                       " target=" + hwy::TargetName(target);
              EXPECT_LT(NormErr(got.data(), expect.data(), got.size()), 1e-5) << what;
              for (int64_t i = 0; i < n; ++i) {
                for (int64_t r = rows; r < stride; ++r) {
                  ASSERT_EQ(got[i * stride + r], 7.0f) << what << ": wrote past rows";
                }
              }
            }
          }
        }
      }
    }
  }
}

// The int8 path: SIMD quantization of activations gives the reference's codes bit for bit
// (zero blocks, rounding ties, saturation at +-127 included).
TEST(QuantKernels, Int8QuantizeMatchesReference) {
  if (!cpu::HasInt8Kernels()) GTEST_SKIP() << "this CPU has no AVX-512 VNNI: no int8 kernels";
  std::mt19937 rng(6);
  std::vector<float> x = RandomVec(32 * 6, rng);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);           // an all-zero block
  for (int j = 0; j < 32; ++j) x[64 + j] = 0.5f * (j - 16);  // ties at x * 127 / 8
  x[100] = 1e30f;                                            // one huge value
  std::vector<int8_t> qr(x.size()), qc(x.size());
  std::vector<float> dr(6), dc(6), sr(6), sc(6);
  ref::QuantizeQ8(x.data(), x.size(), qr.data(), dr.data(), sr.data());
  cpu::QuantizeQ8(x.data(), x.size(), qc.data(), dc.data(), sc.data());
  EXPECT_EQ(qr, qc);
  EXPECT_EQ(dr, dc);
  EXPECT_EQ(sr, sc);
  EXPECT_EQ(dr[1], 0.0f);
  EXPECT_EQ(qr[64 + 31], 119);  // 7.5 / (8 / 127) = 119.06
}

// cpu::Int8MatMul against ref::Int8MatMul on awkward shapes: rows not a multiple of prefill's
// 16-row tile (one row past two tiles, several tiles a task and a short last one), rows of 1, 3, 4
// and 7 blocks (q4_0 decode reads four at a time: a lone partial group, one whole, one of each),
// token counts across the decode path, the 16-token tile and several tiles, 1 and 3 threads.
TEST(QuantKernels, Int8MatMulMatchesReference) {
  if (!cpu::HasInt8Kernels()) GTEST_SKIP() << "this CPU has no AVX-512 VNNI: no int8 kernels";
  std::mt19937 rng(7);
  ThreadPool pool1(1), pool3(3);
  for (DType t : kQuantTypes) {
    const int64_t be = DTypeBlockElems(t);
    for (int64_t rows : {1, 3, 33, 70}) {
      for (int64_t cols : {be, 3 * be, 4 * be, 7 * be}) {
        QuantMatrix q = MakeMatrix(t, rows, cols, rng);
        const std::vector<float> bias = RandomVec(rows, rng);
        for (int64_t n : {1, 2, 6, 7, 19, 133}) {
          const std::vector<float> x = RandomVec(n * cols, rng);
          const int64_t stride = rows + 3;
          std::vector<float> expect(n * stride, 7.0f);
          ref::Int8MatMul(x.data(), n, q.m, bias.data(), expect.data(), stride, pool1);
          for (ThreadPool* pool : {&pool1, &pool3}) {
            std::vector<float> got(n * stride, 7.0f);
            cpu::Int8MatMul(x.data(), n, q.m, bias.data(), got.data(), stride, *pool);
            const std::string what = std::string(DTypeName(t)) + " rows=" + std::to_string(rows) +
                                     " cols=" + std::to_string(cols) + " n=" + std::to_string(n) +
                                     " threads=" + std::to_string(pool->size());
            EXPECT_LT(NormErr(got.data(), expect.data(), got.size()), 1e-5) << what;
            for (int64_t i = 0; i < n; ++i) {
              for (int64_t r = rows; r < stride; ++r) {
                ASSERT_EQ(got[i * stride + r], 7.0f) << what << ": wrote past rows";
              }
            }
            // A token's outputs do not depend on the tokens it is computed with, within a path:
            // the last kInt8MaxDecodeTokens + 1 tokens by prefill, the last token alone by decode.
            const int64_t m = n > cpu::kInt8MaxDecodeTokens ? cpu::kInt8MaxDecodeTokens + 1 : 1;
            std::vector<float> tail(m * stride, 7.0f);
            cpu::Int8MatMul(x.data() + (n - m) * cols, m, q.m, bias.data(), tail.data(), stride,
                            *pool);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t r = 0; r < rows; ++r) {
                ASSERT_EQ(tail[i * stride + r], got[(n - m + i) * stride + r])
                    << what << " token " << n - m + i << " among the last " << m << ", row " << r;
              }
            }
          }
        }
      }
    }
  }
}

// 8-bit activations cost little accuracy: the int8 reference is within 1% of f32 arithmetic on
// the same weights, and QuantMatMul takes the int8 path where the CPU has it.
TEST(QuantKernels, Int8PathIsCloseToF32AndDispatched) {
  std::mt19937 rng(8);
  ThreadPool pool(2);
  for (DType t : kQuantTypes) {
    QuantMatrix q = MakeMatrix(t, 33, 512, rng);
    const std::vector<float> x = RandomVec(5 * 512, rng);
    std::vector<float> f32(5 * 33), i8(5 * 33), got(5 * 33);
    ref::MatMul(x.data(), 5, q.m, nullptr, f32.data(), 33, pool);
    ref::Int8MatMul(x.data(), 5, q.m, nullptr, i8.data(), 33, pool);
    const double err = NormErr(i8.data(), f32.data(), i8.size());
    EXPECT_LT(err, 1e-2) << DTypeName(t);
    EXPECT_GT(err, 0.0) << DTypeName(t);
    cpu::QuantMatMul(x.data(), 5, q.m, nullptr, got.data(), 33, pool);
    EXPECT_LT(NormErr(got.data(), cpu::HasInt8Kernels() ? i8.data() : f32.data(), got.size()), 1e-5)
        << DTypeName(t);
  }
}

// The dispatching entry points route quantized matrices to these kernels.
TEST(QuantKernels, DispatchingEntryPoints) {
  std::mt19937 rng(5);
  ThreadPool pool(2);
  QuantMatrix q = MakeMatrix(DType::kQ6_K, 9, 512, rng);
  const std::vector<float> x = RandomVec(4 * 512, rng);
  std::vector<float> a(4 * 9), b(4 * 9), row(512);
  MatMul(x.data(), 4, q.m, nullptr, a.data(), 9, pool);
  (cpu::HasInt8Kernels() ? ref::Int8MatMul : ref::MatMul)(x.data(), 4, q.m, nullptr, b.data(), 9,
                                                          pool);
  EXPECT_LT(NormErr(a.data(), b.data(), a.size()), 1e-5);
  DequantRow(q.m, 8, row.data());
  EXPECT_LT(NormErr(row.data(), q.deq.data() + 8 * 512, 512), 1e-6);
}

}  // namespace
}  // namespace cachet::kernels
