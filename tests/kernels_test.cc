// Kernel tests in the style of llama.cpp's test-backend-ops: the reference kernels are checked
// against straightforward double-precision math, then every cpu:: kernel against its ref:: twin on
// awkward shapes, dtypes, strides and thread counts. PagedAttention (cpu and ref) is checked
// against ref::ContiguousAttention over the same keys.
#include "kernels/kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_keys.h"
#include "simd_targets.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace cachet::kernels {
namespace {

constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr int64_t kDims[] = {1, 3, 17, 31, 64, 97, 384, 1000, 1024 + 5};

std::vector<float> RandomVec(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ||a - b|| / ||b||, or ||a - b|| when b is all zeros.
double NormErr(const float* a, const float* b, size_t n) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    ref += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(diff)) return std::numeric_limits<double>::infinity();
  return ref == 0.0 ? std::sqrt(diff) : std::sqrt(diff / ref);
}
double NormErr(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return NormErr(a.data(), b.data(), std::min(a.size(), b.size()));
}

// A weight matrix in a given dtype, with its values as f32 (exactly representable in the dtype).
struct TestMatrix {
  std::vector<float> values;   // rows * cols, already rounded to the dtype
  std::vector<uint16_t> half;  // storage for f16 / bf16
  Matrix m;
};

TestMatrix MakeMatrix(int64_t rows, int64_t cols, DType dtype, std::mt19937& rng) {
  TestMatrix t;
  t.values = RandomVec(static_cast<size_t>(rows * cols), rng);
  if (dtype != DType::kF32) {
    t.half.resize(t.values.size());
    for (size_t i = 0; i < t.values.size(); ++i) {
      t.half[i] = dtype == DType::kBF16 ? F32ToBf16(t.values[i]) : F32ToF16(t.values[i]);
      t.values[i] = LoadAsF32(t.half.data(), dtype, static_cast<int64_t>(i));
    }
  }
  t.m.data = dtype == DType::kF32 ? static_cast<const void*>(t.values.data()) : t.half.data();
  t.m.dtype = dtype;
  t.m.rows = rows;
  t.m.cols = cols;
  return t;
}

using testing::KernelTargets;
using testing::ScopedTarget;
using testing::TargetString;

std::string Describe(DType dtype, int64_t rows, int64_t cols, int64_t n) {
  return std::string(DTypeName(dtype)) + " rows=" + std::to_string(rows) +
         " cols=" + std::to_string(cols) + " n=" + std::to_string(n);
}

// ------------------------------------------------------------------------------------------------
// Reference kernels against plain math.

TEST(KernelsRef, MatMulSmallExact) {
  ThreadPool pool(1);
  const float w_values[] = {1.0f, 0.0f, -1.0f, 0.5f, 0.25f, 2.0f};  // [2][3], exact in all dtypes
  const float x[] = {1.0f, 2.0f, 3.0f, -1.0f, 0.0f, 4.0f};          // two tokens
  const float bias[] = {1.0f, -1.0f};
  for (DType dtype : kAllTypes) {
    std::vector<uint16_t> half(6);
    for (int i = 0; i < 6; ++i) {
      half[i] = dtype == DType::kBF16 ? F32ToBf16(w_values[i]) : F32ToF16(w_values[i]);
    }
    Matrix w{dtype == DType::kF32 ? static_cast<const void*>(w_values) : half.data(), dtype, 2, 3};
    float y[2 * 3];
    std::fill(y, y + 6, 99.0f);
    ref::MatMul(x, 2, w, bias, y, 3, pool);
    EXPECT_EQ(y[0], -1.0f) << DTypeName(dtype);  // 1 - 3 + 1
    EXPECT_EQ(y[1], 6.0f) << DTypeName(dtype);   // 0.5 + 0.5 + 6 - 1
    EXPECT_EQ(y[2], 99.0f) << DTypeName(dtype);  // stride padding untouched
    EXPECT_EQ(y[3], -4.0f) << DTypeName(dtype);  // -1 - 4 + 1
    EXPECT_EQ(y[4], 6.5f) << DTypeName(dtype);   // -0.5 + 8 - 1
    float row[3];
    ref::DequantRow(w, 1, row);
    EXPECT_EQ(row[0], 0.5f);
    EXPECT_EQ(row[2], 2.0f);
  }
}

TEST(KernelsRef, MatMulMatchesDouble) {
  std::mt19937 rng(1);
  ThreadPool pool(3);
  const int64_t rows = 37, cols = 531, n = 3;
  for (DType dtype : kAllTypes) {
    TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
    std::vector<float> x = RandomVec(n * cols, rng);
    std::vector<float> bias = RandomVec(rows, rng);
    std::vector<float> y(n * rows), expect(n * rows);
    ref::MatMul(x.data(), n, w.m, bias.data(), y.data(), rows, pool);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        double s = bias[r];
        for (int64_t c = 0; c < cols; ++c)
          s += static_cast<double>(x[t * cols + c]) * w.values[r * cols + c];
        expect[t * rows + r] = static_cast<float>(s);
      }
    }
    EXPECT_LT(NormErr(y, expect), 1e-6) << DTypeName(dtype);
  }
}

TEST(KernelsRef, ElementwiseMatchDouble) {
  std::mt19937 rng(2);
  const int64_t dim = 97;
  std::vector<float> x = RandomVec(dim, rng, -3.0f, 3.0f);
  std::vector<float> weight = RandomVec(dim, rng);
  std::vector<float> y(dim), expect(dim);
  const float eps = 1e-6f;
  ref::RmsNorm(x.data(), weight.data(), dim, eps, y.data());
  double ss = 0.0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const double inv = 1.0 / std::sqrt(ss / dim + eps);
  for (int64_t i = 0; i < dim; ++i) expect[i] = static_cast<float>(x[i] * inv * weight[i]);
  EXPECT_LT(NormErr(y, expect), 1e-6);

  std::vector<float> up = RandomVec(dim, rng);
  ref::SiluMul(x.data(), up.data(), y.data(), dim);
  for (int64_t i = 0; i < dim; ++i)
    expect[i] = static_cast<float>(x[i] / (1.0 + std::exp(-static_cast<double>(x[i]))) * up[i]);
  EXPECT_LT(NormErr(y, expect), 1e-6);

  // Rotate-half RoPE of two heads of 8: pairs (i, i + 4) rotate by the angle of cos/sin[i].
  const int n_heads = 2, head_dim = 8;
  std::vector<float> q = RandomVec(n_heads * head_dim, rng);
  std::vector<float> cos(head_dim / 2), sin(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    cos[i] = std::cos(0.3f * (i + 1));
    sin[i] = std::sin(0.3f * (i + 1));
  }
  std::vector<float> rotated = q;
  ref::RopeRotateHalf(rotated.data(), n_heads, head_dim, cos.data(), sin.data());
  for (int h = 0; h < n_heads; ++h) {
    for (int i = 0; i < head_dim / 2; ++i) {
      const double x0 = q[h * head_dim + i], x1 = q[h * head_dim + i + head_dim / 2];
      EXPECT_NEAR(rotated[h * head_dim + i], x0 * cos[i] - x1 * sin[i], 1e-6);
      EXPECT_NEAR(rotated[h * head_dim + i + head_dim / 2], x1 * cos[i] + x0 * sin[i], 1e-6);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// cpu:: against ref::.

TEST(KernelsCpu, DequantRowMatchesRefExactly) {
  std::mt19937 rng(3);
  for (DType dtype : kAllTypes) {
    for (int64_t cols : kDims) {
      const int64_t rows = 3;
      std::vector<uint32_t> bits(rows * cols);
      std::vector<uint16_t> half(rows * cols);
      for (int64_t i = 0; i < rows * cols; ++i) {
        uint32_t b = rng();
        if (dtype == DType::kF16) {
          b &= 0xffffu;
          if (((b >> 10) & 0x1fu) == 0x1fu) b &= ~0x4000u;  // no inf/NaN; subnormals included
          half[i] = static_cast<uint16_t>(b);
        } else if (dtype == DType::kBF16) {
          b &= 0xffffu;
          if (((b >> 7) & 0xffu) == 0xffu) b &= ~0x4000u;
          half[i] = static_cast<uint16_t>(b);
        } else {
          if (((b >> 23) & 0xffu) == 0xffu) b &= ~0x40000000u;
          bits[i] = b;
        }
      }
      Matrix w{dtype == DType::kF32 ? static_cast<const void*>(bits.data()) : half.data(), dtype,
               rows, cols};
      for (int64_t target : KernelTargets()) {
        ScopedTarget scoped(target);
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<float> a(cols), b(cols);
          cpu::DequantRow(w, r, a.data());
          ref::DequantRow(w, r, b.data());
          EXPECT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * cols), 0)
              << DTypeName(dtype) << " cols=" << cols << " row=" << r << TargetString(target);
        }
      }
    }
  }
}

