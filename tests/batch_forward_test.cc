// The batched forward step (Transformer::ForwardBatch, issue 14): a sequence's output does not
// depend on what it is batched with. First the kernels it rests on (a token's MatMul row alone and
// among other tokens), then kvtiny: sequences served together, with prompt chunks of some beside
// decode tokens of others, against each served alone; then bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cachet/convert.h"
#include "cachet/tokenizer.h"
#include "kernels/int8_dot.h"
#include "kernels/kernels.h"
#include "kv/codecs/codec.h"
#include "kv/page_pool.h"
#include "kv/paged_sequence.h"
#include "model/transformer.h"
#include "simd_targets.h"
#include "test_util.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace cachet {
namespace {

using testing::KernelTargets;
using testing::ModelDir;
using testing::ReadFile;
using testing::ScopedTarget;
using testing::TargetString;
using testing::TempDir;

// ------------------------------------------------------------------------------------------------
// Kernels: a token's row of MatMul alone (n = 1: decode's matrix-vector path) and among n tokens
// (prefill's tiles).

struct WeightMatrix {
  std::vector<float> source;   // the values stored (before rounding to the dtype)
  std::vector<uint8_t> bytes;  // rows in the dtype
  kernels::Matrix m;
};

WeightMatrix MakeWeights(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  WeightMatrix w;
  w.source.resize(rows * cols);
  for (float& v : w.source) v = dist(rng);
  const int64_t row_bytes = DTypeRowBytes(t, cols);
  w.bytes.resize(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = w.source.data() + r * cols;
    uint8_t* dst = w.bytes.data() + r * row_bytes;
    if (DTypeIsQuantized(t)) {
      kernels::ref::QuantizeRow(t, src, cols, dst);
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        if (t == DType::kF32) {
          std::memcpy(dst + 4 * c, &src[c], 4);
        } else {
          const uint16_t h = t == DType::kF16 ? F32ToF16(src[c]) : F32ToBf16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
      }
    }
  }
  w.m = kernels::Matrix{w.bytes.data(), t, rows, cols};
  return w;
}

using MatMulFn = void (*)(const float*, int64_t, const kernels::Matrix&, const float*, float*,
                          int64_t, ThreadPool&);

// Row t of MatMul over tokens [first, first + n) of x (rows of cols floats), y_stride = w.rows + 3.
std::vector<float> Rows(MatMulFn fn, const std::vector<float>& x, int64_t first, int64_t n,
                        const kernels::Matrix& w, const float* bias, ThreadPool& pool) {
  const int64_t stride = w.rows + 3;
  std::vector<float> y(n * stride, -7.0f);
  fn(x.data() + first * w.cols, n, w, bias, y.data(), stride, pool);
  return y;
}

bool SameBits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// The largest |a - b| over n values.
double MaxDiff(const float* a, const float* b, int64_t n) {
  double d = 0.0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, std::abs(double(a[i]) - double(b[i])));
  return d;
}

