#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

namespace cachet {
namespace {

std::vector<float> Logits() { return {1.0f, 3.0f, 2.9f, -1.0f, 0.5f, 2.0f}; }

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p, 6);
  auto l = Logits();
  EXPECT_EQ(s.Sample(l, {}), 1);
}

TEST(Sampler, SeedReproducesAndTopKOneIsGreedy) {
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  Sampler a(p, 6), b(p, 6);
  std::map<int, int> counts;
  for (int i = 0; i < 2000; ++i) {
    auto la = Logits(), lb = Logits();
    const int x = a.Sample(la, {});
    EXPECT_EQ(x, b.Sample(lb, {}));
    ++counts[x];
  }
  EXPECT_EQ(counts.size(), 6u);  // every token is reachable without truncation
  p.top_k = 1;
  Sampler c(p, 6);
  for (int i = 0; i < 50; ++i) {
    auto l = Logits();
    EXPECT_EQ(c.Sample(l, {}), 1);
  }
}

TEST(Sampler, TopPAndMinPTruncate) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.min_p = 0.0f;
  p.top_p = 0.5f;  // tokens 1 (p~.37) and 2 (p~.33) reach 0.5
  Sampler s(p, 6);
  for (int i = 0; i < 500; ++i) {
    auto l = Logits();
    const int x = s.Sample(l, {});
    EXPECT_TRUE(x == 1 || x == 2) << x;
  }
  p.top_p = 1.0f;
  p.min_p = 0.5f;  // keeps tokens with p >= 0.5 p_max: 1, 2 and 5 (e^-1 = .37 < .5 drops 5)
  Sampler m(p, 6);
  for (int i = 0; i < 500; ++i) {
    auto l = Logits();
    const int x = m.Sample(l, {});
    EXPECT_TRUE(x == 1 || x == 2) << x;
  }
}

// Filters that would keep nothing (top_p 0, min_p above 1) keep the most likely token: the sampler
// once read before its candidates and returned token 0.
TEST(Sampler, FiltersKeepTheMostLikelyToken) {
  for (const auto& [top_p, min_p] : {std::pair{0.0f, 0.0f}, {1.0f, 1.5f}, {0.0f, 2.0f}}) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.top_k = 0;
    p.top_p = top_p;
    p.min_p = min_p;
    Sampler s(p, 6);
    for (int i = 0; i < 50; ++i) {
      auto l = Logits();
      EXPECT_EQ(s.Sample(l, {}), 1) << top_p << " " << min_p;
    }
  }
}

// The kept tokens and their probabilities as the filters define them, by sorting everything:
// top_k, then softmax over those, min_p against the most likely, then the top_p prefix.
std::map<int, double> Expected(const std::vector<float>& logits, const SamplingParams& p) {
  std::vector<int> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  if (p.top_k > 0 && size_t(p.top_k) < ids.size()) ids.resize(p.top_k);
  std::vector<double> pr;
  double sum = 0;
  for (int id : ids) sum += std::exp(double(logits[id] - logits[ids[0]]) / p.temperature);
  for (int id : ids)
    pr.push_back(std::exp(double(logits[id] - logits[ids[0]]) / p.temperature) / sum);
  size_t n = ids.size();
  if (p.min_p > 0)
    n = std::count_if(pr.begin(), pr.end(), [&](double x) { return x >= p.min_p * pr[0]; });
  if (p.top_p < 1) {
    double cum = 0;
    size_t keep = 0;
    while (keep < n && cum < p.top_p) cum += pr[keep++];
    n = keep;
  }
  std::map<int, double> out;
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += pr[i];
  for (size_t i = 0; i < n; ++i) out[ids[i]] = pr[i] / total;
  return out;
}

// A large vocabulary, where the top_p prefix runs past the first 64 tokens sorted: each token's
// frequency matches its probability under the filters, and no filtered-out token is drawn.
TEST(Sampler, LargeVocabularyMatchesTheFiltersExactly) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::vector<float> logits(1000);
  for (float& l : logits) l = dist(rng);
  struct Case {
    float temperature, top_p, min_p;
    int top_k;
  } cases[] = {{1.0f, 0.9f, 0.0f, 0},    {0.7f, 0.5f, 0.0f, 0},    {1.0f, 1.0f, 0.05f, 0},
               {0.8f, 0.95f, 0.05f, 40}, {1.3f, 0.3f, 0.01f, 300}, {1.0f, 1.0f, 0.0f, 0}};
  for (const Case& c : cases) {
    SamplingParams p;
    p.temperature = c.temperature;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    p.top_k = c.top_k;
    const std::map<int, double> expect = Expected(logits, p);
    Sampler s(p, static_cast<int>(logits.size()));
    std::map<int, int> counts;
    const int draws = 20000;
    for (int i = 0; i < draws; ++i) {
      std::vector<float> l = logits;
      ++counts[s.Sample(l, {})];
    }
    const std::string what = "T " + std::to_string(c.temperature) + " top_p " +
                             std::to_string(c.top_p) + " min_p " + std::to_string(c.min_p) +
                             " top_k " + std::to_string(c.top_k) + " (" +
                             std::to_string(expect.size()) + " kept)";
    for (const auto& [id, n] : counts) ASSERT_TRUE(expect.count(id)) << what << ": drew " << id;
    for (const auto& [id, q] : expect) {
      const double mean = q * draws, sd = std::sqrt(draws * q * (1 - q));
      const int got = counts.count(id) ? counts[id] : 0;
      ASSERT_LE(std::abs(got - mean), 5 * sd + 1) << what << ": token " << id;
    }
  }
}