// Checks cpu::MatMul against ref::MatMul on one matrix and input, for every target, with and
// without bias, on 1 and 3 threads, with y_stride = rows and larger: normalized error, and the y
// padding (columns [rows, y_stride)) untouched.
void CheckMatMul(const TestMatrix& w, const std::vector<float>& x, int64_t n,
                 const std::vector<float>& bias, ThreadPool& pool1, ThreadPool& pool3,
                 const std::string& what) {
  const int64_t rows = w.m.rows;
  // ref::MatMul without bias; the bias is then added to each output, as MatMul defines it.
  std::vector<float> expect[2];
  expect[0].resize(n * rows);
  ref::MatMul(x.data(), n, w.m, nullptr, expect[0].data(), rows, pool1);
  expect[1] = expect[0];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < rows; ++r) expect[1][t * rows + r] += bias[r];
  }
  constexpr float kSentinel = -12345.0f;
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    for (int variant = 0; variant < 4; ++variant) {
      const int with_bias = variant & 1;
      ThreadPool& pool = (variant & 2) ? pool3 : pool1;
      const int64_t y_stride = rows + (variant == 3 ? 7 : variant);
      std::vector<float> y(n * y_stride, kSentinel);
      cpu::MatMul(x.data(), n, w.m, with_bias ? bias.data() : nullptr, y.data(), y_stride, pool);
      std::vector<float> got;
      for (int64_t t = 0; t < n; ++t) {
        got.insert(got.end(), y.begin() + t * y_stride, y.begin() + t * y_stride + rows);
        for (int64_t r = rows; r < y_stride; ++r) {
          ASSERT_EQ(y[t * y_stride + r], kSentinel)
              << what << TargetString(target) << ": wrote past rows";
        }
      }
      EXPECT_LT(NormErr(got, expect[with_bias]), 1e-5)
          << what << " bias=" << with_bias << " threads=" << pool.size() << " y_stride=" << y_stride
          << TargetString(target);
    }
  }
}

// Decode over a matrix past kDecodeStreamBytes (8 MiB), which the kernel reads one row at a time
// as a DRAM stream: the reference's values, and each row's bits those of the same row read from a
// cache-resident matrix (rows in groups of eight), on 1 and 3 threads and every target.
TEST(KernelsCpu, StreamedMatVecRowsMatchResident) {
  std::mt19937 rng(41);
  ThreadPool pool1(1), pool3(3);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const int64_t cols = 2048, rows = (int64_t{9} << 20) / (cols * DTypeSize(dtype)) + 3;
    TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
    const std::vector<float> x = RandomVec(cols, rng), bias = RandomVec(rows, rng);
    std::vector<float> expect(rows);
    ref::MatMul(x.data(), 1, w.m, bias.data(), expect.data(), rows, pool1);
    for (int64_t target : KernelTargets()) {
      ScopedTarget scoped(target);
      for (ThreadPool* pool : {&pool1, &pool3}) {
        const std::string what = std::string(DTypeName(dtype)) +
                                 " threads=" + std::to_string(pool->size()) + TargetString(target);
        std::vector<float> got(rows);
        cpu::MatMul(x.data(), 1, w.m, bias.data(), got.data(), rows, *pool);
        EXPECT_LT(NormErr(got, expect), 1e-5) << what;
        // A resident matrix of 67 of the same rows (from row 1000): the same bits per row.
        Matrix part = w.m;
        part.data = static_cast<const uint8_t*>(w.m.data) + 1000 * cols * DTypeSize(dtype);
        part.rows = 67;
        std::vector<float> alone(part.rows);
        cpu::MatMul(x.data(), 1, part, bias.data() + 1000, alone.data(), part.rows, *pool);
        for (int64_t r = 0; r < part.rows; ++r) {
          ASSERT_EQ(alone[r], got[1000 + r]) << what << " row " << 1000 + r;
        }
      }
    }
  }
}

TEST(KernelsCpu, MatMulMatchesRef) {
  std::mt19937 rng(4);
  ThreadPool pool1(1), pool3(3);
  for (DType dtype : kAllTypes) {
    for (int64_t rows : kDims) {
      for (int64_t cols : kDims) {
        TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
        std::vector<float> bias = RandomVec(rows, rng);
        for (int64_t n : {1, 2, 3, 5}) {
          std::vector<float> x = RandomVec(n * cols, rng);
          CheckMatMul(w, x, n, bias, pool1, pool3, Describe(dtype, rows, cols, n));
        }
      }
    }
  }
}

TEST(KernelsCpu, MatMulManyTokensMatchesRef) {
  std::mt19937 rng(5);
  ThreadPool pool1(1), pool3(3);
  for (DType dtype : kAllTypes) {
    for (int64_t rows : {1, 17, 97, 384, 1029}) {
      for (int64_t cols : {3, 31, 384, 1029}) {
        TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
        std::vector<float> bias = RandomVec(rows, rng);
        for (int64_t n : {17, 64}) {
          std::vector<float> x = RandomVec(n * cols, rng);
          CheckMatMul(w, x, n, bias, pool1, pool3, Describe(dtype, rows, cols, n));
        }
      }
    }
  }
}

// Each output is computed with the same operation order whatever the thread count.
TEST(KernelsCpu, MatMulIndependentOfThreadCount) {
  std::mt19937 rng(6);
  ThreadPool pool1(1), pool3(3);
  for (DType dtype : kAllTypes) {
    for (int64_t n : {1, 7, 37}) {
      const int64_t cols = n == 37 ? 1029 : 391;  // 1029: the column-chunked prefill path
      TestMatrix w = MakeMatrix(1029, cols, dtype, rng);
      std::vector<float> x = RandomVec(n * cols, rng);
      for (int64_t target : KernelTargets()) {
        ScopedTarget scoped(target);
        std::vector<float> y1(n * 1029), y3(n * 1029);
        cpu::MatMul(x.data(), n, w.m, nullptr, y1.data(), 1029, pool1);
        cpu::MatMul(x.data(), n, w.m, nullptr, y3.data(), 1029, pool3);
        EXPECT_EQ(std::memcmp(y1.data(), y3.data(), sizeof(float) * y1.size()), 0)
            << DTypeName(dtype) << " n=" << n << TargetString(target);
      }
    }
  }
}

