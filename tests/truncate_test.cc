// Rollback (Session::Truncate, PagedSequence::Truncate): a sequence truncated to its first n
// tokens and given new ones computes what a fresh sequence of the same tokens computes, holds the
// pages it would hold, never changes a page it shares (forks, the prefix cache), refuses a bad n
// without changing anything, keeps Quest's selection, and keeps a pressed sequence's tokens
// below n.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

using testing::RelErr;

// ---- PagedSequence on a small layout ----

KvLayout SmallLayout() { return KvLayout{2, 2, 8, 4}; }  // 2 layers x 2 heads, 4-token pages

// Appends n tokens; token at position p has K rows of p + 1 and V rows of -(p + 1).
void AppendTokens(PagedSequence& s, int n) {
  ASSERT_TRUE(s.Reserve(n).ok());
  for (int i = 0; i < n; ++i) {
    const int32_t pos = s.n_tokens() + i;
    const std::vector<float> k(8, float(pos + 1)), v(8, -float(pos + 1));
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) s.Append(l, h, k.data(), v.data(), pos);
    }
  }
  s.CommitTokens(n);
}

// Every table's K rows and positions are the tokens at positions [0, n).
void ExpectTokens(const PagedSequence& s, int n) {
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      std::vector<float> k, v;
      std::vector<int32_t> pos;
      s.Gather(l, h, &k, &v, &pos);
      ASSERT_EQ(pos.size(), size_t(n));
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(pos[i], i);
        EXPECT_EQ(k[size_t(i) * 8], float(i + 1));
        EXPECT_EQ(v[size_t(i) * 8 + 7], -float(i + 1));
      }
    }
  }
}

TEST(KvTruncate, ReleasesPagesAndKeepsRows) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 64 * lay.page_bytes());
  PagedSequence s(pool);
  AppendTokens(s, 10);  // 3 pages per table
  EXPECT_EQ(pool.used_pages(), 12);
  ASSERT_TRUE(s.Truncate(6).ok());  // mid-page: 2 pages per table
  EXPECT_EQ(s.n_tokens(), 6);
  EXPECT_EQ(pool.used_pages(), 8);
  ExpectTokens(s, 6);
  AppendTokens(s, 3);  // into the partly kept page, then a new one
  EXPECT_EQ(pool.used_pages(), 12);
  ExpectTokens(s, 9);
  ASSERT_TRUE(s.Truncate(8).ok());  // on a page boundary
  EXPECT_EQ(pool.used_pages(), 8);
  ExpectTokens(s, 8);
  ASSERT_TRUE(s.Truncate(8).ok());  // nothing to drop
  EXPECT_EQ(pool.used_pages(), 8);
  ASSERT_TRUE(s.Truncate(0).ok());
  EXPECT_EQ(pool.used_pages(), 0);
  EXPECT_EQ(s.pages_held(), 0);
  AppendTokens(s, 5);
  ExpectTokens(s, 5);
}

TEST(KvTruncate, BadLengthChangesNothing) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 64 * lay.page_bytes());
  PagedSequence s(pool);
  AppendTokens(s, 7);
  for (int n : {-1, 8, 1 << 30}) {
    EXPECT_EQ(s.Truncate(n).code(), StatusCode::kInvalidArgument) << n;
    EXPECT_EQ(s.n_tokens(), 7);
    EXPECT_EQ(pool.used_pages(), 8);
    ExpectTokens(s, 7);
  }
}

// A fork truncated inside a page it shares with its parent keeps sharing it until it writes, then
// copies it: the parent's rows never change.
TEST(KvTruncate, SharedPagesAreNeverWritten) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 64 * lay.page_bytes());
  PagedSequence parent(pool);
  AppendTokens(parent, 10);
  auto child = parent.Fork();
  ASSERT_TRUE(child->Truncate(5).ok());
  EXPECT_EQ(pool.used_pages(), 12);  // the parent still holds every page
  EXPECT_EQ(child->pages_held(), 8);
  const kernels::PagedKv pv = parent.View(0, 0), cv = child->View(0, 0);
  EXPECT_EQ(cv.n_tokens, 5);
  EXPECT_EQ(pv.page_ids[1], cv.page_ids[1]);  // the partly kept page, still shared
  EXPECT_EQ(pool.refcount(pv.page_ids[1]), 2);
  EXPECT_EQ(pool.refcount(pv.page_ids[2]), 1);  // only the parent's now
  // The child writes position 5 anew: into a copy of the shared page.
  ASSERT_TRUE(child->Reserve(1).ok());
  const std::vector<float> k(8, 100.0f), v(8, -100.0f);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) child->Append(l, h, k.data(), v.data(), 5);
  }
  child->CommitTokens(1);
  EXPECT_EQ(pool.used_pages(), 16);
  const kernels::PagedKv cv2 = child->View(0, 0);
  EXPECT_NE(cv2.page_ids[1], pv.page_ids[1]);
  EXPECT_EQ((pv.slots + size_t(cv2.page_ids[1]) * pv.slot_floats)[1 * 8], 100.0f);
  ExpectTokens(parent, 10);
  child.reset();
  EXPECT_EQ(pool.used_pages(), 12);
  ExpectTokens(parent, 10);
}

