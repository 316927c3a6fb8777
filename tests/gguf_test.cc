// GGUF: reader errors on corrupt files, `cachet convert` round trips of kvtiny (golden logits and
// greedy continuations through the GGUF), the tokenizer rebuilt from GGUF metadata, the llama Q/K
// row permutation, and the SentencePiece-style vocabulary.
#include "model/gguf.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "cachet/convert.h"
#include "cachet/engine.h"
#include "cachet/tokenizer.h"
#include "model/gguf_model.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

using testing::LoadGolden;
using testing::ModelDir;
using testing::ReadFile;
using testing::TempDir;

// One temporary directory with kvtiny converted to each type once for the whole suite.
class GgufRoundTrip : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new TempDir(); }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Converted(DType t) {
    const std::string path = dir_->path() + "/kvtiny-" + DTypeName(t) + ".gguf";
    if (ReadFile(path).empty()) {
      const Status s = ConvertHfToGguf(ModelDir(), path, t);
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    return path;
  }
  static std::unique_ptr<Engine> MakeEngine(const std::string& model, int threads = 2) {
    EngineOptions o;
    o.model_dir = model;
    o.threads = threads;
    // The engine keys its prefix cache by <model_dir>/config.json, which a .gguf does not have.
    o.prefix_cache = false;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  }
  static std::vector<int32_t> Greedy(Engine& engine, Session& s, std::vector<float> last,
                                     size_t n) {
    std::vector<int32_t> got;
    for (size_t i = 0; i < n; ++i) {
      const int32_t next = ArgMax(last);
      got.push_back(next);
      if (next == engine.tokenizer().eos_id()) break;
      const int32_t one[1] = {next};
      EXPECT_TRUE(s.Eval(one, &last).ok());
    }
    return got;
  }
  static TempDir* dir_;
};
TempDir* GgufRoundTrip::dir_ = nullptr;

TEST_F(GgufRoundTrip, F16AndBf16MatchGoldenLogitsAndGreedy) {
  const auto cases = LoadGolden();
  for (DType t : {DType::kBF16, DType::kF16}) {
    auto engine = MakeEngine(Converted(t));
    ASSERT_NE(engine, nullptr);
    const int vocab = engine->config().vocab_size;
    for (size_t k = 0; k < 3; ++k) {  // the text cases: a few hundred tokens in all
      const auto& c = cases[k];
      SCOPED_TRACE(std::string(DTypeName(t)) + " case " + std::to_string(k));
      auto session = engine->NewSession();
      std::vector<float> logits;
      ASSERT_TRUE(session->Eval(c.ids, &logits, /*all_logits=*/true).ok());
      for (size_t i = 0; i < c.positions.size(); ++i) {
        float err = 0;
        const float* row = logits.data() + size_t(c.positions[i]) * vocab;
        for (int v = 0; v < vocab; ++v) err = std::max(err, std::fabs(row[v] - c.logits[i][v]));
        EXPECT_LT(err, 1e-3f) << "position " << c.positions[i];
      }
      std::vector<float> last(logits.end() - vocab, logits.end());
      EXPECT_EQ(Greedy(*engine, *session, last, c.greedy.size()), c.greedy);
    }
  }
}