TEST(KernelsCpu, ElementwiseMatchRef) {
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    const std::string tn = TargetString(target);
    std::mt19937 rng(7);
    for (int64_t dim : kDims) {
      std::vector<float> x = RandomVec(dim, rng, -4.0f, 4.0f);
      std::vector<float> weight = RandomVec(dim, rng);
      std::vector<float> a(dim), b(dim);
      cpu::RmsNorm(x.data(), weight.data(), dim, 1e-6f, a.data());
      ref::RmsNorm(x.data(), weight.data(), dim, 1e-6f, b.data());
      EXPECT_LT(NormErr(a, b), 1e-5) << "RmsNorm dim=" << dim << tn;
      a = x;  // in place
      cpu::RmsNorm(a.data(), weight.data(), dim, 1e-6f, a.data());
      EXPECT_LT(NormErr(a, b), 1e-5) << "RmsNorm in place dim=" << dim << tn;

      // Gates spanning the saturating ranges of exp.
      std::vector<float> gate = RandomVec(dim, rng, -30.0f, 30.0f);
      if (dim > 2) {
        gate[0] = -200.0f;
        gate[1] = 150.0f;
      }
      std::vector<float> up = RandomVec(dim, rng);
      cpu::SiluMul(gate.data(), up.data(), a.data(), dim);
      ref::SiluMul(gate.data(), up.data(), b.data(), dim);
      EXPECT_LT(NormErr(a, b), 1e-5) << "SiluMul dim=" << dim << tn;
      for (int64_t i = 0; i < dim; ++i) {
        ASSERT_NEAR(a[i], b[i], 1e-6f * (1.0f + std::fabs(b[i])))
            << "SiluMul dim=" << dim << " i=" << i << tn;
      }
      a = gate;  // out aliases gate
      cpu::SiluMul(a.data(), up.data(), a.data(), dim);
      EXPECT_LT(NormErr(a, b), 1e-5) << "SiluMul in place dim=" << dim << tn;
    }
    for (int head_dim : {2, 6, 34, 64, 80, 128, 256}) {
      for (int n_heads : {1, 3, 14}) {
        std::vector<float> x = RandomVec(static_cast<size_t>(n_heads) * head_dim, rng);
        std::vector<float> cos(head_dim / 2), sin(head_dim / 2);
        for (int i = 0; i < head_dim / 2; ++i) {
          const float angle = 37.0f * std::pow(10000.0f, -2.0f * i / head_dim);
          cos[i] = std::cos(angle);
          sin[i] = std::sin(angle);
        }
        std::vector<float> a = x, b = x;
        cpu::RopeRotateHalf(a.data(), n_heads, head_dim, cos.data(), sin.data());
        ref::RopeRotateHalf(b.data(), n_heads, head_dim, cos.data(), sin.data());
        EXPECT_LT(NormErr(a, b), 1e-5)
            << "Rope head_dim=" << head_dim << " n_heads=" << n_heads << tn;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Attention.

// A paged K/V cache holding given keys in a shuffled set of slots, plus the same keys as contiguous
// arrays in logical order. Unused slot memory is NaN and unused positions are -1 (visible to every
// query), so a kernel that reads past a page's tokens fails.
struct TestKv {
  int head_dim = 0, page_tokens = 0, n_tokens = 0;
  std::vector<float> slots;
  std::vector<int32_t> positions;
  std::vector<int32_t> page_ids;
  std::vector<float> k, v;
  std::vector<int32_t> k_pos;
  PagedKv view;
};

TestKv MakeKv(const std::vector<int32_t>& key_pos, int page_tokens, int head_dim,
              std::mt19937& rng) {
  TestKv kv;
  kv.head_dim = head_dim;
  kv.page_tokens = page_tokens;
  kv.n_tokens = static_cast<int>(key_pos.size());
  kv.k_pos = key_pos;
  kv.k = RandomVec(key_pos.size() * head_dim, rng);
  kv.v = RandomVec(key_pos.size() * head_dim, rng);
  const int n_pages = (kv.n_tokens + page_tokens - 1) / page_tokens;
  const int n_slots = n_pages + 3;
  const int64_t slot_floats = 2 * static_cast<int64_t>(page_tokens) * head_dim + 5;
  kv.slots.assign(n_slots * slot_floats, std::numeric_limits<float>::quiet_NaN());
  kv.positions.assign(static_cast<size_t>(n_slots) * page_tokens, -1);
  std::vector<int32_t> perm(n_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  kv.page_ids.assign(perm.begin(), perm.begin() + n_pages);
  for (int j = 0; j < kv.n_tokens; ++j) {
    const int64_t slot = kv.page_ids[j / page_tokens];
    const int in_page = j % page_tokens;
    float* base = kv.slots.data() + slot * slot_floats;
    std::copy_n(&kv.k[static_cast<size_t>(j) * head_dim], head_dim, base + in_page * head_dim);
    std::copy_n(&kv.v[static_cast<size_t>(j) * head_dim], head_dim,
                base + (page_tokens + in_page) * head_dim);
    kv.positions[slot * page_tokens + in_page] = key_pos[j];
  }
  kv.view.slots = kv.slots.data();
  kv.view.positions = kv.positions.data();
  kv.view.slot_floats = slot_floats;
  kv.view.page_tokens = page_tokens;
  kv.view.head_dim = head_dim;
  kv.view.page_ids = kv.page_ids.data();
  kv.view.n_tokens = kv.n_tokens;
  return kv;
}

// Queries and output buffers for n_tok tokens of a GQA group, with padded strides.
struct TestQueries {
  std::vector<float> q;
  std::vector<int32_t> q_pos;
  int n_heads = 0, head_dim = 0;
  int64_t q_stride = 0, out_stride = 0;

  AttnBatch Batch(std::vector<float>& out, float scale) const {
    out.assign(q_pos.size() * out_stride, 777.0f);
    AttnBatch b;
    b.q = q.data();
    b.q_stride = q_stride;
    b.out = out.data();
    b.out_stride = out_stride;
    b.q_pos = q_pos.data();
    b.n_tok = static_cast<int>(q_pos.size());
    b.n_heads = n_heads;
    b.scale = scale;
    return b;
  }
  // The outputs without stride padding; fails if the padding was written.
  std::vector<float> Compact(const std::vector<float>& out) const {
    std::vector<float> c;
    const int64_t row = static_cast<int64_t>(n_heads) * head_dim;
    for (size_t t = 0; t < q_pos.size(); ++t) {
      c.insert(c.end(), out.begin() + t * out_stride, out.begin() + t * out_stride + row);
      for (int64_t i = row; i < out_stride; ++i) EXPECT_EQ(out[t * out_stride + i], 777.0f);
    }
    return c;
  }
};

TestQueries MakeQueries(std::vector<int32_t> q_pos, int n_heads, int head_dim, std::mt19937& rng) {
  TestQueries q;
  q.n_heads = n_heads;
  q.head_dim = head_dim;
  q.q_stride = static_cast<int64_t>(n_heads) * head_dim + 3;
  q.out_stride = static_cast<int64_t>(n_heads) * head_dim + 7;
  q.q_pos = std::move(q_pos);
  q.q = RandomVec(q.q_pos.size() * q.q_stride, rng);
  return q;
}

// Runs ref::ContiguousAttention, ref::PagedAttention and cpu::PagedAttention and compares.
void CheckAttention(const TestKv& kv, const TestQueries& q, float scale, const std::string& what) {
  std::vector<float> out_contig, out_ref, out_cpu;
  ref::ContiguousAttention(q.Batch(out_contig, scale), kv.k.data(), kv.v.data(), kv.k_pos.data(),
                           kv.n_tokens, kv.head_dim);
  ref::PagedAttention(q.Batch(out_ref, scale), kv.view);
  const std::vector<float> expect = q.Compact(out_contig);
  EXPECT_LT(NormErr(q.Compact(out_ref), expect), 1e-6) << "ref " << what;
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    cpu::PagedAttention(q.Batch(out_cpu, scale), kv.view);
    EXPECT_LT(NormErr(q.Compact(out_cpu), expect), 1e-5) << "cpu " << what << TargetString(target);
  }
}

// Scores against q4_0 / q8_0 keys (block_keys.h): the cpu kernel (lanes are keys, 16 at a time,
// two blocks at a time) gives the reference's bits on awkward shapes: key counts around 16, a
// lone last block (head_dim 96), more query rows than one pass of 32; and both are within the
// 8-bit query rounding of the f32 dot product with the decoded keys.
TEST(KernelsCpu, BlockKeyScoresMatchRef) {
  std::mt19937 rng(10);
  for (DType t : {DType::kQ4_0, DType::kQ8_0}) {
    for (int hd : {32, 64, 96, 128}) {
      for (int cnt : {1, 6, 15, 16, 17, 40}) {
        for (int n_rows : {1, 4, 33}) {
          const std::string what = std::string(DTypeName(t)) + " hd=" + std::to_string(hd) +
                                   " keys=" + std::to_string(cnt) +
                                   " rows=" + std::to_string(n_rows);
          const size_t row_bytes = DTypeRowBytes(t, hd);
          std::vector<float> keys = RandomVec(size_t(cnt) * hd, rng, -2.0f, 2.0f);
          std::vector<uint8_t> kq(cnt * row_bytes);
          std::vector<float> decoded(keys.size());
          for (int j = 0; j < cnt; ++j) {
            ref::QuantizeRow(t, keys.data() + size_t(j) * hd, hd, kq.data() + j * row_bytes);
            ref::QuantDequantRow({kq.data(), t, cnt, hd}, j, decoded.data() + size_t(j) * hd);
          }
          const int nb = hd / 32;
          std::vector<float> q = RandomVec(size_t(n_rows) * hd, rng, -3.0f, 3.0f);
          std::vector<int8_t> codes(q.size()), codes_ref(q.size());
          std::vector<float> d(size_t(n_rows) * nb), d_ref(d.size());
          std::vector<int32_t> sum(d.size()), sum_ref(d.size());
          std::vector<QueryQ8> rows(n_rows);
          for (int r = 0; r < n_rows; ++r) {
            const size_t o = size_t(r) * hd, ob = size_t(r) * nb;
            cpu::QuantizeQuery(q.data() + o, hd, &codes[o], &d[ob], &sum[ob]);
            ref::QuantizeQuery(q.data() + o, hd, &codes_ref[o], &d_ref[ob], &sum_ref[ob]);
            rows[r] = {&codes[o], &d[ob], &sum[ob]};
          }
          ASSERT_EQ(codes, codes_ref) << what;
          ASSERT_EQ(d, d_ref) << what;
          ASSERT_EQ(sum, sum_ref) << what;
          const int s_stride = cnt + 3;
          const float scale = 0.3f;
          std::vector<float> got(size_t(n_rows) * s_stride, -7.0f), want(got);
          cpu::BlockKeyScores(kq.data(), t, cnt, hd, rows.data(), n_rows, scale, got.data(),
                              s_stride);
          ref::BlockKeyScores(kq.data(), t, cnt, hd, rows.data(), n_rows, scale, want.data(),
                              s_stride);
          ASSERT_EQ(got, want) << what;  // the padding past cnt untouched too
          for (int r = 0; r < n_rows; ++r) {
            for (int j = 0; j < cnt; ++j) {
              double dot = 0, norm = 0;
              for (int i = 0; i < hd; ++i) {
                dot += double(q[size_t(r) * hd + i]) * decoded[size_t(j) * hd + i];
                norm += std::fabs(double(q[size_t(r) * hd + i]) * decoded[size_t(j) * hd + i]);
              }
              // Each query code is within d / 2 of its value: 1 / 254 of the block's maximum.
              ASSERT_NEAR(got[size_t(r) * s_stride + j], scale * dot, scale * 0.02 * norm + 1e-5)
                  << what << " row " << r << " key " << j;
            }
          }
        }
      }
    }
  }
}

// f16 rounded toward -inf and +inf: the nearest f16 on the right side, every value that is one
// (zeros, subnormals, the largest finite, beyond it, negatives) kept exactly.
TEST(KernelsRef, F16RoundedOutwardBoundsItsValue) {
  std::mt19937 rng(3);
  std::vector<float> xs = {0.0f,      -0.0f,    1.0f,      -1.0f,          65504.0f,
                           -65504.0f, 70000.0f, -70000.0f, 5.96046448e-8f, -5.96046448e-8f,
                           1e-9f,     -1e-9f,   3.14159f,  -2.71828f};
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (int i = 0; i < 2000; ++i) xs.push_back(std::ldexp(u(rng), int(rng() % 30) - 20));
  for (float x : xs) {
    const float down = F16ToF32(F32ToF16Down(x)), up = F16ToF32(F32ToF16Up(x));
    ASSERT_LE(down, x) << x;
    ASSERT_GE(up, x) << x;
    const float near = F16ToF32(F32ToF16(x));
    if (near == x) {  // representable: kept as it is
      ASSERT_EQ(down, x) << x;
      ASSERT_EQ(up, x) << x;
    } else if (std::abs(x) <= 65504.0f) {  // the two f16 around x
      ASSERT_TRUE(down == near || up == near) << x;
      ASSERT_LT(up - down, std::max(std::abs(x) * 2e-3f, 1.2e-7f)) << x;
    }
  }
}

// Quest's page bounds: the per-channel min/max of a page's keys (exact), and the upper bound of
// q.k they give in f16 rounded outward, max over a group's heads (the cpu kernel sums in lanes:
// 1e-5), which no key of the page exceeds.
// The read-bandwidth probe sums every word once, whatever the start's alignment and the tail.
TEST(KernelsCpu, SumWordsMatchesRef) {
  std::mt19937_64 rng(3);
  std::vector<uint64_t> words(1000);
  for (uint64_t& w : words) w = rng();  // wraps: the sums are mod 2^64 on both sides
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    for (int64_t start : {0, 1, 3}) {
      for (int64_t n : {0, 1, 7, 31, 32, 33, 64, 997 - 3}) {
        for (bool prefetch : {false, true}) {
          EXPECT_EQ(cpu::SumWords(words.data() + start, n, prefetch),
                    ref::SumWords(words.data() + start, n, prefetch))
              << "start " << start << " n " << n << " prefetch " << prefetch
              << TargetString(target);
        }
      }
    }
  }
  EXPECT_EQ(ref::SumWords(words.data(), 2, false), words[0] + words[1]);
}

TEST(KernelsCpu, QuestBoundsMatchRef) {
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    const std::string tn = TargetString(target);
    std::mt19937 rng(9);
    for (int hd : {40, 64, 128}) {
      for (int n : {1, 7, 16}) {
        const int n_pages = 5, n_heads = 3;
        std::vector<float> keys = RandomVec(size_t(n_pages) * n * hd, rng, -3.0f, 3.0f);
        std::vector<float> lohi(2 * hd), ref_b(hd * 2);
        std::vector<uint16_t> bounds;  // f16, rounded outward, as Quest keeps them
        for (int p = 0; p < n_pages; ++p) {
          const float* k = keys.data() + size_t(p) * n * hd;
          cpu::KeyBounds(k, n, hd, lohi.data(), lohi.data() + hd);
          ref::KeyBounds(k, n, hd, ref_b.data(), ref_b.data() + hd);
          ASSERT_EQ(lohi, ref_b) << "hd=" << hd << " n=" << n << tn;
          for (int i = 0; i < hd; ++i) bounds.push_back(F32ToF16Down(lohi[i]));
          for (int i = hd; i < 2 * hd; ++i) bounds.push_back(F32ToF16Up(lohi[i]));
        }
        std::vector<float> q = RandomVec(size_t(n_heads) * hd, rng, -2.0f, 2.0f);
        std::vector<float> a(n_pages), b(n_pages);
        cpu::PageBoundScores(q.data(), n_heads, hd, bounds.data(), n_pages, a.data());
        ref::PageBoundScores(q.data(), n_heads, hd, bounds.data(), n_pages, b.data());
        EXPECT_LT(NormErr(a, b), 1e-5) << "hd=" << hd << " n=" << n << tn;
        for (int p = 0; p < n_pages; ++p) {
          for (int h = 0; h < n_heads; ++h) {
            for (int j = 0; j < n; ++j) {
              float dot = 0;
              for (int i = 0; i < hd; ++i)
                dot += q[h * hd + i] * keys[(size_t(p) * n + j) * hd + i];
              ASSERT_LE(dot, b[p] + 1e-4f) << "page " << p << " head " << h << " key " << j;
            }
          }
        }
      }
    }
  }
}

TEST(KernelsCpu, TopKMatchesRef) {
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    const std::string tn = TargetString(target);
    std::mt19937 rng(12);
    for (int n : {1, 2, 15, 16, 17, 100, 1023}) {
      // Values from few levels (many ties), -0 beside +0, infinities, and a continuous spread.
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<float> x = RandomVec(n, rng, -5.0f, 5.0f);
        for (int i = 0; i < n; ++i) {
          if (kind == 0) x[i] = std::round(x[i]);
          if (kind == 1 && i % 3 == 0) x[i] = i % 2 == 0 ? 0.0f : -0.0f;
          if (kind == 1 && i % 7 == 1) x[i] = i % 2 == 0 ? INFINITY : -INFINITY;
        }
        for (int k : {1, 2, n / 3 + 1, n / 2 + 1, n - 1, n}) {
          if (k < 1 || k > n) continue;
          std::vector<int32_t> a(k), b(k);
          cpu::TopK(x.data(), n, k, a.data());
          ref::TopK(x.data(), n, k, b.data());
          ASSERT_EQ(a, b) << "n=" << n << " k=" << k << " kind=" << kind << tn;
          // What it means: ascending, and no index left out is above one taken, nor equal to one
          // taken at a higher index.
          std::vector<bool> in(n);
          for (int i = 0; i < k; ++i) {
            if (i > 0) {
              ASSERT_LT(a[i - 1], a[i]);
            }
            in[a[i]] = true;
          }
          for (int i = 0; i < n; ++i) {
            for (int j = 0; j < k && !in[i]; ++j) {
              ASSERT_TRUE(x[i] < x[a[j]] || (x[i] == x[a[j]] && i > a[j]))
                  << "left out " << i << " taken " << a[j] << " n=" << n << " k=" << k;
            }
          }
        }
      }
    }
  }
}

