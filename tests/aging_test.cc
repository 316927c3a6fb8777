// Precision by age (--kv-cold, kv/aging.h): full pages whose tokens are old enough move to the
// cold pool in its codec, in position order, every token kept exactly once; moved in the same
// codec they attend as before; a lossy cold codec holds fewer bytes at a small cost; a full cold
// pool leaves the pages hot; bad options and --demote beside it are refused.
#include <gtest/gtest.h>

#include <algorithm>

#include "cachet/engine.h"
#include "cachet/press.h"
#include "codec_check.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

constexpr int kDim = 8;

KvLayout HotLayout() {
  KvLayout l{2, 2, kDim, 4};  // 2 layers x 2 heads, 4-token pages
  l.codec_k = l.codec_v = codecs::Codec::kF16;
  l.sinks = 2;  // page 0 stays raw and hot
  return l;
}

// Appends n tokens one at a time (a Reserve each, as decode steps do); the token at position p
// has K rows of p + 1 and V rows of -(p + 1).
void AppendTokens(PagedSequence& s, int n) {
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(s.Reserve(1).ok());
    const int32_t pos = s.n_tokens();
    const std::vector<float> k(kDim, float(pos + 1)), v(kDim, -float(pos + 1));
    for (int t = 0; t < 4; ++t) s.Append(t / 2, t % 2, k.data(), v.data(), pos);
    s.CommitTokens(1);
  }
}

// Every table's hot and cold rows: positions ascending in each, together each token once, rows
// as written.
void ExpectEveryToken(PagedSequence& s, PagePool* cold, int n, int* n_cold) {
  *n_cold = 0;
  for (int ti = 0; ti < 4; ++ti) {
    std::vector<float> k, v, ck, cv;
    std::vector<int32_t> pos, cpos;
    s.Gather(ti / 2, ti % 2, &k, &v, &pos);
    if (cold && !s.cold_tables().empty()) {
      GatherTable(*cold, ti, s.cold_tables()[ti], &ck, &cv, &cpos);
    }
    EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end()));
    EXPECT_TRUE(std::is_sorted(cpos.begin(), cpos.end()));
    std::vector<int32_t> all = pos;
    all.insert(all.end(), cpos.begin(), cpos.end());
    std::sort(all.begin(), all.end());
    ASSERT_EQ(all.size(), size_t(n));
    for (int i = 0; i < n; ++i) EXPECT_EQ(all[i], i);
    for (size_t i = 0; i < cpos.size(); ++i) {
      EXPECT_EQ(ck[i * kDim], float(cpos[i] + 1));
      EXPECT_EQ(cv[i * kDim + kDim - 1], -float(cpos[i] + 1));
    }
    for (size_t i = 0; i < pos.size(); ++i) EXPECT_EQ(k[i * kDim + 3], float(pos[i] + 1));
    *n_cold += static_cast<int>(cpos.size());
  }
}

TEST(KvAging, OldPagesMoveInOrderAndEveryTokenStays) {
  const KvLayout lay = HotLayout();
  KvLayout cold_lay{2, 2, kDim, 4};  // f32
  PagePool pool(lay, 64 * lay.page_bytes()), cold(cold_lay, 64 * cold_lay.page_bytes());
  PagedSequence s(pool);
  s.set_cold_pool(&cold, 1.0);
  s.set_age_out(10);
  AppendTokens(s, 40);
  int n_cold = 0;
  ExpectEveryToken(s, &cold, 40, &n_cold);
  // The last reservation saw 39 tokens: pages wholly below position 29 moved, the sink page
  // (0-3) stayed: positions 4..27 are cold in every table (six pages).
  EXPECT_EQ(n_cold, 4 * 24);
  std::vector<int32_t> pos;
  s.Positions(0, 0, &pos);
  EXPECT_EQ(pos.front(), 0);
  EXPECT_EQ(pos[4], 28);
  EXPECT_EQ(pool.used_pages(), 4 * 4);  // the sink page and three recent ones per table
  EXPECT_EQ(cold.used_pages(), 4 * 6);
  // A fork keeps aging; a rollback into the cold region keeps the tokens below it.
  auto fork = s.Fork();
  EXPECT_EQ(fork->age_out(), 10);
  fork.reset();
  ASSERT_TRUE(s.Truncate(20).ok());
  ExpectEveryToken(s, &cold, 20, &n_cold);
  AppendTokens(s, 20);
  ExpectEveryToken(s, &cold, 40, &n_cold);
}

TEST(KvAging, FullColdPoolLeavesPagesHot) {
  const KvLayout lay = HotLayout();
  KvLayout cold_lay{2, 2, kDim, 4};
  PagePool pool(lay, 64 * lay.page_bytes()), cold(cold_lay, 2 * cold_lay.page_bytes());
  PagedSequence s(pool);
  s.set_cold_pool(&cold, 1.0);
  s.set_age_out(4);
  AppendTokens(s, 24);  // every table would move pages at once: four are needed, two fit
  int n_cold = 0;
  ExpectEveryToken(s, &cold, 24, &n_cold);
  EXPECT_EQ(n_cold, 0);
  EXPECT_EQ(cold.used_pages(), 0);
}

std::unique_ptr<Engine> MakeEngine(const std::string& codec, const std::string& cold = "",
                                   int after = 48) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = o.kv_codec_v = codec;
  o.prefix_cache = false;
  o.kv_cold = cold;
  o.kv_cold_after = after;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

