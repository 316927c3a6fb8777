// Kernel micro-benchmarks: decode matvec bandwidth, prefill GEMM throughput, paged attention, and
// decode-step attention over a cache stored in each KV codec, through the dispatching entry points
// (cpu:: kernels; CACHET_REF_KERNELS=1 times the reference).
//
// Build and run: cmake --build build --target kernels_bench && build/kernels_bench [max_threads
// [attention|codecs|matmul|quant [CODEC]|calibrated FILE.kvcal]] (default: all hardware threads,
// every section but `calibrated`; `codecs` is the codec part of `attention`, CODEC one of its
// names or a K:V pair, NO_F16=1 for it alone; `calibrated` times the kvq / pca page decoders on a
// model's calibration).
// Times are the best per-call time over many short batches, which filters out most interference
// from other load on the machine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kv/codecs/calibration.h"
#include "kv/codecs/codec_simd.h"
#include "kv/codecs/rope_table.h"
#include "kv/page_pool.h"
#include "kv/paged_sequence.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace {

using cachet::DType;
using cachet::ThreadPool;
using namespace cachet::kernels;

template <class Fn>
double SecondsPerCall(const Fn& fn, double total_seconds = 0.5) {
  using Clock = std::chrono::steady_clock;
  fn();
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

// Weights of a [rows][cols] matrix in dtype, 64-byte aligned.
struct Weights {
  std::vector<uint8_t> bytes;
  Matrix m;
  Weights(int64_t rows, int64_t cols, DType dtype, std::mt19937& rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const size_t elem = cachet::DTypeSize(dtype);
    bytes.resize(rows * cols * elem + 64);
    uint8_t* p = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = dist(rng);
      if (dtype == DType::kF32) {
        reinterpret_cast<float*>(p)[i] = v;
      } else {
        reinterpret_cast<uint16_t*>(p)[i] =
            dtype == DType::kBF16 ? cachet::F32ToBf16(v) : cachet::F32ToF16(v);
      }
    }
    m = Matrix{p, dtype, rows, cols};
  }
};

// Copies of one matrix's bytes, 64-byte aligned, that together take 512 MiB: more than any L3
// these benches run on (260 MiB on the Intel VM), so a decode cycling through them (Next) streams
// its weights from DRAM as a real model's decode does.
struct DramCopies {
  std::vector<uint8_t> storage;
  uint8_t* base;
  int64_t bytes, n, next = 0;
  DramCopies(const void* src, int64_t bytes_) : bytes(bytes_) {
    n = ((int64_t{512} << 20) + bytes - 1) / bytes;
    storage.resize(n * bytes + 64);
    base = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
    for (int64_t m = 0; m < n; ++m) std::memcpy(base + m * bytes, src, bytes);
  }
  const uint8_t* Next() { return base + (next++ % n) * bytes; }
};

// An environment variable's integer value (the benchmarks' knobs), or fallback when it is unset.
int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

std::vector<float> RandomVec(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void BenchMatMul(ThreadPool& pool, std::mt19937& rng) {
  struct Shape {
    int64_t rows, cols;
  };
  for (Shape s : {Shape{1024, 384}, Shape{8192, 384}, Shape{4864, 896}, Shape{896, 4864}}) {
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      Weights w(s.rows, s.cols, dtype, rng);
      std::vector<float> x = RandomVec(s.cols, rng), y(s.rows);
      const double t =
          SecondsPerCall([&] { MatMul(x.data(), 1, w.m, nullptr, y.data(), s.rows, pool); });
      std::printf("  decode  %-4s %5lldx%-5lld          %9.2f us %7.1f GB/s\n",
                  cachet::DTypeName(dtype), static_cast<long long>(s.rows),
                  static_cast<long long>(s.cols), t * 1e6,
                  s.rows * s.cols * cachet::DTypeSize(dtype) / t / 1e9);
    }
  }
  // From DRAM: copies of an mha-85m FFN matrix (2048x768 and its transpose), cycled as a real
  // model's decode streams its layers.
  for (Shape s : {Shape{2048, 768}, Shape{768, 2048}}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      Weights w(s.rows, s.cols, dtype, rng);
      DramCopies copies(w.m.data, s.rows * s.cols * cachet::DTypeSize(dtype));
      std::vector<float> x = RandomVec(s.cols, rng), y(s.rows);
      const double t = SecondsPerCall([&] {
        const Matrix m{copies.Next(), dtype, s.rows, s.cols};
        MatMul(x.data(), 1, m, nullptr, y.data(), s.rows, pool);
      });
      std::printf("  decode  %-4s %5lldx%-5lld DRAM     %9.2f us %7.1f GB/s\n",
                  cachet::DTypeName(dtype), static_cast<long long>(s.rows),
                  static_cast<long long>(s.cols), t * 1e6, copies.bytes / t / 1e9);
    }
  }
  for (Shape s : {Shape{1024, 384}, Shape{4864, 896}, Shape{896, 4864}}) {
    for (int64_t n : {4, 64, 512}) {
      Weights w(s.rows, s.cols, DType::kBF16, rng);
      std::vector<float> x = RandomVec(n * s.cols, rng), y(n * s.rows);
      const double t =
          SecondsPerCall([&] { MatMul(x.data(), n, w.m, nullptr, y.data(), s.rows, pool); });
      std::printf("  prefill bf16 %5lldx%-5lld n=%-4lld %9.3f ms %7.1f GFLOP/s\n",
                  static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                  static_cast<long long>(n), t * 1e3, 2.0 * s.rows * s.cols * n / t / 1e9);
    }
  }
}