// q8_0 changes the logits a little (kvtiny is small: 384-wide rows quantize coarsely), and so do
// the 8-bit activations its int8 kernels use, as llama.cpp's do (kernels/int8_dot.h), so greedy
// decoding may leave the reference path where two candidates are nearly tied. The check: teacher
// forced over prompt + reference continuation, q8_0's argmax equals the reference token wherever
// the bf16 model's top-2 margin is clear (> 1 logit; with f32 activations 0.5 suffices: case 2
// step 19, margin 0.6, flips by 0.08 with 8-bit ones), and free-running greedy decoding agrees
// up to the first step where it is not.
TEST_F(GgufRoundTrip, Q8_0AgreesWithGoldenGreedy) {
  const auto cases = LoadGolden();
  auto q8 = MakeEngine(Converted(DType::kQ8_0));
  auto ref = MakeEngine(Converted(DType::kBF16));
  ASSERT_NE(q8, nullptr);
  ASSERT_NE(ref, nullptr);
  const int vocab = q8->config().vocab_size;
  for (size_t k = 0; k < 3; ++k) {
    const auto& c = cases[k];
    SCOPED_TRACE("case " + std::to_string(k));
    std::vector<int32_t> seq = c.ids;
    seq.insert(seq.end(), c.greedy.begin(), c.greedy.end() - 1);
    std::vector<float> lq, lr;
    ASSERT_TRUE(q8->NewSession()->Eval(seq, &lq, true).ok());
    ASSERT_TRUE(ref->NewSession()->Eval(seq, &lr, true).ok());
    int checked = 0;
    size_t clear_prefix = c.greedy.size();  // steps before the first near-tie
    for (size_t i = 0; i < c.greedy.size(); ++i) {
      const size_t pos = c.ids.size() - 1 + i;
      std::vector<float> rq(lq.begin() + pos * vocab, lq.begin() + (pos + 1) * vocab);
      std::vector<float> rr(lr.begin() + pos * vocab, lr.begin() + (pos + 1) * vocab);
      ASSERT_EQ(ArgMax(rr), c.greedy[i]) << "bf16 GGUF vs golden at step " << i;
      std::vector<float> sorted = rr;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] > 1.0f) {
        EXPECT_EQ(ArgMax(rq), c.greedy[i])
            << "step " << i << ", bf16 margin " << sorted[0] - sorted[1];
        ++checked;
      } else {
        clear_prefix = std::min(clear_prefix, i);
      }
    }
    EXPECT_GE(checked, 10);
    RecordProperty("case" + std::to_string(k) + "_clear_prefix", static_cast<int>(clear_prefix));
    // Free-running greedy decoding agrees up to the first near-tie.
    auto s = q8->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(s->Eval(c.ids, &logits).ok());
    const auto got = Greedy(*q8, *s, logits, clear_prefix);
    EXPECT_EQ(got, std::vector<int32_t>(c.greedy.begin(), c.greedy.begin() + clear_prefix));
  }
}

TEST_F(GgufRoundTrip, TokenizerFromMetadataMatchesHf) {
  auto gguf = Tokenizer::Load(Converted(DType::kQ8_0));
  ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
  auto hf = Tokenizer::Load(ModelDir());
  ASSERT_TRUE(hf.ok());
  const Tokenizer& t = **gguf;
  EXPECT_EQ(t.vocab_size(), (*hf)->vocab_size());
  EXPECT_EQ(t.bos_id(), (*hf)->bos_id());
  EXPECT_EQ(t.eos_id(), (*hf)->eos_id());
  EXPECT_EQ(t.add_bos(), (*hf)->add_bos());
  const auto cases = LoadGolden();
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(t.EncodePrompt(cases[k].text), cases[k].ids) << k;
  const auto ref = nlohmann::json::parse(
      ReadFile(std::string(CACHET_TEST_DATA_DIR) + "/tokenizer/kvtiny_reference.json"));
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(t.Encode(text), c["ids"].get<std::vector<int32_t>>()) << text;
  }
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    ASSERT_EQ(t.TokenBytes(id), (*hf)->TokenBytes(id)) << id;
    ASSERT_EQ(t.IsSpecial(id), (*hf)->IsSpecial(id)) << id;
  }
}

TEST_F(GgufRoundTrip, MetadataAndLayout) {
  auto f = GgufFile::Open(Converted(DType::kQ8_0));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->GetString("general.architecture").value(), "llama");
  EXPECT_EQ(f->GetString("tokenizer.ggml.pre").value(), "qwen2");
  EXPECT_EQ(f->GetInt("llama.block_count").value(), 8);
  EXPECT_EQ(f->GetInt("llama.attention.head_count_kv").value(), 2);
  const GgufTensor* q = f->FindTensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dtype, DType::kQ8_0);
  EXPECT_EQ(q->ne, (std::vector<int64_t>{384, 384}));
  const GgufTensor* norm = f->FindTensor("blk.0.attn_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype, DType::kF32);
  EXPECT_EQ(f->FindTensor("output.weight"), nullptr);  // kvtiny ties its embeddings
  auto c = GgufConfig(*f);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_FLOAT_EQ(c->rope_theta, 100000.0f);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
}

// A GGUF is known by its magic whatever its name (`-m model.bin`), and a regular file that is
// not one is refused as such, not looked into as a directory.
TEST_F(GgufRoundTrip, AnyFileNameLoadsByMagic) {
  const std::string bin = dir_->path() + "/kvtiny-q8.bin";
  ASSERT_TRUE(WriteFileAtomically(bin, ReadFile(Converted(DType::kQ8_0))).ok());
  auto engine = MakeEngine(bin);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->config().n_layers, 8);
  const std::string junk = dir_->path() + "/junk.bin";
  ASSERT_TRUE(WriteFileAtomically(junk, std::string(64, 'x')).ok());
  auto e = Engine::Create(EngineOptions{.model_dir = junk});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("junk.bin: bad magic"), std::string::npos)
      << e.status().message();
}

