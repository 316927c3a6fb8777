// Codecs inside the engine: attention on encoded pages equals attention on their decoded rows,
// compressed caches stay close to the f32 cache, really take fewer bytes, and compose with
// prefix reuse, fork and sinks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "codec_check.h"
#include "kernels/kernels.h"
#include "kv/codecs/codec.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

std::unique_ptr<Engine> MakeEngine(const std::string& k, const std::string& v, int sinks = 0,
                                   bool prefix = false, int window = 0) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = k;
  o.kv_codec_v = v;
  o.kv_sinks = sinks;
  o.prefix_cache = prefix;
  o.kv_window = window;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

using testing::MeanKl;

// The first n rows of every (layer, KV head) of a and b hold the same K and V.
void ExpectSameRows(const PagedSequence& a, const PagedSequence& b, int n) {
  const KvLayout& lay = a.layout();
  std::vector<float> ka, va, kb, vb;
  std::vector<int32_t> pa, pb;
  for (int l = 0; l < lay.n_layers; ++l) {
    for (int h = 0; h < lay.n_kv_heads; ++h) {
      a.Gather(l, h, &ka, &va, &pa);
      b.Gather(l, h, &kb, &vb, &pb);
      const size_t m = size_t(n) * lay.head_dim;
      ASSERT_GE(ka.size(), m);
      ASSERT_GE(kb.size(), m);
      EXPECT_TRUE(std::equal(ka.begin(), ka.begin() + m, kb.begin())) << l << " " << h;
      EXPECT_TRUE(std::equal(va.begin(), va.begin() + m, vb.begin())) << l << " " << h;
    }
  }
}

std::vector<int32_t> Prompt() { return testing::LoadGolden().back().ids; }

TEST(CodecEngine, AttentionOnCodesEqualsAttentionOnDecodedRows) {
  // K and V codecs (a rotated role is read in the rotated basis, the sink pages rotated into it),
  // for a decode step (one token: block pages read fused) and a tile of three tokens.
  const std::pair<std::string, std::string> pairs[] = {
      {"int8", "int8"}, {"q4_0", "q4_0"}, {"q8_0", "q4_0"}, {"kivi2", "kivi2"},
      {"rot3", "rot3"}, {"q4_0", "rot3"}, {"rot4", "q8_0"}, {"rot3+qjl", "rot3+qjl"}};
  const auto prompt = Prompt();
  for (const auto& [codec_k, codec_v] : pairs) {
    auto e = MakeEngine(codec_k, codec_v, /*sinks=*/4);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    const PagedSequence& kv = EngineAccess::kv(*s);
    for (const std::vector<int32_t>& qpos : {std::vector<int32_t>{150, 201, 202}, {202}}) {
      SCOPED_TRACE(codec_k + ":" + codec_v + " tokens " + std::to_string(qpos.size()));
      // q4_0 / q8_0 keys are scored with the query quantized to 8 bits (kernels/block_keys.h),
      // which attention over the decoded rows does not do.
      const bool block_keys = codec_k == "q4_0" || codec_k == "q8_0";
      EXPECT_LT(testing::AttendVsDecoded(*e, kv, 3, 1, qpos), block_keys ? 5e-3 : 1e-5);
    }
  }
}

TEST(CodecEngine, CompressedCachesAreCloseAndSmaller) {
  const auto prompt = Prompt();
  std::vector<float> ref;
  auto f32 = MakeEngine("f32", "f32");
  ASSERT_TRUE(f32->NewSession()->Eval(prompt, &ref, true).ok());
  const int64_t f32_bytes = f32->kv_stats().bytes_high_water;
  const int vocab = f32->config().vocab_size;
  struct Case {
    std::string k, v;
    double max_kl;
  };
  // Loose bounds (kvtiny is small and fragile); docs/BENCHMARKS.md has the measured table.
  for (const Case& c : std::vector<Case>{{"f16", "f16", 1e-5},
                                         {"q8_0", "q8_0", 2e-3},
                                         {"int8", "int8", 2e-3},
                                         {"kivi4", "kivi4", 0.1},
                                         {"q4_0", "q4_0", 0.3},
                                         {"int8", "rot3", 0.3},
                                         // rot3/rot3 measures 0.65, rot3+qjl/rot3+qjl 0.39.
                                         {"rot3+qjl", "rot3+qjl", 0.55}}) {
    SCOPED_TRACE(c.k + "/" + c.v);
    auto e = MakeEngine(c.k, c.v);
    auto s = e->NewSession();
    std::vector<float> got;
    ASSERT_TRUE(s->Eval(prompt, &got, true).ok());
    const double kl = MeanKl(ref, got, vocab);
    EXPECT_LT(kl, c.max_kl);
    EXPECT_GT(kl, 0.0);
    const KvStats st = e->kv_stats();
    EXPECT_LT(st.bytes_used, f32_bytes * 0.6) << st.ToString();
  }
}