// Quantized weights: the int8 kernels (QuantMatMul) beside the f32 dequantizing ones
// (DequantMatMul). Decode cycles through DramCopies of a TinyLlama FFN matrix.
void BenchQuantMatMul(ThreadPool& pool, std::mt19937& rng) {
  const int64_t rows = 5632, cols = 2048;
  const char* only = std::getenv("QUANT_TYPE");  // one type's rows, by name (q6_k)
  for (DType dtype :
       {DType::kQ4_0, DType::kQ4_K, DType::kQ8_0, DType::kQ6_K, DType::kQ5_0, DType::kQ5_K,
        DType::kQ4_1, DType::kQ5_1, DType::kIQ4_NL, DType::kIQ4_XS, DType::kQ3_K, DType::kQ2_K}) {
    if (only != nullptr && std::string(only) != cachet::DTypeName(dtype)) continue;
    const int64_t rb = cachet::DTypeRowBytes(dtype, cols);
    std::vector<uint8_t> one(rows * rb);
    const std::vector<float> src = RandomVec(cols, rng);
    for (int64_t r = 0; r < rows; ++r) {
      ref::QuantizeRow(dtype, src.data(), cols, one.data() + r * rb);
    }
    DramCopies copies(one.data(), rows * rb);
    std::vector<float> x = RandomVec(512 * cols, rng), y(512 * rows);
    for (bool int8 : {false, true}) {
      if (int8 && !cpu::HasInt8Kernels()) continue;
      auto run = [&](const Matrix& m, int64_t n) {
        (int8 ? cpu::QuantMatMul : cpu::DequantMatMul)(x.data(), n, m, nullptr, y.data(), rows,
                                                       pool);
      };
      const double t = SecondsPerCall([&] { run(Matrix{copies.Next(), dtype, rows, cols}, 1); });
      std::printf("  decode  %-4s %5lldx%-5lld %-5s    %9.2f us %7.1f GB/s\n",
                  cachet::DTypeName(dtype), static_cast<long long>(rows),
                  static_cast<long long>(cols), int8 ? "int8" : "f32", t * 1e6,
                  rows * rb / t / 1e9);
      // The same rows again and again from L2: what the kernel computes, memory aside.
      const int64_t hot_rows = 512;
      const double th = SecondsPerCall([&] { run(Matrix{copies.base, dtype, hot_rows, cols}, 1); });
      std::printf("  decode  %-4s %5lldx%-5lld %-5s L2 %9.2f us %7.1f GB/s\n",
                  cachet::DTypeName(dtype), static_cast<long long>(hot_rows),
                  static_cast<long long>(cols), int8 ? "int8" : "f32", th * 1e6,
                  hot_rows * rb / th / 1e9);
      // Four tokens over the same hot rows: what a shared unpacking saves, memory aside.
      const double th4 = SecondsPerCall([&] {
        run(Matrix{copies.base, dtype, hot_rows, cols}, 4);
      });
      std::printf("  batch   %-4s %5lldx%-5lld n=4    %-5s L2 %6.2f us %7.1f GB/s %6.2f us/token\n",
                  cachet::DTypeName(dtype), static_cast<long long>(hot_rows),
                  static_cast<long long>(cols), int8 ? "int8" : "f32", th4 * 1e6,
                  hot_rows * rb / th4 / 1e9, th4 * 1e6 / 4);
      // A continuous-batching decode step: n tokens, weights streamed from DRAM once for all.
      for (int64_t n : {2, 4, 8, 16, 32}) {
        const double tb = SecondsPerCall([&] { run(Matrix{copies.Next(), dtype, rows, cols}, n); });
        std::printf(
            "  batch   %-4s %5lldx%-5lld n=%-4lld %-5s %9.2f us %7.1f GB/s %6.2f us/token\n",
            cachet::DTypeName(dtype), static_cast<long long>(rows), static_cast<long long>(cols),
            static_cast<long long>(n), int8 ? "int8" : "f32", tb * 1e6, rows * rb / tb / 1e9,
            tb * 1e6 / n);
      }
      for (int64_t n : {64, 512}) {
        const Matrix m{copies.base, dtype, 2048, cols};
        const double tp = SecondsPerCall([&] { run(m, n); }, 1.0);
        std::printf("  prefill %-4s 2048x%-5lld n=%-4lld %-5s %9.3f ms %7.1f GMAC/s\n",
                    cachet::DTypeName(dtype), static_cast<long long>(cols),
                    static_cast<long long>(n), int8 ? "int8" : "f32", tp * 1e3,
                    2048.0 * cols * n / tp / 1e9);
      }
      // A wide matrix (Llama-3.2-1B's FFN down projection has 8192 columns): the buffer's blocks
      // read as rows of 8192 values (1408 rows); a token's activation codes are 8 KiB.
      if (int8) {
        const int64_t wide = 8192, wide_rows = rows * rb / cachet::DTypeRowBytes(dtype, wide);
        const Matrix m{copies.base, dtype, std::min<int64_t>(wide_rows, 2048), wide};
        std::vector<float> xw = RandomVec(512 * wide, rng), yw(512 * m.rows);
        const double tp = SecondsPerCall(
            [&] { cpu::QuantMatMul(xw.data(), 512, m, nullptr, yw.data(), m.rows, pool); }, 1.0);
        std::printf("  prefill %-4s %4lldx%-5lld n=512  int8  %9.3f ms %7.1f GMAC/s\n",
                    cachet::DTypeName(dtype), static_cast<long long>(m.rows),
                    static_cast<long long>(wide), tp * 1e3, m.rows * wide * 512.0 / tp / 1e9);
      }
    }
  }
}