TEST(KernelsRef, ContiguousAttentionMatchesDouble) {
  std::mt19937 rng(8);
  const int n_keys = 23, head_dim = 16, n_heads = 2;
  std::vector<int32_t> k_pos(n_keys);
  std::iota(k_pos.begin(), k_pos.end(), 0);
  TestKv kv = MakeKv(k_pos, 16, head_dim, rng);
  TestQueries q = MakeQueries({5, 22, -1}, n_heads, head_dim, rng);
  std::vector<float> out;
  const float scale = 0.7f;
  ref::ContiguousAttention(q.Batch(out, scale), kv.k.data(), kv.v.data(), kv.k_pos.data(), n_keys,
                           head_dim);
  for (size_t t = 0; t < q.q_pos.size(); ++t) {
    for (int h = 0; h < n_heads; ++h) {
      const float* qv = &q.q[t * q.q_stride + h * head_dim];
      std::vector<double> p(n_keys, 0.0);
      double max_s = -1e300, sum = 0.0;
      for (int j = 0; j < n_keys; ++j) {
        if (k_pos[j] > q.q_pos[t]) continue;
        double s = 0.0;
        for (int d = 0; d < head_dim; ++d) s += static_cast<double>(qv[d]) * kv.k[j * head_dim + d];
        p[j] = s * scale;
        max_s = std::max(max_s, p[j]);
      }
      for (int j = 0; j < n_keys; ++j) {
        p[j] = k_pos[j] > q.q_pos[t] ? 0.0 : std::exp(p[j] - max_s);
        sum += p[j];
      }
      for (int d = 0; d < head_dim; ++d) {
        double o = 0.0;
        for (int j = 0; j < n_keys; ++j) o += p[j] * kv.v[j * head_dim + d];
        const double expect = sum == 0.0 ? 0.0 : o / sum;
        EXPECT_NEAR(out[t * q.out_stride + h * head_dim + d], expect, 1e-6)
            << "t=" << t << " h=" << h << " d=" << d;
      }
    }
  }
}

