// Model loading: configs, safetensors (single and sharded), every architecture variant, and the
// errors bad files must produce (naming file and tensor, never crashing).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "cachet/convert.h"
#include "cachet/model_config.h"
#include "kv/paged_sequence.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

using nlohmann::json;
using testing::ModelDir;
using testing::ReadFile;
using testing::TempDir;

struct Tensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16"
  std::vector<int64_t> shape;
  std::vector<float> values;
};

std::string EncodeSafetensors(const std::vector<Tensor>& tensors) {
  json header = json::object();
  std::string data;
  for (const Tensor& t : tensors) {
    const size_t begin = data.size();
    for (float v : t.values) {
      if (t.dtype == "F32") {
        data.append(reinterpret_cast<const char*>(&v), 4);
      } else {
        uint16_t h = t.dtype == "F16" ? F32ToF16(v) : F32ToBf16(v);
        data.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  uint64_t n = h.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + h + data;
}

// A tiny random Llama-family model: config + tensors.
struct TinyModel {
  json config;
  std::vector<Tensor> tensors;
};

TinyModel MakeTinyModel(const std::string& model_type, const std::string& dtype, uint32_t seed,
                        bool zero_bias = false) {
  const int d = 32, f = 48, n_heads = 4, n_kv = 2, hd = 16, vocab = 64, layers = 2;
  TinyModel m;
  m.config = {{"model_type", model_type},
              {"vocab_size", vocab},
              {"hidden_size", d},
              {"intermediate_size", f},
              {"num_hidden_layers", layers},
              {"num_attention_heads", n_heads},
              {"num_key_value_heads", n_kv},
              {"head_dim", hd},
              {"rope_theta", 10000.0},
              {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 256},
              {"tie_word_embeddings", false},
              {"hidden_act", "silu"}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.2f);
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float base = 0.0f,
                 bool zero = false) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> v(n);
    for (float& x : v) {
      x = zero ? 0.0f : base + nd(rng);
      x = dtype == "F16" ? F16ToF32(F32ToF16(x)) : dtype == "BF16" ? Bf16ToF32(F32ToBf16(x)) : x;
    }
    m.tensors.push_back({name, dtype, shape, v});
  };
  add("model.embed_tokens.weight", {vocab, d});
  add("lm_head.weight", {vocab, d});
  add("model.norm.weight", {d}, 1.0f);
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {n_heads * hd, d});
    add(p + "self_attn.k_proj.weight", {n_kv * hd, d});
    add(p + "self_attn.v_proj.weight", {n_kv * hd, d});
    add(p + "self_attn.o_proj.weight", {d, n_heads * hd});
    add(p + "mlp.gate_proj.weight", {f, d});
    add(p + "mlp.up_proj.weight", {f, d});
    add(p + "mlp.down_proj.weight", {d, f});
    add(p + "input_layernorm.weight", {d}, 1.0f);
    add(p + "post_attention_layernorm.weight", {d}, 1.0f);
    if (model_type == "qwen2") {
      add(p + "self_attn.q_proj.bias", {n_heads * hd}, 0.0f, zero_bias);
      add(p + "self_attn.k_proj.bias", {n_kv * hd}, 0.0f, zero_bias);
      add(p + "self_attn.v_proj.bias", {n_kv * hd}, 0.0f, zero_bias);
    }
    if (model_type == "qwen3") {
      add(p + "self_attn.q_norm.weight", {hd}, 1.0f);
      add(p + "self_attn.k_norm.weight", {hd}, 1.0f);
    }
  }
  return m;
}

void WriteModel(const TempDir& dir, const TinyModel& m, int shards = 1) {
  dir.Write("config.json", m.config.dump());
  if (shards == 1) {
    dir.Write("model.safetensors", EncodeSafetensors(m.tensors));
    return;
  }
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (int s = 0; s < shards; ++s) {
    std::vector<Tensor> part;
    const std::string name =
        "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
    for (size_t i = s; i < m.tensors.size(); i += shards) {
      part.push_back(m.tensors[i]);
      index["weight_map"][m.tensors[i].name] = name;
    }
    dir.Write(name, EncodeSafetensors(part));
  }
  dir.Write("model.safetensors.index.json", index.dump());
}

