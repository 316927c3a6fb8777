#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "cachet/model_config.h"
#include "model/gguf_model.h"
#include "util/json_excerpt.h"
#include "util/mmap_file.h"

namespace cachet {

using nlohmann::json;

const char* ArchName(Arch a) {
  switch (a) {
    case Arch::kLlama:
      return "llama";
    case Arch::kMistral:
      return "mistral";
    case Arch::kQwen2:
      return "qwen2";
    case Arch::kQwen3:
      return "qwen3";
  }
  return "?";
}

bool ParseArch(const std::string& name, Arch* arch) {
  for (Arch a : {Arch::kLlama, Arch::kMistral, Arch::kQwen2, Arch::kQwen3}) {
    if (name == ArchName(a)) {
      *arch = a;
      return true;
    }
  }
  return false;
}

namespace {

// Reads a number field within [lo, hi]; a present field of the wrong type (a fraction where a
// count belongs, a string), out of range or not finite is an error naming it.
template <class T>
Status GetNumber(const json& j, const char* key, T* out, bool required, const std::string& where,
                 double lo, double hi) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    return required ? InvalidArgument(where + ": missing required field '" + key + "'")
                    : OkStatus();
  }
  if (!it->is_number()) return InvalidArgument(where + ": field '" + key + "' must be a number");
  const double v = it->get<double>();
  if (std::is_integral_v<T> && !it->is_number_integer() && v != std::floor(v)) {
    return InvalidArgument(where + ": field '" + key + "' must be a whole number, not " +
                           JsonExcerpt(*it));
  }
  if (!(v >= lo && v <= hi)) {
    std::ostringstream range;
    range << lo << " to " << hi;
    return InvalidArgument(where + ": field '" + key + "' is " + JsonExcerpt(*it) +
                           ", not in the range " + range.str());
  }
  *out = static_cast<T>(v);
  return OkStatus();
}

// Bounds of the fields: generous, but a count is positive and fits the int math downstream.
constexpr double kMaxDim = 1 << 20, kMaxCount = 1 << 16, kMaxVocab = 1 << 24;
constexpr double kMaxPositions = 1 << 30, kMaxId = (1u << 31) - 1;

}  // namespace

