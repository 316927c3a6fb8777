#include <sentencepiece_processor.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "cachet/convert.h"
#include "cachet/model_config.h"
#include "cachet/progress.h"
#include "cachet/tokenizer.h"
#include "kernels/kernels.h"
#include "model/gguf.h"
#include "model/gguf_convert_internal.h"
#include "model/gguf_model.h"
#include "model/safetensors.h"
#include "util/json_excerpt.h"
#include "util/mmap_file.h"
#include "util/thread_pool.h"

namespace cachet {
namespace {

using json = nlohmann::json;

// The Split regexes llama.cpp knows by pre-tokenizer name.
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

uint32_t FileType(WeightFormat f) {
  return f.mix_m ? Info(f.type).file_type_m : Info(f.type).file_type;
}

// The llama.cpp pre-tokenizer name of a tokenizer.json pre_tokenizer.
Result<std::string> PreTokenizerName(const json& root, const std::string& path) {
  const json& pt = root.value("pre_tokenizer", json());
  if (pt.is_object() && pt.value("type", "") == "ByteLevel" && pt.value("use_regex", true)) {
    return std::string("gpt2");
  }
  if (pt.is_object() && pt.value("type", "") == "Sequence" && pt.contains("pretokenizers") &&
      pt["pretokenizers"].is_array() && pt["pretokenizers"].size() == 2) {
    const json& split = pt["pretokenizers"][0];
    const json& bl = pt["pretokenizers"][1];
    if (split.value("type", "") == "Split" && split.contains("pattern") &&
        split["pattern"].is_object() && split["pattern"].contains("Regex") &&
        bl.value("type", "") == "ByteLevel" && !bl.value("use_regex", true)) {
      const std::string re = split["pattern"]["Regex"].get<std::string>();
      if (re == kQwen2Regex) return std::string("qwen2");
      if (re == kLlama3Regex) return std::string("llama-bpe");
    }
  }
  return Unimplemented(path + ": pre_tokenizer " + JsonExcerpt(pt, 200) +
                       " has no llama.cpp pre-tokenizer name (supported: GPT-2 ByteLevel, the "
                       "Qwen2 and Llama-3 Split regexes)");
}

Status AddBpeVocab(const std::string& path, int vocab_size, GgufWriter& w) {
  CACHET_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object() || !root.contains("model") ||
      !root["model"].is_object()) {
    return InvalidArgument(path + ": not a tokenizer.json object with a model");
  }
  const json& m = root["model"];
  if (m.value("type", "BPE") != "BPE" || !m.contains("vocab") || !m["vocab"].is_object() ||
      !m.contains("merges") || !m["merges"].is_array()) {
    return Unimplemented(path + ": only BPE tokenizer.json models can be converted");
  }
  CACHET_ASSIGN_OR_RETURN(std::string pre, PreTokenizerName(root, path));
  std::vector<std::string> tokens(vocab_size);
  std::vector<int32_t> types(vocab_size, 5);  // UNUSED until seen
  for (int i = 0; i < vocab_size; ++i) tokens[i] = "[PAD" + std::to_string(i) + "]";
  auto set = [&](const std::string& t, int64_t id, int32_t type) -> Status {
    if (id < 0 || id >= vocab_size) {
      return InvalidArgument(path + ": token id " + std::to_string(id) + " of '" + t +
                             "' is outside the model's vocab_size " + std::to_string(vocab_size));
    }
    tokens[id] = t;
    types[id] = type;
    return OkStatus();
  };
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer()) return InvalidArgument(path + ": bad vocab id");
    CACHET_RETURN_IF_ERROR(set(it.key(), it.value().get<int64_t>(), 1));
  }
  if (root.contains("added_tokens") && root["added_tokens"].is_array()) {
    for (const json& a : root["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a.contains("content")) continue;
      CACHET_RETURN_IF_ERROR(set(a["content"].get<std::string>(), a["id"].get<int64_t>(),
                                 a.value("special", false) ? 3 : 4));
    }
  }
  std::vector<std::string> merges;
  merges.reserve(m["merges"].size());
  for (const json& e : m["merges"]) {
    if (e.is_string()) {
      merges.push_back(e.get<std::string>());
    } else if (e.is_array() && e.size() == 2) {
      merges.push_back(e[0].get<std::string>() + " " + e[1].get<std::string>());
    } else {
      return InvalidArgument(path + ": bad merge " + JsonExcerpt(e));
    }
  }
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", pre);
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  w.SetStringArray("tokenizer.ggml.merges", merges);
  return OkStatus();
}

