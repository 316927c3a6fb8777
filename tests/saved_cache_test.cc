// Saved caches (Session::Save, Engine::LoadSession, kv/sequence_file.h): a context compressed once
// (any press, codec, window, demotion) and saved continues in another engine exactly as the saving
// session would have, bit for bit; a file of another model or layout, a damaged file and a pool
// without room are clear errors that allocate nothing.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "cachet/engine.h"
#include "cachet/press.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

struct Layout {
  std::string k = "f32", v = "f32";
  int window = 0, sinks = 0;
  int64_t kv_mem_mib = 0;
  std::string cold = "";  // precision by age: kv_cold, kv_cold_after
  int cold_after = 48;
};

std::unique_ptr<Engine> MakeEngine(const Layout& l) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = l.k;
  o.kv_codec_v = l.v;
  o.kv_window = l.window;
  o.kv_sinks = l.sinks;
  o.kv_mem_mib = l.kv_mem_mib;
  o.kv_cold = l.cold;
  o.kv_cold_after = l.cold_after;
  o.prefix_cache = false;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

const std::vector<int32_t>& Ids() {  // ~1000 tokens of text
  static const std::vector<int32_t> ids = testing::LoadGolden().back().ids;
  return ids;
}
std::vector<int32_t> Slice(size_t from, size_t n) {
  return {Ids().begin() + from, Ids().begin() + from + n};
}

// Logits of a question, then of four greedy decode steps after it.
std::vector<std::vector<float>> Continue(Session& s, const std::vector<int32_t>& question) {
  std::vector<std::vector<float>> out(1);
  EXPECT_TRUE(s.Eval(question, &out[0]).ok());
  for (int i = 0; i < 4; ++i) {
    const int32_t next = static_cast<int32_t>(
        std::max_element(out.back().begin(), out.back().end()) - out.back().begin());
    out.emplace_back();
    EXPECT_TRUE(s.Eval(std::span(&next, 1), &out.back()).ok());
  }
  return out;
}

struct Case {
  const char* name;
  Layout layout;
  const char* press;  // "" for none
};

// Saved, loaded into a second engine of the same options: the question and the decode steps
// after it give the same bits as in the session that saved, which held the same pages.
TEST(SavedCache, LoadedSessionContinuesBitForBit) {
  testing::TempDir dir;
  const auto context = Slice(0, 300), question = Slice(600, 12);
  const Case cases[] = {
      {"f32, no press", {}, ""},
      {"q4_0 + snapkv", {"q4_0", "q4_0"}, "snapkv"},
      {"kivi4 keys, window 32, sinks 4 + expected", {"kivi4", "q4_0", 32, 4}, "expected"},
      {"f16 + knorm demoted to q4_0", {"f16", "f16"}, "knorm+demote:q4_0"},
      {"f16 + quest", {"f16", "f16"}, "quest"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto saver = MakeEngine(c.layout), loader = MakeEngine(c.layout);
    auto s = saver->NewSession();
    std::string compression = "none";
    if (*c.press) {
      press::PressOptions o;
      ASSERT_TRUE(press::ParsePressSpec(c.press, &o).ok());
      o.ratio = 0.5;
      if (o.quest) o.quest_pages = 4;
      ASSERT_TRUE(s->EvalPressed(context, o, nullptr).ok());
      compression = press::PressSpec(o);
    } else {
      ASSERT_TRUE(s->Eval(context, nullptr).ok());
    }
    const std::string path = dir.path() + "/ctx.ckv";
    ASSERT_TRUE(s->Save(path, compression).ok());
    auto info = ReadSavedCacheInfo(path);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->n_tokens, 300);
    EXPECT_EQ(info->codec_k, c.layout.k);
    EXPECT_EQ(info->window, c.layout.window);
    EXPECT_EQ(info->compression, compression);
    const int64_t full_rows = int64_t{300} * saver->config().n_layers * saver->config().n_kv_heads;
    if (std::string(c.press) == "snapkv" || std::string(c.press) == "expected") {
      EXPECT_LT(info->held_rows, full_rows * 6 / 10);  // half evicted
    } else {
      EXPECT_EQ(info->held_rows, full_rows);  // quest evicts nothing; demoted rows stay (cold)
    }
    EXPECT_EQ(info->cold_codec,
              std::string(c.press).find("demote") != std::string::npos ? "q4_0" : "");
    auto loaded = loader->LoadSession(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ((*loaded)->n_tokens(), s->n_tokens());
    EXPECT_EQ((*loaded)->tokens(), s->tokens());
    EXPECT_EQ((*loaded)->kv_bytes(), s->kv_bytes());
    const auto want = Continue(*s, question), got = Continue(**loaded, question);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].size(), want[i].size());
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)), 0)
          << "step " << i;
    }
    // Loaded again, for a different question: the same file serves any number of them.
    auto again = loader->LoadSession(path);
    ASSERT_TRUE(again.ok());
    std::vector<float> other;
    EXPECT_TRUE((*again)->Eval(Slice(700, 9), &other).ok());
  }
}