namespace {
Result<ModelConfig> ParseConfig(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(where + ": not a JSON object");
  ModelConfig c;
  c.model_type = j.value("model_type", "");
  if (!ParseArch(c.model_type, &c.arch)) {
    return Unimplemented(where + ": unsupported architecture model_type='" + c.model_type +
                         "' (supported: llama, mistral, qwen2, qwen3)");
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return Unimplemented(where + ": unsupported hidden_act " + JsonExcerpt(j["hidden_act"]));
  }
  CACHET_RETURN_IF_ERROR(GetNumber(j, "vocab_size", &c.vocab_size, true, where, 1, kMaxVocab));
  CACHET_RETURN_IF_ERROR(GetNumber(j, "hidden_size", &c.hidden_size, true, where, 1, kMaxDim));
  CACHET_RETURN_IF_ERROR(
      GetNumber(j, "intermediate_size", &c.intermediate_size, true, where, 1, kMaxDim));
  CACHET_RETURN_IF_ERROR(GetNumber(j, "num_hidden_layers", &c.n_layers, true, where, 1, kMaxCount));
  CACHET_RETURN_IF_ERROR(
      GetNumber(j, "num_attention_heads", &c.n_heads, true, where, 1, kMaxCount));
  c.n_kv_heads = c.n_heads;
  CACHET_RETURN_IF_ERROR(
      GetNumber(j, "num_key_value_heads", &c.n_kv_heads, false, where, 1, kMaxCount));
  c.head_dim = c.hidden_size / c.n_heads;
  CACHET_RETURN_IF_ERROR(GetNumber(j, "head_dim", &c.head_dim, false, where, 1, kMaxCount));
  constexpr double kHuge = std::numeric_limits<float>::max();
  CACHET_RETURN_IF_ERROR(GetNumber(j, "rope_theta", &c.rope_theta, false, where, 1e-30, kHuge));
  CACHET_RETURN_IF_ERROR(GetNumber(j, "rms_norm_eps", &c.rms_norm_eps, false, where, 0, 1));
  CACHET_RETURN_IF_ERROR(GetNumber(j, "max_position_embeddings", &c.max_position_embeddings, false,
                                   where, 1, kMaxPositions));
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.attention_bias = c.arch == Arch::kQwen2 || j.value("attention_bias", false);
  c.qk_norm = c.arch == Arch::kQwen3;
  CACHET_RETURN_IF_ERROR(GetNumber(j, "bos_token_id", &c.bos_token_id, false, where, -1, kMaxId));
  if (j.contains("eos_token_id") && j["eos_token_id"].is_array() && !j["eos_token_id"].empty()) {
    c.eos_token_id = j["eos_token_id"][0].get<int>();
  } else {
    CACHET_RETURN_IF_ERROR(GetNumber(j, "eos_token_id", &c.eos_token_id, false, where, -1, kMaxId));
  }

  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 || c.n_layers <= 0 ||
      c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0) {
    return InvalidArgument(where + ": sizes must be positive");
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return InvalidArgument(where + ": num_attention_heads (" + std::to_string(c.n_heads) +
                           ") is not a multiple of num_key_value_heads (" +
                           std::to_string(c.n_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) return InvalidArgument(where + ": head_dim must be even for RoPE");

  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    const json& rs = *it;
    std::string type = rs.value("rope_type", rs.value("type", ""));
    c.rope_scaling.factor = rs.value("factor", 1.0f);
    if (type == "linear") {
      c.rope_scaling.type = RopeScaling::Type::kLinear;
    } else if (type == "llama3") {
      c.rope_scaling.type = RopeScaling::Type::kLlama3;
      c.rope_scaling.low_freq_factor = rs.value("low_freq_factor", 1.0f);
      c.rope_scaling.high_freq_factor = rs.value("high_freq_factor", 4.0f);
      c.rope_scaling.original_max_position_embeddings =
          rs.value("original_max_position_embeddings", 8192);
    } else if (type != "default") {
      return Unimplemented(where + ": rope_scaling.type '" + type +
                           "' is not supported (supported: linear, llama3)");
    }
    if (!(c.rope_scaling.factor > 0 && std::isfinite(c.rope_scaling.factor))) {
      return InvalidArgument(where + ": rope_scaling.factor must be a finite number > 0");
    }
    if (c.rope_scaling.original_max_position_embeddings <= 0) {
      return InvalidArgument(where + ": rope_scaling.original_max_position_embeddings must be > 0");
    }
  }
  return c;
}
}  // namespace

Result<ModelConfig> ModelConfig::FromJson(const std::string& text, const std::string& where) {
  try {
    return ParseConfig(text, where);
  } catch (const json::exception& e) {  // a field of the wrong type
    return InvalidArgument(where + ": " + e.what());
  }
}

Result<ModelConfig> ModelConfig::Load(const std::string& model_dir) {
  if (IsGgufPath(model_dir)) {
    CACHET_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(model_dir));
    return GgufConfig(file);
  }
  std::string path = model_dir + "/config.json";
  CACHET_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return FromJson(text, path);
}

std::vector<float> ModelConfig::RopeInvFreq() const {
  const int half = head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    // As HF: 1 / base ** (arange(0, d, 2).float() / d), in f32.
    float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(rope_theta, e);
  }
  const RopeScaling& rs = rope_scaling;
  if (rs.type == RopeScaling::Type::kLinear) {
    for (float& f : inv) f /= rs.factor;
  } else if (rs.type == RopeScaling::Type::kLlama3) {
    const float old_ctx = static_cast<float>(rs.original_max_position_embeddings);
    const float low_wavelen = old_ctx / rs.low_freq_factor;
    const float high_wavelen = old_ctx / rs.high_freq_factor;
    for (float& f : inv) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f /= rs.factor;
      } else {
        float smooth =
            (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1.0f - smooth) * f / rs.factor + smooth * f;
      }
    }
  }
  return inv;
}

int64_t ModelConfig::ParamCount() const {
  const int64_t d = hidden_size, f = intermediate_size, hd = head_dim;
  int64_t attn = d * n_heads * hd * 2 + d * n_kv_heads * hd * 2;
  if (attention_bias) attn += (n_heads + 2 * n_kv_heads) * hd;
  if (qk_norm) attn += 2 * hd;
  int64_t layer = attn + 3 * d * f + 2 * d;
  int64_t embed = int64_t{vocab_size} * d;
  return embed * (tie_word_embeddings ? 1 : 2) + n_layers * layer + d;
}

}  // namespace cachet