void BenchAttention(std::mt19937& rng) {
  const int page_tokens = 16;
  for (int head_dim : {64, 128}) {
    for (int n_keys : {512, 4096}) {
      const int n_pages = (n_keys + page_tokens - 1) / page_tokens;
      const int64_t slot_floats = 2 * page_tokens * head_dim;
      std::vector<float> slots = RandomVec(n_pages * slot_floats, rng);
      std::vector<int32_t> positions(n_pages * page_tokens), page_ids(n_pages);
      std::iota(positions.begin(), positions.end(), 0);
      std::iota(page_ids.begin(), page_ids.end(), 0);
      PagedKv kv{slots.data(), positions.data(), slot_floats, page_tokens,
                 head_dim,     page_ids.data(),  n_keys};
      for (int n_heads : {1, 7}) {
        for (int n_q : {1, 64}) {
          std::vector<float> q = RandomVec(static_cast<size_t>(n_q) * n_heads * head_dim, rng);
          std::vector<float> out(q.size());
          std::vector<int32_t> q_pos(n_q);
          std::iota(q_pos.begin(), q_pos.end(), n_keys - n_q);
          AttnBatch b{q.data(),     int64_t{n_heads} * head_dim,
                      out.data(),   int64_t{n_heads} * head_dim,
                      q_pos.data(), n_q,
                      n_heads,      1.0f / 8.0f};
          const double t = SecondsPerCall([&] { PagedAttention(b, kv); });
          const double flops = 4.0 * n_q * n_heads * head_dim * (n_keys - n_q / 2.0);
          std::printf(
              "  attention head_dim=%-3d keys=%-4d heads=%d queries=%-2d %9.2f us %6.1f GFLOP/s\n",
              head_dim, n_keys, n_heads, n_q, t * 1e6, flops / t / 1e9);
        }
      }
    }
  }
}

