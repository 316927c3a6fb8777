// Private to src/model: what the two GGUF writers (gguf_convert.cc for HF directories,
// gguf_synthetic.cc for synthetic models) share, so that both write the same metadata keys and
// the same tensors in the same layout.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cachet/convert.h"
#include "cachet/model_config.h"
#include "cachet/status.h"
#include "model/gguf.h"
#include "util/dtype.h"

namespace cachet::gguf_convert_internal {

// One tensor of a Llama-family model, named and shaped as in a HF checkpoint.
struct ModelTensor {
  std::string hf_name;
  std::vector<int64_t> shape;  // [rows, cols] for matrices, [n] for norms and biases
  bool rope_rows = false;      // Q/K weights and biases, permuted for GGUF `llama` models
  bool norm = false;           // an RMSNorm weight
  int layer = -1;              // the decoder layer it belongs to, if any
};

// Every tensor of a model of this config, in the order convert writes them: the embedding, the
// final norm, the LM head when untied, then each layer's norms, projections, biases and QK norms.
std::vector<ModelTensor> ModelTensors(const ModelConfig& c);

// general.* and the {arch}.* hyper-parameters (mistral is written as llama, as llama.cpp runs
// it), including linear RoPE scaling; `name` becomes general.name.
void SetModelMetadata(const ModelConfig& c, const std::string& name, WeightFormat format,
                      GgufWriter& w);

// Writes HF-order row `row` of a tensor (shape.back() floats) to out. Called from several threads
// at once, so it must only read shared state.
using RowSource = std::function<void(int64_t row, float* out)>;

// Adds tensors to a GgufWriter. Their bytes are made when the writer writes the file: rows in
// parallel on `threads` threads (0: one per core), each row produced by its RowSource and
// encoded with kernels::ref::QuantizeRow, so the bytes do not depend on the thread count.
// Matrices are stored as MatrixType says, vectors as f32; rope_rows tensors are permuted as
// GgufRopeRow says when the architecture needs it. With `progress`, a progress bar on stderr counts
// the values written.
class TensorAdder {
 public:
  TensorAdder(GgufWriter& w, const ModelConfig& c, WeightFormat format, int threads, bool progress);
  void Add(const ModelTensor& t, RowSource rows);
  // A tensor of another name and shape (rope_freqs), as Add stores vectors.
  void AddVector(const std::string& gguf_name, int64_t n, RowSource rows);

 private:
  struct State;
  GgufWriter& w_;
  WeightFormat format_;
  int n_layers_;
  int n_gqa_;  // query heads per KV head
  bool tied_;
  int head_dim_;
  bool permute_;
  std::shared_ptr<State> state_;
};

// The type matrix t is stored as in `format` (WeightFormat), fallbacks included.
DType MatrixType(const WeightFormat& format, const ModelTensor& t, int n_layers, int n_gqa,
                 bool tied);

}  // namespace cachet::gguf_convert_internal