Status AddSpmVocab(const std::string& path, int vocab_size, GgufWriter& w) {
  sentencepiece::SentencePieceProcessor sp;
  const auto st = sp.Load(path);
  if (!st.ok()) return DataLoss(path + ": " + st.ToString());
  const int n = sp.GetPieceSize();
  if (n > vocab_size) {
    return InvalidArgument(path + ": " + std::to_string(n) + " pieces exceed vocab_size " +
                           std::to_string(vocab_size));
  }
  std::vector<std::string> tokens(vocab_size);
  std::vector<float> scores(vocab_size, -1000.0f);
  std::vector<int32_t> types(vocab_size, 5);
  for (int i = 0; i < vocab_size; ++i) tokens[i] = "[PAD" + std::to_string(i) + "]";
  for (int i = 0; i < n; ++i) {
    tokens[i] = sp.IdToPiece(i);
    scores[i] = sp.GetScore(i);
    types[i] = sp.IsUnknown(i)   ? 2
               : sp.IsControl(i) ? 3
               : sp.IsUnused(i)  ? 5
               : sp.IsByte(i)    ? 6
                                 : 1;
  }
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetString("tokenizer.ggml.pre", "default");
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetF32Array("tokenizer.ggml.scores", scores);
  w.SetI32Array("tokenizer.ggml.token_type", types);
  if (sp.unk_id() >= 0) w.SetU32("tokenizer.ggml.unknown_token_id", sp.unk_id());
  return OkStatus();
}

}  // namespace

namespace gguf_convert_internal {

std::vector<ModelTensor> ModelTensors(const ModelConfig& c) {
  const int64_t d = c.hidden_size, f = c.intermediate_size, hd = c.head_dim;
  const int64_t q = int64_t{c.n_heads} * hd, kv = int64_t{c.n_kv_heads} * hd;
  std::vector<ModelTensor> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  t.push_back({"model.norm.weight", {d}, false, true});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", {c.vocab_size, d}});
  for (int l = 0; l < c.n_layers; ++l) {
    const size_t first = t.size();
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {d}, false, true});
    t.push_back({p + "post_attention_layernorm.weight", {d}, false, true});
    t.push_back({p + "self_attn.q_proj.weight", {q, d}, true});
    t.push_back({p + "self_attn.k_proj.weight", {kv, d}, true});
    t.push_back({p + "self_attn.v_proj.weight", {kv, d}});
    t.push_back({p + "self_attn.o_proj.weight", {d, q}});
    t.push_back({p + "mlp.gate_proj.weight", {f, d}});
    t.push_back({p + "mlp.up_proj.weight", {f, d}});
    t.push_back({p + "mlp.down_proj.weight", {d, f}});
    if (c.attention_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {q}, true});
      t.push_back({p + "self_attn.k_proj.bias", {kv}, true});
      t.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
    if (c.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {hd}, false, true});
      t.push_back({p + "self_attn.k_norm.weight", {hd}, false, true});
    }
    for (size_t i = first; i < t.size(); ++i) t[i].layer = l;
  }
  return t;
}