// One decode step's attention (a group of `heads` query heads: 3 as in GQA, 1 as in MHA; head_dim
// 64, 4096 keys (KEYS) in 16-token pages, positions in 16 bits) over a cache stored in each codec.
// The caches are built once and the codecs timed in turn, many rounds, so that machine noise hits
// them alike; best time per call.
void BenchCodecAttention(std::mt19937& rng, int heads, const std::string& only_codec) {
  using cachet::KvLayout;
  using cachet::PagedSequence;
  using cachet::PagePool;
  // KEYS=N: keys a table (4096 unless set; mha-85m's long-context point is 16384).
  const int n = std::max(16, EnvInt("KEYS", 4096)), hd = 64;
  // TABLES=N: N tables (layers) of n keys each, attended in turn by a timed call, so that the
  // pages stream from DRAM once N tables outgrow the last-level cache (q4_0: 290 KiB a table).
  const int tables = std::max(1, EnvInt("TABLES", 1));
  std::vector<std::string> names = {"f32",   "f16",  "q8_0", "q4_0",       "int8",
                                    "kivi4", "rot4", "rot3", "kivi4:q4_0", "q4_0:rot3"};
  if (!only_codec.empty()) names = {"f16", only_codec};
  // NO_F16=1 with a CODEC: that codec alone (a profile of it alone; no ratio printed).
  if (!only_codec.empty() && std::getenv("NO_F16") != nullptr) names = {only_codec};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::unique_ptr<PagePool>> pools;
  std::vector<std::unique_ptr<PagedSequence>> seqs;
  std::vector<float> k(hd), v(hd);
  for (const std::string& name : names) {  // K[:V]
    KvLayout lay;
    lay.n_layers = tables;
    lay.n_kv_heads = 1;
    lay.head_dim = hd;
    lay.page_tokens = EnvInt("PT", lay.page_tokens);
    // Positions in 16 bits, as an engine whose context fits them stores them; WIDE_POSITIONS=1:
    // in 32.
    if (std::getenv("WIDE_POSITIONS") == nullptr) lay.max_tokens = n;
    const auto [k_name, v_name] = cachet::codecs::SplitKv(name);
    auto codec_k = cachet::codecs::ParseCodec(k_name);
    auto codec_v = cachet::codecs::ParseCodec(v_name);
    if (!codec_k.ok() || !codec_v.ok()) {
      std::fprintf(stderr, "kernels_bench codecs: '%s' is not K[:V] codecs: %s\n", name.c_str(),
                   (!codec_k.ok() ? codec_k : codec_v).status().message().c_str());
      std::exit(2);
    }
    lay.codec_k = *codec_k;
    lay.codec_v = *codec_v;
    // 2 MiB holds 4096 keys of the widest codec (f32 K and V).
    const size_t table_bytes = size_t(2 << 20) * ((n + 4095) / 4096);
    pools.push_back(std::make_unique<PagePool>(lay, size_t(tables) * table_bytes + (64 << 20)));
    seqs.push_back(std::make_unique<PagedSequence>(*pools.back()));
    if (!seqs.back()->Reserve(n).ok()) std::abort();
    for (int t = 0; t < n; ++t) {
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      for (int l = 0; l < tables; ++l) seqs.back()->Append(l, 0, k.data(), v.data(), t);
    }
    seqs.back()->CommitTokens(n);
  }
  std::vector<float> q = RandomVec(heads * hd, rng), out(q.size());
  const int32_t q_pos = n - 1;
  const AttnBatch b{q.data(), heads * hd, out.data(), heads * hd, &q_pos, 1, heads, 0.125f};
  std::vector<double> best(seqs.size(), 1e9);
  using Clock = std::chrono::steady_clock;
  const int calls = std::max(32, tables);  // per timing, cycling through the tables
  for (int round = 0; round < (tables > 1 ? 10 : 100); ++round) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto t0 = Clock::now();
      for (int it = 0; it < calls; ++it) seqs[i]->Attend(it % tables, 0, b);
      best[i] = std::min(best[i], std::chrono::duration<double>(Clock::now() - t0).count() / calls);
    }
  }
  const size_t f16 = std::find(names.begin(), names.end(), "f16") - names.begin();
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::printf("  decode attention %-10s keys=%d heads=%d head_dim=%d %8.1f us", names[i].c_str(),
                n, heads, hd, best[i] * 1e6);
    if (f16 < names.size()) std::printf("  x f16 %.2f", best[i] / best[f16]);
    std::printf("\n");
  }
}