// ---- Sessions on kvtiny ----

std::unique_ptr<Engine> MakeEngine(const std::string& k, const std::string& v,
                                   bool prefix_cache = false, int window = 0) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = k;
  o.kv_codec_v = v;
  o.prefix_cache = prefix_cache;
  o.kv_window = window;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<int32_t> Slice(const std::vector<int32_t>& ids, size_t from, size_t n) {
  return {ids.begin() + from, ids.begin() + from + n};
}
std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const std::vector<int32_t>& Ids() {  // ~1000 tokens of text
  static const std::vector<int32_t> ids = testing::LoadGolden().back().ids;
  return ids;
}

// Logits of C (its last token), then of three decode steps after it.
std::vector<std::vector<float>> EvalThenDecode(Session& s, const std::vector<int32_t>& c) {
  std::vector<std::vector<float>> out(1);
  EXPECT_TRUE(s.Eval(c, &out[0]).ok());
  for (int i = 0; i < 3; ++i) {
    const int32_t one[1] = {c[i]};
    out.emplace_back();
    EXPECT_TRUE(s.Eval(one, &out.back()).ok());
  }
  return out;
}

// Eval A + B, truncate to |A|, eval C: the logits (and pages) of a fresh session's A + C, bit for
// bit, for row-wise layouts, the truncation on a page boundary (48) and inside a page (53).
TEST(KvTruncate, EvalAfterTruncateEqualsFreshSession) {
  const auto& ids = Ids();
  const auto b = Slice(ids, 100, 70), c = Slice(ids, 300, 20);
  for (const auto& [ck, cv] : std::vector<std::pair<std::string, std::string>>{
           {"f32", "f32"}, {"f16", "f16"}, {"q4_0", "q4_0"}}) {
    auto truncated_engine = MakeEngine(ck, cv), fresh_engine = MakeEngine(ck, cv);
    for (int a_len : {48, 53, 1}) {
      SCOPED_TRACE(ck + "/" + cv + " |A| = " + std::to_string(a_len));
      const auto a = Slice(ids, 0, a_len);
      auto s = truncated_engine->NewSession();
      ASSERT_TRUE(s->Eval(a, nullptr).ok());
      ASSERT_TRUE(s->Eval(b, nullptr).ok());  // A and B in two Evals: B starts mid-page
      ASSERT_TRUE(s->Truncate(a_len).ok());
      EXPECT_EQ(s->n_tokens(), a_len);
      EXPECT_EQ(s->tokens(), a);
      auto fresh = fresh_engine->NewSession();
      ASSERT_TRUE(fresh->Eval(a, nullptr).ok());
      // (2) No page leaks: the pool holds what a session of |A| tokens holds.
      const KvStats ts = truncated_engine->kv_stats(), fs = fresh_engine->kv_stats();
      EXPECT_EQ(ts.pages_used, fs.pages_used);
      EXPECT_EQ(ts.bytes_used, fs.bytes_used);
      EXPECT_EQ(EngineAccess::kv(*s).pages_held(), EngineAccess::kv(*fresh).pages_held());
      const auto got = EvalThenDecode(*s, c);
      auto cold = fresh_engine->NewSession();
      std::vector<float> want_c;
      ASSERT_TRUE(cold->Eval(Concat(a, c), &want_c).ok());
      EXPECT_EQ(got[0], want_c) << "C after truncation vs A + C in one Eval";
      const auto want = EvalThenDecode(*fresh, c);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i;
    }
  }
}

