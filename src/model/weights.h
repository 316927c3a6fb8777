// The tensors of a Llama-family model, as views into the mapped files (matrices) or small f32
// copies (norm weights and biases, a few KB).
#pragma once

#include <cstdint>
#include <vector>

#include "cachet/model_config.h"
#include "kernels/kernels.h"
#include "model/safetensors.h"
#include "util/mmap_file.h"

namespace cachet {

struct LayerWeights {
  kernels::Matrix wq, wk, wv, wo, w_gate, w_up, w_down;
  std::vector<float> attn_norm, ffn_norm;
  std::vector<float> bq, bk, bv;      // qwen2 / attention_bias only
  std::vector<float> q_norm, k_norm;  // qwen3 only: [head_dim]
};

struct ModelWeights {
  TensorStore store;  // owns the mappings the matrices point into
  kernels::Matrix embed;
  kernels::Matrix lm_head;  // == embed when tied
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  // Q/K rows and biases in llama.cpp's permuted order (llama GGUF): the forward pass puts the
  // projections' outputs back in HF order (GgufRowsToHf).
  bool qk_gguf_order = false;

  static Result<ModelWeights> Load(const ModelConfig& config, TensorStore store);
  // Of the files: how much is resident, how much in 2 MiB pages.
  Residency residency() const;
};

}  // namespace cachet