// Logits of every token of a fixed prompt.
Result<std::vector<float>> RunTiny(const std::string& dir, bool copy_weights = false) {
  CACHET_ASSIGN_OR_RETURN(auto model, Transformer::Load(dir, 16, copy_weights));
  const ModelConfig& c = model->config();
  PagePool pool(KvLayout{c.n_layers, c.n_kv_heads, c.head_dim, 4}, 1 << 20);
  PagedSequence seq(pool);
  ThreadPool threads(2);
  std::vector<int32_t> tokens = {1, 5, 9, 33, 2, 60, 7, 7, 12, 40, 3};
  std::vector<int32_t> pos(tokens.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  std::vector<float> logits(tokens.size() * c.vocab_size);
  CACHET_RETURN_IF_ERROR(model->Forward(tokens, pos, seq, threads, logits.data(), true));
  return logits;
}

using testing::RelErr;

TEST(ModelLoading, KvtinyConfigAndTensors) {
  auto c = ModelConfig::Load(ModelDir());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, Arch::kLlama);
  EXPECT_EQ(c->n_layers, 8);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_NEAR(c->ParamCount() / 1e6, 15.74, 0.01);
  auto store = TensorStore::OpenDir(ModelDir());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->tensors().at("model.embed_tokens.weight").dtype, DType::kBF16);
}

TEST(ModelLoading, ArchitectureVariantsRun) {
  for (std::string arch : {"llama", "mistral", "qwen2", "qwen3"}) {
    TempDir dir;
    WriteModel(dir, MakeTinyModel(arch, "F32", 7));
    auto logits = RunTiny(dir.path());
    ASSERT_TRUE(logits.ok()) << arch << ": " << logits.status().ToString();
    for (float v : *logits) ASSERT_TRUE(std::isfinite(v)) << arch;
  }
}

TEST(ModelLoading, Qwen2WithZeroBiasEqualsLlama) {
  TempDir a, b, c;
  WriteModel(a, MakeTinyModel("llama", "F32", 11));
  WriteModel(b, MakeTinyModel("qwen2", "F32", 11, /*zero_bias=*/true));
  WriteModel(c, MakeTinyModel("qwen2", "F32", 11, /*zero_bias=*/false));
  auto la = RunTiny(a.path()), lb = RunTiny(b.path()), lc = RunTiny(c.path());
  ASSERT_TRUE(la.ok() && lb.ok() && lc.ok());
  EXPECT_LT(RelErr(*lb, *la), 1e-6);  // the bias path adds exactly zero
  EXPECT_GT(RelErr(*lc, *la), 1e-3);  // and real biases do change the output
}

TEST(ModelLoading, Qwen3UnitNormsDifferFromLlama) {
  // q_norm/k_norm normalize each head; with weights 1 the output still differs from plain llama,
  // proving the per-head norms are applied.
  TempDir a, b;
  WriteModel(a, MakeTinyModel("llama", "F32", 13));
  WriteModel(b, MakeTinyModel("qwen3", "F32", 13));
  auto la = RunTiny(a.path()), lb = RunTiny(b.path());
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_GT(RelErr(*lb, *la), 1e-3);
}

TEST(ModelLoading, DTypesAndShardingAgree) {
  // Values rounded to bf16 are exact in f32, f16 (in this range) and bf16 files alike.
  TinyModel m = MakeTinyModel("llama", "BF16", 5);
  TempDir f32, f16, bf16, sharded;
  TinyModel m32 = m, m16 = m;
  for (auto& t : m32.tensors) t.dtype = "F32";
  for (auto& t : m16.tensors) t.dtype = "F16";
  WriteModel(f32, m32);
  WriteModel(f16, m16);
  WriteModel(bf16, m);
  WriteModel(sharded, m, /*shards=*/3);
  auto a = RunTiny(f32.path()), b = RunTiny(f16.path()), c = RunTiny(bf16.path()),
       d = RunTiny(sharded.path());
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok()) << d.status().ToString();
  EXPECT_LT(RelErr(*b, *a), 1e-4);  // f16 rounding of the few values bf16 keeps but f16 cannot
  EXPECT_LT(RelErr(*c, *a), 1e-6);
  EXPECT_EQ(*d, *c);
}