// Staged layouts (KIVI keys encoded per page, a recent window): a sealed page kept in part goes
// back to a raw page holding its decoded rows, whole sealed pages stay sealed. So the kept rows
// are the rows the sequence held (to f16 rounding), not bit for bit a fresh session's (which has
// those tokens raw: they differ by the codec's error), in as many pages; decoding goes on past
// the window, pages sealing as they age.
TEST(KvTruncate, StagedLayoutsStayConsistent) {
  const auto& ids = Ids();
  const auto b = Slice(ids, 100, 70), c = Slice(ids, 300, 20);
  struct Case {
    std::string k, v;
    int window;
  };
  for (const Case& cs : {Case{"kivi4", "kivi4", 0}, Case{"q4_0", "q4_0", 32}}) {
    auto engine = MakeEngine(cs.k, cs.v, false, cs.window);
    auto fresh_engine = MakeEngine(cs.k, cs.v, false, cs.window);
    const ModelConfig& cfg = engine->config();
    for (int a_len : {40, 53}) {  // a_len - 1 is in a page that B's tokens sealed
      SCOPED_TRACE(cs.k + " window " + std::to_string(cs.window) + " |A| " + std::to_string(a_len));
      const auto a = Slice(ids, 0, a_len);
      auto s = engine->NewSession();
      ASSERT_TRUE(s->Eval(Concat(a, b), nullptr).ok());
      auto untruncated = s->Fork();
      ASSERT_TRUE(s->Truncate(a_len).ok());
      auto fresh = fresh_engine->NewSession();
      ASSERT_TRUE(fresh->Eval(a, nullptr).ok());
      for (int l = 0; l < cfg.n_layers; ++l) {
        for (int h = 0; h < cfg.n_kv_heads; ++h) {
          std::vector<float> k, v, uk, uv, fk, fv;
          std::vector<int32_t> pos, upos, fpos;
          EngineAccess::kv(*s).Gather(l, h, &k, &v, &pos);
          EngineAccess::kv(*untruncated).Gather(l, h, &uk, &uv, &upos);
          EngineAccess::kv(*fresh).Gather(l, h, &fk, &fv, &fpos);
          ASSERT_EQ(pos, fpos);
          uk.resize(k.size());
          uv.resize(v.size());
          EXPECT_LT(RelErr(k, uk), 1e-3);
          EXPECT_LT(RelErr(v, uv), 1e-3);
          EXPECT_LT(RelErr(k, fk), 0.2);
          EXPECT_LT(RelErr(v, fv), 0.2);
        }
      }
      untruncated.reset();
      EXPECT_EQ(engine->kv_stats().pages_used, fresh_engine->kv_stats().pages_used);
      std::vector<float> got, want;
      ASSERT_TRUE(s->Eval(c, &got).ok());
      ASSERT_TRUE(fresh->Eval(c, &want).ok());
      EXPECT_LT(RelErr(got, want), 0.3);  // kvtiny's logits are fragile under 4-bit keys
      for (int i = 0; i < 40; ++i) {
        const int32_t one[1] = {ids[400 + i]};
        ASSERT_TRUE(s->Eval(one, &got).ok());
        ASSERT_TRUE(fresh->Eval(one, &want).ok());
      }
      EXPECT_LT(RelErr(got, want), 0.3);
      EXPECT_EQ(engine->kv_stats().pages_used, fresh_engine->kv_stats().pages_used);
    }
  }
}

// Pending sampled tokens and the last logits go: the next Eval / Generate needs new tokens.
// A bad n changes nothing.
TEST(KvTruncate, SessionStateAndBadLength) {
  auto engine = MakeEngine("f32", "f32");
  const auto a = Slice(Ids(), 0, 30);
  auto s = engine->NewSession();
  GenerateOptions g;
  g.max_tokens = 5;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  ASSERT_TRUE(s->Generate(a, g).ok());  // 4 generated tokens evaluated, the 5th pending
  ASSERT_EQ(s->n_tokens(), 34);
  const KvStats before = engine->kv_stats();
  std::vector<float> pending_logits;
  {
    auto f = s->Fork();
    ASSERT_TRUE(f->Eval({}, &pending_logits).ok());  // evaluates the pending token
  }
  for (int n : {-1, 35, 1000}) {
    EXPECT_EQ(s->Truncate(n).code(), StatusCode::kInvalidArgument) << n;
    EXPECT_EQ(s->n_tokens(), 34);
    EXPECT_EQ(engine->kv_stats().pages_used, before.pages_used);
  }
  std::vector<float> logits;
  {
    auto f = s->Fork();
    ASSERT_TRUE(f->Eval({}, &logits).ok());
    EXPECT_EQ(logits, pending_logits) << "the pending token survives a refused Truncate";
  }
  ASSERT_TRUE(s->Truncate(34).ok());  // no token dropped; the pending one and logits are
  EXPECT_EQ(s->n_tokens(), 34);
  ASSERT_TRUE(s->Eval({}, &logits).ok());
  EXPECT_TRUE(logits.empty());
  EXPECT_EQ(s->Generate({}, g).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s->Truncate(30).ok());
  auto r = s->Generate(Slice(Ids(), 30, 1), g);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(s->n_tokens(), 35);
}