// GgufRopeRow is llama.cpp's LlamaModel.permute: w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2).
TEST(GgufPermutation, MatchesLlamaCppPermute) {
  const int n_head = 3, d = 8;
  for (int h = 0; h < n_head; ++h) {
    for (int s = 0; s < 2; ++s) {
      for (int j = 0; j < d / 2; ++j) {
        const int hf_row = h * d + s * (d / 2) + j;  // index into reshape (n_head, 2, d/2)
        const int gguf_row = h * d + j * 2 + s;      // after swapaxes: (n_head, d/2, 2)
        EXPECT_EQ(GgufRopeRow(hf_row, d), gguf_row);
      }
    }
  }
  // The forward pass's inverse: outputs of GGUF rows put back in HF order.
  std::vector<float> gguf(n_head * d), hf(n_head * d, -1.0f);
  for (int r = 0; r < n_head * d; ++r) gguf[r] = static_cast<float>(r);
  GgufRowsToHf(gguf.data(), n_head, d, hf.data());
  for (int r = 0; r < n_head * d; ++r) EXPECT_EQ(hf[r], gguf[GgufRopeRow(r, d)]) << r;
}

// ------------------------------------------------------------------------------------------------
// Corrupt files

std::string SmallGguf(const TempDir& dir, const std::string& name = "small.gguf") {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("general.alignment", 32);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "c"});
  w.SetF32Array("tokenizer.ggml.scores", {0.5f, -1.0f, 2.0f});
  w.AddTensor("w", DType::kF32, {2, 4}, [](uint8_t* out) {
    for (int i = 0; i < 8; ++i) {
      const float v = static_cast<float>(i);
      std::memcpy(out + 4 * i, &v, 4);
    }
  });
  w.AddTensor("q", DType::kQ8_0, {1, 32}, [](uint8_t* out) { std::memset(out, 0, 34); });
  const std::string path = dir.path() + "/" + name;
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

Status ParseBytes(const std::string& bytes) {
  return GgufFile::Parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t.gguf")
      .status();
}

// Offset of the first occurrence of `what` in the file, for patching.
size_t Find(const std::string& bytes, const std::string& what) {
  const size_t p = bytes.find(what);
  EXPECT_NE(p, std::string::npos) << what;
  return p;
}

template <class T>
void Patch(std::string& bytes, size_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof(T));
}

// A written model leaves the page cache (util/mmap_file.h, DropFromPageCache): its next load
// reads it from disk rather than mapping the write's folios.
TEST(GgufWriter, WrittenFileLeavesThePageCache) {
  // A tmpfs file's pages are the file and cannot leave: then the test writes in the build tree.
  auto on_tmpfs = [](const std::string& path) {
    struct statfs fs {};
    return ::statfs(path.c_str(), &fs) == 0 && fs.f_type == 0x01021994;
  };
  std::optional<TempDir> scratch(std::in_place);
  if (on_tmpfs(scratch->path())) scratch.emplace(std::filesystem::current_path().string());
  const TempDir& dir = *scratch;
  ASSERT_FALSE(dir.path().empty());
  ASSERT_FALSE(on_tmpfs(dir.path())) << dir.path() << ": no directory off tmpfs to write in";
  constexpr int64_t kBytes = 8 << 20;
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.AddTensor("w", DType::kF32, {kBytes / 4}, [](uint8_t* out) { std::memset(out, 7, kBytes); });
  const std::string path = dir.path() + "/big.gguf";
  ASSERT_TRUE(w.Write(path).ok());
  auto f = MappedFile::Open(path);
  ASSERT_TRUE(f.ok());
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((f->size() + page - 1) / page);
  ASSERT_EQ(::mincore(const_cast<uint8_t*>(f->data()), f->size(), resident.data()), 0);
  size_t in_cache = 0;
  for (unsigned char r : resident) in_cache += r & 1;
  EXPECT_LT(in_cache, resident.size() / 4) << in_cache << " of " << resident.size();
  EXPECT_EQ(f->data()[f->size() - 1], 7);  // and it reads back
}