// --no-mmap: weights read into memory give the mapped weights' logits bit for bit, from sharded
// safetensors and from kvtiny as a GGUF (whose llama Q/K rows are copied out and their pages in
// the read copy released: nothing reads them again).
TEST(ModelLoading, ReadWeightsEqualMapped) {
  TempDir dir, out;
  WriteModel(dir, MakeTinyModel("llama", "BF16", 9), /*shards=*/2);
  const std::string gguf = out.path() + "/kvtiny-q8_0.gguf";
  const Status converted = ConvertHfToGguf(ModelDir(), gguf, DType::kQ8_0, 2, false);
  ASSERT_TRUE(converted.ok()) << converted.ToString();
  for (const std::string& model : {dir.path(), gguf}) {
    auto mapped = RunTiny(model), read = RunTiny(model, /*copy_weights=*/true);
    ASSERT_TRUE(mapped.ok() && read.ok()) << model << ": " << read.status().ToString();
    EXPECT_EQ(*read, *mapped) << model;
  }
  EXPECT_FALSE(Transformer::Load(out.path() + "/missing.gguf", 8, true).ok());
}

// Residency (what `cachet bench` reports of the weights' pages): a buffer's bytes count once
// touched, its mapping found among smaps'; kvtiny's weights count whole after a forward pass,
// mapped or read in, GGUF or safetensors.
TEST(ModelLoading, WeightResidency) {
  auto buf = HugePageBuffer::Allocate(size_t{8} << 20, "test");
  ASSERT_TRUE(buf.ok()) << buf.status().ToString();
  const std::vector<MemoryRange> range = {{buf->data(), buf->size()}};
  const Residency before = ResidencyOf(range);
  std::memset(buf->data(), 1, buf->size());
  const Residency after = ResidencyOf(range);
  EXPECT_GE(after.resident_bytes - before.resident_bytes, int64_t{8} << 20);
  EXPECT_LE(after.huge_page_bytes, after.resident_bytes);
  EXPECT_EQ(ResidencyOf({}).resident_bytes, 0);

  TempDir out;
  const std::string gguf = out.path() + "/kvtiny-q8_0.gguf";
  const Status converted = ConvertHfToGguf(ModelDir(), gguf, DType::kQ8_0, 2, false);
  ASSERT_TRUE(converted.ok()) << converted.ToString();
  for (const std::string& model : {ModelDir(), gguf}) {
    for (bool copy : {false, true}) {
      auto m = Transformer::Load(model, 16, copy);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      const ModelConfig& c = (*m)->config();
      PagePool pool(KvLayout{c.n_layers, c.n_kv_heads, c.head_dim, 4}, 1 << 20);
      PagedSequence seq(pool);
      ThreadPool threads(1);
      const std::vector<int32_t> tokens = {1, 5}, pos = {0, 1};
      std::vector<float> logits(2 * c.vocab_size);
      ASSERT_TRUE((*m)->Forward(tokens, pos, seq, threads, logits.data(), true).ok());
      const ModelWeights& w = (*m)->weights();
      const Residency r = w.residency();
      const auto file = static_cast<int64_t>(w.store.mapped_bytes());
      // Every matrix was read (the LM head is the tied embedding), each a view of the files: a
      // llama GGUF's Q/K rows too, read in llama.cpp's order.
      EXPECT_GE(r.resident_bytes, file * 9 / 10) << model << (copy ? " read" : " mapped");
      EXPECT_LE(r.resident_bytes, file + (4 << 20)) << model;
      EXPECT_EQ(w.qk_gguf_order, model == gguf) << model;
      const std::vector<MemoryRange> files = w.store.ranges();
      auto in_files = [&](const kernels::Matrix& m) {
        const auto* p = static_cast<const uint8_t*>(m.data);
        return std::any_of(files.begin(), files.end(), [&](const MemoryRange& f) {
          const auto* b = static_cast<const uint8_t*>(f.data);
          return p >= b && p + m.bytes() <= b + f.size;
        });
      };
      for (const LayerWeights& L : w.layers) {
        for (const kernels::Matrix* m :
             {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
          EXPECT_TRUE(in_files(*m)) << model;
        }
      }
    }
  }
}

// Writes an 80 MiB file 4 KiB at a time (as a download is), so that the page cache holds it in
// 4 KiB folios; returns whether the filesystem fills 2 MiB folios when the file is read.
bool WriteInSmallFolios(const std::string& path, size_t bytes) {
  std::vector<uint32_t> block(1024);
  const int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  EXPECT_GE(out, 0);
  for (size_t at = 0; at < bytes; at += 4096) {
    for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<uint32_t>(at / 4 + i);
    EXPECT_EQ(::write(out, block.data(), 4096), 4096);
  }
  EXPECT_EQ(::fdatasync(out), 0);  // dirty pages stay in the cache
  const bool fills = PageCacheFillsHugeFolios(out);
  ::close(out);
  return fills;
}

// Maps the file; counts words that are not their index (0 expected) and its MiB in 2 MiB pages.
std::pair<size_t, int64_t> MapAndCount(const std::string& path, size_t bytes) {
  auto f = MappedFile::Open(path);
  if (!f.ok()) return {bytes, 0};
  const auto* words = reinterpret_cast<const uint32_t*>(f->data());
  size_t wrong = 0;
  for (size_t i = 0; i < bytes / 4; ++i) wrong += words[i] != static_cast<uint32_t>(i);
  return {wrong, ResidencyOf({{f->data(), f->size()}}).huge_page_bytes >> 20};
}

// A file the page cache holds in 4 KiB folios maps in 2 MiB pages where the filesystem fills such
// folios: MappedFile::Open drops it from the cache and its faults read it again. The bytes are the
// file's either way. Then again in a process that may not write the file (as root: a child as
// nobody): kernels that restrict mincore show it none of the file's unmapped pages, and the load
// reads its samples instead (Linux 6.18 here shows them).
TEST(ModelLoading, SmallFoliosAreReadAgainIntoHugeOnes) {
  TempDir dir;
  const std::string path = dir.path() + "/weights.bin";
  const size_t bytes = size_t{80} << 20;
  const bool fills = WriteInSmallFolios(path, bytes);
  const auto [wrong, huge_mib] = MapAndCount(path, bytes);
  EXPECT_EQ(wrong, 0u);
  std::printf("[ info     ] page cache fills 2 MiB folios here: %s; %lld of 80 MiB mapped so\n",
              fills ? "yes" : "no", static_cast<long long>(huge_mib));
  if (fills) {
    EXPECT_GE(huge_mib, 40);
  }

  if (::geteuid() != 0) {
    std::printf("[ info     ] not root: no process here may not write the file\n");
    return;
  }
  // Under /tmp (world-searchable), wherever TMPDIR points: nobody must reach the file.
  TempDir shared("/tmp");
  ASSERT_EQ(::chmod(shared.path().c_str(), 0755), 0);
  const std::string theirs = shared.path() + "/weights.bin";
  WriteInSmallFolios(theirs, bytes);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    const auto [w, mib] = MapAndCount(theirs, bytes);
    ::_exit(w != 0 ? 1 : fills && mib < 40 ? 2 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) {  // root without CAP_SETUID (a restricted container)
    std::printf("[ info     ] setuid(nobody) refused: the second half was not run\n");
    return;
  }
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: wrong bytes, 2: under half in 2 MiB pages";
}

TEST(ModelLoading, RopeScalingInvFreq) {
  ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.0f;
  const std::vector<float> plain = c.RopeInvFreq();
  c.rope_scaling.type = RopeScaling::Type::kLinear;
  c.rope_scaling.factor = 4.0f;
  std::vector<float> linear = c.RopeInvFreq();
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_FLOAT_EQ(linear[i], plain[i] / 4.0f);
  // Llama 3.1: factor 8, low 1, high 4, original context 8192. High frequencies (wavelength below
  // 2048) are kept, low ones (above 8192) divided by 8, the band between interpolated.
  c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 8192};
  std::vector<float> l3 = c.RopeInvFreq();
  int kept = 0, divided = 0, smooth = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const float wavelen = 2 * M_PI / plain[i];
    if (wavelen < 2048) {
      EXPECT_FLOAT_EQ(l3[i], plain[i]);
      ++kept;
    } else if (wavelen > 8192) {
      EXPECT_FLOAT_EQ(l3[i], plain[i] / 8);
      ++divided;
    } else {
      EXPECT_LT(l3[i], plain[i]);
      EXPECT_GT(l3[i], plain[i] / 8);
      ++smooth;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smooth, 0);
  EXPECT_NEAR(l3[0], 1.0f, 1e-6);  // the highest frequency is untouched
}