// --kv-window: a page stays f16 until `window` newer tokens follow it, then it is encoded. The
// recent rows are the f32 rows rounded to f16, memory is the encoded pages plus the window's raw
// ones, the logits get closer to the f32 cache's, and prefix reuse shares only final (encoded)
// pages.
TEST(CodecEngine, RecentWindowStaysFullPrecision) {
  std::vector<int32_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 10 + int32_t(i * 7919 % 400);
  std::vector<float> ref, plain, windowed, warm;
  auto f32 = MakeEngine("f32", "f32");
  auto f32_s = f32->NewSession();
  ASSERT_TRUE(f32_s->Eval(prompt, &ref, true).ok());
  ASSERT_TRUE(MakeEngine("q4_0", "q4_0")->NewSession()->Eval(prompt, &plain, true).ok());
  auto e = MakeEngine("q4_0", "q4_0", 0, /*prefix=*/true, /*window=*/64);
  auto s = e->NewSession();
  ASSERT_TRUE(s->Eval(prompt, &windowed, true).ok());
  const ModelConfig& c = e->config();
  const KvLayout& lay = EngineAccess::kv_pool(*e).layout();
  // (300 - 64) / 16 = 14 pages encoded, 5 raw, per (layer, KV head).
  EXPECT_EQ(
      EngineAccess::kv(*s).bytes_held(),
      size_t(c.n_layers) * c.n_kv_heads * (14 * lay.codec_page_bytes() + 5 * lay.raw_page_bytes()));
  std::vector<float> k, v, fk, fv;
  std::vector<int32_t> pos;
  EngineAccess::kv(*s).Gather(0, 1, &k, &v, &pos);
  EngineAccess::kv(*f32_s).Gather(0, 1, &fk, &fv, &pos);
  const int hd = c.head_dim;
  // Layer 0 rows do not depend on the cache: the window holds exactly the f32 rows in f16.
  const int n_recent = 300 - 14 * 16;
  std::vector<uint8_t> f16(
      codecs::PageBytes(codecs::Codec::kF16, codecs::Role::kKey, n_recent, hd));
  std::vector<float> rounded(size_t(n_recent) * hd);
  codecs::EncodePage(codecs::Codec::kF16, codecs::Role::kKey, fk.data() + 14 * 16 * hd, n_recent,
                     n_recent, hd, f16.data());
  codecs::DecodePage(codecs::Codec::kF16, codecs::Role::kKey, f16.data(), n_recent, n_recent, hd,
                     rounded.data());
  int inexact = 0;
  for (int i = 0; i < n_recent * hd; ++i) {
    ASSERT_EQ(k[14 * 16 * hd + i], rounded[i]) << i;
    inexact += rounded[i] != fk[14 * 16 * hd + i];
  }
  EXPECT_GT(inexact, 0);  // f16, not f32
  int differ = 0;
  for (int i = 0; i < 14 * 16 * hd; ++i) differ += k[i] != fk[i];
  EXPECT_GT(differ, 0);  // the older pages are q4_0
  const double kl_plain = MeanKl(ref, plain, c.vocab_size);
  const double kl_window = MeanKl(ref, windowed, c.vocab_size);
  EXPECT_LT(kl_window, kl_plain);
  // The prompt is one chunk, and its pages are sealed only after it has attended: every token
  // read its neighbours in f16, as an f16 cache gives them.
  std::vector<float> f16_logits;
  ASSERT_TRUE(MakeEngine("f16", "f16")->NewSession()->Eval(prompt, &f16_logits, true).ok());
  EXPECT_EQ(windowed, f16_logits);
  // Sixteen more tokens age one more page into q4_0.
  ASSERT_TRUE(s->Eval(std::vector<int32_t>(16, 42), nullptr).ok());
  EXPECT_EQ(
      EngineAccess::kv(*s).bytes_held(),
      size_t(c.n_layers) * c.n_kv_heads * (15 * lay.codec_page_bytes() + 5 * lay.raw_page_bytes()));
  // Prefix reuse: only the 14 encoded blocks are cached, holding the very rows a cold run holds.
  // The logits move a little: a cold prompt reads its own pages before they are sealed, a warm
  // one reads the cached blocks sealed.
  auto publisher = e->NewSession();
  ASSERT_TRUE(publisher->Eval(prompt, nullptr).ok());
  publisher->Publish();
  auto reuser = e->NewSession();
  ASSERT_TRUE(reuser->Eval(prompt, &warm).ok());
  EXPECT_EQ(e->kv_stats().prefix_hit_tokens, 14 * 16);
  std::vector<float> cold;
  auto cold_engine = MakeEngine("q4_0", "q4_0", 0, /*prefix=*/false, /*window=*/64);
  auto cold_s = cold_engine->NewSession();
  ASSERT_TRUE(cold_s->Eval(prompt, &cold).ok());
  ExpectSameRows(EngineAccess::kv(*reuser), EngineAccess::kv(*cold_s), 14 * 16);
  EXPECT_LT(MeanKl(cold, warm, c.vocab_size), kl_plain);
}