TEST(Sampler, RepetitionPenaltyDemotesSeenTokens) {
  SamplingParams p;
  p.temperature = 0;
  p.repeat_penalty = 2.0f;
  Sampler s(p, 6);
  auto l = Logits();
  const std::vector<int32_t> history = {1, 1, 1};
  EXPECT_EQ(s.Sample(l, history), 2);  // 3.0 / 2 = 1.5 < 2.9
  EXPECT_FLOAT_EQ(l[1], 1.5f);         // penalized once, not three times
}

// OpenAI's penalties as llama.cpp applies them: logit -= frequency * count + presence, for each
// token of the last repeat_last_n, after the repeat penalty; nothing else moves.
TEST(Sampler, PresenceAndFrequencyPenaltiesCountTheWindow) {
  SamplingParams p;
  p.temperature = 0;
  p.repeat_penalty = 2.0f;
  p.presence_penalty = 0.25f;
  p.frequency_penalty = 0.5f;
  p.repeat_last_n = 4;
  Sampler s(p, 6);
  auto l = Logits();
  // Token 5 falls out of the 4-token window; 2 is counted three times, 3 once, 0 never.
  const std::vector<int32_t> history = {5, 2, 3, 2, 2};
  s.Sample(l, history);
  const std::vector<float> base = Logits();
  EXPECT_FLOAT_EQ(l[2], base[2] / 2.0f - 0.5f * 3 - 0.25f);
  EXPECT_FLOAT_EQ(l[3], base[3] * 2.0f - 0.5f * 1 - 0.25f);  // a negative logit: times the penalty
  for (int t : {0, 1, 4, 5}) EXPECT_EQ(l[t], base[t]) << t;
  // The window's counts start afresh at every call (no state left from the last).
  auto again = Logits();
  s.Sample(again, history);
  EXPECT_EQ(again, l);
  // repeat_last_n = -1: the whole history; 0: no penalty at all.
  p.repeat_last_n = -1;
  Sampler all(p, 6);
  auto la = Logits();
  all.Sample(la, history);
  EXPECT_FLOAT_EQ(la[5], base[5] / 2.0f - 0.5f - 0.25f);
  p.repeat_last_n = 0;
  Sampler none(p, 6);
  auto ln = Logits();
  none.Sample(ln, history);
  EXPECT_EQ(ln, base);
  // Negative penalties favour the seen tokens (OpenAI's range is [-2, 2]).
  p.repeat_penalty = 1.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 0.0f;
  p.repeat_last_n = 64;
  Sampler favour(p, 6);
  auto lf = Logits();
  EXPECT_EQ(favour.Sample(lf, std::vector<int32_t>{3}), 1);
  EXPECT_FLOAT_EQ(lf[3], base[3] + 2.0f);
}

// logit_bias is added before anything else: +100 forces a token greedy or sampled, -100 bans it;
// ids outside the vocabulary are passed over.
TEST(Sampler, LogitBiasForcesOrBans) {
  SamplingParams p;
  p.temperature = 0;
  p.logit_bias = {{3, 100.0f}, {99, 100.0f}, {-4, 5.0f}};
  Sampler greedy(p, 6);
  auto l = Logits();
  EXPECT_EQ(greedy.Sample(l, {}), 3);
  EXPECT_FLOAT_EQ(l[3], 99.0f);
  p.logit_bias = {{1, -100.0f}, {2, -100.0f}};
  p.temperature = 1.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  Sampler sampled(p, 6);
  std::map<int, int> counts;
  for (int i = 0; i < 1000; ++i) {
    auto ls = Logits();
    ++counts[sampled.Sample(ls, {})];
  }
  EXPECT_EQ(counts.count(1), 0u);
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.size(), 4u);  // the other four all still come up
  // The bias first, then the penalties on the biased logit.
  p.temperature = 0;
  p.logit_bias = {{4, 10.0f}};
  p.frequency_penalty = 2.0f;
  Sampler both(p, 6);
  auto lb = Logits();
  EXPECT_EQ(both.Sample(lb, std::vector<int32_t>{4, 4}), 4);  // 0.5 + 10 - 4 = 6.5 > 3
  EXPECT_FLOAT_EQ(lb[4], 6.5f);
}

}  // namespace
}  // namespace cachet