// ---- bad inputs: each names what is wrong and where ----

std::string LoadError(const std::string& dir) {
  auto r = Transformer::Load(dir, 8);
  EXPECT_FALSE(r.ok());
  return r.ok() ? "" : r.status().ToString();
}

TEST(ModelLoadingErrors, UnknownArchitecture) {
  TempDir dir;
  TinyModel m = MakeTinyModel("llama", "F32", 1);
  m.config["model_type"] = "gpt_neox";
  WriteModel(dir, m);
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("gpt_neox"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, MalformedConfig) {
  TempDir dir;
  dir.Write("config.json", "{\"model_type\": \"llama\", \"hidden_size\": \"big\"");
  EXPECT_NE(LoadError(dir.path()).find("config.json"), std::string::npos);
  json config = MakeTinyModel("llama", "F32", 1).config;
  config["hidden_size"] = "big";
  dir.Write("config.json", config.dump());
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;
}

// Values of the right type but no sense are refused by name: they would divide by zero, size
// buffers from garbage or never generate.
TEST(ModelLoadingErrors, ConfigValuesOutOfRange) {
  const json good = MakeTinyModel("llama", "F32", 1).config;
  ASSERT_TRUE(ModelConfig::FromJson(good.dump(), "config.json").ok());
  const std::pair<const char*, json> bad[] = {{"max_position_embeddings", 0},
                                              {"max_position_embeddings", -5},
                                              {"rope_theta", 0},
                                              {"rope_theta", -1.0},
                                              {"hidden_size", 64.5},
                                              {"num_hidden_layers", 0},
                                              {"rms_norm_eps", -1e-6},
                                              {"vocab_size", 1e12},
                                              {"head_dim", 3.5}};
  for (const auto& [key, value] : bad) {
    json config = good;
    config[key] = value;
    auto r = ModelConfig::FromJson(config.dump(), "config.json");
    ASSERT_FALSE(r.ok()) << key << " = " << value.dump();
    EXPECT_NE(r.status().message().find(std::string("config.json: field '") + key + "'"),
              std::string::npos)
        << r.status().message();
  }
  json whole = good;
  whole["max_position_embeddings"] = 4096.0;  // a count written as a float: still a count
  EXPECT_TRUE(ModelConfig::FromJson(whole.dump(), "config.json").ok());
}

// Converting onto one of the model's own files is refused before anything is written (it once
// truncated the shard it was reading: SIGBUS and a destroyed model).
TEST(ModelLoadingErrors, ConvertNeverWritesOverItsInput) {
  TempDir dir;
  WriteModel(dir, MakeTinyModel("llama", "F32", 1));
  const std::string shard = dir.path() + "/model.safetensors";
  const std::string before = testing::ReadFile(shard);
  const Status s = ConvertHfToGguf(dir.path(), shard, DType::kQ8_0, 1, false);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is a file of the model being converted"), std::string::npos)
      << s.message();
  EXPECT_EQ(testing::ReadFile(shard), before);
}

// A config with fewer layers than its checkpoint holds describes other weights.
TEST(ModelLoadingErrors, FewerLayersThanTheWeights) {
  TempDir dir;
  TinyModel m = MakeTinyModel("llama", "F32", 1);
  m.config["num_hidden_layers"] = m.config["num_hidden_layers"].get<int>() - 1;
  WriteModel(dir, m);
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("more layers"), std::string::npos) << e;
  EXPECT_NE(e.find("num_hidden_layers"), std::string::npos) << e;
}