// A cache whose old pages went cold (--kv-cold K:V) is saved with its cold codecs and age, and a
// loading engine ages it on as the saving one did, with or without --kv-cold of its own; one
// whose --kv-cold or --kv-cold-after differs is refused by name.
TEST(SavedCache, AgedCacheAgesOnWhenLoaded) {
  testing::TempDir dir;
  const Layout aged{"q8_0", "q8_0", 0, 0, 0, "q8_0:q4_0", 48};
  auto saver = MakeEngine(aged);
  auto s = saver->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 200), nullptr).ok());
  ASSERT_TRUE(s->Eval(Slice(200, 100), nullptr).ok());  // pages 48+ tokens old move
  ASSERT_GT(EngineAccess::kv(*s).cold_length(0, 0), 100);
  const std::string path = dir.path() + "/aged.ckv";
  ASSERT_TRUE(s->Save(path, "none").ok());
  auto info = ReadSavedCacheInfo(path);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->cold_codec, "q8_0:q4_0");
  EXPECT_EQ(info->cold_after, 48);
  const auto want = Continue(*s, Slice(600, 40));
  Layout plain = aged;
  plain.cold = "";
  for (const Layout& l : {plain, aged}) {
    auto engine = MakeEngine(l);  // outlives its sessions
    auto loaded = engine->LoadSession(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ(EngineAccess::kv(**loaded).age_out(), 48);
    const auto got = Continue(**loaded, Slice(600, 40));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)), 0)
          << "step " << i;
    }
  }
  Layout other_codec = aged, other_age = aged;
  other_codec.cold = "q4_0";
  other_age.cold_after = 64;
  auto r = MakeEngine(other_codec)->LoadSession(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("coded q8_0:q4_0, not --kv-cold q4_0"), std::string::npos)
      << r.status().message();
  r = MakeEngine(other_age)->LoadSession(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not --kv-cold-after 64"), std::string::npos)
      << r.status().message();
}

// Pages old enough to go cold are saved cold, as the next step would have moved them: the file
// holds them in the cold codec, and both sessions continue as one that never saved.
TEST(SavedCache, SavingMovesThePagesDueToGoCold) {
  testing::TempDir dir;
  const Layout aged{"q8_0", "q8_0", 0, 0, 0, "q4_0", 48};
  auto engine = MakeEngine(aged);
  auto saver = engine->NewSession(), unsaved = engine->NewSession();
  for (auto* s : {saver.get(), unsaved.get()}) ASSERT_TRUE(s->Eval(Slice(0, 200), nullptr).ok());
  ASSERT_EQ(EngineAccess::kv(*saver).cold_length(0, 0), 0);  // a step ages, not a prompt's end
  const std::string path = dir.path() + "/aged.ckv";
  ASSERT_TRUE(saver->Save(path, "none").ok());
  // 16-token pages whose last position is below 200 - 48: the first 9.
  EXPECT_EQ(EngineAccess::kv(*saver).cold_length(0, 0), 144);
  auto loaded = engine->LoadSession(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(EngineAccess::kv(**loaded).cold_length(0, 0), 144);
  const auto want = Continue(*unsaved, Slice(600, 40));
  for (Session* s : {saver.get(), loaded->get()}) {
    const auto got = Continue(*s, Slice(600, 40));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)), 0)
          << "step " << i;
    }
  }
}