DType MatrixType(const WeightFormat& format, const ModelTensor& t, int n_layers, int n_gqa,
                 bool tied) {
  const int64_t cols = t.shape.back();
  DType want = format.type;
  if (format.mix_m) {
    // llama.cpp's rules (llama_tensor_get_type) for its Q4_K_M, Q5_K_M, Q3_K_M and Q2_K files.
    const int i = t.layer, n = n_layers;
    // use_more_bits: the first and last eighth of the layers, and every third between.
    const bool more_bits = i >= 0 && (i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2);
    const bool lm_head =
        t.hf_name == "lm_head.weight" || (tied && t.hf_name == "model.embed_tokens.weight");
    const bool v = t.hf_name.ends_with("self_attn.v_proj.weight");
    const bool down = t.hf_name.ends_with("mlp.down_proj.weight");
    const bool out = t.hf_name.ends_with("self_attn.o_proj.weight");
    if (lm_head) {
      want = DTypeRowBytes(DType::kQ6_K, cols) >= 0 ? DType::kQ6_K : DType::kQ8_0;
    } else if (format.type == DType::kQ3_K) {
      if (v) want = i < 2 ? DType::kQ5_K : DType::kQ4_K;
      if (down) want = i < n / 16 ? DType::kQ5_K : DType::kQ4_K;
      if (out) want = DType::kQ4_K;
    } else if (format.type == DType::kQ2_K) {
      if (v) want = n_gqa >= 4 ? DType::kQ4_K : DType::kQ3_K;
      if (down || out) want = DType::kQ3_K;
    } else if (more_bits && (v || down)) {
      want = DType::kQ6_K;
    }
  }
  if (DTypeRowBytes(want, cols) >= 0) return want;
  // llama.cpp's fallbacks for rows off the 256-value super-blocks (qwen2.5-0.5b's 896 columns).
  const DType fallback = want == DType::kQ4_K                           ? DType::kQ5_0
                         : want == DType::kQ5_K                         ? DType::kQ5_1
                         : want == DType::kIQ4_XS                       ? DType::kIQ4_NL
                         : want == DType::kQ3_K || want == DType::kQ2_K ? DType::kQ4_0
                         : want == DType::kQ6_K                         ? DType::kQ8_0
                                                                        : DType::kF16;
  return DTypeRowBytes(fallback, cols) >= 0 ? fallback : DType::kF16;
}

void SetModelMetadata(const ModelConfig& c, const std::string& name, WeightFormat format,
                      GgufWriter& w) {
  // llama.cpp runs Mistral checkpoints as "llama".
  const std::string arch = c.arch == Arch::kMistral ? "llama" : ArchName(c.arch);
  w.SetString("general.architecture", arch);
  w.SetString("general.name", name);
  w.SetU32("general.file_type", FileType(format));
  w.SetU32("general.quantization_version", 2);
  const std::string a = arch + ".";
  w.SetU32(a + "block_count", c.n_layers);
  w.SetU32(a + "context_length", c.max_position_embeddings);
  w.SetU32(a + "embedding_length", c.hidden_size);
  w.SetU32(a + "feed_forward_length", c.intermediate_size);
  w.SetU32(a + "attention.head_count", c.n_heads);
  w.SetU32(a + "attention.head_count_kv", c.n_kv_heads);
  w.SetU32(a + "attention.key_length", c.head_dim);
  w.SetU32(a + "attention.value_length", c.head_dim);
  w.SetU32(a + "rope.dimension_count", c.head_dim);
  w.SetF32(a + "rope.freq_base", c.rope_theta);
  w.SetF32(a + "attention.layer_norm_rms_epsilon", c.rms_norm_eps);
  w.SetU32(a + "vocab_size", c.vocab_size);
  if (c.rope_scaling.type == RopeScaling::Type::kLinear) {
    w.SetString(a + "rope.scaling.type", "linear");
    w.SetF32(a + "rope.scaling.factor", c.rope_scaling.factor);
  }
}

