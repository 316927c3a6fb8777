// HF model directory -> GGUF file (`cachet convert`), loadable by Cachet and llama.cpp.
#pragma once

#include <string>

#include "util/dtype.h"
#include "util/status.h"

namespace cachet {

// Writes the model in `model_dir` (config.json, safetensors, tokenizer.json or tokenizer.model) as
// a GGUF v3 file. Matrices (embedding and output included) are stored as `type` (f32, f16, bf16,
// q8_0, q4_0, q4_K or q6_K; a matrix whose rows do not fit the block size falls back to f16);
// norms and biases stay f32. Q/K rows of llama/mistral models are permuted as llama.cpp expects.
Status ConvertHfToGguf(const std::string& model_dir, const std::string& out_path, DType type);

}  // namespace cachet
