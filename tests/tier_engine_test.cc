// The prefix cache's disk tier through the engine (EngineOptions::disk_cache_dir) on kvtiny: a
// new engine (a restarted process) answers a repeated prompt from disk with the logits a cold
// prefill gives, bit for bit; damaged files, another KV layout and another tenant's salt are
// misses that change no output.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cachet/engine.h"
#include "test_util.h"

namespace cachet {
namespace {

namespace fs = std::filesystem;

EngineOptions Options(const std::string& dir, const char* codec = "f32") {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.n_ctx = 1024;
  o.kv_codec_k = o.kv_codec_v = codec;
  o.disk_cache_dir = dir;
  return o;
}

// About n tokens of text, BOS first.
std::vector<int32_t> Prompt(const Engine& e, int n, const char* seed = "Lily") {
  std::string text;
  std::vector<int32_t> ids;
  for (int i = 0; static_cast<int>(ids.size()) < n; ++i) {
    text += std::string(seed) + " went to the park on day " + std::to_string(i) +
            " and saw a big red ball under the old tree. ";
    ids = e.tokenizer().EncodePrompt(text);
  }
  ids.resize(n);
  return ids;
}

struct Outcome {
  std::vector<float> logits;
  KvStats kv;
};

Outcome Eval(const EngineOptions& o, const std::vector<int32_t>& prompt,
             std::string_view salt = {}) {
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  Outcome r;
  auto s = (*e)->NewSession(salt);
  EXPECT_TRUE(s->Eval(prompt, &r.logits).ok());
  r.kv = (*e)->kv_stats();
  return r;
}

std::vector<int32_t> PromptOf(int n, const char* seed = "Lily") {
  auto e = Engine::Create(Options(""));
  EXPECT_TRUE(e.ok());
  return Prompt(**e, n, seed);
}

int64_t Served(const KvStats& kv) { return kv.tiers.empty() ? 0 : kv.tiers[0].loaded_tokens; }

std::vector<fs::path> RunFiles(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& f : fs::recursive_directory_iterator(dir)) {
    if (f.is_regular_file()) out.push_back(f.path());
  }
  return out;
}

// 600 tokens: two full runs of 256 and a tail. A second engine (as a restarted process) gets
// every whole block from disk and the cold prefill's logits exactly; f32 and q4_0 pages alike.
TEST(TierEngine, RestartedEngineServesThePromptFromDisk) {
  for (const char* codec : {"f32", "q4_0"}) {
    SCOPED_TRACE(codec);
    testing::TempDir dir;
    const EngineOptions o = Options(dir.path(), codec);
    EngineOptions cold_options = o;
    cold_options.disk_cache_dir.clear();
    const auto prompt = PromptOf(600);
    const Outcome cold = Eval(cold_options, prompt);
    const Outcome first = Eval(o, prompt);
    EXPECT_EQ(first.logits, cold.logits);
    ASSERT_EQ(first.kv.tiers.size(), 1u);
    EXPECT_EQ(first.kv.tiers[0].entries, 3);  // 256 + 256 + the 5 whole blocks after them
    EXPECT_EQ(Served(first.kv), 0);
    const Outcome again = Eval(o, prompt);
    EXPECT_EQ(again.logits, cold.logits);
    EXPECT_EQ(again.kv.prefix_hit_tokens, 592);  // 37 blocks: all but the last partial one
    EXPECT_EQ(Served(again.kv), 592);
    EXPECT_EQ(again.kv.tiers[0].hits, 3);
    EXPECT_EQ(again.kv.tiers[0].bytes_written, 0);
  }
}

// A prompt sharing the first 300 tokens: the first full run (256 tokens) comes from disk, the
// rest is computed; the logits are a cold prefill's.
TEST(TierEngine, SharedPrefixReusesWholeRuns) {
  testing::TempDir dir;
  const EngineOptions o = Options(dir.path());
  EngineOptions cold_options = o;
  cold_options.disk_cache_dir.clear();
  auto prompt = PromptOf(600);
  Eval(o, prompt);
  const auto other = PromptOf(400, "Tom");
  std::copy(other.begin() + 300, other.end(), prompt.begin() + 300);
  prompt.resize(400);
  const Outcome cold = Eval(cold_options, prompt);
  const Outcome hit = Eval(o, prompt);
  EXPECT_EQ(Served(hit.kv), 256);
  EXPECT_EQ(hit.logits, cold.logits);
}

// Damage under the cache: a flipped byte and a truncated file are counted misses (deleted), never
// served; another KV layout's runs and another tenant's are not served either.
TEST(TierEngine, DamageOtherLayoutsAndSaltsAreMisses) {
  testing::TempDir dir;
  const EngineOptions o = Options(dir.path());
  EngineOptions cold_options = o;
  cold_options.disk_cache_dir.clear();
  const auto prompt = PromptOf(300);  // a full run and a tail run
  const Outcome cold = Eval(cold_options, prompt);
  Eval(o, prompt);
  auto files = RunFiles(dir.path());
  ASSERT_EQ(files.size(), 2u);
  for (const fs::path& f : files) {  // flip a byte in the middle of each
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(fs::file_size(f) / 2));
    char c = 0;
    io.read(&c, 1);
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) / 2));
    c = static_cast<char>(c ^ 0x10);
    io.write(&c, 1);
  }
  const Outcome damaged = Eval(o, prompt);
  EXPECT_EQ(damaged.logits, cold.logits);
  EXPECT_EQ(Served(damaged.kv), 0);
  EXPECT_GE(damaged.kv.tiers[0].corrupt, 1);
  // The damaged runs were dropped and the prompt stored again: served whole next time.
  const Outcome healed = Eval(o, prompt);
  EXPECT_EQ(Served(healed.kv), 288);
  EXPECT_EQ(healed.logits, cold.logits);
  // Truncated: a miss.
  for (const fs::path& f : RunFiles(dir.path())) fs::resize_file(f, fs::file_size(f) - 7);
  const Outcome cut = Eval(o, prompt);
  EXPECT_EQ(Served(cut.kv), 0);
  EXPECT_EQ(cut.logits, cold.logits);

  // q8_0 pages are another namespace: the f32 runs are not served to it.
  const Outcome other_layout = Eval(Options(dir.path(), "q8_0"), prompt);
  EXPECT_EQ(Served(other_layout.kv), 0);
  // Another tenant's salt: its own chain of keys, nothing served.
  const Outcome salted = Eval(o, prompt, "tenant-b");
  EXPECT_EQ(Served(salted.kv), 0);
  EXPECT_EQ(salted.logits, cold.logits);
}

