#include "model/gguf_model.h"

#include <sys/stat.h>

#include <cmath>
#include <utility>

#include "model/safetensors.h"

namespace cachet {

namespace {

// HF suffix after "model.layers.N." -> GGUF suffix after "blk.N.".
constexpr std::pair<const char*, const char*> kLayerNames[] = {
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_proj.bias", "attn_q.bias"},
    {"self_attn.k_proj.bias", "attn_k.bias"},
    {"self_attn.v_proj.bias", "attn_v.bias"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"input_layernorm.weight", "attn_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
};

}  // namespace

std::string GgufTensorName(const std::string& hf) {
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  const std::string prefix = "model.layers.";
  if (hf.rfind(prefix, 0) != 0) return hf;
  const size_t dot = hf.find('.', prefix.size());
  if (dot == std::string::npos) return hf;
  const std::string layer = hf.substr(prefix.size(), dot - prefix.size());
  const std::string rest = hf.substr(dot + 1);
  for (const auto& [h, g] : kLayerNames) {
    if (rest == h) return "blk." + layer + "." + g;
  }
  return hf;
}

bool IsGgufPath(const std::string& path) {
  if (path.ends_with(".gguf")) return true;
  // Any other regular file is read as GGUF too: one that is not gets GGUF's "bad magic" error,
  // which names it, rather than "FILE/config.json: cannot open".
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

Result<ModelConfig> GgufConfig(const GgufFile& f) {
  const std::string& where = f.path();
  ModelConfig c;
  CACHET_ASSIGN_OR_RETURN(c.model_type, f.GetString("general.architecture"));
  if (!ParseArch(c.model_type, &c.arch)) {
    return Unimplemented(where + ": unsupported general.architecture '" + c.model_type +
                         "' (supported: llama, mistral, qwen2, qwen3)");
  }
  const std::string a = c.model_type + ".";
  auto get_int = [&](const std::string& key, int* out, bool required) -> Status {
    if (!required && !f.Find(a + key)) return OkStatus();
    CACHET_ASSIGN_OR_RETURN(int64_t v, f.GetInt(a + key));
    if (v <= 0 || v > (int64_t{1} << 30)) {
      return InvalidArgument(where + ": metadata '" + a + key + "' = " + std::to_string(v) +
                             " is out of range");
    }
    *out = static_cast<int>(v);
    return OkStatus();
  };
  CACHET_RETURN_IF_ERROR(get_int("block_count", &c.n_layers, true));
  CACHET_RETURN_IF_ERROR(get_int("embedding_length", &c.hidden_size, true));
  CACHET_RETURN_IF_ERROR(get_int("feed_forward_length", &c.intermediate_size, true));
  CACHET_RETURN_IF_ERROR(get_int("attention.head_count", &c.n_heads, true));
  c.n_kv_heads = c.n_heads;
  CACHET_RETURN_IF_ERROR(get_int("attention.head_count_kv", &c.n_kv_heads, false));
  c.head_dim = c.hidden_size / c.n_heads;
  CACHET_RETURN_IF_ERROR(get_int("attention.key_length", &c.head_dim, false));
  if (f.Find(a + "attention.value_length")) {
    int vl = 0;
    CACHET_RETURN_IF_ERROR(get_int("attention.value_length", &vl, true));
    if (vl != c.head_dim) {
      return Unimplemented(where + ": attention.value_length != attention.key_length");
    }
  }
  CACHET_RETURN_IF_ERROR(get_int("context_length", &c.max_position_embeddings, false));
  if (f.Find(a + "rope.freq_base")) {
    CACHET_ASSIGN_OR_RETURN(double v, f.GetFloat(a + "rope.freq_base"));
    c.rope_theta = static_cast<float>(v);
  }
  c.rms_norm_eps = 1e-5f;
  if (f.Find(a + "attention.layer_norm_rms_epsilon")) {
    CACHET_ASSIGN_OR_RETURN(double v, f.GetFloat(a + "attention.layer_norm_rms_epsilon"));
    c.rms_norm_eps = static_cast<float>(v);
  }
  const GgufTensor* embd = f.FindTensor("token_embd.weight");
  if (!embd) return NotFound(where + ": tensor 'token_embd.weight' is missing");
  if (embd->ne.size() != 2) {
    return InvalidArgument(where + ": tensor 'token_embd.weight' is not a matrix");
  }
  c.vocab_size = static_cast<int>(embd->ne[1]);
  CACHET_RETURN_IF_ERROR(get_int("vocab_size", &c.vocab_size, false));
  c.tie_word_embeddings = f.FindTensor("output.weight") == nullptr;
  c.attention_bias = c.arch == Arch::kQwen2 || f.FindTensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = c.arch == Arch::kQwen3;
  if (f.Find("tokenizer.ggml.bos_token_id")) {
    CACHET_ASSIGN_OR_RETURN(int64_t v, f.GetInt("tokenizer.ggml.bos_token_id"));
    c.bos_token_id = static_cast<int>(v);
  }
  if (f.Find("tokenizer.ggml.eos_token_id")) {
    CACHET_ASSIGN_OR_RETURN(int64_t v, f.GetInt("tokenizer.ggml.eos_token_id"));
    c.eos_token_id = static_cast<int>(v);
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return InvalidArgument(where + ": attention.head_count (" + std::to_string(c.n_heads) +
                           ") is not a multiple of attention.head_count_kv (" +
                           std::to_string(c.n_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) return InvalidArgument(where + ": head_dim must be even for RoPE");

  // RoPE scaling: linear from metadata; Llama-3 style from the rope_freqs tensor, recognized when
  // it equals the llama3 formula with factor = its largest value and HF's default parameters.
  if (f.Find(a + "rope.scaling.type")) {
    CACHET_ASSIGN_OR_RETURN(std::string type, f.GetString(a + "rope.scaling.type"));
    if (type == "linear") {
      c.rope_scaling.type = RopeScaling::Type::kLinear;
      CACHET_ASSIGN_OR_RETURN(double factor, f.GetFloat(a + "rope.scaling.factor"));
      if (!(factor > 0)) return InvalidArgument(where + ": rope.scaling.factor must be > 0");
      c.rope_scaling.factor = static_cast<float>(factor);
    } else if (type != "none") {
      return Unimplemented(where + ": metadata '" + a + "rope.scaling.type' = '" + type +
                           "' is not supported (supported: none, linear)");
    }
  }
  if (const GgufTensor* rf = f.FindTensor("rope_freqs.weight")) {
    const int half = c.head_dim / 2;
    if (rf->dtype != DType::kF32 || rf->ne.size() != 1 || rf->ne[0] != half) {
      return InvalidArgument(where + ": tensor 'rope_freqs.weight' must be f32 [head_dim / 2]");
    }
    const float* ff = reinterpret_cast<const float*>(rf->data);
    float factor = 1.0f;
    for (int i = 0; i < half; ++i) factor = std::max(factor, ff[i]);
    ModelConfig plain = c;
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = factor;
    if (f.Find(a + "rope.scaling.original_context_length")) {
      CACHET_ASSIGN_OR_RETURN(int64_t v, f.GetInt(a + "rope.scaling.original_context_length"));
      c.rope_scaling.original_max_position_embeddings = static_cast<int>(v);
    }
    const std::vector<float> base = plain.RopeInvFreq(), scaled = c.RopeInvFreq();
    for (int i = 0; i < half; ++i) {
      if (std::fabs(base[i] / scaled[i] - ff[i]) > 1e-3f * ff[i]) {
        return Unimplemented(where +
                             ": tensor 'rope_freqs.weight' does not match Llama-3 RoPE "
                             "scaling with low/high_freq_factor 1/4 (dimension " +
                             std::to_string(i) + ")");
      }
    }
  }
  return c;
}

Result<TensorStore> TensorStore::FromGguf(GgufFile file) {
  TensorStore store;
  store.origin_ = file.path();
  store.gguf_ = true;
  for (const GgufTensor& t : file.tensors()) {
    TensorInfo info;
    info.dtype = t.dtype;
    info.shape = t.shape;
    info.data = t.data;
    info.n_bytes = t.n_bytes;
    info.file = 0;
    store.tensors_.emplace(t.name, std::move(info));
  }
  store.files_.push_back(file.TakeFile());
  return store;
}

}  // namespace cachet