// Checks fn on w: every token's row, computed among n tokens, has the same bits as the same token
// computed among m other tokens. Alone (n = 1) it must be the same bits too, unless int8_decode:
// then batches of up to kInt8MaxDecodeTokens give each token its bits alone, larger ones their own
// bits, within the rounding of f32 arithmetic over the dot product's terms of the first (see
// MatMulRowDoesNotDependOnTheBatch).
void CheckRowsIndependent(MatMulFn fn, const kernels::Matrix& w, bool int8_decode,
                          const std::string& what, std::mt19937& rng) {
  ThreadPool pool1(1), pool3(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t n_tok = 41;
  std::vector<float> x(n_tok * w.cols);
  for (float& v : x) v = dist(rng);
  std::vector<float> bias(w.rows);
  for (float& v : bias) v = dist(rng);
  for (const float* b :
       {static_cast<const float*>(nullptr), static_cast<const float*>(bias.data())}) {
    const std::string desc = what + (b ? " bias" : "");
    const int64_t stride = w.rows + 3;
    const std::vector<float> all = Rows(fn, x, 0, n_tok, w, b, pool3);
    // Other batches: the same tokens at other places in tiles of other sizes. int8: batches of
    // up to kInt8MaxDecodeTokens take decode's path, so each token is what it is alone.
    for (auto [first, n] :
         {std::pair<int64_t, int64_t>{0, 2}, {5, 3}, {9, 6}, {3, 7}, {7, 17}, {1, 40}}) {
      const std::vector<float> part = Rows(fn, x, first, n, w, b, n % 2 ? pool1 : pool3);
      const bool decode_path = int8_decode && n <= kernels::cpu::kInt8MaxDecodeTokens;
      for (int64_t t = 0; t < n; ++t) {
        const std::vector<float> ref =
            decode_path ? Rows(fn, x, first + t, 1, w, b, pool3) : std::vector<float>();
        ASSERT_TRUE(SameBits(&part[t * stride],
                             decode_path ? ref.data() : &all[(first + t) * stride], w.rows))
            << desc << ": token " << first + t << " among " << n << " tokens";
      }
    }
    // Alone: decode's path.
    for (int64_t t : {int64_t{0}, int64_t{13}, n_tok - 1}) {
      for (ThreadPool* pool : {&pool1, &pool3}) {
        const std::vector<float> one = Rows(fn, x, t, 1, w, b, *pool);
        const float* ref = &all[t * stride];
        if (!int8_decode) {
          ASSERT_TRUE(SameBits(one.data(), ref, w.rows))
              << desc << ": token " << t << " alone, max diff " << MaxDiff(one.data(), ref, w.rows);
          continue;
        }
        // int8 decode and prefill sum the same integer block products but round the scaling
        // and the sums over blocks in another order: a few f32 roundings of the dot product's
        // terms, bounded here by 16 ulps of sum_c |w_c x_c| (the largest seen is under one).
        std::vector<float> wrow(w.cols);
        for (int64_t r = 0; r < w.rows; ++r) {
          kernels::ref::DequantRow(w, r, wrow.data());
          double terms = 0.0;
          for (int64_t c = 0; c < w.cols; ++c)
            terms += std::abs(double(wrow[c]) * x[t * w.cols + c]);
          const double bound = 16 * std::ldexp(terms, -23);
          ASSERT_LE(std::abs(double(one[r]) - ref[r]), bound)
              << desc << ": token " << t << " alone, row " << r;
        }
      }
    }
  }
}

// f32, f16 and bf16 weights, and quantized ones through the f32 (dequantizing) kernels: a token's
// row has the same bits alone as in any batch, on every SIMD target. The int8 kernels (q4_0, q8_0
// and q4_K on AVX-512 VNNI) give a token the same bits in any batch of more than
// kInt8MaxDecodeTokens, and alone or in a smaller batch (the matrix-vector path) its bits alone,
// which differ from the first only by rounding: decode accumulates a block's integer products in 16
// i32 lanes, scales each lane's partial sum and adds them over alternating block pairs (with q4_0 /
// q8_0's offsets subtracted in the integers), while prefill scales each block's whole integer sum
// once, adds the blocks in order and subtracts the offsets in floats.
TEST(BatchDeterminism, MatMulRowDoesNotDependOnTheBatch) {
  std::mt19937 rng(14);
  for (int64_t target : KernelTargets()) {
    ScopedTarget scoped(target);
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      // Columns: a multiple of every 2N, a partial last block, fewer than one vector.
      for (int64_t cols : {384, 1000, 37, 5}) {
        for (int64_t rows : {67, 5, 1024}) {
          WeightMatrix w = MakeWeights(t, rows, cols, rng);
          CheckRowsIndependent(kernels::cpu::MatMul, w.m, false,
                               std::string(DTypeName(t)) + " " + std::to_string(rows) + "x" +
                                   std::to_string(cols) + TargetString(target),
                               rng);
        }
      }
    }
    // Matrices over 8 MiB: decode reads them four rows at a time instead of eight.
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      const int64_t cols = 384, rows = (int64_t{8} << 20) / (cols * DTypeSize(t)) + 5;
      WeightMatrix w = MakeWeights(t, rows, cols, rng);
      ThreadPool pool(2);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<float> x(3 * cols);
      for (float& v : x) v = dist(rng);
      const std::vector<float> three = Rows(kernels::cpu::MatMul, x, 0, 3, w.m, nullptr, pool);
      for (int64_t tok = 0; tok < 3; ++tok) {
        const std::vector<float> one = Rows(kernels::cpu::MatMul, x, tok, 1, w.m, nullptr, pool);
        ASSERT_TRUE(SameBits(one.data(), &three[tok * (rows + 3)], rows))
            << DTypeName(t) << " " << rows << "x" << cols << TargetString(target) << ": token "
            << tok << " alone";
      }
    }
    for (DType t :
         {DType::kQ8_0, DType::kQ5_0, DType::kQ5_1, DType::kQ4_0, DType::kQ4_1, DType::kQ4_K,
          DType::kQ5_K, DType::kQ6_K, DType::kQ3_K, DType::kQ2_K, DType::kIQ4_NL, DType::kIQ4_XS}) {
      const bool k_quant = DTypeBlockElems(t) == 256;
      for (int64_t cols :
           k_quant ? std::vector<int64_t>{256, 768} : std::vector<int64_t>{384, 416}) {
        for (int64_t rows : {67, 5}) {
          WeightMatrix w = MakeWeights(t, rows, cols, rng);
          const std::string what = std::string(DTypeName(t)) + " " + std::to_string(rows) + "x" +
                                   std::to_string(cols) + TargetString(target);
          CheckRowsIndependent(kernels::cpu::DequantMatMul, w.m, false, what + " dequant", rng);
          const bool int8 = kernels::HasInt8Path(t) && kernels::cpu::HasInt8Kernels();
          CheckRowsIndependent(kernels::cpu::MatMul, w.m, int8, what, rng);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// kvtiny: sequences served together against each served alone.

constexpr int kMaxBatch = 64;
constexpr int kGenerate = 24;

const char* const kPrompts[] = {
    "In the beginning God created the heaven and the earth.",
    "And the LORD said",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that "
    "mourn: for they shall be comforted.",
    "Now the serpent was more subtil than any beast of the field which the LORD God had made. And "
    "he said unto the woman, Yea, hath God said, Ye shall not eat of every tree of the garden?",
};

int32_t ArgMax(const float* v, int n) {
  return static_cast<int32_t>(std::max_element(v, v + n) - v);
}

// Which path of the int8 kernels a step of n rows takes: 'd' the matrix-vector one, 'p' prefill.
char Int8Path(int64_t n) { return n <= kernels::cpu::kInt8MaxDecodeTokens ? 'd' : 'p'; }

// What greedy decoding gave one sequence: each generated token and the logits it was chosen from,
// and with them the int8 path of every token the sequence computed until then and of the LM head's
// product that gave the logits: two runs with the same paths give the same bits.
struct Served {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<std::string> paths;
};

// kvtiny (the safetensors directory, bf16) or a GGUF of it, loaded once; prompts tokenized.
class BatchForward : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new TempDir(); }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  // kvtiny in dtype t (bf16: the embedded model itself).
  static Transformer& Model(DType t) {
    static std::map<DType, std::unique_ptr<Transformer>> models;
    std::unique_ptr<Transformer>& m = models[t];
    if (!m) {
      std::string path = ModelDir();
      if (t != DType::kBF16) {
        path = dir_->path() + "/kvtiny-" + DTypeName(t) + ".gguf";
        if (ReadFile(path).empty()) {
          const Status s = ConvertHfToGguf(ModelDir(), path, t);
          EXPECT_TRUE(s.ok()) << s.ToString();
        }
      }
      auto r = Transformer::Load(path, kMaxBatch);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      m = std::move(r).value();
    }
    return *m;
  }
  static std::vector<std::vector<int32_t>> Prompts() {
    auto tok = Tokenizer::Load(ModelDir());
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    std::vector<std::vector<int32_t>> out;
    for (const char* p : kPrompts) out.push_back((*tok)->EncodePrompt(p));
    return out;
  }
  static KvLayout Layout(const Transformer& model, const std::string& codec) {
    const ModelConfig& c = model.config();
    KvLayout layout{c.n_layers, c.n_kv_heads, c.head_dim, 16};
    auto k = codecs::ParseCodec(codec);
    EXPECT_TRUE(k.ok());
    layout.codec_k = layout.codec_v = *k;
    return layout;
  }

  // One prompt served alone: prefilled in one step, then one token per step.
  static Served ServeAlone(Transformer& model, const KvLayout& layout,
                           const std::vector<int32_t>& prompt, ThreadPool& threads) {
    const int vocab = model.config().vocab_size;
    PagePool pool(layout, size_t{64} << 20);
    PagedSequence seq(pool);
    Served out;
    std::vector<int32_t> pos(prompt.size());
    for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
    std::vector<float> logits(vocab);
    Status s = model.Forward(prompt, pos, seq, threads, logits.data(), false);
    EXPECT_TRUE(s.ok()) << s.ToString();
    std::string paths(prompt.size(), Int8Path(static_cast<int64_t>(prompt.size())));
    for (int g = 0; g < kGenerate; ++g) {
      if (g > 0) paths += Int8Path(1);
      out.paths.push_back(paths + Int8Path(1));
      out.logits.push_back(logits);
      out.tokens.push_back(ArgMax(logits.data(), vocab));
      if (g + 1 == kGenerate) break;
      const int32_t tok[1] = {out.tokens.back()};
      const int32_t p[1] = {static_cast<int32_t>(prompt.size()) + g};
      s = model.Forward(tok, p, seq, threads, logits.data(), false);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    return out;
  }

  // A schedule of the steps serving several sequences together.
  struct Schedule {
    int budget;              // tokens per step at most
    std::vector<int> chunk;  // sequence i's prompt goes in chunks of at most chunk[i] tokens
    int arrive_every;        // sequence i arrives at step i * arrive_every
  };

  // All prompts served together from one pool, as a server's steps would run them: each step holds
  // the next token of every decoding sequence, then prompt chunks of the prefilling ones, within
  // the schedule's budget. Entries come in a different order every step. Returns each sequence's
  // result and the steps' sizes.
  static std::vector<Served> ServeTogether(Transformer& model, const KvLayout& layout,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           const Schedule& sched, ThreadPool& threads,
                                           std::vector<int>* step_sizes) {
    const int budget = sched.budget;
    const int vocab = model.config().vocab_size;
    const size_t n_seq = prompts.size();
    PagePool pool(layout, size_t{64} << 20);
    std::vector<std::unique_ptr<PagedSequence>> seqs;
    for (size_t i = 0; i < n_seq; ++i) seqs.push_back(std::make_unique<PagedSequence>(pool));
    std::vector<Served> out(n_seq);
    std::vector<size_t> prefilled(n_seq, 0);
    std::vector<std::vector<int32_t>> pos(n_seq);
    std::vector<std::vector<int32_t>> next(n_seq, std::vector<int32_t>(1));
    std::vector<std::vector<float>> logits(n_seq, std::vector<float>(vocab));
    std::vector<std::string> paths(n_seq);
    for (int step = 0;; ++step) {
      std::vector<SeqChunk> entries;
      std::vector<size_t> owner;  // the sequence of each entry
      int left = budget;
      for (int pass = 0; pass < 2; ++pass) {  // decoding sequences first, then prefilling ones
        for (size_t k = 0; k < n_seq; ++k) {
          const size_t i = (k + step) % n_seq;
          const bool decoding = prefilled[i] == prompts[i].size();
          if (step < int(i) * sched.arrive_every || (pass == 0) != decoding || left == 0) continue;
          if (decoding && out[i].tokens.size() == size_t(kGenerate)) continue;  // done
          SeqChunk e;
          e.kv = seqs[i].get();
          if (decoding) {
            next[i][0] = out[i].tokens.back();
            pos[i] = {static_cast<int32_t>(prompts[i].size() + out[i].tokens.size() - 1)};
            e.tokens = next[i];
            e.logits = logits[i].data();
            left -= 1;
          } else {
            const size_t n =
                std::min({size_t(sched.chunk[i]), size_t(left), prompts[i].size() - prefilled[i]});
            e.tokens = std::span(prompts[i]).subspan(prefilled[i], n);
            pos[i].resize(n);
            for (size_t j = 0; j < n; ++j) pos[i][j] = static_cast<int32_t>(prefilled[i] + j);
            prefilled[i] += n;
            // Logits only after the prompt's last chunk.
            if (prefilled[i] == prompts[i].size()) e.logits = logits[i].data();
            left -= static_cast<int>(n);
          }
          e.positions = pos[i];
          entries.push_back(e);
          owner.push_back(i);
        }
      }
      if (entries.empty()) break;
      step_sizes->push_back(budget - left);
      const Status s = model.ForwardBatch(entries, threads);
      EXPECT_TRUE(s.ok()) << s.ToString();
      if (!s.ok()) break;
      int head_rows = 0;
      for (const SeqChunk& e : entries) head_rows += e.logits != nullptr;
      for (size_t k = 0; k < entries.size(); ++k) {
        const size_t i = owner[k];
        paths[i].append(entries[k].tokens.size(), Int8Path(budget - left));
        if (entries[k].logits == nullptr) continue;
        out[i].paths.push_back(paths[i] + Int8Path(head_rows));
        out[i].logits.push_back(logits[i]);
        out[i].tokens.push_back(ArgMax(logits[i].data(), vocab));
      }
    }
    return out;
  }

  // Serves kPrompts together in two schedules; expects each sequence's greedy tokens and logits,
  // bit for bit, to be what it gets alone. int8: see TogetherEqualsAloneInt8Weights.
  static void ExpectTogetherEqualsAlone(Transformer& model, const std::string& codec, bool int8,
                                        const std::string& what) {
    ThreadPool threads(2);
    const KvLayout layout = Layout(model, codec);
    const std::vector<std::vector<int32_t>> prompts = Prompts();
    const int vocab = model.config().vocab_size;
    // Prompt chunks of several sizes, within budgets that mix them with decode tokens.
    const Schedule schedules[] = {{16, {5, 16, 7, 11}, 1}, {9, {3, 4, 9, 2}, 2}};
    std::vector<std::vector<Served>> together;
    for (const Schedule& sched : schedules) {
      std::vector<int> sizes;
      together.push_back(ServeTogether(model, layout, prompts, sched, threads, &sizes));
      // The steps did mix: some were full (prompt chunks beside decode tokens), some a lone token.
      EXPECT_NE(std::find(sizes.begin(), sizes.end(), sched.budget), sizes.end()) << what;
      EXPECT_NE(std::find(sizes.begin(), sizes.end(), 1), sizes.end()) << what;
      for (size_t i = 0; i < prompts.size(); ++i) {
        ASSERT_EQ(together.back()[i].tokens.size(), size_t(kGenerate)) << what;
      }
    }
    int exact = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (!int8) {
        const Served alone = ServeAlone(model, layout, prompts[i], threads);
        for (size_t k = 0; k < together.size(); ++k) {
          const std::string at = what + " budget " + std::to_string(schedules[k].budget) +
                                 " sequence " + std::to_string(i);
          EXPECT_EQ(together[k][i].tokens, alone.tokens) << at;
          for (int g = 0; g < kGenerate; ++g) {
            const float* a = alone.logits[g].data();
            const float* b = together[k][i].logits[g].data();
            ASSERT_TRUE(SameBits(a, b, vocab))
                << at << " token " << g << ": max diff " << MaxDiff(a, b, vocab);
            ++exact;
          }
        }
        continue;
      }
      // int8: any two of the runs (alone, either schedule) give a token the same bits wherever
      // every token before it and its LM head row took the same paths, with the same tokens.
      const Served alone = ServeAlone(model, layout, prompts[i], threads);
      const Served* runs[] = {&alone, &together[0][i], &together[1][i]};
      for (int x = 0; x < 3; ++x) {
        for (int y = x + 1; y < 3; ++y) {
          const Served& a = *runs[x];
          const Served& b = *runs[y];
          for (int g = 0; g < kGenerate; ++g) {
            if (a.paths[g] == b.paths[g]) {
              ASSERT_TRUE(SameBits(a.logits[g].data(), b.logits[g].data(), vocab))
                  << what << " sequence " << i << " runs " << x << "/" << y << " token " << g
                  << ": max diff " << MaxDiff(a.logits[g].data(), b.logits[g].data(), vocab);
              ++exact;
            }
            if (a.tokens[g] != b.tokens[g]) break;
          }
        }
      }
    }
    EXPECT_GE(exact, int8 ? 40 : 2 * 4 * kGenerate) << what;
  }

  static TempDir* dir_;
};

TempDir* BatchForward::dir_ = nullptr;

// The embedded model (bf16 weights), f32 and f16 KV: bit for bit.
TEST_F(BatchForward, TogetherEqualsAloneBf16) {
  for (const char* codec : {"f32", "f16"}) {
    ExpectTogetherEqualsAlone(Model(DType::kBF16), codec, false, std::string("bf16, KV ") + codec);
  }
}

// Past 2048 keys a decode step's attention runs in parts (KvSequence::DecodeParts): how many
// depends on the sequence and the threads, not on its batch, so a long sequence decoded beside
// another (a short one and a long one of another length) gets the bits it gets alone.
TEST_F(BatchForward, LongDecodeInPartsTogetherEqualsAlone) {
  Transformer& model = Model(DType::kBF16);
  ThreadPool threads(2);
  const int vocab = model.config().vocab_size;
  std::vector<int32_t> base;
  for (const auto& p : Prompts()) base.insert(base.end(), p.begin(), p.end());
  const int lengths[3] = {2300, 40, 3100};
  for (const char* codec : {"f32", "f16"}) {
    const KvLayout layout = Layout(model, codec);
    PagePool pool(layout, size_t{256} << 20);
    std::vector<std::unique_ptr<PagedSequence>> seqs;
    std::vector<std::vector<float>> logits(3, std::vector<float>(vocab));
    for (int i = 0; i < 3; ++i) {
      seqs.push_back(std::make_unique<PagedSequence>(pool));
      std::vector<int32_t> ids(lengths[i]), pos(lengths[i]);
      for (int j = 0; j < lengths[i]; ++j) ids[j] = base[(j * 7 + i) % base.size()], pos[j] = j;
      for (int j = 0; j < lengths[i]; j += kMaxBatch) {  // the model's steps hold kMaxBatch
        const int n = std::min(kMaxBatch, lengths[i] - j);
        const Status st = model.Forward(std::span(ids).subspan(j, n), std::span(pos).subspan(j, n),
                                        *seqs.back(), threads, logits[i].data(), false);
        ASSERT_TRUE(st.ok()) << st.ToString();
      }
    }
    EXPECT_GT(seqs[0]->DecodeParts(threads.size()), 1);
    EXPECT_EQ(seqs[1]->DecodeParts(threads.size()), 1);
    // Forks of the prefilled sequences: one decode step each alone, then all three together.
    const int32_t tok[3] = {11, 12, 13};
    const int32_t pos[3] = {lengths[0], lengths[1], lengths[2]};
    std::vector<std::vector<float>> alone(3, std::vector<float>(vocab)), together = alone;
    for (int i = 0; i < 3; ++i) {
      auto fork = seqs[i]->Fork();
      ASSERT_TRUE(model
                      .Forward(std::span(tok + i, 1), std::span(pos + i, 1), *fork, threads,
                               alone[i].data(), false)
                      .ok());
    }
    std::vector<std::unique_ptr<PagedSequence>> forks;
    std::vector<SeqChunk> entries(3);
    for (int i = 0; i < 3; ++i) {
      forks.push_back(seqs[i]->Fork());
      entries[i].kv = forks.back().get();
      entries[i].tokens = std::span(tok + i, 1);
      entries[i].positions = std::span(pos + i, 1);
      entries[i].logits = together[i].data();
    }
    ASSERT_TRUE(model.ForwardBatch(entries, threads).ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(SameBits(alone[i].data(), together[i].data(), vocab))
          << codec << " sequence " << i << ": max diff "
          << MaxDiff(alone[i].data(), together[i].data(), vocab);
    }
  }
}

// f16 weights: bit for bit too.
TEST_F(BatchForward, TogetherEqualsAloneF16) {
  ExpectTogetherEqualsAlone(Model(DType::kF16), "f16", false, "f16, KV f16");
}

// q8_0, q4_0 and q4_K on the int8 kernels (AVX-512 VNNI): a matrix-vector product (a step of one
// token, an LM head of one row) rounds each dot product differently from a product of several
// rows (see BatchDeterminism.MatMulRowDoesNotDependOnTheBatch), and the next layer's activations,
// quantized to int8 again, can turn that into a different code: on kvtiny the logits move by up to
// ~1.5% of their scale and q4_0's greedy tokens can differ from the sequence's alone. What is
// checked: two batched schedules give a sequence the same bits as long as neither took it through
// a matrix-vector product. Without the int8 kernels: bit for bit, as the other types.
// kvtiny's q6_K file is one of them: its 384-column matrices do not split into q6_K's 256-value
// super-blocks, so `cachet convert` writes them q8_0 (ffn_down, 1024 columns, is q6_K).
TEST_F(BatchForward, TogetherEqualsAloneInt8Weights) {
  for (DType t :
       {DType::kQ8_0, DType::kQ5_0, DType::kQ5_1, DType::kQ4_0, DType::kQ4_1, DType::kQ4_K,
        DType::kQ5_K, DType::kQ6_K, DType::kQ3_K, DType::kQ2_K, DType::kIQ4_NL, DType::kIQ4_XS}) {
    ExpectTogetherEqualsAlone(Model(t), "f32", kernels::cpu::HasInt8Kernels(),
                              std::string(DTypeName(t)) + ", KV f32");
  }
}

// Logits of the last token of `tokens` run alone on a fresh sequence (positions from 0).
std::vector<float> LastLogits(Transformer& model, const KvLayout& layout,
                              std::span<const int32_t> tokens, ThreadPool& threads) {
  PagePool pool(layout, size_t{64} << 20);
  PagedSequence seq(pool);
  std::vector<int32_t> pos(tokens.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  std::vector<float> logits(model.config().vocab_size);
  const Status s = model.Forward(tokens, pos, seq, threads, logits.data(), false);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return logits;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Bad input is refused before anything changes, with a message naming the entry; the sequences then
// go on exactly as if the bad steps had not been tried.
TEST_F(BatchForward, BadInputNamesTheEntryAndChangesNothing) {
  Transformer& model = Model(DType::kBF16);
  const int vocab = model.config().vocab_size;
  ThreadPool threads(2);
  KvLayout layout = Layout(model, "f32");
  layout.page_tokens = 4;  // the first step fills a page: the next needs new ones
  PagePool pool(layout, size_t{64} << 20);
  std::vector<std::vector<int32_t>> prompts = Prompts();
  prompts.erase(prompts.begin() + 1);  // the others have at least 6 tokens
  std::vector<std::unique_ptr<PagedSequence>> seqs;
  std::vector<std::vector<int32_t>> pos(3);
  std::vector<SeqChunk> first;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(std::make_unique<PagedSequence>(pool));
    for (int j = 0; j < 4; ++j) pos[i].push_back(j);
    first.push_back({seqs[i].get(), std::span(prompts[i]).first(4), pos[i], nullptr, false});
  }
  ASSERT_TRUE(model.ForwardBatch(first, threads).ok());
  const int used = pool.used_pages();
  auto expect_unchanged = [&](const std::string& what) {
    EXPECT_EQ(pool.used_pages(), used) << what;
    for (const auto& s : seqs) {
      EXPECT_EQ(s->n_tokens(), 4) << what;
      EXPECT_EQ(s->pages_held(), layout.heads_total()) << what;
    }
  };
  // The next chunk of each prompt (tokens 4 and 5), and bad versions of it.
  std::vector<std::vector<int32_t>> next(3), next_pos(3, std::vector<int32_t>{4, 5});
  for (int i = 0; i < 3; ++i) next[i] = {prompts[i][4], prompts[i][5]};
  std::vector<std::vector<float>> logits(3, std::vector<float>(vocab));
  auto step = [&]() {
    std::vector<SeqChunk> e;
    for (int i = 0; i < 3; ++i)
      e.push_back({seqs[i].get(), next[i], next_pos[i], logits[i].data()});
    return e;
  };
  {
    std::vector<SeqChunk> e = step();
    const int32_t bad[2] = {prompts[2][4], vocab};
    e[2].tokens = bad;
    const Status s = model.ForwardBatch(e, threads);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "entry 2: token id " + std::to_string(vocab) + " at index 1"))
        << s.message();
    expect_unchanged("bad token id");
  }
  {
    std::vector<SeqChunk> e = step();
    e[1].positions = std::span(next_pos[1]).first(1);
    const Status s = model.ForwardBatch(e, threads);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "entry 1: 1 positions for 2 tokens")) << s.message();
    expect_unchanged("positions");
  }
  {
    std::vector<SeqChunk> e = step();
    e[1].kv = nullptr;
    const Status s = model.ForwardBatch(e, threads);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "entry 1: no KV sequence")) << s.message();
    expect_unchanged("null sequence");
  }
  {
    std::vector<SeqChunk> e = step();
    e[2].kv = seqs[0].get();
    const Status s = model.ForwardBatch(e, threads);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "entry 2: its KV sequence is also entry 0's")) << s.message();
    expect_unchanged("a sequence twice");
  }
  {
    std::vector<SeqChunk> e = step();
    std::vector<int32_t> many(kMaxBatch - 3, prompts[1][4]), many_pos(kMaxBatch - 3);
    for (size_t j = 0; j < many_pos.size(); ++j) many_pos[j] = 4 + static_cast<int32_t>(j);
    e[1].tokens = many;
    e[1].positions = many_pos;
    const Status s = model.ForwardBatch(e, threads);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "entry 2: brings the step to " +
                                          std::to_string(kMaxBatch + 1) + " tokens, over the " +
                                          "batch of " + std::to_string(kMaxBatch)))
        << s.message();
    expect_unchanged("too many tokens");
  }
  // The good step now gives what each sequence gets alone.
  ASSERT_TRUE(model.ForwardBatch(step(), threads).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(seqs[i]->n_tokens(), 6);
    const std::vector<float> want =
        LastLogits(model, layout, std::span(prompts[i]).first(6), threads);
    EXPECT_TRUE(SameBits(logits[i].data(), want.data(), vocab)) << "sequence " << i;
  }
}