// --tier-zstd: runs are stored compressed (f32 pages of text shrink), any engine reads them back
// bit for bit, and a reader without the flag inflates them too.
TEST(TierEngine, ZstdRunsAreSmallerAndReadBackExactly) {
  testing::TempDir plain_dir, zstd_dir;
  EngineOptions plain = Options(plain_dir.path()), packed = Options(zstd_dir.path());
  packed.tier_zstd = true;
  EngineOptions cold_options = plain;
  cold_options.disk_cache_dir.clear();
  const auto prompt = PromptOf(600);
  const Outcome cold = Eval(cold_options, prompt);
  const Outcome a = Eval(plain, prompt), b = Eval(packed, prompt);
  EXPECT_EQ(b.logits, cold.logits);
  ASSERT_EQ(a.kv.tiers.size(), 1u);
  ASSERT_EQ(b.kv.tiers.size(), 1u);
  EXPECT_LT(b.kv.tiers[0].bytes_written, a.kv.tiers[0].bytes_written * 95 / 100)
      << a.kv.tiers[0].bytes_written;
  EngineOptions reader = packed;
  reader.tier_zstd = false;  // what was stored decides, not the reader's flag
  const Outcome again = Eval(reader, prompt);
  EXPECT_EQ(again.logits, cold.logits);
  EXPECT_EQ(Served(again.kv), 592);
  EXPECT_EQ(again.kv.tiers[0].corrupt, 0);
}

TEST(TierEngine, BadOptionsAreClearErrors) {
  testing::TempDir dir;
  EngineOptions o = Options(dir.path());
  o.prefix_cache = false;
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--disk-cache"), std::string::npos) << e.status().message();
  o = Options(dir.Write("a-file", "x"));
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("a-file"), std::string::npos) << e.status().message();
}

}  // namespace
}  // namespace cachet