TEST(CodecEngine, PrefixReuseForkAndSinksCompose) {
  const auto prompt = Prompt();
  for (std::string codec : {"q8_0", "kivi4"}) {
    SCOPED_TRACE(codec);
    std::vector<float> cold, warm;
    auto e = MakeEngine(codec, codec, 16, /*prefix=*/true);
    {
      auto s = e->NewSession();
      ASSERT_TRUE(s->Eval(prompt, nullptr).ok());
      s->Publish();
    }
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(prompt, &warm).ok());
    EXPECT_EQ(e->kv_stats().prefix_hits, 1);
    // The cached pages hold the very codes a cold run writes, and the warm run reads them as a
    // cold one that stops at the cached blocks reads its pages, sealed (KIVI keys).
    const int hit = static_cast<int>(e->kv_stats().prefix_hit_tokens);
    auto cold_e = MakeEngine(codec, codec, 16);
    auto cold_s = cold_e->NewSession();
    ASSERT_TRUE(cold_s->Eval(std::span(prompt).first(hit), nullptr).ok());
    ASSERT_TRUE(cold_s->Eval(std::span(prompt).subspan(hit), &cold).ok());
    EXPECT_EQ(warm, cold);
    // Fork at a partial page; both sides diverge without touching each other.
    auto child = s->Fork();
    std::vector<float> a, b;
    ASSERT_TRUE(child->Eval(std::vector<int32_t>{5}, &a).ok());
    ASSERT_TRUE(s->Eval(std::vector<int32_t>{6}, &b).ok());
    EXPECT_NE(a, b);
    // Sinks: the first page of every (layer, head) stays raw f32.
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    EngineAccess::kv(*s).Gather(0, 0, &k, &v, &pos);
    EXPECT_EQ(pos[0], 0);
  }
}

TEST(CodecEngine, RoundTripOnRealKeysAndValues) {
  // kvtiny's own K and V (every layer and head of a 1000-token prompt), page by page. Keys carry
  // outlier channels, which per-token codecs pay for and KIVI's per-channel keys do not.
  auto e = MakeEngine("f32", "f32");
  auto s = e->NewSession();
  ASSERT_TRUE(s->Eval(Prompt(), nullptr).ok());
  const int hd = e->config().head_dim, pt = 16;
  struct Bound {
    codecs::Codec c;
    double key, value;
  };
  const Bound bounds[] = {
      {codecs::Codec::kF16, 1e-3, 1e-3},     {codecs::Codec::kBF16, 5e-3, 5e-3},
      {codecs::Codec::kInt8, 2e-2, 2e-2},    {codecs::Codec::kQ8_0, 2e-2, 2e-2},
      {codecs::Codec::kQ4_0, 0.2, 0.2},      {codecs::Codec::kKivi4, 0.1, 0.15},
      {codecs::Codec::kKivi2, 0.5, 0.6},     {codecs::Codec::kRot4, 0.15, 0.15},
      {codecs::Codec::kRot3, 0.25, 0.25},    {codecs::Codec::kRot2, 0.45, 0.45},
      {codecs::Codec::kRot3Qjl, 0.16, 0.16}, {codecs::Codec::kRot2Qjl, 0.3, 0.3}};
  for (const Bound& b : bounds) {
    SCOPED_TRACE(codecs::CodecName(b.c));
    for (codecs::Role role : {codecs::Role::kKey, codecs::Role::kValue}) {
      double num = 0, den = 0;
      for (int l = 0; l < e->config().n_layers; ++l) {
        for (int h = 0; h < e->config().n_kv_heads; ++h) {
          std::vector<float> k, v;
          std::vector<int32_t> pos;
          EngineAccess::kv(*s).Gather(l, h, &k, &v, &pos);
          const std::vector<float>& x = role == codecs::Role::kKey ? k : v;
          std::vector<uint8_t> page(codecs::PageBytes(b.c, role, pt, hd));
          std::vector<float> y(size_t(pt) * hd);
          for (size_t p = 0; p + size_t(pt) * hd <= x.size(); p += size_t(pt) * hd) {
            codecs::EncodePage(b.c, role, x.data() + p, pt, pt, hd, page.data());
            codecs::DecodePage(b.c, role, page.data(), pt, pt, hd, y.data());
            for (size_t i = 0; i < y.size(); ++i) {
              num += (y[i] - x[p + i]) * double(y[i] - x[p + i]);
              den += double(x[p + i]) * x[p + i];
            }
          }
        }
      }
      const double err = std::sqrt(num / den);
      EXPECT_LT(err, role == codecs::Role::kKey ? b.key : b.value)
          << (role == codecs::Role::kKey ? "keys" : "values");
      EXPECT_GT(err, 0.0);
    }
  }
}