TEST(GgufReader, ReadsWhatTheWriterWrote) {
  TempDir dir;
  auto f = GgufFile::Open(SmallGguf(dir));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->alignment(), 32u);
  auto tokens = f->GetArray("tokenizer.ggml.tokens", GgufType::kString);
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ((*tokens)->strs, (std::vector<std::string>{"a", "b", "c"}));
  auto scores = f->GetArray("tokenizer.ggml.scores", GgufType::kF32);
  ASSERT_TRUE(scores.ok());
  EXPECT_EQ((*scores)->nums, (std::vector<double>{0.5, -1.0, 2.0}));
  const GgufTensor* w = f->FindTensor("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(reinterpret_cast<const float*>(w->data)[7], 7.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % 32, 0u);
  const GgufTensor* q = f->FindTensor("q");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->n_bytes, 34u);
  EXPECT_EQ(q->offset, 32u);
  EXPECT_FALSE(f->GetInt("general.architecture").ok());
  EXPECT_NE(f->GetInt("nope").status().message().find("'nope' is missing"), std::string::npos);
}

TEST(GgufReader, CorruptFilesGiveClearErrors) {
  TempDir dir;
  const std::string good = ReadFile(SmallGguf(dir));
  ASSERT_TRUE(ParseBytes(good).ok());
  auto expect_error = [](const std::string& bytes, const std::string& needle) {
    const Status s = ParseBytes(bytes);
    EXPECT_FALSE(s.ok()) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("t.gguf"), std::string::npos) << s.message();
  };
  // Bad magic, unsupported version.
  std::string b = good;
  b[0] = 'X';
  expect_error(b, "bad magic");
  b = good;
  Patch<uint32_t>(b, 4, 1);
  expect_error(b, "version 1");
  // Truncated anywhere: in the header, the metadata, the tensor infos or the data.
  for (size_t n : {size_t{0}, size_t{3}, size_t{10}, size_t{30}, size_t{100}, good.size() / 2,
                   good.size() - 40, good.size() - 31}) {
    const Status s = ParseBytes(good.substr(0, n));
    EXPECT_FALSE(s.ok()) << n;
    EXPECT_TRUE(s.message().find("truncated") != std::string::npos ||
                s.message().find("too small") != std::string::npos ||
                s.message().find("exceeds") != std::string::npos ||
                s.message().find("cannot fit") != std::string::npos)
        << n << ": " << s.message();
  }
  expect_error(good.substr(0, good.size() - 31), "tensor 'q'");
  EXPECT_TRUE(ParseBytes(good.substr(0, good.size() - 30)).ok());  // only padding is missing
  // Huge counts.
  b = good;
  Patch<uint64_t>(b, 8, uint64_t{1} << 62);
  expect_error(b, "tensor count");
  b = good;
  Patch<uint64_t>(b, 16, ~uint64_t{0});
  expect_error(b, "metadata count");
  b = good;  // the token array's element count (right after its type)
  Patch<uint64_t>(b, Find(b, "tokenizer.ggml.tokens") + 21 + 8, uint64_t{1} << 60);
  expect_error(b, "metadata 'tokenizer.ggml.tokens': array count");
  b = good;  // a string length
  Patch<uint64_t>(b, Find(b, "general.architecture") + 20 + 4, uint64_t{1} << 40);
  expect_error(b, "string length");
  // Tensor info fields: name, n_dims, ne..., type, offset. "q" is the last tensor.
  const size_t q_info = Find(good, std::string("\x01\0\0\0\0\0\0\0q", 9)) + 9;
  b = good;
  Patch<uint64_t>(b, q_info + 4 + 8 * 2 + 4, 4096);
  expect_error(b, "tensor 'q': data [4096");
  b = good;
  Patch<uint64_t>(b, q_info + 4 + 8 * 2 + 4, 33);
  expect_error(b, "not a multiple of the alignment");
  b = good;
  Patch<uint32_t>(b, q_info + 4 + 8 * 2, 16);
  expect_error(b,
               "tensor 'q': tensor type 16 (iq2_xxs) is not supported (supported: f32, f16, q4_0, "
               "q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, bf16)");
  b = good;
  Patch<uint32_t>(b, q_info + 4 + 8 * 2, 999);
  expect_error(b, "tensor type 999 (unknown)");
  b = good;
  Patch<uint64_t>(b, q_info + 4, 31);
  expect_error(b, "not a multiple of the q8_0 block size");
  b = good;
  Patch<uint64_t>(b, q_info + 4, uint64_t{1} << 40);
  Patch<uint64_t>(b, q_info + 12, uint64_t{1} << 40);
  expect_error(b, "overflow");
  b = good;
  Patch<uint32_t>(b, q_info, 9);
  expect_error(b, "9 dimensions");
  // A bad value type.
  b = good;
  Patch<uint32_t>(b, Find(b, "general.alignment") + 17, 77);
  expect_error(b, "metadata 'general.alignment': unknown value type 77");
}