TEST(KernelsAttention, PagedMatchesContiguous) {
  std::mt19937 rng(9);
  for (int n_keys : {1, 15, 16, 17, 97, 1000, 4095}) {
    std::vector<int32_t> k_pos(n_keys);
    std::iota(k_pos.begin(), k_pos.end(), 0);
    for (int page_tokens : {1, 16, 64}) {
      for (int head_dim : {64, 80, 128}) {
        TestKv kv = MakeKv(k_pos, page_tokens, head_dim, rng);
        for (int n_heads : {1, 3, 4}) {
          // Sharper softmax for some cases, to exercise the running-max rescaling.
          const float scale =
              (n_heads == 3 ? 4.0f : 1.0f) / std::sqrt(static_cast<float>(head_dim));
          const std::string what =
              "keys=" + std::to_string(n_keys) + " page=" + std::to_string(page_tokens) +
              " head_dim=" + std::to_string(head_dim) + " heads=" + std::to_string(n_heads);
          // Decode: one query at the last position.
          CheckAttention(kv, MakeQueries({n_keys - 1}, n_heads, head_dim, rng), scale,
                         "decode " + what);
          // Prefill chunk: the queries are the last keys, causally masked.
          const int n_q = std::min(n_keys, 7);
          std::vector<int32_t> q_pos(n_q);
          std::iota(q_pos.begin(), q_pos.end(), n_keys - n_q);
          CheckAttention(kv, MakeQueries(q_pos, n_heads, head_dim, rng), scale, "prefill " + what);
        }
      }
    }
  }
}

// Many query tokens (several tiles of query rows), including a prefill from position 0.
TEST(KernelsAttention, LongPrefillMatchesContiguous) {
  std::mt19937 rng(10);
  const int n_keys = 300, head_dim = 64;
  std::vector<int32_t> k_pos(n_keys);
  std::iota(k_pos.begin(), k_pos.end(), 0);
  TestKv kv = MakeKv(k_pos, 16, head_dim, rng);
  for (int n_heads : {1, 4, 7, 16}) {
    std::vector<int32_t> q_pos(n_keys);
    std::iota(q_pos.begin(), q_pos.end(), 0);
    CheckAttention(kv, MakeQueries(q_pos, n_heads, head_dim, rng), 0.125f,
                   "heads=" + std::to_string(n_heads));
  }
}

// n key positions from 10 on with gaps of 1-5 (as after eviction), shuffled across and within
// pages; *end is one past the gaps after the largest.
std::vector<int32_t> GappedShuffledPositions(int n, std::mt19937& rng, int32_t* end) {
  std::vector<int32_t> k_pos(n);
  int32_t p = 10;
  for (int32_t& x : k_pos) {
    x = p;
    p += 1 + static_cast<int32_t>(rng() % 5);
  }
  std::shuffle(k_pos.begin(), k_pos.end(), rng);
  *end = p;
  return k_pos;
}

// Positions with gaps (as after eviction), in no particular order across and within pages, and
// queries before, between and after them.
TEST(KernelsAttention, GappedUnsortedPositions) {
  std::mt19937 rng(11);
  for (int n_keys : {17, 97, 1000}) {
    int32_t last = 0;
    const std::vector<int32_t> k_pos = GappedShuffledPositions(n_keys, rng, &last);
    for (int page_tokens : {1, 16, 64}) {
      for (int head_dim : {64, 80}) {
        TestKv kv = MakeKv(k_pos, page_tokens, head_dim, rng);
        for (int n_heads : {1, 3, 4}) {
          std::vector<int32_t> q_pos = {5,        10,           11,       last / 3,
                                        last / 2, last / 2 + 1, last - 1, last + 100};
          CheckAttention(kv, MakeQueries(q_pos, n_heads, head_dim, rng), 0.2f,
                         "keys=" + std::to_string(n_keys) + " page=" + std::to_string(page_tokens) +
                             " head_dim=" + std::to_string(head_dim) +
                             " heads=" + std::to_string(n_heads));
        }
      }
    }
  }
}

// The AttnObserve key weights of one observe, in double: the textbook softmax of each (token,
// head) row with q_pos >= min_pos, summed over those rows (rows that see no key add nothing), or
// the largest of them (max).
std::vector<double> ExpectedKeyWeights(const TestKv& kv, const TestQueries& q, float scale,
                                       int32_t min_pos, bool max = false) {
  const int hd = kv.head_dim;
  std::vector<double> w(kv.n_tokens, 0.0), p(kv.n_tokens);
  for (size_t t = 0; t < q.q_pos.size(); ++t) {
    if (q.q_pos[t] < min_pos) continue;
    for (int h = 0; h < q.n_heads; ++h) {
      const float* qv = &q.q[t * q.q_stride + h * hd];
      double max_s = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int j = 0; j < kv.n_tokens; ++j) {
        if (kv.k_pos[j] > q.q_pos[t]) continue;
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(qv[d]) * kv.k[size_t(j) * hd + d];
        p[j] = s * scale;
        max_s = std::max(max_s, p[j]);
      }
      for (int j = 0; j < kv.n_tokens; ++j) {
        p[j] = kv.k_pos[j] > q.q_pos[t] ? 0.0 : std::exp(p[j] - max_s);
        sum += p[j];
      }
      if (sum == 0.0) continue;
      for (int j = 0; j < kv.n_tokens; ++j)
        w[j] = max ? std::max(w[j], p[j] / sum) : w[j] + p[j] / sum;
    }
  }
  return w;
}