// (3) Forks and the prefix cache: truncating a fork (inside a page it shares with its parent and
// with the prefix cache) never changes the parent's outputs, and a new session matching the
// published prefix still gets cold logits.
TEST(KvTruncate, ForksAndPrefixCacheKeepTheirPages) {
  const auto& ids = Ids();
  const auto a = Slice(ids, 0, 53), b = Slice(ids, 100, 75), c = Slice(ids, 300, 20),
             d = Slice(ids, 400, 20);
  const auto ab = Concat(a, b);
  auto cold_engine = MakeEngine("f32", "f32");
  auto cold_logits = [&](const std::vector<int32_t>& tokens) {
    std::vector<float> l;
    EXPECT_TRUE(cold_engine->NewSession()->Eval(tokens, &l).ok());
    return l;
  };
  for (const std::string codec : {"f32", "q4_0"}) {
    SCOPED_TRACE(codec);
    if (codec != "f32") cold_engine = MakeEngine(codec, codec);
    auto engine = MakeEngine(codec, codec, /*prefix_cache=*/true);
    {
      auto first = engine->NewSession();
      ASSERT_TRUE(first->Eval(ab, nullptr).ok());
      first->Publish();  // blocks 0..6 of A + B
    }
    auto parent = engine->NewSession();
    ASSERT_TRUE(parent->Eval(ab, nullptr).ok());  // pages 0..6 from the prefix cache
    EXPECT_EQ(engine->kv_stats().prefix_hit_tokens, 112);
    auto child = parent->Fork();
    ASSERT_TRUE(child->Truncate(53).ok());  // inside block 3, shared three ways
    std::vector<float> got;
    ASSERT_TRUE(child->Eval(c, &got).ok());
    EXPECT_EQ(got, cold_logits(Concat(a, c)));
    ASSERT_TRUE(parent->Eval(d, &got).ok());
    EXPECT_EQ(got, cold_logits(Concat(ab, d)));
    // A new session matching the published prefix reads the cached pages, unchanged.
    auto again = engine->NewSession();
    const auto abd = Concat(ab, d);
    ASSERT_TRUE(again->Eval(abd, &got).ok());
    EXPECT_EQ(got, cold_logits(abd));
    // No leak: with the sessions gone, only the prefix cache holds pages.
    child.reset();
    parent.reset();
    again.reset();
    EXPECT_EQ(engine->kv_stats().pages_used, engine->kv_stats().pages_cached);
    engine->ClearPrefixCache();
    EXPECT_EQ(engine->kv_stats().pages_used, 0);
  }
}

// (5) Quest: decode steps after a truncation select the pages (and give the logits) they select
// in a fresh session of the same tokens; the key bounds of the pages kept whole stay.
TEST(KvTruncate, QuestSelectionAgrees) {
  const auto& ids = Ids();
  press::PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("quest", &o).ok());
  o.quest_pages = 3;
  for (int a_len : {160, 165}) {
    SCOPED_TRACE(a_len);
    auto engine = MakeEngine("f16", "f16"), fresh_engine = MakeEngine("f16", "f16");
    const auto a = Slice(ids, 0, a_len), b = Slice(ids, 200, 90);
    auto s = engine->NewSession();
    ASSERT_TRUE(s->EvalPressed(Concat(a, b), o, nullptr).ok());
    ASSERT_TRUE(EngineAccess::kv(*s).quest());
    ASSERT_TRUE(s->Truncate(a_len).ok());
    auto fresh = fresh_engine->NewSession();
    ASSERT_TRUE(fresh->EvalPressed(a, o, nullptr).ok());
    const ModelConfig& cfg = engine->config();
    for (int step = 0; step < 40; ++step) {  // one token at a time: Quest's decode steps
      const int32_t one[1] = {ids[500 + step]};
      std::vector<float> got, want;
      ASSERT_TRUE(s->Eval(one, &got).ok());
      ASSERT_TRUE(fresh->Eval(one, &want).ok());
      ASSERT_EQ(got, want) << "step " << step;
    }
    for (int l = 0; l < cfg.n_layers; ++l) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const auto kt = EngineAccess::kv(*s).key_bounds(l, h),
                   kf = EngineAccess::kv(*fresh).key_bounds(l, h);
        ASSERT_EQ(kt.size(), kf.size());
        EXPECT_EQ(std::memcmp(kt.data(), kf.data(), kt.size() * sizeof(kt[0])), 0);
      }
    }
  }
}