// An output is written beside its path and renamed over it: through a symbolic link the file it
// names is replaced (the link stays); a directory, a pipe or a device is refused, not replaced
// (as root, `-o /dev/full` had turned the device into a regular file).
TEST(SavedCache, OnlyRegularFilesAreReplaced) {
  testing::TempDir dir;
  auto engine = MakeEngine(Layout{});
  auto s = engine->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 20), nullptr).ok());
  const std::string file = dir.path() + "/real.ckv", link = dir.path() + "/link.ckv";
  { std::ofstream(file) << "old"; }
  std::filesystem::create_symlink(file, link);
  ASSERT_TRUE(s->Save(link, "none").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_TRUE(ReadSavedCacheInfo(file).ok());
  const std::string fifo = dir.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& bad : {fifo, dir.path()}) {
    const Status st = s->Save(bad, "none");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  }
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  std::filesystem::create_symlink(fifo, dir.path() + "/to_fifo");
  EXPECT_FALSE(s->Save(dir.path() + "/to_fifo", "none").ok());
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
}

// Generate continues from the saved logits when no new tokens are given.
TEST(SavedCache, GenerateFromTheSavedLogits) {
  testing::TempDir dir;
  auto a = MakeEngine({}), b = MakeEngine({});
  auto s = a->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 100), nullptr).ok());
  ASSERT_TRUE(s->Save(dir.path() + "/x.ckv").ok());
  GenerateOptions g;
  g.max_tokens = 8;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  auto want = s->Generate({}, g);
  auto loaded = b->LoadSession(dir.path() + "/x.ckv");
  ASSERT_TRUE(loaded.ok());
  auto got = (*loaded)->Generate({}, g);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(got->tokens, want->tokens);
}

// Another layout or model: FailedPrecondition naming the difference; nothing allocated.
TEST(SavedCache, AnotherLayoutIsRefusedByName) {
  testing::TempDir dir;
  auto q4 = MakeEngine({"q4_0", "q4_0"});
  auto s = q4->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 64), nullptr).ok());
  const std::string path = dir.path() + "/q4.ckv";
  ASSERT_TRUE(s->Save(path).ok());
  auto f32 = MakeEngine({});
  const int used = f32->kv_stats().pages_used;
  auto r = f32->LoadSession(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("q4_0/q4_0 (this engine: f32/f32)"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(path), std::string::npos);
  EXPECT_EQ(f32->kv_stats().pages_used, used);
  auto windowed = MakeEngine({"q4_0", "q4_0", 16});
  r = windowed->LoadSession(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--kv-window 0 (this engine: 16)"), std::string::npos)
      << r.status().message();
}

// Damaged files: every single-byte flip and every truncation is DataLoss before a page is taken.
TEST(SavedCache, DamageIsDetectedBeforeAnythingIsAllocated) {
  testing::TempDir dir;
  auto e = MakeEngine({"q8_0", "q4_0"});
  auto s = e->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 40), nullptr).ok());
  const std::string path = dir.path() + "/c.ckv", bad = dir.path() + "/bad.ckv";
  ASSERT_TRUE(s->Save(path).ok());
  const std::string bytes = testing::ReadFile(path);
  ASSERT_GT(bytes.size(), 1000u);
  const int used = e->kv_stats().pages_used;
  auto write = [&](const std::string& b) {
    std::ofstream(bad, std::ios::binary | std::ios::trunc).write(b.data(), b.size());
  };
  for (size_t at : {size_t{0}, size_t{5}, size_t{40}, bytes.size() / 2, bytes.size() - 1}) {
    std::string b = bytes;
    b[at] ^= 0x10;
    write(b);
    auto r = e->LoadSession(bad);
    ASSERT_FALSE(r.ok()) << "flip at " << at;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    EXPECT_EQ(e->kv_stats().pages_used, used);
  }
  for (size_t n : {size_t{0}, size_t{3}, size_t{100}, bytes.size() - 8, bytes.size() - 1}) {
    write(bytes.substr(0, n));
    auto r = e->LoadSession(bad);
    ASSERT_FALSE(r.ok()) << "truncated to " << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    EXPECT_EQ(e->kv_stats().pages_used, used);
  }
  auto missing = e->LoadSession(dir.path() + "/none.ckv");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(ReadSavedCacheInfo(bad).ok());
}