// Gathers two observes at once (different min_pos; the second keeps the largest weight, the
// first sums) with ref:: and cpu:: PagedAttention: the key weights match the double-precision
// softmax, are added to (or the max of) what key_weight held, nothing past n_tokens is written,
// and the outputs equal those of the same call without observing.
void CheckObserve(const TestKv& kv, const TestQueries& q, float scale, int32_t min_pos_a,
                  int32_t min_pos_b, const std::string& what) {
  const int32_t min_pos[2] = {min_pos_a, min_pos_b};
  std::vector<double> expect[2];
  for (int i = 0; i < 2; ++i) expect[i] = ExpectedKeyWeights(kv, q, scale, min_pos[i], i == 1);
  constexpr float kGuard = 123.0f;
  constexpr float kStart[2] = {0.25f, 1e-4f};
  auto run = [&](auto attend, const std::string& who) {
    std::vector<float> out_plain, out_obs;
    attend(q.Batch(out_plain, scale));
    std::vector<float> weights[2];
    AttnObserve obs[2];
    for (int i = 0; i < 2; ++i) {
      weights[i].assign(kv.n_tokens + 1, kStart[i]);
      weights[i][kv.n_tokens] = kGuard;
      obs[i].min_pos = min_pos[i];
      obs[i].key_weight = weights[i].data();
      obs[i].max = i == 1;
    }
    AttnBatch b = q.Batch(out_obs, scale);
    b.observe = obs;
    b.n_observe = 2;
    attend(b);
    EXPECT_EQ(q.Compact(out_obs), q.Compact(out_plain)) << who << what;
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(weights[i][kv.n_tokens], kGuard) << who << what;
      double max_err = 0.0;
      int worst = -1;
      for (int j = 0; j < kv.n_tokens; ++j) {
        const double want =
            i == 1 ? std::max<double>(kStart[i], expect[i][j]) : kStart[i] + expect[i][j];
        const double err = std::fabs(weights[i][j] - want);
        if (err > max_err) max_err = err, worst = j;
      }
      EXPECT_LT(max_err, 1e-5) << who << what << " observe " << i << " min_pos=" << min_pos[i]
                               << " key " << worst;
    }
  };
  run([&](const AttnBatch& b) { ref::PagedAttention(b, kv.view); }, "ref ");
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    run([&](const AttnBatch& b) { cpu::PagedAttention(b, kv.view); }, "cpu" + TargetString(target));
  }
}

TEST(KernelsAttention, ObserveMatchesReferenceWeights) {
  std::mt19937 rng(13);
  for (int n_keys : {1, 17, 97, 1000}) {
    int32_t last = 0;
    const std::vector<int32_t> k_pos = GappedShuffledPositions(n_keys, rng, &last);
    for (int page_tokens : {1, 16, 64}) {
      for (int head_dim : {64, 48}) {
        TestKv kv = MakeKv(k_pos, page_tokens, head_dim, rng);
        for (int n_heads : {1, 4}) {
          const float scale = (n_heads == 4 ? 4.0f : 1.0f) / std::sqrt(float(head_dim));
          const std::string what =
              " keys=" + std::to_string(n_keys) + " page=" + std::to_string(page_tokens) +
              " head_dim=" + std::to_string(head_dim) + " heads=" + std::to_string(n_heads);
          // Prefill: unsorted, with a repeat and a row that sees no key; with 4 heads the rows
          // span two tiles of the cpu kernel.
          const std::vector<int32_t> q_pos = {5,        10,       11,           last / 3,
                                              last / 2, last / 4, last / 2 + 1, last - 1,
                                              7,        last - 2, last / 2,     last + 100};
          TestQueries prefill = MakeQueries(q_pos, n_heads, head_dim, rng);
          CheckObserve(kv, prefill, scale, 5, last / 2 + 1, " prefill" + what);
          CheckObserve(kv, prefill, scale, last / 3, std::numeric_limits<int32_t>::min(),
                       " prefill" + what);
          // Decode: one token, observed by one observe only.
          TestQueries decode = MakeQueries({last}, n_heads, head_dim, rng);
          CheckObserve(kv, decode, scale, 0, last + 1, " decode" + what);
        }
      }
    }
  }
}

// A page source whose pages have different row types (f32, f16, bf16, q8_0 and q4_0 blocks, K
// and V independently; KIVI keys, 2-bit level values) and key counts: what PagedSequence gives the
// kernel for codec pages, sinks and a cold pool.
struct TypedPages final : PageRows {
  int pt = 0, hd = 0;
  std::vector<int> cnt;
  std::vector<DType> k_type, v_type;
  std::vector<std::vector<uint16_t>> k16, v16;  // f16 / bf16 pages
  std::vector<std::vector<float>> k32, v32;     // f32 pages
  std::vector<std::vector<uint8_t>> kq, vq;     // q8_0 / q4_0 pages; KIVI key codes
  std::vector<int> k_bits;                      // KIVI keys: bits per code, else 0
  std::vector<std::vector<uint16_t>> k_chan;    // KIVI keys: (minimum, scale) per channel
  std::vector<bool> v_lvl;                      // values in 2-bit level blocks (cq2), in vq
  float levels[16] = {-1.5f, -0.5f, 0.25f, 1.75f};
  std::vector<std::vector<int32_t>> pos;
  std::vector<std::vector<uint16_t>> pos16;  // the same where they fit 16 bits, else empty
  std::vector<float> k, v;                   // every key's rows as stored (rounded), contiguous
  std::vector<int32_t> k_pos;

  int n_pages() const override { return static_cast<int>(cnt.size()); }
  int n_keys() const override { return static_cast<int>(k_pos.size()); }
  int page_tokens() const override { return pt; }
  int head_dim() const override { return hd; }
  // Odd pages hand over their positions in 16 bits (as a pool whose context fits them stores
  // them), even ones in 32: both kinds, side by side, in every test.
  PagePositions Positions(int page, int* n) const override {
    *n = cnt[page];
    if (page % 2 == 1 && !pos16[page].empty()) return {nullptr, pos16[page].data()};
    return {pos[page].data()};
  }
  PageData Rows(int page, float*, float*) const override {
    auto data = [&](DType t, const auto& p16, const auto& p32, const auto& pq) -> const void* {
      if (DTypeIsQuantized(t)) return pq[page].data();
      return t == DType::kF32 ? static_cast<const void*>(p32[page].data()) : p16[page].data();
    };
    PageData d{data(k_type[page], k16, k32, kq), data(v_type[page], v16, v32, vq), k_type[page],
               v_type[page]};
    if (k_bits[page] > 0) {
      d.k = kq[page].data();
      d.k_channels = k_chan[page].data();
      d.k_bits = k_bits[page];
    }
    if (v_lvl[page]) {
      d.v = vq[page].data();
      d.v_levels = levels;
    }
    return d;
  }

  // Level blocks (PageData::v_levels) for n rows: random codes and per-block f16 scales; the
  // values they stand for go into out.
  static void StoreLevels(int n, int hd, const float* levels, std::mt19937& rng,
                          std::vector<uint8_t>* blocks, std::vector<float>* out) {
    std::uniform_int_distribution<int> code(0, 3);
    std::uniform_real_distribution<float> u(0.1f, 2.0f);
    for (int64_t b = 0; b < int64_t{n} * hd / 32; ++b) {
      const uint16_t s = F32ToF16(u(rng));
      blocks->push_back(static_cast<uint8_t>(s & 0xff));
      blocks->push_back(static_cast<uint8_t>(s >> 8));
      const size_t codes = blocks->size();
      blocks->resize(codes + 8, 0);
      for (int i = 0; i < 32; ++i) {
        const int c = code(rng);
        (*blocks)[codes + i % 8] |= static_cast<uint8_t>(c << (2 * (i / 8)));
        out->push_back(F16ToF32(s) * levels[c]);
      }
    }
  }

  // KIVI keys for n rows: random codes of `bits`, random per-channel minimum and scale; the values
  // they stand for go into out.
  static void StoreChannels(int n, int hd, int bits, std::mt19937& rng, std::vector<uint8_t>* codes,
                            std::vector<uint16_t>* chan, std::vector<float>* out) {
    std::uniform_int_distribution<int> code(0, (1 << bits) - 1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int c = 0; c < hd; ++c)
      chan->push_back(F32ToF16(u(rng))), chan->push_back(F32ToF16(0.3f * u(rng)));
    codes->assign(size_t(n) * hd * bits / 8, 0);
    for (int64_t i = 0; i < int64_t{n} * hd; ++i) {
      const int c = code(rng), ch = static_cast<int>(i % hd);
      (*codes)[i * bits / 8] |= static_cast<uint8_t>(c << (i * bits % 8));
      out->push_back(F16ToF32((*chan)[2 * ch]) + F16ToF32((*chan)[2 * ch + 1]) * c);
    }
  }

  // Stores x (rows of hd values) as type t into a page, and the rounded values into out.
  static void Store(DType t, const std::vector<float>& x, int hd, std::vector<uint16_t>* p16,
                    std::vector<float>* p32, std::vector<uint8_t>* pq, std::vector<float>* out) {
    if (DTypeIsQuantized(t)) {
      const int64_t rows = int64_t(x.size()) / hd;
      const size_t row_bytes = DTypeRowBytes(t, hd);
      pq->resize(rows * row_bytes);
      std::vector<float> back(hd);
      for (int64_t r = 0; r < rows; ++r) {
        ref::QuantizeRow(t, x.data() + r * hd, hd, pq->data() + r * row_bytes);
        ref::QuantDequantRow({pq->data(), t, rows, hd}, r, back.data());
        out->insert(out->end(), back.begin(), back.end());
      }
      return;
    }
    for (float f : x) {
      float r = f;
      if (t == DType::kF16) {
        p16->push_back(F32ToF16(f));
        r = F16ToF32(p16->back());
      } else if (t == DType::kBF16) {
        p16->push_back(F32ToBf16(f));
        r = Bf16ToF32(p16->back());
      } else {
        p32->push_back(f);
      }
      out->push_back(r);
    }
  }
};