// The calibrated codecs' page decoders (what a kvq / pca decode step spends beside attention) on
// a model's own calibration: per table and role, 4096 rows drawn from the calibrated channel
// statistics, coded into 16-token pages, then decoded page by page as attention asks for them
// (keys turned by their positions' RoPE, theta 10000). Per codec: ns per row, tables of one width
// and of mixed widths apart. PT=N sets the page's tokens.
void BenchCalibratedDecode(const std::string& path, std::mt19937& rng) {
  namespace codecs = cachet::codecs;
  auto cal = codecs::LoadCalibration(path);
  if (!cal.ok()) {
    std::fprintf(stderr, "%s\n", cal.status().ToString().c_str());
    std::exit(1);
  }
  const int d = cal->head_dim, n = 4096, pt = EnvInt("PT", 16);
  const int tables = cal->n_layers * cal->n_kv_heads;
  std::vector<float> inv(d / 2);
  for (int j = 0; j < d / 2; ++j) inv[j] = 1.0f / std::pow(10000.0f, 2.0f * j / d);
  const codecs::RopeTable rope(inv, n);
  std::vector<int32_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> rows(size_t(n) * d), out(size_t(pt) * d);
  for (codecs::Codec c : {codecs::Codec::kKvq4, codecs::Codec::kKvq3, codecs::Codec::kPca4}) {
    for (codecs::Role role : {codecs::Role::kKey, codecs::Role::kValue}) {
      double ns[2] = {0, 0};
      int count[2] = {0, 0};
      for (int t = 0; t < tables; ++t) {
        const codecs::HeadStats& h = cal->head(t, role);
        const codecs::CalPlan& plan = cal->plan(t, role, c);
        const bool kvq = codecs::IsKvq(c);
        for (int r = 0; r < n; ++r) {
          for (int i = 0; i < d; ++i) {
            rows[size_t(r) * d + i] = kvq ? h.ch_mean[i] + h.ch_scale[i] * nd(rng)
                                          : h.mean[i] + h.channel_std[i] * nd(rng);
          }
        }
        const size_t page_bytes = codecs::PageBytes(c, role, pt, d);
        std::vector<uint8_t> pages(page_bytes * (n / pt));
        for (int p = 0; p < n / pt; ++p) {
          codecs::EncodePage(c, role, rows.data() + size_t(p) * pt * d, pt, pt, d,
                             pages.data() + p * page_bytes, &plan);
        }
        const bool turn = codecs::StoredBeforeRope(c, role);
        const double s = SecondsPerCall(
            [&] {
              for (int p = 0; p < n / pt; ++p) {
                codecs::simd::DecodeStored(c, role, pages.data() + p * page_bytes, pt, pt, d,
                                           out.data(), &plan, turn ? &rope : nullptr,
                                           pos.data() + p * pt);
              }
            },
            0.1);
        ns[!plan.uniform] += s * 1e9 / n;
        ++count[!plan.uniform];
      }
      for (int mixed : {0, 1}) {
        if (count[mixed] == 0) continue;
        std::printf("  decode %-4s %-6s %-11s %2d tables  %6.2f ns/row\n", codecs::CodecName(c),
                    role == codecs::Role::kKey ? "keys" : "values",
                    mixed ? "mixed width" : "one width", count[mixed], ns[mixed] / count[mixed]);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : ThreadPool::DefaultThreads();
  const std::string only = argc > 2 ? argv[2] : "";  // attention, matmul or quant; all if empty
  std::mt19937 rng(1);
  if (only == "calibrated") {
    if (argc < 4) {
      std::fprintf(stderr, "usage: kernels_bench THREADS calibrated FILE.kvcal\n");
      return 1;
    }
    std::printf("calibrated page decoders (single-threaded, %s):\n", argv[3]);
    BenchCalibratedDecode(argv[3], rng);
    return 0;
  }
  if (only.empty() || only == "attention") {
    std::printf("attention (single-threaded):\n");
    BenchAttention(rng);
  }
  if (only.empty() || only == "attention" || only == "codecs") {
    const std::string codec = only == "codecs" && argc > 3 ? argv[3] : "";
    std::printf("attention over codec pages (single-threaded):\n");
    // GQA=N: the grouped call's query heads (3, kvtiny's group, unless set; TinyLlama's is 8).
    const int group = std::max(2, EnvInt("GQA", 3));
    if (!std::getenv("MHA_ONLY")) BenchCodecAttention(rng, group, codec);
    BenchCodecAttention(rng, 1, codec);
  }
  std::vector<int> thread_counts;
  for (int t = 1; t < max_threads; t *= 2) thread_counts.push_back(t);
  thread_counts.push_back(std::max(1, max_threads));
  for (int threads : thread_counts) {
    ThreadPool pool(threads);
    if (only.empty() || only == "matmul") {
      std::printf("matmul, %d thread(s):\n", threads);
      BenchMatMul(pool, rng);
    }
    if (only.empty() || only == "quant") {
      std::printf("quantized matmul, %d thread(s):\n", threads);
      BenchQuantMatMul(pool, rng);
    }
  }
  return 0;
}