// An unsupported hidden_act is shown cut short: dumping it whole recursed once per nesting level
// (a few MB of "[[[[" crashed the loader).
TEST(ModelLoadingErrors, DeeplyNestedConfigValue) {
  json config = MakeTinyModel("llama", "F32", 1).config;
  config.erase("hidden_act");
  std::string text = config.dump();
  text.pop_back();
  text += ", \"hidden_act\": " + std::string(200000, '[') + std::string(200000, ']') + "}";
  auto r = ModelConfig::FromJson(text, "config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("config.json: unsupported hidden_act [[[[...]]]]"),
            std::string::npos)
      << r.status().message();
}

TEST(ModelLoadingErrors, MissingTensor) {
  TempDir dir;
  TinyModel m = MakeTinyModel("llama", "F32", 1);
  m.tensors.erase(m.tensors.begin() + 5);  // a layer-0 matrix
  const std::string name = MakeTinyModel("llama", "F32", 1).tensors[5].name;
  WriteModel(dir, m);
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find(name), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, MisShapedTensor) {
  TempDir dir;
  TinyModel m = MakeTinyModel("llama", "F32", 1);
  for (auto& t : m.tensors) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") t.shape = {32, 48};  // transposed
  }
  WriteModel(dir, m);
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[32, 48]"), std::string::npos) << e;
  EXPECT_NE(e.find("expected [48, 32]"), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, TruncatedShard) {
  TempDir dir;
  WriteModel(dir, MakeTinyModel("llama", "F32", 1), 3);
  const std::string shard = dir.path() + "/model-00002-of-00003.safetensors";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 100);
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("model-00002-of-00003.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor '"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, HeaderLies) {
  TempDir dir;
  WriteModel(dir, MakeTinyModel("llama", "F32", 1));
  std::string file = ReadFile(dir.path() + "/model.safetensors");
  // Header length beyond the file.
  std::string bad = file;
  uint64_t huge = file.size() + 10;
  std::memcpy(bad.data(), &huge, 8);
  dir.Write("model.safetensors", bad);
  EXPECT_NE(LoadError(dir.path()).find("exceeds the file size"), std::string::npos);
  // Offsets beyond the data section, and offsets that disagree with the shape.
  for (auto [from, to, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"data_offsets\":[0,", "\"data_offsets\":[999999999,", "outside"},
           {"\"shape\":[64,32]", "\"shape\":[64,31]", "do not hold shape"},
           {"\"dtype\":\"F32\"", "\"dtype\":\"I64\"", "unsupported dtype I64"},
           {"\"data_offsets\"", "\"data_offsetz\"", "malformed entry"}}) {
    std::string f = file;
    size_t at = f.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    std::string replaced = f.substr(0, at) + to + f.substr(at + from.size());
    // Keep the header length consistent with the edited header.
    uint64_t hl;
    std::memcpy(&hl, replaced.data(), 8);
    hl += to.size() - from.size();
    std::memcpy(replaced.data(), &hl, 8);
    dir.Write("model.safetensors", replaced);
    const std::string e = LoadError(dir.path());
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  }
  // Not JSON at all.
  std::string garbage = file;
  garbage[9] = '#';
  dir.Write("model.safetensors", garbage);
  EXPECT_NE(LoadError(dir.path()).find("not a JSON object"), std::string::npos);
}

