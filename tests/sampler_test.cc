#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <map>

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

}  // namespace
}  // namespace cachet