// The first 384 tokens of the longest golden prompt: 320 decode steps, past 64 of them cold at
// --kv-cold-after 48 (the whole prompt's 950 steps took 130 s of CI's ASan build for these tests,
// and told nothing more).
std::vector<int32_t> AgingPrompt() {
  std::vector<int32_t> ids = testing::LoadGolden().back().ids;
  ids.resize(std::min<size_t>(ids.size(), 384));
  return ids;
}

// Evaluates the prompt's first 64 tokens, then the rest one by one: every step's logits.
std::vector<float> StepLogits(Engine& e, std::vector<int32_t> prompt, size_t* bytes, int* n_cold) {
  auto s = e.NewSession();
  std::vector<float> all, logits;
  EXPECT_TRUE(s->Eval(std::span(prompt).first(64), &logits).ok());
  all = logits;
  for (size_t i = 64; i < prompt.size(); ++i) {
    EXPECT_TRUE(s->Eval(std::span(prompt).subspan(i, 1), &logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
  }
  *bytes = s->kv_bytes();
  *n_cold = EngineAccess::kv(*s).cold_length(0, 0);
  return all;
}

TEST(KvAging, SameCodecColdAttendsAsHot) {
  const std::vector<int32_t> prompt = AgingPrompt();
  ASSERT_EQ(prompt.size(), size_t(384));
  size_t bytes_hot = 0, bytes_aged = 0;
  int cold_hot = 0, cold_aged = 0;
  const auto hot = StepLogits(*MakeEngine("f16"), prompt, &bytes_hot, &cold_hot);
  const auto aged = StepLogits(*MakeEngine("f16", "f16"), prompt, &bytes_aged, &cold_aged);
  EXPECT_EQ(cold_hot, 0);
  EXPECT_GT(cold_aged, 64);
  // The same rows, read in another order (hot pages, then cold ones: other online-softmax
  // chunks): rounding only (1e-4 over 320 steps), every step's argmax the same.
  EXPECT_LT(testing::RelErr(aged, hot), 1e-3);
  const int vocab = 8192;
  for (size_t t = 0; t * vocab < hot.size(); ++t) {
    const auto a = hot.begin() + t * vocab, g = aged.begin() + t * vocab;
    EXPECT_EQ(std::max_element(a, a + vocab) - a, std::max_element(g, g + vocab) - g) << t;
  }
}

TEST(KvAging, LossyColdHoldsFewerBytes) {
  const std::vector<int32_t> prompt = AgingPrompt();
  const int vocab = MakeEngine("f32")->config().vocab_size;
  size_t bytes[4];
  int n_cold[4];
  const auto ref = StepLogits(*MakeEngine("f32"), prompt, &bytes[0], &n_cold[0]);
  const auto q8 = StepLogits(*MakeEngine("q8_0"), prompt, &bytes[1], &n_cold[1]);
  const auto q4 = StepLogits(*MakeEngine("q4_0"), prompt, &bytes[2], &n_cold[2]);
  const auto aged = StepLogits(*MakeEngine("q8_0", "q4_0"), prompt, &bytes[3], &n_cold[3]);
  EXPECT_GT(n_cold[3], 64);
  EXPECT_LT(bytes[3], bytes[1]);
  EXPECT_GT(bytes[3], bytes[2]);
  // Recent tokens in q8_0 and old ones in q4_0: closer to f32 than q4_0 everywhere.
  EXPECT_LT(testing::MeanKl(ref, aged, vocab), testing::MeanKl(ref, q4, vocab));
  EXPECT_GT(testing::MeanKl(ref, aged, vocab), testing::MeanKl(ref, q8, vocab));
  // K:V apart: old keys kept in q8_0, old values in q4_0: between the two.
  size_t split_bytes = 0;
  int split_cold = 0;
  const auto split =
      StepLogits(*MakeEngine("q8_0", "q8_0:q4_0"), prompt, &split_bytes, &split_cold);
  EXPECT_EQ(split_cold, n_cold[3]);
  EXPECT_GT(split_bytes, bytes[3]);
  EXPECT_LT(split_bytes, bytes[1]);
  EXPECT_LT(testing::MeanKl(ref, split, vocab), testing::MeanKl(ref, aged, vocab));
}

TEST(KvAging, BadOptionsAreRefused) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 1;
  o.kv_codec_k = o.kv_codec_v = "q8_0";
  o.kv_cold = "kivi4";
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--kv-cold kivi4"), std::string::npos);
  o.kv_cold = "nonsense";
  EXPECT_FALSE(Engine::Create(o).ok());
  o.kv_cold = "q4_0:nonsense";  // the values' codec is checked as the keys'
  EXPECT_FALSE(Engine::Create(o).ok());
  o.kv_cold = "q4_0:";
  EXPECT_FALSE(Engine::Create(o).ok());
  o.kv_cold = "q4_0";
  o.kv_cold_after = 0;
  EXPECT_FALSE(Engine::Create(o).ok());
  // A press that demotes tokens into the cold pool does not combine with aging.
  auto engine = MakeEngine("q8_0", "q4_0");
  auto s = engine->NewSession();
  press::PressOptions p;
  p.ratio = 0.5;
  p.demote = "q4_0";
  const std::vector<int32_t> prompt = testing::LoadGolden().back().ids;
  const Status st = s->EvalPressed(prompt, p, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--kv-cold"), std::string::npos);
}

}  // namespace
}  // namespace cachet