TypedPages MakeTypedPages(const std::vector<int32_t>& key_pos, int pt, int hd, std::mt19937& rng) {
  TypedPages tp;
  tp.pt = pt;
  tp.hd = hd;
  // Block types need whole blocks of 32 per row.
  const std::vector<DType> types =
      hd % 32 == 0
          ? std::vector<DType>{DType::kF16, DType::kQ4_0, DType::kF32, DType::kQ8_0, DType::kBF16}
          : std::vector<DType>{DType::kF16, DType::kF32, DType::kBF16};
  const int n_types = static_cast<int>(types.size());
  std::uniform_int_distribution<int> count(1, pt);
  for (size_t j = 0; j < key_pos.size();) {
    const int n = std::min<int>(count(rng), int(key_pos.size() - j));
    const int i = static_cast<int>(tp.cnt.size());
    tp.cnt.push_back(n);
    tp.k_type.push_back(types[i % n_types]);
    tp.v_type.push_back(types[(i / n_types + i) % n_types]);
    tp.k16.emplace_back();
    tp.v16.emplace_back();
    tp.k32.emplace_back();
    tp.v32.emplace_back();
    tp.kq.emplace_back();
    tp.vq.emplace_back();
    tp.k_chan.emplace_back();
    // Every fourth page holds KIVI keys, 4 and 2 bits in turn (whole blocks of 32 channels).
    tp.k_bits.push_back(hd % 32 == 0 && i % 4 == 3 ? (i % 8 == 3 ? 4 : 2) : 0);
    if (tp.k_bits.back() > 0) {
      TypedPages::StoreChannels(n, hd, tp.k_bits.back(), rng, &tp.kq.back(), &tp.k_chan.back(),
                                &tp.k);
    } else {
      TypedPages::Store(tp.k_type.back(), RandomVec(size_t(n) * hd, rng), hd, &tp.k16.back(),
                        &tp.k32.back(), &tp.kq.back(), &tp.k);
    }
    // Every fifth page holds values in 2-bit level blocks.
    tp.v_lvl.push_back(hd % 32 == 0 && i % 5 == 2);
    if (tp.v_lvl.back()) {
      TypedPages::StoreLevels(n, hd, tp.levels, rng, &tp.vq.back(), &tp.v);
    } else {
      TypedPages::Store(tp.v_type.back(), RandomVec(size_t(n) * hd, rng), hd, &tp.v16.back(),
                        &tp.v32.back(), &tp.vq.back(), &tp.v);
    }
    tp.pos.emplace_back(key_pos.begin() + j, key_pos.begin() + j + n);
    const bool fits = std::all_of(tp.pos.back().begin(), tp.pos.back().end(),
                                  [](int32_t p) { return p >= 0 && p <= 0xFFFF; });
    tp.pos16.emplace_back(fits ? tp.pos.back().size() : 0);
    std::copy_n(tp.pos.back().begin(), tp.pos16.back().size(), tp.pos16.back().begin());
    tp.k_pos.insert(tp.k_pos.end(), key_pos.begin() + j, key_pos.begin() + j + n);
    j += n;
  }
  return tp;
}

TEST(KernelsAttention, TypedPageRowsMatchContiguous) {
  std::mt19937 rng(14);
  for (int n_keys : {1, 17, 300}) {
    int32_t last = 0;
    const std::vector<int32_t> k_pos = GappedShuffledPositions(n_keys, rng, &last);
    for (int pt : {1, 16}) {
      for (int hd : {64, 40, 96}) {  // 40: a row tail past the last whole vector
        const TypedPages tp = MakeTypedPages(k_pos, pt, hd, rng);
        // Rows in blocks of up to 4 (kRowBlock) and a remainder; 40: a multi-query group wider
        // than a tile's 32 rows (a tile of one token).
        for (int n_heads : {1, 3, 4, 6, 40}) {
          const std::string what = "keys=" + std::to_string(n_keys) +
                                   " page=" + std::to_string(pt) + " hd=" + std::to_string(hd) +
                                   " heads=" + std::to_string(n_heads);
          const float scale = 2.0f / std::sqrt(float(hd));
          for (const std::vector<int32_t>& q_pos :
               {std::vector<int32_t>{last}, std::vector<int32_t>{3, last / 2, last, last - 1}}) {
            const TestQueries q = MakeQueries(q_pos, n_heads, hd, rng);
            std::vector<float> out_contig, out_ref, out_cpu;
            ref::ContiguousAttention(q.Batch(out_contig, scale), tp.k.data(), tp.v.data(),
                                     tp.k_pos.data(), n_keys, hd);
            // q4_0 / q8_0 key pages are scored with the queries quantized to 8 bits
            // (block_keys.h), which the contiguous reference over the decoded keys does not do.
            const bool block_keys = hd % 32 == 0;
            // q4_0 value pages of 64-wide heads are summed with 8-bit weights where the CPU has
            // the int8 kernels (the reference sums exact ones): 3e-4 - 7e-4 here; the bound on
            // each sum is tested in q4_value_sums_test.cc.
            const bool q4_weights = hd == 64 && cpu::HasInt8Kernels();
            ref::PagedAttentionRows(q.Batch(out_ref, scale), tp);
            const std::vector<float> expect = q.Compact(out_ref);
            EXPECT_LT(NormErr(expect, q.Compact(out_contig)), block_keys ? 5e-3 : 1e-6)
                << "ref " << what;
            // Observed weights of the last query row, against the reference kernel's.
            std::vector<float> w_ref(n_keys, 0.0f), w_cpu(n_keys, 0.0f);
            AttnObserve obs{last, w_ref.data()};
            AttnBatch b = q.Batch(out_ref, scale);
            b.observe = &obs;
            b.n_observe = 1;
            ref::PagedAttentionRows(b, tp);
            for (int64_t target : KernelTargets()) {
              ScopedTarget scoped(target);
              cpu::PagedAttentionRows(q.Batch(out_cpu, scale), tp);
              EXPECT_LT(NormErr(q.Compact(out_cpu), expect), q4_weights ? 2e-3 : 1e-5)
                  << "cpu " << what << TargetString(target);
              std::fill(w_cpu.begin(), w_cpu.end(), 0.0f);
              obs.key_weight = w_cpu.data();
              AttnBatch bc = q.Batch(out_cpu, scale);
              bc.observe = &obs;
              bc.n_observe = 1;
              cpu::PagedAttentionRows(bc, tp);
              EXPECT_LT(NormErr(w_cpu, w_ref), 1e-5) << "observe " << what << TargetString(target);
            }
          }
        }
      }
    }
  }
}

// A source that decodes its pages (as codec pages are: into the buffers the kernel passes),
// counting the calls; stale rows are left in the buffers it is handed, so a page read from a buffer
// it was not decoded into shows.
struct DecodingPages final : PageRows {
  explicit DecodingPages(const TypedPages& tp) : tp(tp), calls(tp.n_pages(), 0) {}
  int n_pages() const override { return tp.n_pages(); }
  int n_keys() const override { return tp.n_keys(); }
  int page_tokens() const override { return tp.pt; }
  int head_dim() const override { return tp.hd; }
  PagePositions Positions(int page, int* n) const override { return tp.Positions(page, n); }
  PageData Rows(int page, float* k_buf, float* v_buf) const override {
    ++calls[page];
    int64_t first = 0;
    for (int p = 0; p < page; ++p) first += tp.cnt[p];
    const size_t n = size_t(tp.cnt[page]) * tp.hd;
    std::copy_n(tp.k.begin() + first * tp.hd, n, k_buf);
    std::copy_n(tp.v.begin() + first * tp.hd, n, v_buf);
    return {k_buf, v_buf, DType::kF32, DType::kF32};
  }
  const TypedPages& tp;
  mutable std::vector<int> calls;
};

