// Synthetic GGUFs (`cachet convert --synthetic`, src/model/gguf_synthetic.cc): the shipped shapes
// and their parameter counts, small custom shapes written at every weight type and run by the
// engine, determinism of the bytes for a seed, the generated tokenizer, and shape errors.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "cachet/convert.h"
#include "cachet/engine.h"
#include "cachet/tokenizer.h"
#include "model/gguf.h"
#include "model/gguf_model.h"
#include "test_util.h"

namespace cachet {
namespace {

using testing::ReadFile;
using testing::TempDir;

// Row lengths of 256 and 512: every matrix is a whole number of q4_K blocks, so each type is
// really written as that type (a row that is not falls back to f16).
constexpr char kLlamaShape[] = R"({
  "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
  "vocab_size": 1000, "max_position_embeddings": 512, "rope_theta": 10000.0,
  "rms_norm_eps": 1e-5, "tie_word_embeddings": false
})";
// QKV biases and tied embeddings.
constexpr char kQwenShape[] = R"({
  "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 256,
  "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 512,
  "vocab_size": 700, "max_position_embeddings": 512, "rope_theta": 1000000.0,
  "rms_norm_eps": 1e-6, "tie_word_embeddings": true
})";

class Synthetic : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new TempDir(); }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Shape(const std::string& name, const char* json) {
    return dir_->Write(name + ".json", json);
  }
  static std::string Write(const char* json, WeightFormat format, uint64_t seed, int threads = 2) {
    const std::string out = dir_->path() + "/m-" + DTypeName(format.type) +
                            (format.mix_m ? "_m-" : "-") + std::to_string(seed) + "-" +
                            std::to_string(threads) + ".gguf";
    const Status s = WriteSyntheticGguf(Shape("shape", json), out, format, seed, threads);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }
  static std::unique_ptr<Engine> MakeEngine(const std::string& model) {
    EngineOptions o;
    o.model_dir = model;
    o.threads = 2;
    o.prefix_cache = false;
    o.n_ctx = 256;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  }
  // A few tokens evaluate to finite logits.
  static void ExpectFiniteLogits(Engine& engine) {
    std::vector<float> logits;
    ASSERT_TRUE(engine.NewSession()->Eval(std::vector<int32_t>{3, 4, 5, 6}, &logits, true).ok());
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  }
  static inline TempDir* dir_ = nullptr;
};

TEST_F(Synthetic, ShippedShapesHaveTheirModelsParameterCounts) {
  struct Want {
    const char* name;
    int64_t params;
    int layers, hidden, heads, kv_heads, ffn, vocab;
    bool tied, bias;
  };
  const Want want[] = {
      {"tinyllama-1.1b", 1100048384, 22, 2048, 32, 4, 5632, 32000, false, false},
      {"qwen2.5-0.5b", 494032768, 24, 896, 14, 2, 4864, 151936, true, true},
      {"llama-3.2-1b", 1235814400, 16, 2048, 32, 8, 8192, 128256, true, false},
      {"mha-85m", 134105856, 12, 768, 12, 12, 2048, 32000, false, false},
  };
  for (const Want& w : want) {
    SCOPED_TRACE(w.name);
    auto c = LoadShape(w.name);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->ParamCount(), w.params);
    EXPECT_EQ(c->n_layers, w.layers);
    EXPECT_EQ(c->hidden_size, w.hidden);
    EXPECT_EQ(c->n_heads, w.heads);
    EXPECT_EQ(c->n_kv_heads, w.kv_heads);
    EXPECT_EQ(c->head_dim, 64);
    EXPECT_EQ(c->intermediate_size, w.ffn);
    EXPECT_EQ(c->vocab_size, w.vocab);
    EXPECT_EQ(c->tie_word_embeddings, w.tied);
    EXPECT_EQ(c->attention_bias, w.bias);
    EXPECT_EQ(c->max_position_embeddings, 16384);
  }
  // A path works as well as a name.
  auto by_path = LoadShape(ShapesDir() + "/mha-85m.json");
  ASSERT_TRUE(by_path.ok()) << by_path.status().ToString();
  EXPECT_EQ(by_path->ParamCount(), 134105856);
}

