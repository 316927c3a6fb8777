// Synthetic GGUFs (`cachet convert --synthetic SHAPE`): a real model's architecture and tensor
// shapes with seeded random weights and a generated tokenizer, for measuring speed at real sizes
// without the real weights (speed does not depend on what the weights learned).
//
// Weights: each row of each tensor has its own xoshiro256++ stream, seeded by splitmix64 from
// (seed, the tensor's HF name, the row), so rows can be made in any order on any number of
// threads and the file is the same. Normal values come from the Box-Muller transform in float
// (24-bit uniforms: the tails stop at 5.8 standard deviations, which nothing here needs).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cachet/convert.h"
#include "model/gguf.h"
#include "model/gguf_convert_internal.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

using gguf_convert_internal::ModelTensor;
using gguf_convert_internal::TensorAdder;

constexpr float kStd = 0.02f;
// Token ids of the generated vocabulary: three control tokens, the 256 bytes, then words.
constexpr int kUnk = 0, kBos = 1, kEos = 2, kFirstByte = 3, kFirstWord = kFirstByte + 256;

uint64_t SplitMix64(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Xoshiro256pp {
 public:
  explicit Xoshiro256pp(uint64_t seed) {
    for (uint64_t& w : s_) w = SplitMix64(&seed);
  }
  uint64_t Next() {
    const uint64_t result = Rotl(s_[0] + s_[3], 23) + s_[0];
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// The seed of a tensor's rows: the run's seed mixed with an FNV-1a hash of the tensor's name.
uint64_t TensorSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001B3ull;
  uint64_t x = seed ^ h;
  return SplitMix64(&x);
}

// n values from N(0, stddev^2), the stream of row `row` of the tensor seeded by `tensor_seed`.
void FillNormal(uint64_t tensor_seed, int64_t row, float stddev, float* out, int64_t n) {
  Xoshiro256pp rng(tensor_seed + static_cast<uint64_t>(row) * 0xD1B54A32D192ED03ull);
  constexpr float kTwoPi = 6.28318530717958647692f;
  for (int64_t i = 0; i < n; i += 2) {
    const uint64_t r = rng.Next();
    const float u1 = static_cast<float>((r >> 40) + 1) * 0x1p-24f;         // (0, 1]
    const float u2 = static_cast<float>((r >> 16) & 0xFFFFFF) * 0x1p-24f;  // [0, 1)
    const float radius = stddev * std::sqrt(-2.0f * std::log(u1));
    const float angle = kTwoPi * u2;
    out[i] = radius * std::cos(angle);
    if (i + 1 < n) out[i + 1] = radius * std::sin(angle);
  }
}

// GPT-2's bytes_to_unicode: the byte-level alphabet's character (UTF-8) for byte b.
std::string ByteLevelChar(int b) {
  auto printable = [](int x) {
    return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
  };
  int cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int x = 0; x < b; ++x) cp += !printable(x);
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The generated tokenizer (see WriteSyntheticGguf): words over a-z enumerated by length, then in
// lexicographic order; each word is the merge of its prefix and its last letter, both earlier
// tokens, so every word is reachable and merge ranks follow token ids.
void AddSyntheticVocab(int vocab_size, GgufWriter& w) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  tokens.reserve(vocab_size);
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteLevelChar(b));
  std::vector<std::string> merges;
  merges.reserve(vocab_size - kFirstWord);
  for (int len = 2; static_cast<int>(tokens.size()) < vocab_size; ++len) {
    std::string word(len, 'a');
    for (bool more = true; more && static_cast<int>(tokens.size()) < vocab_size;) {
      merges.push_back(word.substr(0, len - 1) + " " + word.back());
      tokens.push_back(word);
      more = false;  // next word in lexicographic order; false after "zz..z"
      for (int i = len - 1; i >= 0 && !more; --i) {
        if (word[i] == 'z') {
          word[i] = 'a';
        } else {
          ++word[i];
          more = true;
        }
      }
    }
  }
  std::vector<int32_t> types(tokens.size(), 1);  // normal
  types[kUnk] = types[kBos] = types[kEos] = 3;   // control
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "default");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetStringArray("tokenizer.ggml.merges", merges);
  w.SetU32("tokenizer.ggml.bos_token_id", kBos);
  w.SetU32("tokenizer.ggml.eos_token_id", kEos);
  w.SetBool("tokenizer.ggml.add_bos_token", true);
  w.SetBool("tokenizer.ggml.add_eos_token", false);
}

bool IsShapePath(const std::string& s) {
  return s.find('/') != std::string::npos ||
         (s.size() > 5 && s.compare(s.size() - 5, 5, ".json") == 0);
}

}  // namespace

std::string ShapesDir() {
  // CACHET_DEFAULT_MODEL_DIR is <source>/models/kvtiny.
  return (std::filesystem::path(CACHET_DEFAULT_MODEL_DIR).parent_path() / "shapes").string();
}

Result<ModelConfig> LoadShape(const std::string& shape) {
  std::string path = shape;
  if (!IsShapePath(shape)) {
    path = ShapesDir() + "/" + shape + ".json";
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      std::vector<std::string> names;
      for (const auto& e : std::filesystem::directory_iterator(ShapesDir(), ec)) {
        if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
      }
      std::sort(names.begin(), names.end());
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      return NotFound("unknown shape '" + shape + "': no " + path + " (shipped shapes: " + list +
                      "; or give the path of a config.json-style file)");
    }
  }
  CACHET_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  CACHET_ASSIGN_OR_RETURN(ModelConfig c, ModelConfig::FromJson(text, path));
  if (c.vocab_size < kFirstWord) {
    return InvalidArgument(path + ": vocab_size " + std::to_string(c.vocab_size) + " is below " +
                           std::to_string(kFirstWord) +
                           ", the generated tokenizer's 3 control and 256 byte tokens");
  }
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3) {
    return Unimplemented(path +
                         ": rope_scaling of type llama3 is not supported in a shape (it "
                         "changes the rotation frequencies, not the work: leave it out)");
  }
  return c;
}

Status WriteSyntheticGguf(const std::string& shape, const std::string& out_path,
                          WeightFormat format, uint64_t seed, int threads, bool progress) {
  CACHET_ASSIGN_OR_RETURN(ModelConfig c, LoadShape(shape));
  const std::string name =
      IsShapePath(shape) ? std::filesystem::path(shape).stem().string() : shape;
  GgufWriter w;
  gguf_convert_internal::SetModelMetadata(
      c, name + " (synthetic, seed " + std::to_string(seed) + ")", format, w);
  AddSyntheticVocab(c.vocab_size, w);
  TensorAdder adder(w, c, format, threads, progress);
  for (const ModelTensor& t : gguf_convert_internal::ModelTensors(c)) {
    const int64_t cols = t.shape.back();
    if (t.norm) {
      adder.Add(t, [cols](int64_t, float* out) { std::fill(out, out + cols, 1.0f); });
    } else {
      adder.Add(t, [key = TensorSeed(seed, t.hf_name), cols](int64_t row, float* out) {
        FillNormal(key, row, kStd, out, cols);
      });
    }
  }
  return w.Write(out_path);
}

}  // namespace cachet
