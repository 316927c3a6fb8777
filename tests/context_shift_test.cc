// Context shift (PagedSequence::Renumber, Session::Shift): a cached key re-rotated to a new
// position equals the key computed there, within f32 rounding and per codec within that codec's
// own error; dropped tokens free their pages; shared pages are copied, never written; blocks past
// the shift are not published; on kvtiny a shifted session generates on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "cachet/press.h"
#include "kv/codecs/codec.h"
#include "kv/compaction.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

constexpr int kDim = 64;

std::vector<float> InvFreq() {
  ModelConfig c;
  c.head_dim = kDim;
  c.rope_theta = 100000.0f;
  return c.RopeInvFreq();
}

// n tokens whose keys are base rows rotated to their positions (as the model writes them).
struct ShiftCache {
  ShiftCache(KvLayout layout, int n) : lay(layout), pool(lay, 4096 * lay.page_bytes()), seq(pool) {
    std::mt19937 rng(11);
    std::normal_distribution<float> g;
    const int T = lay.n_layers * lay.n_kv_heads;
    base.assign(T, std::vector<float>(size_t(n) * kDim));
    v = base;
    for (int ti = 0; ti < T; ++ti) {
      for (float& x : base[ti]) x = g(rng);
      for (float& x : v[ti]) x = g(rng);
    }
    EXPECT_TRUE(seq.Reserve(n).ok());
    for (int j = 0; j < n; ++j) {
      for (int ti = 0; ti < T; ++ti) {
        std::vector<float> k = Key(ti, j, j);
        seq.Append(ti / lay.n_kv_heads, ti % lay.n_kv_heads, k.data(), &v[ti][size_t(j) * kDim], j);
      }
    }
    seq.CommitTokens(n);
  }
  // Token j's key of table ti as computed at position pos.
  std::vector<float> Key(int ti, int j, int pos) const {
    std::vector<float> k(base[ti].begin() + size_t(j) * kDim,
                         base[ti].begin() + size_t(j + 1) * kDim);
    RerotateKey(k.data(), kDim, pos, inv_freq);
    return k;
  }
  // The largest difference of any stored key (at its stored position) from the key computed
  // there, and of any stored value from its own; token_of maps a stored position to its token.
  double KeyError(const std::vector<int>& token_of) const {
    double worst = 0;
    for (int ti = 0; ti < lay.n_layers * lay.n_kv_heads; ++ti) {
      std::vector<float> k, vv;
      std::vector<int32_t> pos;
      seq.Gather(ti / lay.n_kv_heads, ti % lay.n_kv_heads, &k, &vv, &pos);
      for (size_t r = 0; r < pos.size(); ++r) {
        const std::vector<float> want = Key(static_cast<int>(ti), token_of[pos[r]], pos[r]);
        for (int d = 0; d < kDim; ++d) {
          worst = std::max(worst, double(std::abs(k[r * kDim + d] - want[d])));
        }
      }
    }
    return worst;
  }
  KvLayout lay;
  PagePool pool;
  PagedSequence seq;
  std::vector<float> inv_freq = InvFreq();
  std::vector<std::vector<float>> base, v;
};

KvLayout Layout(const std::string& codec_k, const std::string& codec_v, int window = 0) {
  KvLayout l{2, 2, kDim, 16};
  l.codec_k = codecs::ParseCodec(codec_k).value();
  l.codec_v = codecs::ParseCodec(codec_v).value();
  l.window = window;
  return l;
}