TEST_F(Synthetic, EveryTypeLoadsAndGivesFiniteLogits) {
  for (const char* json : {kLlamaShape, kQwenShape}) {
    for (DType type : {DType::kF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_K}) {
      SCOPED_TRACE(std::string(DTypeName(type)) + (json == kQwenShape ? " qwen2" : " llama"));
      const std::string path = Write(json, type, 7);
      auto f = GgufFile::Open(path);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      const GgufTensor* down = f->FindTensor("blk.1.ffn_down.weight");
      ASSERT_NE(down, nullptr);
      EXPECT_EQ(down->dtype, type);
      ASSERT_NE(f->FindTensor("blk.0.attn_norm.weight"), nullptr);
      EXPECT_EQ(f->FindTensor("blk.0.attn_norm.weight")->dtype, DType::kF32);
      EXPECT_EQ(f->FindTensor("output.weight") == nullptr, json == kQwenShape);
      EXPECT_EQ(f->FindTensor("blk.0.attn_q.bias") != nullptr, json == kQwenShape);

      auto engine = MakeEngine(path);
      ASSERT_NE(engine, nullptr);
      const int vocab = engine->config().vocab_size;
      std::vector<int32_t> ids;
      for (int i = 0; i < 40; ++i) ids.push_back(3 + (i * 97) % (vocab - 3));
      std::vector<float> logits;
      auto session = engine->NewSession();
      ASSERT_TRUE(session->Eval(ids, &logits, /*all_logits=*/true).ok());
      ASSERT_EQ(logits.size(), ids.size() * vocab);
      double sum_sq = 0;
      for (float x : logits) {
        ASSERT_TRUE(std::isfinite(x));
        sum_sq += double(x) * x;
      }
      // Random weights of std 0.02 give logits of std about 0.02 * sqrt(hidden) = 0.32.
      const double rms = std::sqrt(sum_sq / logits.size());
      EXPECT_GT(rms, 0.05);
      EXPECT_LT(rms, 3.0);
    }
  }
}

// Matrices whose rows do not split into q4_K's 256-value super-blocks are written q5_0 (they split
// into 32s), as llama.cpp's quantizer writes them; the others q4_K; the file loads and computes.
TEST_F(Synthetic, RowsOffTheSuperBlockFallBackToQ5_0) {
  constexpr char kShape[] = R"({
    "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 320,
    "num_attention_heads": 5, "num_key_value_heads": 1, "intermediate_size": 512,
    "vocab_size": 600, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": false
  })";
  const std::string path = Write(kShape, DType::kQ4_K, 2);
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->FindTensor("blk.0.attn_q.weight")->dtype, DType::kQ5_0);    // 320 columns
  EXPECT_EQ(f->FindTensor("blk.0.ffn_up.weight")->dtype, DType::kQ5_0);    // 320 columns
  EXPECT_EQ(f->FindTensor("blk.0.ffn_down.weight")->dtype, DType::kQ4_K);  // 512 columns
  auto engine = MakeEngine(path);
  ASSERT_NE(engine, nullptr);
  ExpectFiniteLogits(*engine);
}

