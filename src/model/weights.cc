#include "model/weights.h"

#include "model/gguf_model.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

struct Loader {
  const TensorStore& store;

  // Tensors are named as in HF checkpoints; a GGUF store holds them under their GGUF names.
  std::string Name(const std::string& hf) const { return store.gguf() ? GgufTensorName(hf) : hf; }
  bool Has(const std::string& name) const { return store.Has(Name(name)); }

  Result<kernels::Matrix> Matrix(const std::string& name, int64_t rows, int64_t cols) {
    CACHET_ASSIGN_OR_RETURN(const TensorInfo* t, store.Get(Name(name), {rows, cols}));
    return kernels::Matrix{t->data, t->dtype, rows, cols};
  }

  Result<std::vector<float>> Vector(const std::string& name, int64_t n) {
    CACHET_ASSIGN_OR_RETURN(const TensorInfo* t, store.Get(Name(name), {n}));
    if (DTypeIsQuantized(t->dtype)) {
      return Unimplemented("tensor '" + Name(name) + "' is " + DTypeName(t->dtype) +
                           ": vectors (norms, biases) must be f32, f16 or bf16");
    }
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = LoadAsF32(t->data, t->dtype, i);
    return v;
  }
};

}  // namespace

Result<ModelWeights> ModelWeights::Load(const ModelConfig& c, TensorStore store) {
  ModelWeights w;
  w.store = std::move(store);
  Loader ld{w.store};
  const int64_t d = c.hidden_size, hd = c.head_dim, f = c.intermediate_size;
  const int64_t q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
  CACHET_ASSIGN_OR_RETURN(w.embed, ld.Matrix("model.embed_tokens.weight", c.vocab_size, d));
  CACHET_ASSIGN_OR_RETURN(w.final_norm, ld.Vector("model.norm.weight", d));
  if (c.tie_word_embeddings || !ld.Has("lm_head.weight")) {
    if (!c.tie_word_embeddings) {
      return NotFound("tensor 'lm_head.weight' is missing and tie_word_embeddings is false");
    }
    w.lm_head = w.embed;
  } else {
    CACHET_ASSIGN_OR_RETURN(w.lm_head, ld.Matrix("lm_head.weight", c.vocab_size, d));
  }
  w.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    CACHET_ASSIGN_OR_RETURN(L.wq, ld.Matrix(p + "self_attn.q_proj.weight", q_dim, d));
    CACHET_ASSIGN_OR_RETURN(L.wk, ld.Matrix(p + "self_attn.k_proj.weight", kv_dim, d));
    CACHET_ASSIGN_OR_RETURN(L.wv, ld.Matrix(p + "self_attn.v_proj.weight", kv_dim, d));
    CACHET_ASSIGN_OR_RETURN(L.wo, ld.Matrix(p + "self_attn.o_proj.weight", d, q_dim));
    CACHET_ASSIGN_OR_RETURN(L.w_gate, ld.Matrix(p + "mlp.gate_proj.weight", f, d));
    CACHET_ASSIGN_OR_RETURN(L.w_up, ld.Matrix(p + "mlp.up_proj.weight", f, d));
    CACHET_ASSIGN_OR_RETURN(L.w_down, ld.Matrix(p + "mlp.down_proj.weight", d, f));
    CACHET_ASSIGN_OR_RETURN(L.attn_norm, ld.Vector(p + "input_layernorm.weight", d));
    CACHET_ASSIGN_OR_RETURN(L.ffn_norm, ld.Vector(p + "post_attention_layernorm.weight", d));
    if (c.attention_bias) {
      CACHET_ASSIGN_OR_RETURN(L.bq, ld.Vector(p + "self_attn.q_proj.bias", q_dim));
      CACHET_ASSIGN_OR_RETURN(L.bk, ld.Vector(p + "self_attn.k_proj.bias", kv_dim));
      CACHET_ASSIGN_OR_RETURN(L.bv, ld.Vector(p + "self_attn.v_proj.bias", kv_dim));
    }
    if (c.qk_norm) {
      CACHET_ASSIGN_OR_RETURN(L.q_norm, ld.Vector(p + "self_attn.q_norm.weight", hd));
      CACHET_ASSIGN_OR_RETURN(L.k_norm, ld.Vector(p + "self_attn.k_norm.weight", hd));
    }
  }
  w.qk_gguf_order = w.store.gguf() && GgufPermutesQK(c.arch);
  // Weights of a layer past num_hidden_layers: a config that does not describe these weights.
  if (const std::string extra =
          "model.layers." + std::to_string(c.n_layers) + ".input_layernorm.weight";
      ld.Has(extra)) {
    return InvalidArgument("the weights hold more layers than the config's " +
                           std::to_string(c.n_layers) + " (tensor '" + ld.Name(extra) +
                           "' is not used): num_hidden_layers does not describe this checkpoint");
  }
  return w;
}

Residency ModelWeights::residency() const { return ResidencyOf(store.ranges()); }

}  // namespace cachet
