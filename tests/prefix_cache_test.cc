// The prefix cache end to end: reused prefixes give the logits a cold prefill gives, tenants
// with different salts never share, the pool evicts cached pages when it needs room, and a
// failed prefill leaves the cache exactly as it was.
#include <gtest/gtest.h>

#include <cmath>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "test_util.h"

namespace cachet {
namespace {

std::unique_ptr<Engine> MakeEngine(bool prefix_cache, int64_t kv_mem_mib = 0) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.prefix_cache = prefix_cache;
  o.kv_mem_mib = kv_mem_mib;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Prompt() { return testing::LoadGolden().back().ids; }  // ~1000 tokens

using testing::RelErr;

TEST(PrefixCache, ReusedPrefixGivesColdLogits) {
  const auto prompt = Prompt();
  std::vector<float> cold;
  ASSERT_TRUE(MakeEngine(false)->NewSession()->Eval(prompt, &cold).ok());

  auto engine = MakeEngine(true);
  {
    auto first = engine->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(first->Eval(prompt, &logits).ok());
    EXPECT_EQ(logits, cold);
    first->Publish();
  }
  // The same prompt, and one that shares only its first half, both reuse whole pages.
  auto again = engine->NewSession();
  std::vector<float> warm;
  ASSERT_TRUE(again->Eval(prompt, &warm).ok());
  KvStats s = engine->kv_stats();
  EXPECT_EQ(s.prefix_hits, 1);
  EXPECT_EQ(s.prefix_hit_tokens, (prompt.size() - 1) / 16 * 16);
  EXPECT_LT(RelErr(warm, cold), 1e-5);
  EXPECT_EQ(warm, cold) << "not bitwise equal on the same thread count";

  std::vector<int32_t> half(prompt.begin(), prompt.begin() + prompt.size() / 2);
  half.push_back(7);
  half.push_back(8);
  std::vector<float> half_cold, half_warm;
  ASSERT_TRUE(MakeEngine(false)->NewSession()->Eval(half, &half_cold).ok());
  ASSERT_TRUE(engine->NewSession()->Eval(half, &half_warm).ok());
  EXPECT_EQ(engine->kv_stats().prefix_hit_tokens - s.prefix_hit_tokens,
            static_cast<int64_t>(prompt.size() / 2 / 16 * 16));
  EXPECT_LT(RelErr(half_warm, half_cold), 1e-5);
}

TEST(PrefixCache, SaltsIsolateTenants) {
  auto engine = MakeEngine(true);
  const auto prompt = Prompt();
  {
    auto a = engine->NewSession("tenant-a");
    ASSERT_TRUE(a->Eval(prompt, nullptr).ok());
    a->Publish();
  }
  ASSERT_TRUE(engine->NewSession("tenant-b")->Eval(prompt, nullptr).ok());
  EXPECT_EQ(engine->kv_stats().prefix_hits, 0);
  ASSERT_TRUE(engine->NewSession()->Eval(prompt, nullptr).ok());  // no salt is a tenant too
  EXPECT_EQ(engine->kv_stats().prefix_hits, 0);
  ASSERT_TRUE(engine->NewSession("tenant-a")->Eval(prompt, nullptr).ok());
  EXPECT_EQ(engine->kv_stats().prefix_hits, 1);
}

TEST(PrefixCache, EvictsLeastRecentlyUsedWhenPoolNeedsRoom) {
  // 20 MiB holds ~2500 tokens of kvtiny's f32 KV: three 1000-token prompts cannot all stay.
  auto engine = MakeEngine(true, 20);
  const auto prompt = Prompt();
  for (int32_t variant = 0; variant < 3; ++variant) {
    std::vector<int32_t> p = prompt;
    p[1] = 100 + variant;  // differs from the first page on: no sharing between variants
    auto s = engine->NewSession();
    ASSERT_TRUE(s->Eval(p, nullptr).ok()) << variant;
    s->Publish();
  }
  const KvStats s = engine->kv_stats();
  EXPECT_GT(s.evicted_blocks, 0);
  EXPECT_LE(s.pages_used, s.pages_total);
  // The most recent variant is still cached whole; the oldest lost its tail (leaves go first).
  std::vector<int32_t> newest = prompt, oldest = prompt;
  newest[1] = 102;
  oldest[1] = 100;
  const int64_t full = (prompt.size() - 1) / 16 * 16;
  int64_t hit0 = engine->kv_stats().prefix_hit_tokens;
  ASSERT_TRUE(engine->NewSession()->Eval(newest, nullptr).ok());
  EXPECT_EQ(engine->kv_stats().prefix_hit_tokens - hit0, full);
  hit0 = engine->kv_stats().prefix_hit_tokens;
  ASSERT_TRUE(engine->NewSession()->Eval(oldest, nullptr).ok());
  EXPECT_LT(engine->kv_stats().prefix_hit_tokens - hit0, full);
}

TEST(PrefixCache, ExhaustionMidPrefillChangesNothing) {
  auto engine = MakeEngine(true, 4);  // ~500 tokens of KV
  const auto prompt = Prompt();
  {
    auto s = engine->NewSession();
    std::vector<int32_t> small(prompt.begin(), prompt.begin() + 200);
    ASSERT_TRUE(s->Eval(small, nullptr).ok());
    s->Publish();
  }
  auto live = engine->NewSession();
  std::vector<int32_t> other(prompt.begin() + 300, prompt.begin() + 400);
  ASSERT_TRUE(live->Eval(other, nullptr).ok());
  const KvStats before = engine->kv_stats();
  auto s = engine->NewSession();
  Status st = s->Eval(prompt, nullptr);  // reuses 192 cached tokens, then runs out of pages
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("--kv-mem"), std::string::npos) << st.message();
  EXPECT_EQ(s->n_tokens(), 0);
  const KvStats after = engine->kv_stats();
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.pages_free, before.pages_free);
  EXPECT_EQ(after.pages_cached, before.pages_cached);
  EXPECT_EQ(after.evicted_blocks, before.evicted_blocks);
  // The session is still usable with a prompt that fits.
  std::vector<int32_t> fits(prompt.begin(), prompt.begin() + 100);
  EXPECT_TRUE(s->Eval(fits, nullptr).ok());
}

TEST(PrefixCache, ForkedSessionsDivergeIndependently) {
  auto engine = MakeEngine(false);
  const auto prompt = Prompt();
  auto parent = engine->NewSession();
  std::vector<float> base;
  ASSERT_TRUE(parent->Eval(std::span(prompt).first(101), &base).ok());  // 101: a partial page
  const int used = engine->kv_stats().pages_used;
  auto child = parent->Fork();
  EXPECT_EQ(engine->kv_stats().pages_used, used);  // shared, not copied
  std::vector<float> a, b, ref;
  ASSERT_TRUE(child->Eval(std::vector<int32_t>{5}, &a).ok());
  ASSERT_TRUE(parent->Eval(std::vector<int32_t>{6}, &b).ok());
  // Each equals a cold run of its own token sequence.
  std::vector<int32_t> pa(prompt.begin(), prompt.begin() + 101), pb = pa;
  pa.push_back(5);
  pb.push_back(6);
  auto cold = MakeEngine(false);
  ASSERT_TRUE(cold->NewSession()->Eval(pa, &ref).ok());
  EXPECT_LT(RelErr(a, ref), 1e-5);
  ASSERT_TRUE(cold->NewSession()->Eval(pb, &ref).ok());
  EXPECT_LT(RelErr(b, ref), 1e-5);
}

}  // namespace
}  // namespace cachet