// A Reserve that fails (KV pool full) is reported with the entry's index; no sequence has appended
// or committed anything; the entries before it keep the room they reserved, the ones after are
// untouched; the step retried without the entry gives what the others get alone.
TEST_F(BatchForward, ReserveFailureNamesTheEntry) {
  Transformer& model = Model(DType::kBF16);
  const int vocab = model.config().vocab_size;
  ThreadPool threads(2);
  const KvLayout layout = Layout(model, "f32");
  const int tables = layout.heads_total();  // a page per (layer, KV head) per 16 tokens
  PagePool pool(layout, size_t(2 * tables + tables / 2) * layout.page_bytes());
  const std::vector<std::vector<int32_t>> prompts = Prompts();
  ASSERT_GE(prompts[3].size(), 33u);
  PagedSequence a(pool), b(pool), c(pool);
  const std::span<const int32_t> ta = std::span(prompts[0]).first(5),
                                 tb = std::span(prompts[3]).first(33),  // 3 pages per table
      tc = std::span(prompts[2]).first(3);
  std::vector<int32_t> pos(33);
  for (int j = 0; j < 33; ++j) pos[j] = j;
  std::vector<float> la(vocab), lb(vocab), lc(vocab);
  std::vector<SeqChunk> e = {{&a, ta, std::span(pos).first(5), la.data()},
                             {&b, tb, std::span(pos).first(33), lb.data()},
                             {&c, tc, std::span(pos).first(3), lc.data()}};
  const Status s = model.ForwardBatch(e, threads);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(s.message(), "ForwardBatch entry 1: ")) << s.message();
  for (const PagedSequence* seq : {&a, &b, &c}) EXPECT_EQ(seq->n_tokens(), 0);
  EXPECT_EQ(a.pages_held(), tables);  // its reservation
  EXPECT_EQ(b.pages_held(), 0);
  EXPECT_EQ(c.pages_held(), 0);
  EXPECT_EQ(pool.used_pages(), tables);
  // Without entry 1: a uses the room it holds, c takes its own.
  e.erase(e.begin() + 1);
  ASSERT_TRUE(model.ForwardBatch(e, threads).ok());
  EXPECT_EQ(pool.used_pages(), 2 * tables);
  EXPECT_EQ(a.n_tokens(), 5);
  EXPECT_EQ(c.n_tokens(), 3);
  EXPECT_TRUE(SameBits(la.data(), LastLogits(model, layout, ta, threads).data(), vocab));
  EXPECT_TRUE(SameBits(lc.data(), LastLogits(model, layout, tc, threads).data(), vocab));
}