// --type q4_k_m / q5_k_m: llama.cpp's Q4_K_M / Q5_K_M mix. q6_K for the LM head (the embedding
// when tied), and for attn_v and ffn_down where llama.cpp's use_more_bits(i, n) holds (i < n/8,
// i >= 7n/8, or (i - n/8) % 3 == 2: layers 0, 3, 6, 7 of 8); q4_K / q5_K elsewhere; falling back
// as llama.cpp does (tests/peer_agreement.sh compares every matrix with llama.cpp's quantizer).
TEST_F(Synthetic, KMixGivesLlamaCppsTypes) {
  constexpr char kEight[] = R"({
    "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 512,
    "vocab_size": 600, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": false
  })";
  for (DType base : {DType::kQ4_K, DType::kQ5_K}) {
    SCOPED_TRACE(DTypeName(base));
    const std::string path = Write(kEight, WeightFormat::MixM(base), 3);
    auto engine = MakeEngine(path);
    ASSERT_NE(engine, nullptr);
    std::map<std::string, DType> types;
    for (const auto& m : engine->weight_matrices()) types[m.name] = m.type;
    ASSERT_EQ(types.size(), 2u + 8 * 7);
    EXPECT_EQ(types["token_embd"], base);
    EXPECT_EQ(types["output"], DType::kQ6_K);
    for (int l = 0; l < 8; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      const DType more = l == 0 || l == 3 || l == 6 || l == 7 ? DType::kQ6_K : base;
      EXPECT_EQ(types[p + "attn_v"], more) << l;
      EXPECT_EQ(types[p + "ffn_down"], more) << l;
      for (const char* m : {"attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"}) {
        EXPECT_EQ(types[p + m], base) << p << m;
      }
    }
    ExpectFiniteLogits(*engine);
  }

  // Tied: the embedding is the LM head, in q6_K; 320 columns: q6_K falls back to q8_0, q4_K to
  // q5_0, q5_K to q5_1.
  constexpr char kTied[] = R"({
    "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 320,
    "num_attention_heads": 5, "num_key_value_heads": 1, "intermediate_size": 512,
    "vocab_size": 600, "max_position_embeddings": 512, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": true
  })";
  for (DType base : {DType::kQ4_K, DType::kQ5_K}) {
    SCOPED_TRACE(DTypeName(base));
    const DType fallback = base == DType::kQ4_K ? DType::kQ5_0 : DType::kQ5_1;
    auto f = GgufFile::Open(Write(kTied, WeightFormat::MixM(base), 4));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->FindTensor("output.weight"), nullptr);
    EXPECT_EQ(f->FindTensor("token_embd.weight")->dtype, DType::kQ8_0);  // q6_K, 320 columns
    // Of two layers only the second gets more bits (1 >= 7 * 2 / 8).
    EXPECT_EQ(f->FindTensor("blk.0.attn_v.weight")->dtype, fallback);      // 320 columns
    EXPECT_EQ(f->FindTensor("blk.1.attn_v.weight")->dtype, DType::kQ8_0);  // q6_K, 320 columns
    EXPECT_EQ(f->FindTensor("blk.0.ffn_down.weight")->dtype, base);        // 512 columns
    EXPECT_EQ(f->FindTensor("blk.1.ffn_down.weight")->dtype, DType::kQ6_K);
    EXPECT_EQ(f->FindTensor("blk.1.ffn_up.weight")->dtype, fallback);  // 320 columns
  }
}

TEST_F(Synthetic, BytesDependOnTheSeedOnly) {
  for (DType type : {DType::kF16, DType::kQ4_K}) {
    SCOPED_TRACE(DTypeName(type));
    const std::string a = ReadFile(Write(kQwenShape, type, 5, /*threads=*/1));
    const std::string b = ReadFile(Write(kQwenShape, type, 5, /*threads=*/3));
    const std::string c = ReadFile(Write(kQwenShape, type, 6, /*threads=*/1));
    ASSERT_GT(a.size(), 100000u);
    EXPECT_TRUE(a == b) << "same seed, other thread count: the bytes differ";
    ASSERT_EQ(a.size(), c.size());
    EXPECT_FALSE(a == c) << "another seed gave the same file";
  }
}

TEST_F(Synthetic, WeightsHaveTheStatedDistribution) {
  auto f = GgufFile::Open(Write(kLlamaShape, DType::kF32, 3));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufTensor* up = f->FindTensor("blk.0.ffn_up.weight");  // 512 x 256
  ASSERT_NE(up, nullptr);
  const float* x = reinterpret_cast<const float*>(up->data);
  const int64_t n = up->ne[0] * up->ne[1];
  double sum = 0, sum_sq = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i], sum_sq += double(x[i]) * x[i];
  EXPECT_NEAR(sum / n, 0.0, 0.001);
  EXPECT_NEAR(std::sqrt(sum_sq / n), 0.02, 0.0005);
  const GgufTensor* norm = f->FindTensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  for (int64_t i = 0; i < norm->ne[0]; ++i) {
    ASSERT_EQ(reinterpret_cast<const float*>(norm->data)[i], 1.0f);
  }
}