// A prompt's tiles share the pages the source decodes: each page is decoded once (by the first
// tile that sees it), and every tile attends as if it had decoded the page itself.
TEST(KernelsAttention, PromptTilesDecodeEachPageOnce) {
  std::mt19937 rng(16);
  int32_t last = 0;
  const std::vector<int32_t> k_pos = GappedShuffledPositions(300, rng, &last);
  const TypedPages tp = MakeTypedPages(k_pos, 16, 64, rng);
  for (int n_heads : {1, 3}) {
    std::vector<int32_t> q_pos;  // 70 tokens: three tiles of one head, seven of three
    for (int t = 0; t < 70; ++t) q_pos.push_back(t == 69 ? last : (t * 37) % (last + 1));
    const TestQueries q = MakeQueries(q_pos, n_heads, 64, rng);
    const float scale = 0.25f;
    std::vector<float> out_contig, out_cpu;
    ref::ContiguousAttention(q.Batch(out_contig, scale), tp.k.data(), tp.v.data(), tp.k_pos.data(),
                             tp.n_keys(), 64);
    for (int64_t target : KernelTargets()) {
      ScopedTarget scoped(target);
      const DecodingPages pages(tp);
      cpu::PagedAttentionRows(q.Batch(out_cpu, scale), pages);
      EXPECT_LT(NormErr(q.Compact(out_cpu), q.Compact(out_contig)), 1e-5)
          << "heads=" << n_heads << TargetString(target);
      for (int p = 0; p < tp.n_pages(); ++p) {
        ASSERT_EQ(pages.calls[p], 1)
            << "page " << p << " heads=" << n_heads << TargetString(target);
      }
    }
  }
}

// A decode step reads KIVI key pages fused, a tile of more rows unpacks them first; block pages
// are read in row blocks: the same query gets the same bits in a tile of any size (a
// prefix-cached prompt must equal a cold one).
TEST(KernelsAttention, FusedAndUnpackedPagesGiveTheSameBits) {
  std::mt19937 rng(15);
  int32_t last = 0;
  const std::vector<int32_t> k_pos = GappedShuffledPositions(200, rng, &last);
  for (int hd : {64, 128}) {
    const TypedPages tp = MakeTypedPages(k_pos, 16, hd, rng);
    for (int n_heads : {1, 3, 4}) {
      // Four tokens; the last one alone is a decode step.
      const TestQueries four = MakeQueries({last - 3, last / 2, 7, last}, n_heads, hd, rng);
      TestQueries one = four;
      one.q_pos = {last};
      one.q.assign(four.q.begin() + 3 * four.q_stride, four.q.end());
      for (int64_t target : KernelTargets()) {
        ScopedTarget scoped(target);
        std::vector<float> out_four, out_one;
        cpu::PagedAttentionRows(four.Batch(out_four, 0.125f), tp);
        cpu::PagedAttentionRows(one.Batch(out_one, 0.125f), tp);
        const std::vector<float> a = four.Compact(out_four), b = one.Compact(out_one);
        ASSERT_EQ(std::vector<float>(a.end() - b.size(), a.end()), b)
            << "hd=" << hd << " heads=" << n_heads << TargetString(target);
      }
    }
  }
}

TEST(KernelsAttention, NoVisibleKeyGivesZeros) {
  std::mt19937 rng(12);
  std::vector<int32_t> k_pos(40);
  std::iota(k_pos.begin(), k_pos.end(), 100);
  TestKv kv = MakeKv(k_pos, 16, 64, rng);
  TestQueries q = MakeQueries({3, 99}, 3, 64, rng);
  TestKv empty = MakeKv({}, 16, 64, rng);
  for (const TestKv* cache : {&kv, &empty}) {
    std::vector<float> out_ref, out_contig;
    ref::PagedAttention(q.Batch(out_ref, 0.125f), cache->view);
    ref::ContiguousAttention(q.Batch(out_contig, 0.125f), cache->k.data(), cache->v.data(),
                             cache->k_pos.data(), cache->n_tokens, 64);
    for (const std::vector<float>* out : {&out_ref, &out_contig}) {
      for (float x : q.Compact(*out)) ASSERT_EQ(x, 0.0f);
    }
    for (int64_t target : KernelTargets()) {
      ScopedTarget scoped(target);
      std::vector<float> out_cpu;
      cpu::PagedAttention(q.Batch(out_cpu, 0.125f), cache->view);
      for (float x : q.Compact(out_cpu)) ASSERT_EQ(x, 0.0f) << TargetString(target);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Speed (prints only): --gtest_also_run_disabled_tests --gtest_filter='KernelsBench*'

// Seconds per call: the best of many short batches, since the machine may be shared.
template <class Fn>
double SecondsPerCall(const Fn& fn, double total_seconds = 0.5) {
  using Clock = std::chrono::steady_clock;
  fn();  // warm up
  auto t0 = Clock::now();
  fn();
  const double one = std::chrono::duration<double>(Clock::now() - t0).count();
  const int batch = std::max(1, static_cast<int>(1e-3 / std::max(one, 1e-9)));
  double best = one;
  const auto end = Clock::now() + std::chrono::duration<double>(total_seconds);
  while (Clock::now() < end) {
    t0 = Clock::now();
    for (int i = 0; i < batch; ++i) fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / batch);
  }
  return best;
}

TEST(KernelsBench, DISABLED_MatMul) {
  std::mt19937 rng(13);
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (int64_t rows : {1024, 8192}) {
      const int64_t cols = 384;
      TestMatrix w = MakeMatrix(rows, cols, DType::kBF16, rng);
      std::vector<float> x = RandomVec(cols, rng), y(rows);
      const double s =
          SecondsPerCall([&] { cpu::MatMul(x.data(), 1, w.m, nullptr, y.data(), rows, pool); });
      std::printf("decode bf16 %5lldx%lld threads=%d: %8.2f us  %6.1f GB/s\n", (long long)rows,
                  (long long)cols, threads, s * 1e6, rows * cols * 2 / s / 1e9);
    }
    // Weights streamed from DRAM (48 MiB of f16), as a decode step reads them.
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      const int64_t rows = 65536, cols = 384;
      TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
      std::vector<float> x = RandomVec(cols, rng), y(rows);
      const double s =
          SecondsPerCall([&] { cpu::MatMul(x.data(), 1, w.m, nullptr, y.data(), rows, pool); });
      std::printf("decode %-4s %5lldx%lld threads=%d: %8.2f us  %6.1f GB/s (from DRAM)\n",
                  DTypeName(dtype), (long long)rows, (long long)cols, threads, s * 1e6,
                  rows * cols * DTypeSize(dtype) / s / 1e9);
    }
    for (DType dtype : kAllTypes) {
      const int64_t rows = 1024, cols = 384, n = 512;
      TestMatrix w = MakeMatrix(rows, cols, dtype, rng);
      std::vector<float> x = RandomVec(n * cols, rng), y(n * rows);
      const double s =
          SecondsPerCall([&] { cpu::MatMul(x.data(), n, w.m, nullptr, y.data(), rows, pool); });
      std::printf("prefill %-4s %lldx%lld n=%lld threads=%d: %8.2f ms  %6.1f GFLOP/s\n",
                  DTypeName(dtype), (long long)rows, (long long)cols, (long long)n, threads,
                  s * 1e3, 2.0 * rows * cols * n / s / 1e9);
    }
  }
}

TEST(KernelsBench, DISABLED_Attention) {
  std::mt19937 rng(14);
  for (int n_keys : {512, 4096}) {
    std::vector<int32_t> k_pos(n_keys);
    std::iota(k_pos.begin(), k_pos.end(), 0);
    TestKv kv = MakeKv(k_pos, 16, 64, rng);
    for (int n_q : {1, 64}) {
      std::vector<int32_t> q_pos(n_q);
      std::iota(q_pos.begin(), q_pos.end(), n_keys - n_q);
      TestQueries q = MakeQueries(q_pos, 7, 64, rng);
      std::vector<float> out;
      const AttnBatch b = q.Batch(out, 0.125f);
      const double s = SecondsPerCall([&] { cpu::PagedAttention(b, kv.view); });
      std::printf("attention keys=%d queries=%d heads=7 head_dim=64: %8.2f us  %6.1f GFLOP/s\n",
                  n_keys, n_q, s * 1e6, 4.0 * n_q * 7 * 64 * (n_keys - n_q / 2.0) / s / 1e9);
    }
  }
}

}  // namespace
}  // namespace cachet::kernels