// Shared by the fill callbacks of one writer: they run one at a time, in order, when it writes.
struct TensorAdder::State {
  ThreadPool pool;
  bool progress;
  int64_t total_values = 0, done_values = 0;
  size_t tensors = 0, filled = 0;
  std::unique_ptr<ProgressBar> bar;
  State(int threads, bool progress)
      : pool(threads > 0 ? threads : ThreadPool::DefaultThreads()), progress(progress) {}

  // Runs rows [0, rows) of one tensor on the pool, cols values each, then counts the tensor done.
  void Rows(int64_t rows, int64_t cols, const std::function<void(int64_t, float*)>& row_fn) {
    if (progress && !bar) {
      bar = std::make_unique<ProgressBar>("convert, M values", Mega(total_values));
    }
    constexpr int64_t kRowsPerTask = 16;
    std::vector<std::vector<float>> scratch(pool.size(), std::vector<float>(cols));
    std::atomic<int64_t> done{0};
    pool.Run((rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task, int thread) {
      const int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
      for (int64_t r = task * kRowsPerTask; r < end; ++r) row_fn(r, scratch[thread].data());
      done += (end - task * kRowsPerTask) * cols;
      // Only the calling thread draws: ProgressBar is not thread-safe.
      if (thread == 0 && bar) bar->Update(Mega(done_values + done.load()));
    });
    done_values += rows * cols;
    if (++filled == tensors) {
      if (bar) bar->Update(Mega(total_values));  // the one "100%" line
      bar.reset();
    } else if (bar) {
      bar->Update(Mega(done_values));
    }
  }
  // Millions of values, rounded down below the total so that only the end draws as finished.
  int64_t Mega(int64_t n) const {
    return n >= total_values
               ? std::max<int64_t>(1, total_values / 1000000)
               : std::min(n / 1000000, std::max<int64_t>(1, total_values / 1000000) - 1);
  }
};

TensorAdder::TensorAdder(GgufWriter& w, const ModelConfig& c, WeightFormat format, int threads,
                         bool progress)
    : w_(w),
      format_(format),
      n_layers_(c.n_layers),
      n_gqa_(c.n_kv_heads > 0 ? c.n_heads / c.n_kv_heads : 1),
      tied_(c.tie_word_embeddings),
      head_dim_(c.head_dim),
      permute_(GgufPermutesQK(c.arch)),
      state_(std::make_shared<State>(threads, progress)) {}

void TensorAdder::Add(const ModelTensor& t, RowSource rows) {
  const bool rope = t.rope_rows && permute_;
  const int64_t hd = head_dim_;
  if (t.shape.size() == 1) {
    const int64_t n = t.shape[0];
    if (!rope) return AddVector(GgufTensorName(t.hf_name), n, std::move(rows));
    ++state_->tensors;
    state_->total_values += n;
    w_.AddTensor(GgufTensorName(t.hf_name), DType::kF32, {n},
                 [st = state_, n, hd, rows = std::move(rows)](uint8_t* dst) {
                   std::vector<float> v(n);
                   st->Rows(1, n, [&](int64_t, float*) { rows(0, v.data()); });
                   float* o = reinterpret_cast<float*>(dst);
                   for (int64_t i = 0; i < n; ++i) o[GgufRopeRow(i, hd)] = v[i];
                 });
    return;
  }
  const int64_t n_rows = t.shape[0], cols = t.shape[1];
  const DType out = MatrixType(format_, t, n_layers_, n_gqa_, tied_);
  const int64_t row_bytes = DTypeRowBytes(out, cols);
  ++state_->tensors;
  state_->total_values += n_rows * cols;
  w_.AddTensor(GgufTensorName(t.hf_name), out, {n_rows, cols},
               [=, st = state_, rows = std::move(rows)](uint8_t* dst) {
                 st->Rows(n_rows, cols, [&](int64_t r, float* row) {
                   rows(r, row);
                   const int64_t g = rope ? GgufRopeRow(r, hd) : r;
                   kernels::ref::QuantizeRow(out, row, cols, dst + g * row_bytes);
                 });
               });
}