TEST_F(Synthetic, GeneratedTokenizerRoundTripsAndItsMergesAreWellFormed) {
  auto f = GgufFile::Open(Write(kLlamaShape, DType::kQ8_0, 1));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto tokens = f->GetArray("tokenizer.ggml.tokens", GgufType::kString);
  auto merges = f->GetArray("tokenizer.ggml.merges", GgufType::kString);
  ASSERT_TRUE(tokens.ok() && merges.ok());
  const std::vector<std::string>& t = (*tokens)->strs;
  ASSERT_EQ(t.size(), 1000u);
  EXPECT_EQ(t[1], "<s>");
  EXPECT_EQ(t[2], "</s>");
  EXPECT_EQ(t[3 + 'a'], "a");
  EXPECT_EQ(t[3 + ' '], "\xC4\xA0");  // GPT-2's byte alphabet: space is U+0120
  EXPECT_EQ(t[259], "aa");
  EXPECT_EQ(t[259 + 26 * 26], "aaa");
  EXPECT_EQ(std::set<std::string>(t.begin(), t.end()).size(), t.size()) << "duplicate tokens";
  // Merge i makes token 259 + i out of two earlier tokens.
  ASSERT_EQ((*merges)->strs.size(), t.size() - 259);
  std::map<std::string, size_t> id;
  for (size_t i = 0; i < t.size(); ++i) id[t[i]] = i;
  for (size_t i = 0; i < (*merges)->strs.size(); ++i) {
    const std::string& m = (*merges)->strs[i];
    const size_t sp = m.find(' ');
    ASSERT_NE(sp, std::string::npos) << m;
    const std::string l = m.substr(0, sp), r = m.substr(sp + 1);
    ASSERT_TRUE(id.count(l) && id.count(r)) << m;
    EXPECT_LT(id[l], 259 + i) << m;
    EXPECT_LT(id[r], 259 + i) << m;
    EXPECT_EQ(l + r, t[259 + i]);
  }

  auto tok = TokenizerFromGguf(*f);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), 1000);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_TRUE((*tok)->add_bos());
  for (const std::string& text : std::vector<std::string>{
           "hello world, the quick brown fox jumps over the lazy dog", "Ab 12 \n\t x",
           "caf\xC3\xA9", "zz zzz aaa ab", std::string("\x00\xFF bytes", 8)}) {
    const std::vector<int32_t> ids = (*tok)->Encode(text);
    EXPECT_EQ((*tok)->Decode(ids), text);
    for (int32_t i : ids) EXPECT_GE(i, 3) << "a control token in plain text";
  }
  EXPECT_EQ((*tok)->Encode("ab"), std::vector<int32_t>({259 + 1}));
  EXPECT_LT((*tok)->Encode("hello world").size(), std::string("hello world").size());
}

TEST_F(Synthetic, BadShapesAreClearErrors) {
  auto unknown = LoadShape("no-such-shape");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown shape 'no-such-shape'"), std::string::npos)
      << unknown.status().ToString();
  EXPECT_NE(unknown.status().message().find("tinyllama-1.1b"), std::string::npos)
      << unknown.status().ToString();

  const std::string missing = Shape("missing", R"({"model_type": "llama", "vocab_size": 1000})");
  auto m = LoadShape(missing);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find(missing), std::string::npos) << m.status().ToString();
  EXPECT_NE(m.status().message().find("hidden_size"), std::string::npos) << m.status().ToString();

  std::string typo_json = kLlamaShape;
  typo_json.replace(typo_json.find("\"hidden_size\": 256"), 18, "\"hidden_size\": \"big\"");
  const std::string typo = Shape("typo", typo_json.c_str());
  auto ty = LoadShape(typo);
  ASSERT_FALSE(ty.ok());
  EXPECT_NE(ty.status().message().find("'hidden_size' must be a number"), std::string::npos)
      << ty.status().ToString();

  const std::string garbage = Shape("garbage", "{not json");
  auto g = LoadShape(garbage);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find(garbage), std::string::npos) << g.status().ToString();

  std::string small = kLlamaShape;
  small.replace(small.find("\"vocab_size\": 1000"), 18, "\"vocab_size\": 200");
  auto s = LoadShape(Shape("small", small.c_str()));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("vocab_size 200"), std::string::npos)
      << s.status().ToString();

  auto nofile = LoadShape(dir_->path() + "/absent.json");
  ASSERT_FALSE(nofile.ok());
  EXPECT_NE(nofile.status().message().find("absent.json"), std::string::npos)
      << nofile.status().ToString();

  const Status w = WriteSyntheticGguf("no-such-shape", dir_->path() + "/x.gguf", DType::kF16, 1);
  EXPECT_FALSE(w.ok());
}

}  // namespace
}  // namespace cachet
