// Model hyper-parameters from a HF config.json (Llama family).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cachet/status.h"

namespace cachet {

enum class Arch { kLlama, kMistral, kQwen2, kQwen3 };
const char* ArchName(Arch a);
// "llama", "mistral", "qwen2", "qwen3" (HF model_type and GGUF general.architecture alike).
bool ParseArch(const std::string& name, Arch* arch);

struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 } type = Type::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string model_type;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  float rope_theta = 10000.0f;
  float rms_norm_eps = 1e-6f;
  int max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (always for qwen2)
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3)
  RopeScaling rope_scaling;
  int bos_token_id = -1;
  int eos_token_id = -1;

  // RoPE inverse frequencies (head_dim / 2 values), rope_scaling applied, in f32 as HF computes.
  std::vector<float> RopeInvFreq() const;
  int64_t ParamCount() const;
  // Bytes of K and V for one token over all layers and KV heads.
  int64_t KvBytesPerToken(int bytes_per_value) const {
    return int64_t{2} * n_layers * n_kv_heads * head_dim * bytes_per_value;
  }

  static Result<ModelConfig> FromJson(const std::string& json_text, const std::string& where);
  static Result<ModelConfig> Load(const std::string& model_dir);  // <dir>/config.json
};

}  // namespace cachet