// The default pool (kv_mem_mib 0) holds one full context in every layout, including those with
// f32 rows on one side, whose codec pages outweigh the f16 raw pages it was sized by.
TEST(CodecEngine, DefaultPoolHoldsAFullContext) {
  for (auto [k, v, window] : {std::tuple{"f16", "f32", 0},
                              {"q4_0", "f32", 0},
                              {"f32", "q4_0", 0},
                              {"f16", "f16", 0},
                              {"kivi4", "f32", 0},
                              {"f32", "q8_0", 16}}) {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    o.n_ctx = 256;
    o.kv_codec_k = k;
    o.kv_codec_v = v;
    o.kv_window = window;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    auto s = (*e)->NewSession();
    std::vector<int32_t> ids = Prompt();
    ids.resize(255);
    const Status st = s->Eval(ids, nullptr);
    EXPECT_TRUE(st.ok()) << k << ":" << v << " " << st.ToString();
  }
  // A pool larger than the machine's memory is refused (its bookkeeping alone grew to GiBs).
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_mem_mib = int64_t{1} << 40;
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("more than this machine's memory"), std::string::npos)
      << e.status().ToString();
}

// Positions take 16 bits where the context fits them (kvtiny's 4096 tokens) and 32 where it does
// not: the same logits either way, two bytes less per token and table, and a cache saved by one
// engine continues in the other (files keep 32-bit positions).
TEST(CodecEngine, PositionsIn16BitsWhereTheContextFits) {
  auto make = [](int n_ctx) {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    o.n_ctx = n_ctx;
    o.kv_codec_k = o.kv_codec_v = "q4_0";
    o.kv_window = 16;  // staged pages: positions copied when a page is sealed
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  };
  auto narrow = make(0), wide = make(70000);
  const auto prompt = Prompt();
  const int n = 203;
  std::vector<float> ln, lw;
  auto sn = narrow->NewSession(), sw = wide->NewSession();
  ASSERT_TRUE(sn->Eval(std::span(prompt).first(n), &ln).ok());
  ASSERT_TRUE(sw->Eval(std::span(prompt).first(n), &lw).ok());
  EXPECT_EQ(ln, lw);
  const KvLayout& lay = EngineAccess::kv(*sn).layout();
  EXPECT_TRUE(lay.short_positions());
  EXPECT_FALSE(EngineAccess::kv(*sw).layout().short_positions());
  const int pages = EngineAccess::kv(*sn).pages_held();
  EXPECT_EQ(pages, EngineAccess::kv(*sw).pages_held());
  EXPECT_EQ(sw->kv_bytes() - sn->kv_bytes(), size_t(pages) * lay.page_tokens * 2);
  for (int i = n; i < n + 20; ++i) {
    ASSERT_TRUE(sn->Eval(std::span(prompt).subspan(i, 1), &ln).ok());
    ASSERT_TRUE(sw->Eval(std::span(prompt).subspan(i, 1), &lw).ok());
    ASSERT_EQ(ln, lw) << "token " << i;
  }
  // Saved by the narrow engine, continued by the wide one, and back.
  testing::TempDir dir;
  for (auto [from, to] : {std::pair{sn.get(), wide.get()}, {sw.get(), narrow.get()}}) {
    const std::string path = dir.path() + "/c.kv";
    ASSERT_TRUE(from->Save(path).ok());
    auto loaded = to->LoadSession(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    std::vector<float> a, b;
    ASSERT_TRUE(from->Eval(std::span(prompt).subspan(n + 20, 1), &a).ok());
    ASSERT_TRUE((*loaded)->Eval(std::span(prompt).subspan(n + 20, 1), &b).ok());
    EXPECT_EQ(a, b);
  }
}

TEST(CodecEngine, BadCodecOptionsAreClearErrors) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_codec_k = "int3";
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("unknown KV codec 'int3'"), std::string::npos);
}

}  // namespace
}  // namespace cachet