// Speed (prints only; not run by ctest): one decode step of 16 sequences batched against 16
// single-sequence steps, on kvtiny. --gtest_also_run_disabled_tests
// --gtest_filter='BatchForward.DISABLED_*'
TEST_F(BatchForward, DISABLED_DecodeStepSpeed) {
  using Clock = std::chrono::steady_clock;
  Transformer& model = Model(DType::kBF16);
  const int vocab = model.config().vocab_size;
  constexpr int kSeqs = 16, kSteps = 8, kReps = 5;
  for (int threads_n : {1, 2}) {
    ThreadPool threads(threads_n);
    for (int ctx : {128, 512}) {
      PagePool pool(Layout(model, "f32"), size_t{512} << 20);
      std::mt19937 rng(5);
      std::uniform_int_distribution<int32_t> id(3, vocab - 1);
      // Two sets of 16 sequences with the same prompts: one decoded batched, one one by one.
      std::vector<std::unique_ptr<PagedSequence>> seqs[2];
      std::vector<int32_t> prompt(ctx), pos(ctx);
      for (int i = 0; i < kSeqs; ++i) {
        for (int j = 0; j < ctx; ++j) prompt[j] = id(rng), pos[j] = j;
        for (auto& set : seqs) {
          set.push_back(std::make_unique<PagedSequence>(pool));
          for (int j = 0; j < ctx; j += kMaxBatch) {
            const int n = std::min(kMaxBatch, ctx - j);
            ASSERT_TRUE(model
                            .Forward(std::span(prompt).subspan(j, n), std::span(pos).subspan(j, n),
                                     *set.back(), threads, nullptr, false)
                            .ok());
          }
        }
      }
      std::vector<int32_t> tok(kSeqs, 5), tpos(kSeqs, ctx);
      std::vector<float> logits(size_t(kSeqs) * vocab);
      std::vector<double> batched, single;
      for (int rep = 0; rep < kReps; ++rep) {
        auto t0 = Clock::now();
        for (int s = 0; s < kSteps; ++s) {
          std::vector<SeqChunk> e;
          for (int i = 0; i < kSeqs; ++i) {
            e.push_back({seqs[0][i].get(), std::span(tok).subspan(i, 1),
                         std::span(tpos).subspan(i, 1), logits.data() + size_t(i) * vocab});
          }
          ASSERT_TRUE(model.ForwardBatch(e, threads).ok());
          for (int32_t& p : tpos) ++p;
        }
        batched.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() /
                          kSteps);
        for (int32_t& p : tpos) p -= kSteps;
        t0 = Clock::now();
        for (int s = 0; s < kSteps; ++s) {
          for (int i = 0; i < kSeqs; ++i) {
            ASSERT_TRUE(model
                            .Forward(std::span(tok).subspan(i, 1), std::span(tpos).subspan(i, 1),
                                     *seqs[1][i], threads, logits.data() + size_t(i) * vocab, false)
                            .ok());
          }
          for (int32_t& p : tpos) ++p;
        }
        single.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() /
                         kSteps);
      }
      std::sort(batched.begin(), batched.end());
      std::sort(single.begin(), single.end());
      const double b = batched[kReps / 2], one = single[kReps / 2];
      std::printf(
          "kvtiny decode, %d sequences at ctx %d, threads=%d: one batched step %.2f ms, %d "
          "single steps %.2f ms (%.2fx); %.0f vs %.0f tok/s\n",
          kSeqs, ctx, threads_n, b, kSeqs, one, one / b, kSeqs * 1e3 / b, kSeqs * 1e3 / one);
    }
  }
}

}  // namespace
}  // namespace cachet