void TensorAdder::AddVector(const std::string& gguf_name, int64_t n, RowSource rows) {
  ++state_->tensors;
  state_->total_values += n;
  w_.AddTensor(gguf_name, DType::kF32, {n}, [st = state_, n, rows = std::move(rows)](uint8_t* dst) {
    st->Rows(1, n, [&](int64_t, float*) { rows(0, reinterpret_cast<float*>(dst)); });
  });
}

}  // namespace gguf_convert_internal

Status ConvertHfToGguf(const std::string& dir, const std::string& out_path, WeightFormat format,
                       int threads, bool progress) {
  using namespace gguf_convert_internal;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (std::filesystem::equivalent(entry.path(), out_path, ec)) {
      return InvalidArgument(out_path + ": is a file of the model being converted (" + dir +
                             "); write the GGUF elsewhere");
    }
  }
  CACHET_ASSIGN_OR_RETURN(ModelConfig c, ModelConfig::Load(dir));
  CACHET_ASSIGN_OR_RETURN(TensorStore store, TensorStore::OpenDir(dir));
  CACHET_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::Load(dir));
  if (c.rope_scaling.type != RopeScaling::Type::kNone &&
      c.rope_scaling.type != RopeScaling::Type::kLinear &&
      c.rope_scaling.type != RopeScaling::Type::kLlama3) {
    return Unimplemented(dir + ": rope scaling cannot be converted");
  }
  GgufWriter w;
  SetModelMetadata(c, std::filesystem::path(dir).filename().string(), format, w);

  const std::filesystem::path d(dir);
  if (std::filesystem::exists(d / "tokenizer.json", ec)) {
    CACHET_RETURN_IF_ERROR(AddBpeVocab((d / "tokenizer.json").string(), c.vocab_size, w));
  } else {
    CACHET_RETURN_IF_ERROR(AddSpmVocab((d / "tokenizer.model").string(), c.vocab_size, w));
  }
  if (tok->bos_id() >= 0) w.SetU32("tokenizer.ggml.bos_token_id", tok->bos_id());
  if (tok->eos_id() >= 0) w.SetU32("tokenizer.ggml.eos_token_id", tok->eos_id());
  w.SetBool("tokenizer.ggml.add_bos_token", tok->add_bos());
  w.SetBool("tokenizer.ggml.add_eos_token", false);

  TensorAdder adder(w, c, format, threads, progress);
  for (const ModelTensor& mt : ModelTensors(c)) {
    auto it = store.tensors().find(mt.hf_name);
    if (it == store.tensors().end()) {
      // An untied model whose checkpoint has no LM head: the loader ties it to the embedding.
      if (mt.hf_name == "lm_head.weight") continue;
      return NotFound(dir + ": tensor '" + mt.hf_name + "' is missing");
    }
    const TensorInfo* t = &it->second;
    if (t->shape != mt.shape) {
      return InvalidArgument(dir + ": tensor '" + mt.hf_name + "' has shape " +
                             ShapeString(t->shape) + ", config.json implies " +
                             ShapeString(mt.shape));
    }
    const int64_t cols = mt.shape.back();
    adder.Add(mt, [t, cols](int64_t r, float* out) {
      const char* src = static_cast<const char*>(t->data) + r * cols * DTypeSize(t->dtype);
      for (int64_t k = 0; k < cols; ++k) out[k] = LoadAsF32(src, t->dtype, k);
    });
  }
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3) {
    ModelConfig plain = c;
    plain.rope_scaling = RopeScaling();
    const std::vector<float> base = plain.RopeInvFreq(), scaled = c.RopeInvFreq();
    adder.AddVector("rope_freqs.weight", c.head_dim / 2, [base, scaled](int64_t, float* o) {
      for (size_t i = 0; i < base.size(); ++i) o[i] = base[i] / scaled[i];
    });
  }
  return w.Write(out_path);
}

}  // namespace cachet
