// libFuzzer target for the GGUF reader: parses arbitrary bytes, then, when they parse, builds the
// model config and the tokenizer from the metadata and reads every tensor's bytes, so that ASan
// sees any out-of-bounds access. Build and run: scripts/fuzz.sh [seconds].
//
// With CACHET_FUZZ_SEED_DIR set, LLVMFuzzerInitialize first writes seed GGUF files there.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "model/gguf.h"
#include "model/gguf_model.h"

namespace {

void WriteSeeds(const std::string& dir) {
  using cachet::DType;
  using cachet::GgufWriter;
  GgufWriter w;
  w.SetString("general.architecture", "qwen2");
  w.SetU32("general.alignment", 32);
  w.SetU32("qwen2.block_count", 1);
  w.SetU32("qwen2.embedding_length", 32);
  w.SetU32("qwen2.feed_forward_length", 64);
  w.SetU32("qwen2.attention.head_count", 2);
  w.SetU32("qwen2.attention.head_count_kv", 1);
  w.SetF32("qwen2.rope.freq_base", 10000.0f);
  w.SetF32("qwen2.attention.layer_norm_rms_epsilon", 1e-6f);
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "qwen2");
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "ab", "\xC4\xA0", "<|x|>"});
  w.SetI32Array("tokenizer.ggml.token_type", {1, 1, 1, 1, 3});
  w.SetStringArray("tokenizer.ggml.merges", {"a b"});
  w.SetU32("tokenizer.ggml.bos_token_id", 4);
  w.SetBool("tokenizer.ggml.add_bos_token", false);
  auto zeros = [](uint8_t* out) { (void)out; };
  w.AddTensor("token_embd.weight", DType::kQ8_0, {5, 32}, zeros);
  w.AddTensor("output_norm.weight", DType::kF32, {32}, zeros);
  w.AddTensor("blk.0.attn_q.weight", DType::kQ4_0, {32, 32}, zeros);
  w.AddTensor("blk.0.ffn_down.weight", DType::kQ4_K, {32, 256}, zeros);
  w.AddTensor("blk.0.ffn_up.weight", DType::kQ6_K, {2, 256}, zeros);
  w.AddTensor("blk.0.ffn_gate.weight", DType::kQ5_0, {2, 64}, zeros);
  w.AddTensor("blk.0.attn_q.bias", DType::kBF16, {32}, zeros);
  (void)w.Write(dir + "/seed-qwen2.gguf");

  GgufWriter s;
  s.SetString("general.architecture", "llama");
  s.SetString("tokenizer.ggml.model", "llama");
  s.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "\xE2\x96\x81", "a", "<0x41>"});
  s.SetF32Array("tokenizer.ggml.scores", {0, 0, -1, -2, 0});
  s.SetI32Array("tokenizer.ggml.token_type", {2, 3, 1, 1, 6});
  s.AddTensor("token_embd.weight", DType::kF16, {5, 8}, zeros);
  (void)s.Write(dir + "/seed-llama.gguf");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("CACHET_FUZZ_SEED_DIR")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = cachet::GgufFile::Parse(data, size, "fuzz.gguf");
  if (!f.ok()) return 0;
  volatile uint8_t sink = 0;
  for (const cachet::GgufTensor& t : f->tensors()) {
    if (t.n_bytes > 0) sink = sink ^ t.data[0] ^ t.data[t.n_bytes - 1];
  }
  (void)cachet::GgufConfig(*f);
  if (const cachet::GgufValue* tokens = f->Find("tokenizer.ggml.tokens");
      tokens != nullptr && tokens->array_size() < 4096) {
    auto tok = cachet::TokenizerFromGguf(*f);
    if (tok.ok()) {
      const std::string text(reinterpret_cast<const char*>(data), size < 64 ? size : 64);
      const auto ids = (*tok)->Encode(text);
      (void)(*tok)->Decode(ids);
    }
  }
  return 0;
}
