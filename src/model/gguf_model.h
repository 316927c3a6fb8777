// A GGUF file as a Cachet model: hyper-parameters from its metadata, tensor names, the tokenizer
// (gguf_tokenizer.cc), and llama.cpp's Q/K row permutation for `llama` models.
//
// llama.cpp's HF -> GGUF converter permutes the rows of q_proj and k_proj (weights and biases) of
// llama-architecture models (Llama, Mistral) so that GGML's interleaved-pair RoPE equals HF's
// rotate-half: within each head of d rows, GGUF row 2j + s holds HF row s * d/2 + j (s = 0, 1).
// Cachet computes rotate-half: the weights stay as mapped, and the forward pass puts each
// projection's outputs back in HF order (GgufRowsToHf) before RoPE; `cachet convert` applies the
// permutation. qwen2 / qwen3 use NEOX (rotate-half) RoPE: no permutation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cachet/model_config.h"
#include "cachet/tokenizer.h"
#include "model/gguf.h"

namespace cachet {

// A .gguf name, or any file that starts with GGUF's magic (llama.cpp reads `-m model.bin` too).
bool IsGgufPath(const std::string& path);

// The model's hyper-parameters from general.architecture and {arch}.* keys.
Result<ModelConfig> GgufConfig(const GgufFile& f);

// The GGUF name of a HF tensor name (model.layers.3.self_attn.q_proj.weight ->
// blk.3.attn_q.weight); names it does not know are returned unchanged.
std::string GgufTensorName(const std::string& hf_name);

// True when Q/K rows of this GGUF architecture are stored in llama.cpp's permuted order.
inline bool GgufPermutesQK(Arch a) { return a == Arch::kLlama || a == Arch::kMistral; }
// The GGUF row that holds row r (HF order) of a Q/K projection with heads of head_dim rows:
// loading reads HF row r from it, converting writes HF row r to it.
inline int64_t GgufRopeRow(int64_t r, int64_t head_dim) {
  const int64_t head = r / head_dim, i = r % head_dim, half = head_dim / 2;
  return head * head_dim + 2 * (i % half) + i / half;  // HF s * half + j -> GGUF 2j + s
}
// One token's Q or K projection computed from GGUF rows (in), in HF order (out).
inline void GgufRowsToHf(const float* in, int n_heads, int head_dim, float* out) {
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h, in += head_dim, out += head_dim) {
    for (int j = 0; j < half; ++j) {
      out[j] = in[2 * j];
      out[half + j] = in[2 * j + 1];
    }
  }
}

// The tokenizer described by tokenizer.ggml.* (model "gpt2": byte-level BPE with pre-tokenizers
// default / llama-bpe / qwen2; model "llama": SentencePiece-style BPE by scores with byte
// fallback).
Result<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& f);

}  // namespace cachet