TEST(ModelLoadingErrors, IndexNamesMissingShard) {
  TempDir dir;
  WriteModel(dir, MakeTinyModel("llama", "F32", 1), 2);
  std::filesystem::remove(dir.path() + "/model-00002-of-00002.safetensors");
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("model-00002-of-00002.safetensors"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, NoWeightsAtAll) {
  TempDir dir;
  dir.Write("config.json", MakeTinyModel("llama", "F32", 1).config.dump());
  const std::string e = LoadError(dir.path());
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
}

TEST(ModelLoadingErrors, BadTokenIdChangesNothing) {
  TempDir dir;
  WriteModel(dir, MakeTinyModel("llama", "F32", 1));
  auto model = Transformer::Load(dir.path(), 8);
  ASSERT_TRUE(model.ok());
  const ModelConfig& c = (*model)->config();
  PagePool pool(KvLayout{c.n_layers, c.n_kv_heads, c.head_dim, 4}, 1 << 20);
  PagedSequence seq(pool);
  ThreadPool threads(1);
  std::vector<int32_t> tokens = {1, 2, 64}, pos = {0, 1, 2};
  std::vector<float> logits(c.vocab_size);
  Status s = (*model)->Forward(tokens, pos, seq, threads, logits.data(), false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token id 64 at index 2"), std::string::npos) << s.message();
  EXPECT_EQ(pool.used_pages(), 0);
  EXPECT_EQ(seq.n_tokens(), 0);
}

}  // namespace
}  // namespace cachet