// Pressed sequences: each (layer, KV head) keeps the tokens it holds at positions below n. Back
// into what was generated after a pressed prompt, that is the state the sequence had then: the
// logits of a session pressed the same way given only the kept tokens. Back into the prompt, the
// tokens the press kept there (hot or demoted) stay, and decoding goes on.
TEST(KvTruncate, PressedSequencesKeepTheirTokensBelowN) {
  const auto& ids = Ids();
  const auto p = Slice(ids, 0, 200), b = Slice(ids, 300, 40), c = Slice(ids, 500, 10);
  for (const char* spec : {"snapkv", "knorm+demote:q4_0"}) {
    SCOPED_TRACE(spec);
    press::PressOptions o;
    ASSERT_TRUE(press::ParsePressSpec(spec, &o).ok());
    o.ratio = 0.5;
    auto engine = MakeEngine("f32", "f32"), fresh_engine = MakeEngine("f32", "f32");
    // The kept tokens are evaluated in the same chunks in both sessions: a chunk's blocks of one
    // token read the cold pages a decode step reads, so chunking changes a demoted sequence's
    // logits.
    auto s = engine->NewSession();
    ASSERT_TRUE(s->EvalPressed(p, o, nullptr).ok());
    ASSERT_TRUE(s->Eval(Slice(b, 0, 13), nullptr).ok());
    ASSERT_TRUE(s->Eval(Slice(b, 13, 27), nullptr).ok());
    auto into_prompt = s->Fork();
    ASSERT_TRUE(s->Truncate(200 + 13).ok());
    auto fresh = fresh_engine->NewSession();
    ASSERT_TRUE(fresh->EvalPressed(p, o, nullptr).ok());
    ASSERT_TRUE(fresh->Eval(Slice(b, 0, 13), nullptr).ok());
    EXPECT_EQ(EngineAccess::kv(*s).pages_held(), EngineAccess::kv(*fresh).pages_held());
    EXPECT_EQ(EngineAccess::kv(*s).bytes_held(), EngineAccess::kv(*fresh).bytes_held());
    EXPECT_EQ(EvalThenDecode(*s, c), EvalThenDecode(*fresh, c));

    // Into the prompt: every table keeps its tokens at positions < 150, the demoted ones too.
    const ModelConfig& cfg = engine->config();
    std::vector<std::vector<int32_t>> before(cfg.n_layers * cfg.n_kv_heads);
    for (int l = 0; l < cfg.n_layers; ++l) {
      for (int h = 0; h < cfg.n_kv_heads; ++h)
        EngineAccess::kv(*into_prompt).Positions(l, h, &before[l * cfg.n_kv_heads + h]);
    }
    ASSERT_TRUE(into_prompt->Truncate(150).ok());
    for (int l = 0; l < cfg.n_layers; ++l) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        std::vector<int32_t> pos, want;
        EngineAccess::kv(*into_prompt).Positions(l, h, &pos);
        for (int32_t x : before[l * cfg.n_kv_heads + h]) {
          if (x < 150) want.push_back(x);
        }
        EXPECT_EQ(pos, want);
        if (!o.demote.empty()) {  // every token below 150 is hot or cold
          EXPECT_EQ(int(pos.size()) + EngineAccess::kv(*into_prompt).cold_length(l, h), 150);
        }
      }
    }
    std::vector<float> logits;
    ASSERT_TRUE(into_prompt->Eval(c, &logits).ok());
    EXPECT_EQ(into_prompt->n_tokens(), 160);
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  }
}

}  // namespace
}  // namespace cachet
