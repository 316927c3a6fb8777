// The Llama-family forward pass (llama, mistral, qwen2, qwen3) on CPU. Prefill chunks use
// matrix-matrix kernels, single tokens matrix-vector ones; K and V go straight into the KV cache
// through KvSequence and attention reads them back through its page-table view.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/kv_sequence.h"
#include "model/weights.h"
#include "util/thread_pool.h"

namespace cachet {

class Transformer {
 public:
  // max_batch bounds the tokens of one Forward call (the ubatch); scratch is sized for it once.
  Transformer(ModelConfig config, ModelWeights weights, int max_batch);

  static Result<std::unique_ptr<Transformer>> Load(const std::string& model_dir, int max_batch);

  // Runs tokens (at the given positions) through the model, appending their K/V to kv.
  // logits receives vocab_size floats per token when all_logits, else for the last token only.
  // Bad token ids or a full KV pool return an error and leave kv unchanged.
  Status Forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                 KvSequence& kv, ThreadPool& pool, float* logits, bool all_logits);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  int max_batch() const { return max_batch_; }

 private:
  void Attention(int layer, int n, const int32_t* positions, KvSequence& kv, ThreadPool& pool);

  ModelConfig config_;
  ModelWeights weights_;
  int max_batch_;
  std::vector<float> inv_freq_;
  // Activations for one batch, [max_batch][width] each.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_;
};

}  // namespace cachet
