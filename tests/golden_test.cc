// Replays the reference model's outputs: logits at listed positions and greedy continuations of
// every golden case (fp32 HF forward of kvtiny's bf16 weights).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <span>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "cachet/tokenizer.h"
#include "runtime/sampler.h"
#include "test_util.h"

namespace cachet {
namespace {

using testing::LoadGolden;
using testing::ModelDir;

std::unique_ptr<Engine> MakeEngine(int threads, int ubatch = 512, int page_tokens = 16) {
  EngineOptions o;
  o.model_dir = ModelDir();
  o.threads = threads;
  o.ubatch = ubatch;
  o.page_tokens = page_tokens;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

float MaxAbsDiff(const float* a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

class GoldenTest : public ::testing::TestWithParam<int> {};  // thread count

TEST_P(GoldenTest, LogitsAndGreedyMatchReference) {
  auto engine = MakeEngine(GetParam());
  const int vocab = engine->config().vocab_size;
  for (const auto& c : LoadGolden()) {
    SCOPED_TRACE(c.kind + " case of " + std::to_string(c.ids.size()) + " tokens");
    auto session = engine->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(session->Eval(c.ids, &logits, /*all_logits=*/true).ok());
    for (size_t i = 0; i < c.positions.size(); ++i) {
      const float err = MaxAbsDiff(logits.data() + size_t(c.positions[i]) * vocab, c.logits[i]);
      EXPECT_LT(err, 1e-3f) << "position " << c.positions[i];
      EXPECT_LT(err, 2e-4f) << "position " << c.positions[i] << " (f32 should be ~1e-4)";
    }
    // Greedy continuation, token by token through the decode path.
    std::vector<int32_t> got;
    std::vector<float> last(logits.end() - vocab, logits.end());
    for (size_t i = 0; i < c.greedy.size(); ++i) {
      const int32_t next = ArgMax(last);
      got.push_back(next);
      if (next == engine->tokenizer().eos_id()) break;
      const int32_t one[1] = {next};
      ASSERT_TRUE(session->Eval(one, &last).ok());
    }
    EXPECT_EQ(got, c.greedy);
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, GoldenTest, ::testing::Values(1, 2));

TEST(Golden, ChunkingAndPageSizeDoNotChangeLogits) {
  const auto cases = LoadGolden();
  const auto& c = cases.back();  // a ~1000-token task prompt
  std::vector<float> base;
  {
    auto e = MakeEngine(2);
    ASSERT_TRUE(e->NewSession()->Eval(c.ids, &base, true).ok());
  }
  for (auto [ubatch, page] :
       std::vector<std::pair<int, int>>{{7, 1}, {100, 16}, {512, 64}, {1, 16}}) {
    auto e = MakeEngine(2, ubatch, page);
    std::vector<float> logits;
    ASSERT_TRUE(e->NewSession()->Eval(c.ids, &logits, true).ok());
    double num = 0, den = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      num += (logits[i] - base[i]) * double(logits[i] - base[i]);
      den += double(base[i]) * base[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-5) << "ubatch " << ubatch << " page_tokens " << page;
  }
}

// Past PagedSequence::kKeysPerPart * 2 keys a decode step's attention runs in parts, merged
// (flash decoding); a prompt's last row is computed in one pass. Both layouts: the plain f32 page
// table and f16 pages through the codec path.
TEST(Golden, LongContextDecodeInPartsEqualsPrefill) {
  const auto cases = LoadGolden();
  std::vector<int32_t> ids;
  while (ids.size() < 2600) ids.insert(ids.end(), cases.back().ids.begin(), cases.back().ids.end());
  ids.resize(2600);
  for (const char* codec : {"f32", "f16"}) {
    EngineOptions o;
    o.model_dir = ModelDir();
    o.threads = 2;
    o.kv_codec_k = o.kv_codec_v = codec;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const int vocab = (*e)->config().vocab_size;
    std::vector<float> prefill, decode;
    ASSERT_TRUE((*e)->NewSession()->Eval(ids, &prefill).ok());
    auto session = (*e)->NewSession();
    ASSERT_TRUE(session->Eval(std::span(ids).first(ids.size() - 1), &decode).ok());
    ASSERT_TRUE(session->Eval(std::span(ids).last(1), &decode).ok());
    ASSERT_EQ(decode.size(), size_t(vocab));
    double num = 0, den = 0;
    for (int i = 0; i < vocab; ++i) {
      num += (decode[i] - prefill[i]) * double(decode[i] - prefill[i]);
      den += double(prefill[i]) * prefill[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-5) << codec;
    EXPECT_EQ(ArgMax(decode), ArgMax(prefill)) << codec;
  }
}

TEST(Golden, CliRunPrintsGreedyContinuation) {
  const auto cases = LoadGolden();
  const auto& c = cases.front();
  ASSERT_EQ(c.text, "In the beginning God created the heaven and the earth.");
  auto tok = Tokenizer::Load(ModelDir());
  ASSERT_TRUE(tok.ok());
  std::vector<int32_t> first24(c.greedy.begin(),
                               c.greedy.begin() + std::min<size_t>(24, c.greedy.size()));
  const std::string expected = (*tok)->Decode(first24) + "\n";
  const testing::CliRun r = testing::RunCachet("run -q -t 2 -p \"" + c.text + "\" -n 24 --temp 0");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, expected);
}

}  // namespace
}  // namespace cachet