TEST(ContextShift, RerotatedKeysEqualKeysComputedAtTheirNewPositions) {
  struct Case {
    const char *k, *v;
    int window;
  };
  for (const Case& c : {Case{"f32", "f32", 0}, Case{"f16", "f16", 0}, Case{"q8_0", "q8_0", 0},
                        Case{"q4_0", "q4_0", 0}, Case{"kivi4", "q4_0", 0}, Case{"rot3", "rot3", 0},
                        Case{"q4_0", "q4_0", 16}}) {
    for (auto [begin, end] : {std::pair{5, 37}, std::pair{0, 16}, std::pair{40, 90}}) {
      SCOPED_TRACE(std::string(c.k) + ":" + c.v + " window " + std::to_string(c.window) +
                   " drop [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
      const int n = 100;
      ShiftCache cache(Layout(c.k, c.v, c.window), n);
      std::vector<int> identity(n);
      for (int j = 0; j < n; ++j) identity[j] = j;
      const double own_error = cache.KeyError(identity);  // the codec's, before any shift
      const int pages_before = cache.seq.pages_held();
      std::vector<int32_t> new_pos(n);
      std::vector<int> token_of(n - (end - begin));
      for (int p = 0; p < n; ++p) {
        new_pos[p] = p < begin ? p : p < end ? -1 : p - (end - begin);
        if (new_pos[p] >= 0) token_of[new_pos[p]] = p;
      }
      ASSERT_TRUE(cache.seq.Renumber(new_pos, cache.inv_freq).ok());
      EXPECT_EQ(cache.seq.n_tokens(), n - (end - begin));
      EXPECT_EQ(cache.seq.head_length(1, 1), n - (end - begin));
      EXPECT_LT(cache.seq.pages_held(), pages_before);
      // f32: rounding only; a codec: decoded, rotated and encoded again, so about its own error
      // twice (rotation codecs' errors do not add exactly: 3x).
      const double tol = std::string(c.k) == "f32" ? 2e-5 : 3 * own_error + 1e-5;
      EXPECT_LE(cache.KeyError(token_of), tol) << "own error " << own_error;
      // Values are not touched beyond their codec; f32 ones exactly.
      std::vector<float> k, vv;
      std::vector<int32_t> pos;
      cache.seq.Gather(0, 1, &k, &vv, &pos);
      for (size_t r = 0; r < pos.size(); ++r) {
        EXPECT_EQ(pos[r], static_cast<int32_t>(r));
        if (std::string(c.v) == "f32") {
          for (int d = 0; d < kDim; ++d)
            EXPECT_EQ(vv[r * kDim + d], cache.v[1][token_of[r] * kDim + d]);
        }
      }
    }
  }
}

TEST(ContextShift, SharedPagesAreCopiedAndLaterBlocksAreNotPublished) {
  const int n = 64;
  ShiftCache cache(Layout("f32", "f32"), n);
  std::unique_ptr<PagedSequence> fork = cache.seq.Fork();
  std::vector<float> fk_before, fv, fk_after;
  std::vector<int32_t> pos;
  fork->Gather(1, 0, &fk_before, &fv, &pos);
  std::vector<int32_t> new_pos(n);
  for (int p = 0; p < n; ++p) new_pos[p] = p < 20 ? p : p < 40 ? -1 : p - 20;
  std::vector<int32_t> pages;
  ASSERT_TRUE(cache.seq.BlockPages(2, &pages));
  ASSERT_TRUE(cache.seq.Renumber(new_pos, cache.inv_freq).ok());
  fork->Gather(1, 0, &fk_after, &fv, &pos);
  EXPECT_EQ(fk_after, fk_before);                 // the fork's pages were not written
  EXPECT_TRUE(cache.seq.BlockPages(0, &pages));   // positions 0..15: unchanged
  EXPECT_FALSE(cache.seq.BlockPages(1, &pages));  // holds the first moved tokens
  // Bad renumberings change nothing.
  std::vector<int32_t> descending(cache.seq.n_tokens(), 0);
  EXPECT_EQ(cache.seq.Renumber(descending, cache.inv_freq).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.seq.Renumber(std::vector<int32_t>(3, 0), cache.inv_freq).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.seq.n_tokens(), 44);
}

TEST(ContextShift, AShiftedSessionGeneratesOnFromItsMovedTokens) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const Tokenizer& tok = (*engine)->tokenizer();
  const std::vector<int32_t> head = tok.EncodePrompt("The pass key is 52817. Remember it.\n\n");
  const std::vector<int32_t> middle = tok.Encode(
      "Once upon a time, there was a little girl named Lily. She had a red ball and a small dog "
      "named Max. Every day after school they ran to the park by the river.\n\n");
  const std::vector<int32_t> question = tok.Encode("Question: What is the pass key?\nAnswer:");
  std::vector<int32_t> all = head;
  all.insert(all.end(), middle.begin(), middle.end());
  all.insert(all.end(), question.begin(), question.end());
  auto s = (*engine)->NewSession();
  std::vector<float> logits;
  ASSERT_TRUE(s->Eval(all, &logits).ok());
  EXPECT_EQ(s->Shift(3, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Shift(0, s->n_tokens() + 1).code(), StatusCode::kInvalidArgument);
  const size_t bytes = s->kv_bytes();
  const int begin = static_cast<int>(head.size());
  ASSERT_TRUE(s->Shift(begin, begin + static_cast<int>(middle.size())).ok());
  EXPECT_EQ(s->n_tokens(), static_cast<int>(head.size() + question.size()));
  EXPECT_LT(s->kv_bytes(), bytes);
  std::vector<int32_t> kept = head;
  kept.insert(kept.end(), question.begin(), question.end());
  EXPECT_EQ(s->tokens(), kept);
  // It answers from the moved tokens, as the unshifted session does.
  GenerateOptions g;
  g.max_tokens = 8;
  g.sampling.temperature = 0;
  auto shifted = s->Generate({}, g);
  ASSERT_TRUE(shifted.ok()) << shifted.status().ToString();
  EXPECT_TRUE(tok.Decode(shifted->tokens).starts_with(" 52817")) << tok.Decode(shifted->tokens);
}

// What `cachet chat --on-full` does, turn by turn, on kvtiny in the format it was trained on: a
// pass key first (the protected "system prompt"), then 50 paragraphs in a 1024-token context,
// making room by shifting out the oldest paragraph or by pressing everything between the pass
// key and the last paragraph (keydiff+max, positions given back); at the end the pass key is
// still answered.
TEST(ContextShift, APassKeySurvivesFiftyTurnsOfShiftingOrPressing) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.n_ctx = 1024;
  o.prefix_cache = false;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const Tokenizer& tok = (*engine)->tokenizer();
  const std::vector<int32_t> key =
      tok.EncodePrompt("The pass key is 52817. Remember it. 52817 is the pass key.\n\n");
  const std::vector<int32_t> question = tok.Encode("Question: What is the pass key?\nAnswer:");
  const char* kTopics[] = {"the dog", "a red ball", "the river", "school", "the park", "Lily"};
  for (const std::string policy : {"shift", "press"}) {
    SCOPED_TRACE(policy);
    auto s = (*engine)->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(s->Eval(key, &logits).ok());
    const int protected_tokens = s->n_tokens();
    std::vector<int> starts;  // where each paragraph still held begins
    int made_room = 0;
    for (int turn = 0; turn < 50; ++turn) {
      const std::vector<int32_t> para = tok.Encode(
          "Every day after school " + std::string(kTopics[turn % 6]) + " was there, and turn " +
          std::to_string(turn) + " of the story went on by the water until the evening came.\n\n");
      while (s->n_tokens() + static_cast<int>(para.size() + question.size()) + 8 > o.n_ctx) {
        ++made_room;
        if (policy == "shift") {
          ASSERT_GE(starts.size(), 2u);
          const int drop = starts[1] - starts[0];
          ASSERT_TRUE(s->Shift(starts[0], starts[1]).ok());
          starts.erase(starts.begin());
          for (int& st : starts) st -= drop;
        } else {
          press::PressOptions p;
          ASSERT_TRUE(press::ParsePressSpec("keydiff+max", &p).ok());
          p.ratio = 0.5;
          p.sinks = protected_tokens;
          p.window = s->n_tokens() - starts.back();
          ASSERT_TRUE(s->Compress(p).ok());
          const int before = s->n_tokens();
          ASSERT_TRUE(s->CompactPositions().ok());
          const int last = starts.back() - (before - s->n_tokens());
          starts = {protected_tokens, last};
        }
      }
      starts.push_back(s->n_tokens());
      ASSERT_TRUE(s->Eval(para, &logits).ok());
    }
    EXPECT_GT(made_room, 0);
    EXPECT_LE(s->n_tokens(), o.n_ctx);
    // The pass key's tokens are where they were, untouched.
    EXPECT_TRUE(std::equal(key.begin(), key.end(), s->tokens().begin()));
    GenerateOptions g;
    g.max_tokens = 8;
    g.sampling.temperature = 0;
    auto answer = s->Generate(question, g);
    ASSERT_TRUE(answer.ok()) << answer.status().ToString();
    EXPECT_TRUE(tok.Decode(answer->tokens).starts_with(" 52817")) << tok.Decode(answer->tokens);
  }
}

}  // namespace
}  // namespace cachet