TEST(GgufReader, OpenErrorsNameTheFile) {
  TempDir dir;
  const std::string p = dir.Write("bad.gguf", "GGUF");
  auto f = GgufFile::Open(p);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find(p), std::string::npos) << f.status().message();
  // A model load of a GGUF without the architecture metadata names the file and the key.
  auto e = Engine::Create(EngineOptions{.model_dir = SmallGguf(dir, "m.gguf")});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("m.gguf"), std::string::npos) << e.status().message();
}

// ------------------------------------------------------------------------------------------------
// SentencePiece-style vocabulary ("llama" tokenizer model)

TEST(GgufTokenizer, SpmMergesByScoreWithByteFallback) {
  TempDir dir;
  GgufWriter w;
  // ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0xNN>, then pieces.
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    tokens.push_back(buf);
    types.push_back(6);
    scores.push_back(0);
  }
  const std::vector<std::pair<std::string, float>> pieces = {{"\xE2\x96\x81", -1},
                                                             {"h", -2},
                                                             {"e", -2},
                                                             {"l", -2},
                                                             {"o", -2},
                                                             {"\xE2\x96\x81h", -3},
                                                             {"ll", -4},
                                                             {"\xE2\x96\x81he", -5},
                                                             {"llo", -6},
                                                             {"\xE2\x96\x81hello", -7},
                                                             {"he", -8}};
  for (const auto& [p, s] : pieces) {
    tokens.push_back(p);
    types.push_back(1);
    scores.push_back(s);
  }
  const int32_t base = 259;
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetU32("tokenizer.ggml.bos_token_id", 1);
  w.SetU32("tokenizer.ggml.eos_token_id", 2);
  w.SetU32("tokenizer.ggml.unknown_token_id", 0);
  const std::string path = dir.path() + "/spm.gguf";
  ASSERT_TRUE(w.Write(path).ok());
  auto t = Tokenizer::Load(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->kind(), "sentencepiece");
  EXPECT_TRUE((*t)->add_bos());
  // "▁hello": ▁h (-3) before ll (-4) before ▁he (-5), llo (-6), ▁hello (-7).
  EXPECT_EQ((*t)->Encode("hello"), (std::vector<int32_t>{base + 9}));
  // "hel" -> ▁he + l; "z" has no piece: byte fallback <0x7A>; "é" -> two byte tokens.
  EXPECT_EQ((*t)->Encode("hel z\xC3\xA9"),
            (std::vector<int32_t>{base + 7, base + 3, base + 0, 3 + 0x7A, 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ((*t)->EncodePrompt("hello</s>"), (std::vector<int32_t>{1, base + 9, 2}));
  EXPECT_EQ((*t)->Decode((*t)->Encode("hel z\xC3\xA9 hello")), "hel z\xC3\xA9 hello");
  EXPECT_TRUE((*t)->IsSpecial(2));
}

// Found by the gguf fuzzer: token types stored as floats out of int's range were converted
// (undefined behaviour); now they are an error naming the entry.
TEST(GgufTokenizer, TokenTypesThatAreNotIntegersAreErrors) {
  TempDir dir;
  GgufWriter w;
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "a", "b"});
  w.SetF32Array("tokenizer.ggml.scores", {0, -1, -2});
  w.SetF32Array("tokenizer.ggml.token_type", {2, -1.03846e34f, 1});
  const std::string path = dir.path() + "/types.gguf";
  ASSERT_TRUE(w.Write(path).ok());
  auto t = Tokenizer::Load(path);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("'tokenizer.ggml.token_type' entry 1"), std::string::npos)
      << t.status().message();
}

TEST(GgufTokenizer, UnknownModelAndPreTokenizerAreErrors) {
  TempDir dir;
  GgufWriter w;
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "deepseek-coder");
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "ab"});
  w.SetStringArray("tokenizer.ggml.merges", {"a b"});
  const std::string path = dir.path() + "/bpe.gguf";
  ASSERT_TRUE(w.Write(path).ok());
  auto t = Tokenizer::Load(path);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("'tokenizer.ggml.pre' = 'deepseek-coder'"), std::string::npos)
      << t.status().message();
}

}  // namespace
}  // namespace cachet