// Damage a checksum cannot see (the checksum recomputed after the change, as a forger would): the
// parser's own bounds hold. Every header byte and a sample of the rest, changed: a refusal, or a
// session that works (page bytes are not checked beyond their sizes; positions must lie in the
// sequence).
TEST(SavedCache, ForgedFilesAreRefusedOrHarmless) {
  testing::TempDir dir;
  auto e = MakeEngine({"q8_0", "q4_0"});
  auto s = e->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 20), nullptr).ok());
  const std::string path = dir.path() + "/c.ckv", bad = dir.path() + "/forged.ckv";
  ASSERT_TRUE(s->Save(path).ok());
  const std::string bytes = testing::ReadFile(path);
  std::mt19937 rng(5);
  std::vector<size_t> at;
  for (size_t i = 0; i < 400 && i + 8 < bytes.size(); ++i) at.push_back(i);
  for (int i = 0; i < 200; ++i) at.push_back(rng() % (bytes.size() - 8));
  int refused = 0, loaded = 0;
  for (size_t a : at) {
    for (uint8_t x : {uint8_t{0x01}, uint8_t{0xff}}) {
      std::string b = bytes;
      b[a] = static_cast<char>(b[a] ^ x);
      const uint64_t sum = XXH3_64bits(b.data(), b.size() - 8);
      std::memcpy(b.data() + b.size() - 8, &sum, 8);
      std::ofstream(bad, std::ios::binary | std::ios::trunc).write(b.data(), b.size());
      auto r = e->LoadSession(bad);
      if (!r.ok()) {
        ++refused;
        continue;
      }
      if (++loaded % 8 != 1) continue;  // one in eight decodes a token on what it loaded
      const int32_t one[1] = {5};
      std::vector<float> logits;
      EXPECT_TRUE((*r)->Eval(one, &logits).ok()) << "byte " << a;
    }
  }
  EXPECT_GT(refused, 200);  // the header's counts, sizes, kinds and namespace are checked
  EXPECT_GT(loaded, 100);   // page bytes are data
  s.reset();
  EXPECT_EQ(e->kv_stats().pages_used, 0);  // nothing leaked by the refusals or the sessions
}

// A forged position outside the sequence is refused by name (16-bit pools could not hold it, and
// a codec that turns keys by their positions would read past its tables).
TEST(SavedCache, PositionsOutsideTheSequenceAreRefused) {
  testing::TempDir dir;
  auto e = MakeEngine({"q8_0", "q4_0"});
  auto s = e->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 20), nullptr).ok());
  const std::string path = dir.path() + "/c.ckv";
  ASSERT_TRUE(s->Save(path).ok());
  std::string bytes = testing::ReadFile(path);
  std::vector<int32_t> first(16);
  for (int i = 0; i < 16; ++i) first[i] = i;
  const size_t at = bytes.find(std::string_view(reinterpret_cast<const char*>(first.data()), 64));
  ASSERT_NE(at, std::string::npos);  // the first page's positions, as saved
  const int32_t forged = 70000;
  std::memcpy(bytes.data() + at + 3 * 4, &forged, 4);
  const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  const std::string bad = dir.path() + "/forged.ckv";
  std::ofstream(bad, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  auto r = e->LoadSession(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("row 3 of page 0 of table 0 is at position 70000, outside "
                                      "the sequence's 20 tokens"),
            std::string::npos)
      << r.status().message();
}

// A pool too small for the file's pages: ResourceExhausted, the pool as it was.
TEST(SavedCache, NoRoomIsResourceExhausted) {
  testing::TempDir dir;
  auto big = MakeEngine({});
  auto s = big->NewSession();
  ASSERT_TRUE(s->Eval(Slice(0, 400), nullptr).ok());
  ASSERT_TRUE(s->Save(dir.path() + "/big.ckv").ok());
  Layout small;
  small.kv_mem_mib = 1;
  auto e = MakeEngine(small);
  auto r = e->LoadSession(dir.path() + "/big.ckv");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_EQ(e->kv_stats().pages_used, 0);
  // A context longer than the engine's: said so (it was "KV pool exhausted").
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.n_ctx = 128;
  auto short_ctx = Engine::Create(o);
  ASSERT_TRUE(short_ctx.ok());
  r = (*short_ctx)->LoadSession(dir.path() + "/big.ckv");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange) << r.status().ToString();
  EXPECT_NE(r.status().message().find("holds 400 tokens, more than the context of 128"),
            std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace cachet
