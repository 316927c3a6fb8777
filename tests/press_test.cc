// Presses: eviction really frees pages (PagedSequence::Retain), every scorer on hand-built caches
// whose right answer is known, the budget allocators, and presses on the real kvtiny model.
#include "kv/press/press.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "kernels/kernels.h"
#include "kv/paged_sequence.h"
#include "model/transformer.h"
#include "runtime/engine_access.h"
#include "test_util.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace cachet {
namespace {

using press::Allocator;
using press::PressOptions;
using press::Scorer;

constexpr int kDim = 32;  // a whole q8_0 block

// A sequence of n tokens whose K/V rows are random, identical across tables except for a
// per-table offset, at positions 0..n-1. quest_pages > 0: Quest is on while they are appended.
struct TestCache {
  TestCache(KvLayout layout, int n, size_t capacity_pages = 4096, int quest_pages = 0)
      : lay(layout), pool(lay, capacity_pages * lay.page_bytes()), seq(pool) {
    if (quest_pages > 0) seq.set_quest(quest_pages, 1.0);
    std::mt19937 rng(7);
    std::normal_distribution<float> g;
    const int T = lay.n_layers * lay.n_kv_heads;
    k.assign(T, std::vector<float>(size_t(n) * lay.head_dim));
    v = k;
    for (int ti = 0; ti < T; ++ti) {
      for (auto& x : k[ti]) x = g(rng);
      for (auto& x : v[ti]) x = g(rng);
    }
    EXPECT_TRUE(seq.Reserve(n).ok());
    for (int j = 0; j < n; ++j) {
      for (int ti = 0; ti < T; ++ti) {
        seq.Append(ti / lay.n_kv_heads, ti % lay.n_kv_heads, &k[ti][size_t(j) * lay.head_dim],
                   &v[ti][size_t(j) * lay.head_dim], j);
      }
    }
    seq.CommitTokens(n);
  }
  KvLayout lay;
  PagePool pool;
  PagedSequence seq;
  std::vector<std::vector<float>> k, v;  // per table, [n][head_dim]
};

KvLayout Layout(int page_tokens, const char* codec = "f32") {
  KvLayout l{2, 2, kDim, page_tokens};
  l.codec_k = l.codec_v = codecs::ParseCodec(codec).value();
  return l;
}

std::vector<int32_t> RandomKeep(int n, int b, std::mt19937& rng) {
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(b);
  std::sort(idx.begin(), idx.end());
  return idx;
}

size_t PagesFor(int tokens, int pt) { return (tokens + pt - 1) / pt; }

TEST(PressRetain, KeepsExactlyTheChosenRowsAndFreesPages) {
  for (const char* codec : {"f32", "f16", "q8_0"}) {
    for (int pt : {1, 4, 16}) {
      for (int n : {1, 17, 97}) {
        SCOPED_TRACE(std::string(codec) + " pt=" + std::to_string(pt) + " n=" + std::to_string(n));
        TestCache c(Layout(pt, codec), n);
        std::mt19937 rng(n * 31 + pt);
        std::vector<std::vector<int32_t>> keep(4);
        for (auto& kp : keep)
          kp = RandomKeep(n, std::uniform_int_distribution<int>(0, n)(rng), rng);
        std::vector<std::vector<float>> before_k(4), before_v(4);
        std::vector<int32_t> pos;
        for (int ti = 0; ti < 4; ++ti)
          c.seq.Gather(ti / 2, ti % 2, &before_k[ti], &before_v[ti], &pos);
        ASSERT_TRUE(c.seq.Retain(keep).ok());
        size_t pages = 0;
        for (int ti = 0; ti < 4; ++ti) {
          std::vector<float> kk, vv;
          c.seq.Gather(ti / 2, ti % 2, &kk, &vv, &pos);
          ASSERT_EQ(c.seq.head_length(ti / 2, ti % 2), int(keep[ti].size()));
          for (size_t j = 0; j < keep[ti].size(); ++j) {
            EXPECT_EQ(pos[j], keep[ti][j]);
            for (int d = 0; d < kDim; ++d) {
              // Re-encoding a decoded row is exact for f32/f16 and within one q8_0 step.
              const float tol = std::string(codec) == "q8_0" ? 0.05f : 0.0f;
              EXPECT_NEAR(kk[j * kDim + d], before_k[ti][keep[ti][j] * kDim + d], tol);
              EXPECT_NEAR(vv[j * kDim + d], before_v[ti][keep[ti][j] * kDim + d], tol);
              // and still the rows that were appended (within the codec's own error)
              EXPECT_NEAR(kk[j * kDim + d], c.k[ti][keep[ti][j] * kDim + d], 0.05f);
            }
          }
          pages += PagesFor(int(keep[ti].size()), pt);
        }
        // Memory really falls: the pool holds the kept tokens' pages and nothing else.
        EXPECT_EQ(c.pool.used_bytes(), pages * c.lay.page_bytes());
        EXPECT_EQ(c.seq.bytes_held(), pages * c.lay.page_bytes());
        // The compacted cache keeps growing normally.
        ASSERT_TRUE(c.seq.Reserve(3).ok());
      }
    }
  }
}

TEST(PressRetain, AttentionOverRetainedEqualsContiguousOverSubset) {
  TestCache c(Layout(16), 200);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> keep(4);
  for (auto& kp : keep) kp = RandomKeep(200, 61, rng);
  ASSERT_TRUE(c.seq.Retain(keep).ok());
  std::vector<float> q(2 * kDim), out(2 * kDim), ref(2 * kDim);
  for (auto& x : q) x = std::normal_distribution<float>()(rng);
  const int32_t qpos = 500;
  kernels::AttnBatch b{q.data(), 2 * kDim, out.data(), 2 * kDim, &qpos, 1, 2, 0.25f};
  c.seq.Attend(1, 0, b);
  std::vector<float> kk, vv;
  std::vector<int32_t> kp;
  for (int j : keep[2]) {
    kk.insert(kk.end(), &c.k[2][j * kDim], &c.k[2][j * kDim] + kDim);
    vv.insert(vv.end(), &c.v[2][j * kDim], &c.v[2][j * kDim] + kDim);
    kp.push_back(j);
  }
  kernels::AttnBatch rb = b;
  rb.out = ref.data();
  kernels::ref::ContiguousAttention(rb, kk.data(), vv.data(), kp.data(), int(kp.size()), kDim);
  for (int i = 0; i < 2 * kDim; ++i) EXPECT_NEAR(out[i], ref[i], 1e-5);
}

TEST(PressRetain, SharedPagesAreCopiedAndFailureChangesNothing) {
  const KvLayout lay = Layout(4);
  TestCache c(lay, 16, /*capacity_pages=*/20);  // 16 pages used, 4 free
  auto child = c.seq.Fork();
  std::vector<float> pk, pv;
  std::vector<int32_t> ppos;
  c.seq.Gather(0, 0, &pk, &pv, &ppos);
  // Dropping token 0 rewrites every destination page of every table: 16 copies, 4 free.
  std::vector<std::vector<int32_t>> keep(4, std::vector<int32_t>(15));
  for (auto& kp : keep) std::iota(kp.begin(), kp.end(), 1);
  Status st = child->Retain(keep);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(child->head_length(0, 0), 16);
  EXPECT_EQ(c.pool.used_pages(), 16);
  // Keeping a prefix rewrites nothing: the shared pages are kept as they are, the tail freed.
  std::vector<std::vector<int32_t>> prefix(4, std::vector<int32_t>(8));
  for (auto& kp : prefix) std::iota(kp.begin(), kp.end(), 0);
  ASSERT_TRUE(child->Retain(prefix).ok());
  EXPECT_EQ(c.pool.used_pages(), 16);  // the parent still holds all of them
  // A write into a shared page copies it; the parent's rows are untouched.
  std::vector<std::vector<int32_t>> drop(4, {0, 2, 4, 6});
  ASSERT_TRUE(child->Retain(drop).ok());
  std::vector<float> ck, cv, k2, v2;
  std::vector<int32_t> cpos, pos2;
  child->Gather(0, 0, &ck, &cv, &cpos);
  EXPECT_EQ(cpos, (std::vector<int32_t>{0, 2, 4, 6}));
  c.seq.Gather(0, 0, &k2, &v2, &pos2);
  EXPECT_EQ(k2, pk);
  EXPECT_EQ(pos2, ppos);
  child.reset();
  EXPECT_EQ(c.pool.used_pages(), 16);
}

TEST(PressRetain, RejectsBadKeepLists) {
  TestCache c(Layout(4), 8);
  std::vector<std::vector<int32_t>> bad(4, {3, 1});
  EXPECT_EQ(c.seq.Retain(bad).code(), StatusCode::kInvalidArgument);
  std::vector<std::vector<int32_t>> out_of_range(4, {8});
  EXPECT_EQ(c.seq.Retain(out_of_range).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.seq.head_length(0, 0), 8);
}

// Staged layouts (KIVI keys; a recent window with sinks) evict too: each changed page is encoded
// again from what the cache held, in the kind the new length gives it (sealed in the codec, or
// f16 while in the window or a sink), and a forked parent keeps its pages.
TEST(PressRetain, StagedLayoutsEncodeChangedPagesAgain) {
  struct Case {
    const char* codec;
    int sinks, window;
  };
  for (const Case& cs : {Case{"kivi4", 0, 0}, Case{"q4_0", 4, 8}}) {
    SCOPED_TRACE(cs.codec);
    KvLayout lay = Layout(16, cs.codec);
    lay.sinks = cs.sinks;
    lay.window = cs.window;
    ASSERT_TRUE(lay.staged());
    TestCache c(lay, 40);
    const int hd = lay.head_dim;
    std::vector<int32_t> keep;
    for (int32_t j = 0; j < 40; ++j) {
      if (j != 1 && j != 5 && j != 17 && j != 30 && j != 31) keep.push_back(j);
    }
    const int n = int(keep.size());
    std::vector<float> old_k, old_v, pk, pv;
    std::vector<int32_t> old_pos, ppos;
    c.seq.Gather(1, 0, &old_k, &old_v, &old_pos);
    auto child = c.seq.Fork();
    ASSERT_TRUE(child->Retain(std::vector<std::vector<int32_t>>(4, keep)).ok());
    EXPECT_EQ(child->head_length(1, 0), n);
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    child->Gather(1, 0, &k, &v, &pos);
    EXPECT_EQ(pos, keep);
    size_t bytes = 0;
    for (int d = 0; d * 16 < n; ++d) {
      const int cnt = std::min(16, n - d * 16);
      const bool sealed = d < lay.SealedPages(n) && d * 16 >= lay.sinks;
      bytes += sealed ? lay.codec_page_bytes() : lay.raw_page_bytes();
      for (codecs::Role role : {codecs::Role::kKey, codecs::Role::kValue}) {
        const codecs::Codec cc = !sealed                      ? codecs::Codec::kF16
                                 : role == codecs::Role::kKey ? lay.codec_k
                                                              : lay.codec_v;
        const std::vector<float>& old = role == codecs::Role::kKey ? old_k : old_v;
        std::vector<float> rows(size_t(16) * hd), want(rows.size());
        for (int r = 0; r < cnt; ++r) {
          std::copy_n(&old[size_t(keep[d * 16 + r]) * hd], hd, &rows[size_t(r) * hd]);
        }
        std::vector<uint8_t> page(codecs::PageBytes(cc, role, 16, hd));
        codecs::EncodePage(cc, role, rows.data(), cnt, 16, hd, page.data());
        codecs::DecodePage(cc, role, page.data(), cnt, 16, hd, want.data());
        const std::vector<float>& got = role == codecs::Role::kKey ? k : v;
        for (int i = 0; i < cnt * hd; ++i) {
          ASSERT_EQ(got[size_t(d) * 16 * hd + i], want[i]) << "page " << d << " value " << i;
        }
      }
    }
    EXPECT_EQ(child->bytes_held(), 4 * bytes);
    c.seq.Gather(1, 0, &pk, &pv, &ppos);
    EXPECT_EQ(pk, old_k);
    EXPECT_EQ(pv, old_v);
    EXPECT_EQ(ppos, old_pos);
    // The child keeps decoding: new tokens land in its raw pages and age into the codec.
    ASSERT_TRUE(child->Reserve(40).ok());
    std::vector<float> row(hd, 0.5f);
    for (int j = 0; j < 40; ++j) {
      for (int ti = 0; ti < 4; ++ti) child->Append(ti / 2, ti % 2, row.data(), row.data(), 40 + j);
    }
    child->CommitTokens(40);
    EXPECT_EQ(child->head_length(1, 0), n + 40);
  }
}

// Feeds the observer one attention pass per table of queries that all look at `hot` key rows.
void ObservePrompt(TestCache& c, press::PressObserver& obs, int n, const std::vector<int>& hot) {
  c.seq.set_observer(&obs);
  const int window = obs.window();
  std::vector<float> q(size_t(window) * 2 * kDim), out(q.size());
  std::vector<int32_t> qpos(window);
  for (int ti = 0; ti < 4; ++ti) {
    for (int t = 0; t < window; ++t) {
      qpos[t] = n - window + t;
      for (int h = 0; h < 2; ++h) {
        float* qr = &q[(size_t(t) * 2 + h) * kDim];
        std::fill(qr, qr + kDim, 0.0f);
        for (int j : hot)
          for (int d = 0; d < kDim; ++d) qr[d] += 3.0f * c.k[ti][j * kDim + d];
      }
    }
    kernels::AttnBatch b{q.data(), 2 * kDim, out.data(), 2 * kDim, qpos.data(), window, 2, 1.0f};
    c.seq.Attend(ti / 2, ti % 2, b);
  }
  c.seq.set_observer(nullptr);
}

std::vector<int32_t> KeptPositions(const PagedSequence& s, int l, int h) {
  std::vector<int32_t> pos;
  s.Positions(l, h, &pos);
  return pos;
}

bool Has(const std::vector<int32_t>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

TEST(PressScorers, AttentionScorersKeepTheHotTokenAndSinks) {
  for (Scorer s : {Scorer::kSnapKV, Scorer::kH2O, Scorer::kTova, Scorer::kExpected}) {
    SCOPED_TRACE(press::ScorerName(s));
    const int n = 300;
    TestCache c(Layout(16), n);
    press::PressObserver obs(2, 2, kDim, n, 8);
    ObservePrompt(c, obs, n, {123});
    PressOptions o;
    o.scorer = s;
    o.window = 8;
    o.budget = 40;
    auto r = press::Compress(o, c.seq, 2, 2, &obs);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens_after, 4 * 40);
    EXPECT_LT(r->bytes_after, r->bytes_before);
    for (int ti = 0; ti < 4; ++ti) {
      const auto kept = KeptPositions(c.seq, ti / 2, ti % 2);
      EXPECT_EQ(kept.size(), 40u);
      EXPECT_TRUE(Has(kept, 123));
      for (int sink = 0; sink < 4; ++sink) EXPECT_TRUE(Has(kept, sink));
      if (s == Scorer::kSnapKV) {
        for (int w = n - 8; w < n; ++w) EXPECT_TRUE(Has(kept, w));  // the window stays
      }
    }
  }
}

TEST(PressScorers, PositionAndKeyScorers) {
  const int n = 64;
  {  // streaming: sinks + the most recent
    TestCache c(Layout(16), n);
    PressOptions o;
    o.scorer = Scorer::kStreaming;
    o.budget = 12;
    ASSERT_TRUE(press::Compress(o, c.seq, 2, 2, nullptr).ok());
    std::vector<int32_t> want = {0, 1, 2, 3};
    for (int j = n - 8; j < n; ++j) want.push_back(j);
    EXPECT_EQ(KeptPositions(c.seq, 1, 1), want);
  }
  {  // knorm keeps the smallest keys; keydiff the one pointing away from the rest
    PagePool pool(Layout(16), 64 * Layout(16).page_bytes());
    PagedSequence seq(pool);
    ASSERT_TRUE(seq.Reserve(n).ok());
    for (int j = 0; j < n; ++j) {
      std::vector<float> k(kDim, 1.0f + 0.01f * j), v(kDim, 1.0f);
      if (j == 40) std::fill(k.begin(), k.end(), 0.001f);
      if (j == 50) std::fill(k.begin(), k.begin() + kDim / 2, -5.0f);
      for (int ti = 0; ti < 4; ++ti) seq.Append(ti / 2, ti % 2, k.data(), v.data(), j);
    }
    seq.CommitTokens(n);
    auto fork = seq.Fork();
    PressOptions o;
    o.sinks = 0;
    o.budget = 1;
    o.scorer = Scorer::kKNorm;
    ASSERT_TRUE(press::Compress(o, seq, 2, 2, nullptr).ok());
    EXPECT_EQ(KeptPositions(seq, 0, 1), std::vector<int32_t>{40});
    o.scorer = Scorer::kKeyDiff;
    ASSERT_TRUE(press::Compress(o, *fork, 2, 2, nullptr).ok());
    EXPECT_EQ(KeptPositions(*fork, 0, 1), std::vector<int32_t>{50});
  }
  {  // random is seeded, differs from snapkv, and still keeps sinks
    TestCache a(Layout(16), 300), b(Layout(16), 300), c(Layout(16), 300);
    press::PressObserver obs(2, 2, kDim, 300, 8);
    ObservePrompt(c, obs, 300, {123});
    PressOptions o;
    o.budget = 40;
    o.scorer = Scorer::kRandom;
    ASSERT_TRUE(press::Compress(o, a.seq, 2, 2, nullptr).ok());
    ASSERT_TRUE(press::Compress(o, b.seq, 2, 2, nullptr).ok());
    EXPECT_EQ(KeptPositions(a.seq, 1, 0), KeptPositions(b.seq, 1, 0));
    o.scorer = Scorer::kSnapKV;
    o.window = 8;
    ASSERT_TRUE(press::Compress(o, c.seq, 2, 2, &obs).ok());
    EXPECT_NE(KeptPositions(a.seq, 1, 0), KeptPositions(c.seq, 1, 0));
    EXPECT_TRUE(Has(KeptPositions(a.seq, 1, 0), 0));
  }
}

TEST(PressScorers, BoundaryProtectionKeepsSegmentEdges) {
  TestCache c(Layout(16), 300);
  PressOptions o;
  o.scorer = Scorer::kRandom;
  o.sinks = 0;
  o.budget = 40;
  o.protect_boundaries = true;
  o.boundary_share = 0.2;  // 8 tokens: 2 at each end of both segments
  o.segment_starts = {0, 200};
  ASSERT_TRUE(press::Compress(o, c.seq, 2, 2, nullptr).ok());
  for (int ti = 0; ti < 4; ++ti) {
    const auto kept = KeptPositions(c.seq, ti / 2, ti % 2);
    EXPECT_EQ(kept.size(), 40u);
    for (int p : {0, 1, 198, 199, 200, 201, 298, 299}) EXPECT_TRUE(Has(kept, p)) << p;
  }
}

// Merge: evicted values fold into the more similar of their two kept neighbours.
TEST(PressMerge, FoldsEvictedValuesIntoTheMostSimilarKeptNeighbour) {
  const KvLayout lay = Layout(4);
  PagePool pool(lay, 64 * lay.page_bytes());
  PagedSequence seq(pool);
  ASSERT_TRUE(seq.Reserve(6).ok());
  const int axis[6] = {0, 0, 1, 1, 0, 1};  // token j's key points along axis[j]
  for (int j = 0; j < 6; ++j) {
    std::vector<float> k(kDim, 0.0f), v(kDim, float(j));
    k[axis[j]] = 1.0f;
    for (int ti = 0; ti < 4; ++ti) seq.Append(ti / 2, ti % 2, k.data(), v.data(), j);
  }
  seq.CommitTokens(6);
  auto fork = seq.Fork();  // shared pages: the merged rows must be written to private copies
  const std::vector<int32_t> keep = {0, 2, 5};
  std::vector<std::vector<float>> merged(4);
  for (int ti = 0; ti < 4; ++ti)
    press::MergeValues(seq, ti / 2, ti % 2, keep, nullptr, &merged[ti]);
  ASSERT_TRUE(seq.Retain(std::vector<std::vector<int32_t>>(4, keep), false, merged).ok());
  // 1 -> 0 (same key), 3 and 4 -> 2 (3 ties between 2 and 5: the earlier one; 4 matches neither)
  const float want[3] = {0.5f, 3.0f, 5.0f};
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  seq.Gather(1, 1, &k, &v, &pos);
  EXPECT_EQ(pos, keep);
  for (int x = 0; x < 3; ++x) EXPECT_FLOAT_EQ(v[x * kDim + 3], want[x]);
  fork->Gather(1, 1, &k, &v, &pos);  // the fork still sees the original values
  for (int j = 0; j < 6; ++j) EXPECT_EQ(v[j * kDim], float(j));
}

TEST(PressScorers, AttentionScorersNeedAnObserver) {
  TestCache c(Layout(16), 32);
  PressOptions o;
  o.scorer = Scorer::kSnapKV;
  o.budget = 8;
  auto r = press::Compress(o, c.seq, 2, 2, nullptr);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.seq.head_length(0, 0), 32);
}

// Expected attention's query statistics under RoPE: window queries that are one pre-RoPE vector
// u rotated to their positions are un-rotated to u exactly (no spread), and the future statistics
// rotate u to the future positions: to position end for one future position, to the averaged
// rotation A u for many.
TEST(PressObserverRope, QueryStatsRotateToTheFuturePositions) {
  const int d = 8, half = d / 2, end = 40, window = 4;
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = 1.0f / std::pow(10000.0f, 2.0f * i / d);
  const std::vector<double> u = {0.3, -1.2, 0.7, 2.0, -0.4, 0.9, 1.5, -0.8};
  auto rotate_to = [&](double pos) {  // RoPE (rotate-half) of u at pos
    std::vector<double> x(u);
    for (int i = 0; i < half; ++i) {
      const double c = std::cos(pos * inv_freq[i]), s = std::sin(pos * inv_freq[i]);
      x[i] = u[i] * c - u[i + half] * s;
      x[i + half] = u[i + half] * c + u[i] * s;
    }
    return x;
  };
  press::PressObserver obs(1, 1, d, end, window, 1u << press::PressObserver::kWindow);
  obs.set_rope(inv_freq);
  std::vector<float> q;
  std::vector<int32_t> pos;
  for (int p = end - 6; p < end; ++p) {  // two rows before the window, four in it
    for (double x : rotate_to(p)) q.push_back(float(x));
    pos.push_back(p);
  }
  kernels::AttnBatch b;
  b.q = q.data();
  b.q_stride = d;
  b.q_pos = pos.data();
  b.n_tok = static_cast<int>(pos.size());
  b.n_heads = 1;
  obs.Observe(0, 0, end, b);
  obs.Merge(0, 0);
  std::vector<double> mean, cov;
  obs.QueryStats(0, 0, 1, &mean, &cov);
  const std::vector<double> at_end = rotate_to(end);
  for (int i = 0; i < d; ++i) EXPECT_NEAR(mean[i], at_end[i], 1e-5) << i;
  for (double c : cov) EXPECT_NEAR(c, 0.0, 1e-5);
  obs.QueryStats(0, 0, 64, &mean, &cov);
  std::vector<double> avg(d, 0.0);
  for (int t = 0; t < 64; ++t) {
    const std::vector<double> x = rotate_to(end + t);
    for (int i = 0; i < d; ++i) avg[i] += x[i] / 64;
  }
  for (int i = 0; i < d; ++i) EXPECT_NEAR(mean[i], avg[i], 1e-5) << i;
  // The highest-frequency pair turns ~64 radians over 64 positions: its average shrinks.
  EXPECT_LT(std::hypot(mean[0], mean[half]), 0.2 * std::hypot(u[0], u[half]));
}

TEST(PressAllocators, SumToTheBudgetAndRespectFloors) {
  const int L = 6, H = 3, n = 1000;
  std::mt19937 rng(5);
  std::vector<std::vector<float>> scores(L * H, std::vector<float>(n));
  for (int ti = 0; ti < L * H; ++ti) {
    // Head 0 of every layer is concentrated, the others diffuse.
    for (int j = 0; j < n; ++j)
      scores[ti][j] = ti % H == 0 ? (j < 20 ? 1.0f : 1e-6f)
                                  : std::uniform_real_distribution<float>(0.4f, 0.6f)(rng);
  }
  for (Allocator a : {Allocator::kUniform, Allocator::kPyramid, Allocator::kAda}) {
    PressOptions o;
    o.allocator = a;
    for (int64_t total : {int64_t(L * H * 100), int64_t(L * H * 37 + 5)}) {
      const auto b = press::AllocateBudgets(o, L, H, n, total, 8, scores);
      EXPECT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), total);
      for (int x : b) {
        EXPECT_GE(x, 8);
        EXPECT_LE(x, n);
      }
      if (a == Allocator::kUniform) {
        EXPECT_LE(*std::max_element(b.begin(), b.end()) - *std::min_element(b.begin(), b.end()), 1);
      }
      if (a == Allocator::kPyramid) {
        for (int l = 1; l < L; ++l) EXPECT_LE(b[l * H], b[(l - 1) * H]);
        EXPECT_GT(b[0], 3 * b[(L - 1) * H]);
      }
      if (a == Allocator::kAda) {
        const int mean = int(total / (L * H));
        for (int l = 0; l < L; ++l) {
          EXPECT_GE(b[l * H], int(std::ceil(0.2 * mean)) - 1);  // the floor
          EXPECT_LT(b[l * H], b[l * H + 1]);                    // concentrated head needs fewer
        }
      }
    }
  }
}

TEST(PressSpec, ParsesModifiersAndRejectsNonsense) {
  PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("snapkv+ada", &o).ok());
  EXPECT_EQ(o.scorer, Scorer::kSnapKV);
  EXPECT_EQ(o.allocator, Allocator::kAda);
  ASSERT_TRUE(press::ParsePressSpec("pyramidkv", &o).ok());
  EXPECT_EQ(o.allocator, Allocator::kPyramid);
  EXPECT_EQ(press::PressSpec(o), "snapkv+pyramid");
  ASSERT_TRUE(press::ParsePressSpec("knorm+protect+chunked+demote:q4_0", &o).ok());
  EXPECT_TRUE(o.protect_boundaries && o.during_prefill && o.demote == "q4_0");
  EXPECT_EQ(press::PressSpec(o), "knorm+protect+chunked+demote:q4_0");
  ASSERT_TRUE(press::ParsePressSpec("h2o+max", &o).ok());
  EXPECT_EQ(o.share, press::ShareLayers::kMax);
  // A demote codec whose name holds a '+', then a modifier after it.
  ASSERT_TRUE(press::ParsePressSpec("snapkv+demote:rot3+qjl+max", &o).ok());
  EXPECT_EQ(o.demote, "rot3+qjl");
  EXPECT_EQ(o.share, press::ShareLayers::kMax);
  ASSERT_TRUE(press::ParsePressSpec("snapkv+demote:rot3+max", &o).ok());
  EXPECT_EQ(o.demote, "rot3");
  EXPECT_FALSE(press::ParsePressSpec("snapkv+ada+max", &o).ok());
  EXPECT_FALSE(press::ParsePressSpec("snapkv+bogus", &o).ok());
  EXPECT_FALSE(press::ParsePressSpec("nope", &o).ok());
}

// Demote, don't drop: evicted tokens move to a cold pool in a low-bit codec; attention reads the
// hot pages plus (all, or at decode the best-bound fraction of) the cold ones.
TEST(PressDemote, EvictedTokensMoveToTheColdPoolAndStillCount) {
  const int n = 200, pt = 16;
  TestCache c(Layout(pt), n);
  KvLayout cold_lay = Layout(pt, "q8_0");
  PagePool cold(cold_lay, 4096 * cold_lay.page_bytes());
  std::vector<float> q(3 * 2 * kDim), full(q.size()), out(q.size());
  std::mt19937 rng(5);
  for (auto& x : q) x = std::normal_distribution<float>()(rng);
  const int32_t qpos[3] = {n, n + 1, n + 2};
  kernels::AttnBatch b{q.data(), 2 * kDim, full.data(), 2 * kDim, qpos, 3, 2, 0.25f};
  c.seq.Attend(1, 0, b);
  const size_t hot_before = c.pool.used_bytes();
  c.seq.set_cold_pool(&cold, 1.0);
  std::vector<std::vector<int32_t>> keep(4);
  for (auto& k : keep) k = RandomKeep(n, 50, rng);
  ASSERT_TRUE(c.seq.Retain(keep, /*demote=*/true).ok());
  for (int ti = 0; ti < 4; ++ti) {
    EXPECT_EQ(c.seq.head_length(ti / 2, ti % 2), 50);
    EXPECT_EQ(c.seq.cold_length(ti / 2, ti % 2), 150);
  }
  // Hot memory falls by the ratio; the cold pool holds the rest at q8_0's size.
  EXPECT_EQ(c.pool.used_bytes(), 4 * PagesFor(50, pt) * c.lay.page_bytes());
  EXPECT_LT(c.pool.used_bytes(), hot_before / 3);
  EXPECT_EQ(cold.used_bytes(), 4 * PagesFor(150, pt) * cold_lay.page_bytes());
  EXPECT_EQ(c.seq.bytes_held(), c.pool.used_bytes() + cold.used_bytes());
  // Prefill-style attention (three query tokens) reads every page: the full result, up to
  // q8_0's error on the demoted rows.
  b.out = out.data();
  c.seq.Attend(1, 0, b);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], full[i], 2e-2) << i;
  // A decode step reading a fraction of the cold pages reads less.
  c.seq.set_cold_pool(&cold, 0.1);
  kernels::AttnBatch d = b;
  d.n_tok = 1;
  d.decode = true;
  std::vector<float> one(2 * kDim), one_full(2 * kDim);
  d.out = one.data();
  c.seq.Attend(1, 0, d);
  c.seq.set_cold_pool(&cold, 1.0);
  d.out = one_full.data();
  c.seq.Attend(1, 0, d);
  float diff = 0;
  for (int i = 0; i < 2 * kDim; ++i) diff = std::max(diff, std::abs(one[i] - one_full[i]));
  EXPECT_GT(diff, 1e-4);
  for (int i = 0; i < 2 * kDim; ++i) EXPECT_NEAR(one_full[i], full[i], 2e-2);
  // Forks share cold pages; clearing returns them.
  auto fork = c.seq.Fork();
  EXPECT_EQ(fork->cold_length(0, 0), 150);
  fork.reset();
  c.seq.Clear();
  EXPECT_EQ(cold.used_bytes(), 0u);
  EXPECT_EQ(c.pool.used_bytes(), 0u);
}

// Quest: a decode step reads the top-k pages by key-bound score plus the last page, exactly as
// attention over those pages' keys would; prefill chunks and small caches read everything.
TEST(PressQuest, DecodeReadsTheTopBoundPagesPlusTheLast) {
  for (const char* codec : {"f32", "q8_0"}) {
    SCOPED_TRACE(codec);
    const int n = 203, pt = 16, k = 3;
    TestCache c(Layout(pt, codec), n);
    std::mt19937 rng(11);
    std::normal_distribution<float> g;
    std::vector<float> q(2 * kDim), out(2 * kDim), want(2 * kDim), full(2 * kDim);
    for (auto& x : q) x = g(rng);
    const int32_t qpos = n;
    kernels::AttnBatch b{q.data(), 2 * kDim, out.data(), 2 * kDim, &qpos, 1, 2, 0.25f};
    b.decode = true;  // Quest selects pages for decode steps only
    kernels::AttnBatch bf = b;
    bf.out = full.data();
    c.seq.Attend(1, 1, bf);
    c.seq.set_quest(k, 1.0);
    c.seq.Attend(1, 1, b);
    // Expected: bounds from the stored (decoded) keys, top k of the 12 full pages but the last.
    std::vector<float> kk, vv;
    std::vector<int32_t> pos;
    c.seq.Gather(1, 1, &kk, &vv, &pos);
    const int n_pages = (n + pt - 1) / pt;
    std::vector<std::pair<float, int>> ub;
    for (int p = 0; p + 1 < n_pages; ++p) {
      float best = -1e30f;
      for (int h = 0; h < 2; ++h) {
        float s = 0;
        for (int i = 0; i < kDim; ++i) {
          float lo = 1e30f, hi = -1e30f;
          for (int j = p * pt; j < (p + 1) * pt; ++j) {
            lo = std::min(lo, kk[j * kDim + i]);
            hi = std::max(hi, kk[j * kDim + i]);
          }
          s += std::max(q[h * kDim + i] * lo, q[h * kDim + i] * hi);
        }
        best = std::max(best, s);
      }
      ub.push_back({-best, p});
    }
    std::sort(ub.begin(), ub.end());
    std::vector<int> pages;
    for (int i = 0; i < k; ++i) pages.push_back(ub[i].second);
    std::sort(pages.begin(), pages.end());
    pages.push_back(n_pages - 1);
    std::vector<float> sk, sv;
    std::vector<int32_t> sp;
    for (int p : pages) {
      for (int j = p * pt; j < std::min(n, (p + 1) * pt); ++j) {
        sk.insert(sk.end(), &kk[j * kDim], &kk[j * kDim] + kDim);
        sv.insert(sv.end(), &vv[j * kDim], &vv[j * kDim] + kDim);
        sp.push_back(pos[j]);
      }
    }
    kernels::AttnBatch rb = b;
    rb.out = want.data();
    kernels::ref::ContiguousAttention(rb, sk.data(), sv.data(), sp.data(), int(sp.size()), kDim);
    float diff_full = 0;
    for (int i = 0; i < 2 * kDim; ++i) {
      // q8_0 keys are scored with the query quantized to 8 bits (kernels/block_keys.h).
      EXPECT_NEAR(out[i], want[i], std::string(codec) == "q8_0" ? 1e-2 : 1e-5) << i;
      diff_full = std::max(diff_full, std::abs(out[i] - full[i]));
    }
    EXPECT_GT(diff_full, 1e-4);  // it really read fewer pages
    // Enough pages to cover everything: the same as full attention.
    c.seq.set_quest(100, 1.0);
    c.seq.Attend(1, 1, b);
    for (int i = 0; i < 2 * kDim; ++i) EXPECT_EQ(out[i], full[i]);
  }
}

TEST(PressQuest, PicksThePageTheQueryPointsAt) {
  // Small keys everywhere but token 137, which the query points at: its page has the highest
  // bound, so reading one page besides the last gives (nearly) its value.
  const int n = 320, pt = 16;
  const KvLayout lay = Layout(pt);
  PagePool pool(lay, 256 * lay.page_bytes());
  PagedSequence seq(pool);
  ASSERT_TRUE(seq.Reserve(n).ok());
  std::mt19937 rng(2);
  std::normal_distribution<float> g;
  std::vector<float> hot_k(kDim), hot_v(kDim);
  for (int j = 0; j < n; ++j) {
    std::vector<float> k(kDim), v(kDim);
    for (auto& x : k) x = (j == 137 ? 1.0f : 0.1f) * g(rng);
    for (auto& x : v) x = g(rng);
    if (j == 137) hot_k = k, hot_v = v;
    for (int ti = 0; ti < 4; ++ti) seq.Append(ti / 2, ti % 2, k.data(), v.data(), j);
  }
  seq.CommitTokens(n);
  seq.set_quest(1, 1.0);
  std::vector<float> q(2 * kDim), out(2 * kDim);
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < kDim; ++d) q[h * kDim + d] = 2.0f * hot_k[d];
  const int32_t qpos = n;
  kernels::AttnBatch b{q.data(), 2 * kDim, out.data(), 2 * kDim, &qpos, 1, 2, 0.25f};
  b.decode = true;
  seq.Attend(0, 0, b);
  float dot = 0, on = 0, vn = 0;
  for (int d = 0; d < kDim; ++d) {
    dot += out[d] * hot_v[d];
    on += out[d] * out[d];
    vn += hot_v[d] * hot_v[d];
  }
  EXPECT_GT(dot / std::sqrt(on * vn), 0.9f);
}

// Quest's key bounds, built by Append as pages reach their final form when Quest is on during
// the prompt, equal bit for bit those the first decode step builds otherwise, in every kind of
// layout (plain, row-wise codecs, KIVI's staged keys, a rotation codec, sinks and a recent window
// whose pages are bounded raw), and decode steps read the same pages; forks and Retain fall back
// on the lazy fill, after which pages are bounded as they fill again.
TEST(PressQuest, BoundsBuiltAsPagesFillEqualTheLazyOnes) {
  struct Case {
    const char* codec;
    int sinks, window;
  };
  for (const Case& cs : {Case{"f32", 0, 0}, Case{"f16", 0, 0}, Case{"q8_0", 0, 0},
                         Case{"kivi4", 0, 0}, Case{"rot4", 0, 0}, Case{"q4_0", 20, 40}}) {
    SCOPED_TRACE(cs.codec);
    const int n = 203, pt = 16, hd = kDim;
    KvLayout lay = Layout(pt, cs.codec);
    lay.sinks = cs.sinks;
    lay.window = cs.window;
    TestCache eager(lay, n, 4096, /*quest_pages=*/3);
    TestCache lazy(lay, n);
    // Pages in their final form after the prompt: all full ones, or with a window the sealed
    // ones and the sinks'.
    const int64_t final_pages =
        cs.window > 0 ? std::max<int64_t>(lay.SealedPages(n), (cs.sinks + pt - 1) / pt) : n / pt;
    ASSERT_GT(final_pages, 3);
    for (int ti = 0; ti < 4; ++ti) {
      EXPECT_EQ(eager.seq.key_bounds(ti / 2, ti % 2).size(), size_t(final_pages) * 2 * hd);
      EXPECT_TRUE(lazy.seq.key_bounds(ti / 2, ti % 2).empty());
    }
    lazy.seq.set_quest(3, 1.0);
    std::mt19937 rng(5);
    std::normal_distribution<float> g;
    std::vector<float> q(2 * kDim), out_e(2 * kDim), out_l(2 * kDim);
    for (auto& x : q) x = g(rng);
    const int32_t qpos = n;
    kernels::AttnBatch be{q.data(), 2 * kDim, out_e.data(), 2 * kDim, &qpos, 1, 2, 0.25f};
    be.decode = true;  // decode steps build the lazy bounds
    kernels::AttnBatch bl = be;
    bl.out = out_l.data();
    // Bounds of the stored keys, whatever stores them (loosely: Gather decodes another way), of
    // the pages from `from` on.
    auto check_stored = [&](const PagedSequence& seq, int l, int h, size_t from = 0) {
      std::vector<float> kk, vv;
      std::vector<int32_t> pos;
      seq.Gather(l, h, &kk, &vv, &pos);
      const auto kb = seq.key_bounds(l, h);
      for (size_t p = from; p < kb.size() / (2 * hd); ++p) {
        for (int i = 0; i < hd; ++i) {
          float lo = 1e30f, hi = -1e30f;
          for (size_t j = p * pt; j < (p + 1) * pt; ++j) {
            lo = std::min(lo, kk[j * hd + i]);
            hi = std::max(hi, kk[j * hd + i]);
          }
          // f16, rounded outward: below the minimum and above the maximum, within an f16 step.
          const float blo = F16ToF32(kb[p * 2 * hd + i]), bhi = F16ToF32(kb[p * 2 * hd + hd + i]);
          ASSERT_LE(blo, lo + 1e-4f * (1 + std::abs(lo))) << p << " " << i;
          ASSERT_GE(bhi, hi - 1e-4f * (1 + std::abs(hi))) << p << " " << i;
          ASSERT_NEAR(blo, lo, 2e-3f * (1 + std::abs(lo))) << p << " " << i;
          ASSERT_NEAR(bhi, hi, 2e-3f * (1 + std::abs(hi))) << p << " " << i;
        }
      }
    };
    auto same_bounds = [&](const PagedSequence& a, const PagedSequence& b, int l, int h,
                           size_t pages) {
      const auto ka = a.key_bounds(l, h), kb = b.key_bounds(l, h);
      ASSERT_GE(ka.size(), pages * 2 * hd);
      ASSERT_GE(kb.size(), pages * 2 * hd);
      EXPECT_EQ(std::memcmp(ka.data(), kb.data(), pages * 2 * hd * sizeof(uint16_t)), 0);
    };
    const size_t candidates = (n + pt - 1) / pt - 1;
    for (int ti = 0; ti < 4; ++ti) {
      const int l = ti / 2, h = ti % 2;
      eager.seq.Attend(l, h, be);
      lazy.seq.Attend(l, h, bl);
      EXPECT_EQ(eager.seq.key_bounds(l, h).size(), candidates * 2 * hd);
      same_bounds(eager.seq, lazy.seq, l, h, candidates);
      check_stored(eager.seq, l, h);
      EXPECT_EQ(std::memcmp(out_e.data(), out_l.data(), out_e.size() * sizeof(float)), 0);
    }
    // A fork starts without bounds and builds the same ones lazily.
    auto fork = eager.seq.Fork();
    EXPECT_TRUE(fork->key_bounds(1, 1).empty());
    fork->Attend(1, 1, bl);
    same_bounds(*fork, eager.seq, 1, 1, candidates);
    EXPECT_EQ(std::memcmp(out_e.data(), out_l.data(), out_e.size() * sizeof(float)), 0);
    // Retain drops them; appending does not rebuild them all (the next decode step does, as on a
    // sequence that had Quest off meanwhile), then pages filled afterwards get theirs at once.
    std::vector<int32_t> keep;
    for (int32_t j = 0; j < n; ++j) {
      if (j % 7 != 3) keep.push_back(j);
    }
    const std::vector<std::vector<int32_t>> keeps(4, keep);
    ASSERT_TRUE(eager.seq.Retain(keeps).ok());
    lazy.seq.set_quest(0, 1.0);
    ASSERT_TRUE(lazy.seq.Retain(keeps).ok());
    EXPECT_TRUE(eager.seq.key_bounds(0, 1).empty());
    const int more = pt + 5, m = int(keep.size()) + more;
    ASSERT_TRUE(eager.seq.Reserve(more).ok());
    ASSERT_TRUE(lazy.seq.Reserve(more).ok());
    for (int j = 0; j < more; ++j) {
      for (int ti = 0; ti < 4; ++ti) {
        const float* k = &eager.k[ti][size_t(j) * hd];
        const float* v = &eager.v[ti][size_t(j) * hd];
        eager.seq.Append(ti / 2, ti % 2, k, v, n + j);
        lazy.seq.Append(ti / 2, ti % 2, k, v, n + j);
      }
    }
    eager.seq.CommitTokens(more);
    lazy.seq.CommitTokens(more);
    EXPECT_TRUE(eager.seq.key_bounds(0, 1).empty());
    EXPECT_TRUE(lazy.seq.key_bounds(0, 1).empty());
    lazy.seq.set_quest(3, 1.0);
    const int32_t qpos_m = n + more;
    be.q_pos = bl.q_pos = &qpos_m;
    eager.seq.Attend(0, 1, be);
    lazy.seq.Attend(0, 1, bl);
    same_bounds(eager.seq, lazy.seq, 0, 1, (m + pt - 1) / pt - 1);
    check_stored(eager.seq, 0, 1);
    EXPECT_EQ(std::memcmp(out_e.data(), out_l.data(), out_e.size() * sizeof(float)), 0);
    // Two more pages' worth of tokens: the pages reaching their final form are bounded as they do.
    const int64_t had = int64_t(eager.seq.key_bounds(0, 1).size() / (2 * hd));
    ASSERT_TRUE(eager.seq.Reserve(2 * pt).ok());
    for (int j = 0; j < 2 * pt; ++j) {
      for (int ti = 0; ti < 4; ++ti) {
        eager.seq.Append(ti / 2, ti % 2, &eager.k[ti][size_t(more + j) * hd],
                         &eager.v[ti][size_t(more + j) * hd], n + more + j);
      }
    }
    eager.seq.CommitTokens(2 * pt);
    const int m2 = m + 2 * pt;
    const int64_t final_m2 =
        cs.window > 0 ? std::max<int64_t>(lay.SealedPages(m2), (cs.sinks + pt - 1) / pt) : m2 / pt;
    EXPECT_EQ(int64_t(eager.seq.key_bounds(0, 1).size() / (2 * hd)), std::max(had, final_m2));
    // (Window pages bounded raw keep those bounds once sealed, as they always have.)
    check_stored(eager.seq, 0, 1, size_t(had));
  }
}

// kvtiny on 2 threads without a prefix cache (these tests look at one sequence's pages).
std::unique_ptr<Engine> KvtinyEngine(int ubatch = 512, const char* codec_k = "f32",
                                     const char* codec_v = "f32", int sinks = 0, int window = 0) {
  EngineOptions eo;
  eo.model_dir = testing::ModelDir();
  eo.threads = 2;
  eo.ubatch = ubatch;
  eo.prefix_cache = false;
  eo.kv_codec_k = codec_k;
  eo.kv_codec_v = codec_v;
  eo.kv_sinks = sinks;
  eo.kv_window = window;
  auto engine = Engine::Create(eo);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// A prompt of n in-vocabulary tokens with no structure.
std::vector<int32_t> SyntheticPrompt(int n) {
  std::vector<int32_t> prompt(n);
  for (int i = 0; i < n; ++i) prompt[i] = 10 + int32_t(int64_t(i) * 7919 % 400);
  return prompt;
}

// Session::PrepareForPress turns Quest on before the prompt (as `cachet bench --press quest` and
// EvalPressed do): every full page has its bounds when the prompt is in, and decode steps give
// the logits that bounds built lazily by the first decode step give.
TEST(PressEngine, QuestBoundsAreBuiltDuringThePrompt) {
  auto engine = KvtinyEngine(128, "f16", "f16");
  ASSERT_NE(engine, nullptr);
  PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("quest", &o).ok());
  o.ratio = 0.75;
  const auto prompt = SyntheticPrompt(300);
  const int n = static_cast<int>(prompt.size());
  auto eager = engine->NewSession(), lazy = engine->NewSession();
  eager->PrepareForPress(o, n);
  ASSERT_TRUE(eager->Eval(prompt, nullptr).ok());
  lazy->ObserveForPress(n, o.window, press::GatheringsFor(o));
  ASSERT_TRUE(lazy->Eval(prompt, nullptr).ok());
  const ModelConfig& c = engine->config();
  const int pt = EngineAccess::kv(*eager).layout().page_tokens, hd = c.head_dim;
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      EXPECT_EQ(EngineAccess::kv(*eager).key_bounds(l, h).size(), size_t(n / pt) * 2 * hd);
      EXPECT_TRUE(EngineAccess::kv(*lazy).key_bounds(l, h).empty());
    }
  }
  ASSERT_TRUE(eager->Compress(o).ok());
  ASSERT_TRUE(lazy->Compress(o).ok());
  std::vector<float> le, ll;
  for (int i = 0; i < 3; ++i) {
    const int32_t one[1] = {prompt[i]};
    ASSERT_TRUE(eager->Eval(one, &le).ok());
    ASSERT_TRUE(lazy->Eval(one, &ll).ok());
    EXPECT_EQ(le, ll) << i;
  }
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const auto ke = EngineAccess::kv(*eager).key_bounds(l, h),
                 kl = EngineAccess::kv(*lazy).key_bounds(l, h);
      ASSERT_EQ(ke.size(), kl.size());
      EXPECT_EQ(std::memcmp(ke.data(), kl.data(), ke.size() * sizeof(ke[0])), 0) << l << " " << h;
    }
  }
}

// A prompt chunk reads every page even where the forward step splits it among threads into
// blocks of one token (13 tokens on 2 threads): only decode steps (AttnBatch::decode) read
// Quest's subset, so the chunk's logits are those of a session without Quest.
TEST(PressEngine, PromptChunksReadEveryPageUnderQuest) {
  auto engine = KvtinyEngine();
  ASSERT_NE(engine, nullptr);
  PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("quest", &o).ok());
  o.quest_pages = 2;
  const auto prompt = SyntheticPrompt(300);
  auto quest = engine->NewSession(), plain = engine->NewSession();
  ASSERT_TRUE(quest->EvalPressed(prompt, o, nullptr).ok());
  ASSERT_TRUE(plain->Eval(prompt, nullptr).ok());
  const std::vector<int32_t> chunk(prompt.begin(), prompt.begin() + 13);
  std::vector<float> lq, lp;
  ASSERT_TRUE(quest->Eval(chunk, &lq, /*all_logits=*/true).ok());
  ASSERT_TRUE(plain->Eval(chunk, &lp, /*all_logits=*/true).ok());
  EXPECT_EQ(lq, lp);
  // A decode step does read the subset: its logits differ.
  const int32_t one[1] = {prompt[20]};
  ASSERT_TRUE(quest->Eval(one, &lq).ok());
  ASSERT_TRUE(plain->Eval(one, &lp).ok());
  EXPECT_NE(lq, lp);
}

// Forks of one observed prefill share its observer: pressing one fork must not disturb what the
// next one reads (eval sweeps fork every configuration from one prefill).
TEST(PressEngine, ForksOfAnObservedPrefillPressIndependently) {
  auto engine = KvtinyEngine();
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = SyntheticPrompt(700);
  auto base = engine->NewSession();
  base->ObserveForPress(700, 32, 7);
  ASSERT_TRUE(base->Eval(prompt, nullptr).ok());
  std::vector<std::vector<int32_t>> kept;
  for (const char* spec : {"h2o", "h2o", "snapkv+max", "tova"}) {
    press::PressOptions o;
    ASSERT_TRUE(press::ParsePressSpec(spec, &o).ok());
    o.ratio = 0.75;
    auto fork = base->Fork();
    auto r = fork->Compress(o);
    ASSERT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
    std::vector<int32_t> pos;
    EngineAccess::kv(*fork).Positions(1, 0, &pos);
    kept.push_back(pos);
  }
  EXPECT_EQ(kept[0], kept[1]);  // the same press on the same prefill keeps the same tokens
}

// Pressing again while decoding: every N tokens the cache goes back to the prompt's budget, and
// H2O's scores keep accumulating (the observer is compacted with the cache, not dropped).
TEST(PressEngine, DecodeEveryKeepsTheBudget) {
  auto engine = KvtinyEngine();
  ASSERT_NE(engine, nullptr);
  const ModelConfig& cfg = engine->config();
  const std::vector<int32_t> prompt = SyntheticPrompt(600);
  for (const char* spec : {"h2o", "snapkv+max", "streaming+chunked"}) {
    SCOPED_TRACE(spec);
    GenerateOptions g;
    g.max_tokens = 12;
    g.sampling.temperature = 0;
    g.stop_at_eos = false;
    g.press.emplace();
    ASSERT_TRUE(press::ParsePressSpec(spec, &*g.press).ok());
    g.press->ratio = 0.75;
    g.press->decode_every = 4;
    auto s = engine->NewSession();
    auto r = s->Generate(prompt, g);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens.size(), 12u);
    // 11 tokens evaluated after the prompt (the 12th is pending); pressed after the 4th and
    // 8th: 150 + 3.
    for (int l = 0; l < cfg.n_layers; ++l) EXPECT_EQ(EngineAccess::kv(*s).head_length(l, 0), 153);
  }
}

// Compression during prefill: the cache never holds more than the budget plus one chunk, and ends
// at the budget.
TEST(PressEngine, CompressDuringPrefillBoundsPeakMemory) {
  auto engine = KvtinyEngine(256);
  ASSERT_NE(engine, nullptr);
  const ModelConfig& cfg = engine->config();
  const std::vector<int32_t> prompt = SyntheticPrompt(2000);
  const double bytes_per_token = engine->kv_stats().bytes_per_token;
  for (const char* spec : {"snapkv+chunked", "streaming+chunked", "h2o+ada+chunked"}) {
    SCOPED_TRACE(spec);
    press::PressOptions o;
    ASSERT_TRUE(press::ParsePressSpec(spec, &o).ok());
    o.ratio = 0.875;  // 250 of 2000 tokens
    auto s = engine->NewSession();
    size_t peak = 0;
    std::vector<float> logits;
    press::PressResult total;
    ASSERT_TRUE(s->EvalCompressing(prompt, o, &logits, &peak, &total).ok());
    EXPECT_EQ(logits.size(), size_t(cfg.vocab_size));
    // The chunks' presses added up: every token went in, the budget stayed.
    const int64_t tables = int64_t(cfg.n_layers) * cfg.n_kv_heads;
    EXPECT_EQ(total.tokens_before, tables * 2000);
    EXPECT_EQ(total.tokens_after, tables * 250);
    EXPECT_EQ(total.bytes_after, s->kv_bytes());
    EXPECT_EQ(total.peak_bytes, peak);
    EXPECT_GT(total.ms, 0);
    EXPECT_EQ(s->n_tokens(), 2000);
    int64_t kept = 0;
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int h = 0; h < cfg.n_kv_heads; ++h) kept += EngineAccess::kv(*s).head_length(l, h);
    EXPECT_EQ(kept, int64_t(cfg.n_layers) * cfg.n_kv_heads * 250);
    // Budget + one chunk, each table rounded up to whole pages.
    const double bound = (250 + 256 + 2.0 * engine->options().page_tokens) * bytes_per_token;
    EXPECT_LE(double(peak), bound);
    EXPECT_GT(double(peak), (250 + 200) * bytes_per_token);  // it did hold a chunk
  }
}

// Chunked prefill with demotion: later chunks attend to the cold pages too, so the observer sees
// hot + cold keys; only the hot ones are scored, and every evicted token ends in the cold pool.
TEST(PressEngine, CompressDuringPrefillWithDemotion) {
  auto engine = KvtinyEngine(256);
  ASSERT_NE(engine, nullptr);
  const ModelConfig& cfg = engine->config();
  press::PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("snapkv+max+chunked+demote:q4_0", &o).ok());
  o.ratio = 0.875;
  auto s = engine->NewSession();
  size_t peak = 0;
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalCompressing(SyntheticPrompt(2000), o, &logits, &peak).ok());
  for (int l = 0; l < cfg.n_layers; ++l) {
    for (int h = 0; h < cfg.n_kv_heads; ++h) {
      EXPECT_EQ(EngineAccess::kv(*s).head_length(l, h), 250);
      EXPECT_EQ(EngineAccess::kv(*s).cold_length(l, h), 1750);
    }
  }
  EXPECT_GT(engine->kv_stats().cold_bytes_used, 0u);
}

// The gathering through the real forward pass: several threads attend to one head at once (the
// forward pass splits a head's query tokens), so a lost update would show in the sums. Every
// observed row's weights sum to 1.
TEST(PressObserverModel, WeightsSumToTheObservedRows) {
  auto engine = KvtinyEngine(256);
  ASSERT_NE(engine, nullptr);
  const ModelConfig& cfg = engine->config();
  const int n = 700, window = 24, group = cfg.n_heads / cfg.n_kv_heads;
  std::vector<int32_t> tokens(n), positions(n);
  for (int i = 0; i < n; ++i) tokens[i] = 10 + i * 13 % 300, positions[i] = i;
  PagedSequence seq(EngineAccess::kv_pool(*engine));
  press::PressObserver obs(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, window);
  seq.set_observer(&obs);
  ASSERT_TRUE(seq.Reserve(n).ok());
  std::vector<float> logits(cfg.vocab_size);
  for (int start = 0; start < n; start += 256) {
    const int m = std::min(256, n - start);
    ASSERT_TRUE(EngineAccess::model(*engine)
                    .Forward(std::span(tokens).subspan(start, m),
                             std::span(positions).subspan(start, m), seq,
                             EngineAccess::threads(*engine), logits.data(), false)
                    .ok());
  }
  for (int l = 0; l < cfg.n_layers; ++l) {
    for (int h = 0; h < cfg.n_kv_heads; ++h) {
      auto sum = [&](press::PressObserver::Gathering g) {
        const auto& w = obs.weights(l, h, g);
        EXPECT_EQ(w.size(), size_t(n));
        return std::accumulate(w.begin(), w.end(), 0.0);
      };
      EXPECT_NEAR(sum(press::PressObserver::kAll), double(n) * group, 1e-3 * n);
      EXPECT_NEAR(sum(press::PressObserver::kWindow), double(window) * group, 1e-3 * window);
      EXPECT_NEAR(sum(press::PressObserver::kLast), double(group), 1e-4);
    }
  }
}

// On kvtiny: every press runs after a real prompt, frees memory in proportion to the ratio, and
// leaves a cache the model keeps decoding from.
TEST(PressEngine, EveryPressFreesMemoryOnKvtiny) {
  auto engine = KvtinyEngine();
  ASSERT_NE(engine, nullptr);
  const ModelConfig& cfg = engine->config();
  const std::vector<int32_t> prompt = SyntheticPrompt(600);
  auto base = engine->NewSession();
  GenerateOptions full;
  full.max_tokens = 4;
  full.sampling.temperature = 0;
  ASSERT_TRUE(base->Generate(prompt, full).ok());
  const size_t full_bytes = EngineAccess::kv(*base).bytes_held();
  for (const char* spec :
       {"streaming", "h2o", "snapkv", "snapkv+ada", "snapkv+max", "pyramidkv", "tova", "knorm",
        "keydiff", "expected", "random", "expected+mean", "quest", "snapkv+max+demote:q4_0",
        "h2o+merge", "streaming+protect", "kvzip", "lookahead", "kvzip+max"}) {
    SCOPED_TRACE(spec);
    GenerateOptions g = full;
    g.press.emplace();
    ASSERT_TRUE(press::ParsePressSpec(spec, &*g.press).ok());
    g.press->ratio = 0.75;
    auto s = engine->NewSession();
    auto r = s->Generate(prompt, g);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tokens.size(), 4u);
    int64_t kept = 0;
    for (int l = 0; l < cfg.n_layers; ++l)
      for (int h = 0; h < cfg.n_kv_heads; ++h) kept += EngineAccess::kv(*s).head_length(l, h);
    if (g.press->quest || !g.press->demote.empty()) {  // hot tokens stay / move: all still held
      if (g.press->quest) {
        EXPECT_EQ(kept, int64_t(cfg.n_layers) * cfg.n_kv_heads * (600 + 3));
        EXPECT_EQ(EngineAccess::kv(*s).bytes_held(), full_bytes);
      } else {  // a quarter hot in f32, the rest cold in q4_0 (~1/7 of f32)
        EXPECT_EQ(kept, int64_t(cfg.n_layers) * cfg.n_kv_heads * (150 + 3));
        EXPECT_EQ(EngineAccess::kv(*s).cold_length(0, 0), 450);
        EXPECT_LT(EngineAccess::kv(*s).bytes_held(), full_bytes * 0.45);
        EXPECT_GT(engine->kv_stats().cold_bytes_used, 0);
      }
      continue;
    }
    // 150 of 600 per table after the prompt, plus the 3 decoded tokens evaluated since.
    EXPECT_EQ(kept, int64_t(cfg.n_layers) * cfg.n_kv_heads * (150 + 3));
    EXPECT_LT(EngineAccess::kv(*s).bytes_held(), full_bytes * 0.3);
  }
}

// kvzip and lookahead evaluate their probes after the cache and drop them again: the session
// keeps its tokens and its last logits, the pool gets the probes' pages back, and the scores are
// the probes' largest attention weights (kvzip keeps the pass key that its repeat copies).
TEST(PressEngine, ProbeScorersDropTheirProbesAgain) {
  auto engine = KvtinyEngine();
  ASSERT_NE(engine, nullptr);
  const Tokenizer& tok = engine->tokenizer();
  std::string text;
  for (int i = 0; i < 12; ++i) {
    text +=
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
        "again.\n\n";
    if (i == 5) text += "The pass key is 71932. Remember it. 71932 is the pass key.\n\n";
  }
  const std::vector<int32_t> context = tok.EncodePrompt(text);
  for (const char* spec : {"kvzip", "lookahead"}) {
    SCOPED_TRACE(spec);
    auto s = engine->NewSession();
    std::vector<float> logits;
    ASSERT_TRUE(s->Eval(context, &logits).ok());
    const int pages = engine->kv_stats().pages_used;
    press::PressOptions o;
    ASSERT_TRUE(press::ParsePressSpec(spec, &o).ok());
    o.ratio = 0.75;
    auto r = s->Compress(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(s->tokens(), context);
    EXPECT_EQ(s->n_tokens(), static_cast<int>(context.size()));
    EXPECT_LT(engine->kv_stats().pages_used, pages / 2);
    // The probe pass is what pressing cost, and it held the cache, a probe and its attention.
    EXPECT_GT(r->probe_ms, 0);
    EXPECT_GE(r->ms, r->probe_ms);
    EXPECT_GT(r->peak_bytes, r->bytes_before);
    EXPECT_LT(r->bytes_after, r->bytes_before / 2);
    GenerateOptions g;
    g.max_tokens = 8;
    g.sampling.temperature = 0;
    auto answer = s->Generate(tok.Encode("Question: What is the pass key?\nAnswer:"), g);
    ASSERT_TRUE(answer.ok()) << answer.status().ToString();
    if (std::string(spec) == "kvzip") {
      EXPECT_TRUE(tok.Decode(answer->tokens).starts_with(" 71932")) << tok.Decode(answer->tokens);
    }
  }
  // A probe that does not fit in the context is an error that changes nothing.
  EngineOptions small;
  small.model_dir = testing::ModelDir();
  small.n_ctx = static_cast<int>(context.size()) + 4;
  auto e = Engine::Create(small);
  ASSERT_TRUE(e.ok());
  auto s = (*e)->NewSession();
  std::vector<float> logits;
  ASSERT_TRUE(s->Eval(context, &logits).ok());
  press::PressOptions o;
  ASSERT_TRUE(press::ParsePressSpec("lookahead", &o).ok());
  o.ratio = 0.5;
  auto r = s->Compress(o);
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s->n_tokens(), static_cast<int>(context.size()));
}

// Presses on staged codec layouts (KIVI keys; q4_0 with sinks and a recent window): the kept
// tokens are re-encoded, the rest freed, and decoding goes on.
TEST(PressEngine, PressesComposeWithStagedCodecs) {
  struct Case {
    const char *k, *v;
    int sinks, window;
  };
  for (const Case& c : {Case{"kivi4", "q4_0", 0, 0}, Case{"q4_0", "q4_0", 4, 32}}) {
    SCOPED_TRACE(std::string(c.k) + ":" + c.v);
    auto engine = KvtinyEngine(512, c.k, c.v, c.sinks, c.window);
    ASSERT_NE(engine, nullptr);
    const std::vector<int32_t> prompt = SyntheticPrompt(600);
    GenerateOptions g;
    g.max_tokens = 4;
    g.sampling.temperature = 0;
    auto full = engine->NewSession();
    auto rf = full->Generate(prompt, g);
    ASSERT_TRUE(rf.ok()) << rf.status().ToString();
    for (const char* spec : {"snapkv", "h2o+merge", "snapkv+max+demote:rot2"}) {
      SCOPED_TRACE(spec);
      GenerateOptions gp = g;
      gp.press.emplace();
      ASSERT_TRUE(press::ParsePressSpec(spec, &*gp.press).ok());
      gp.press->ratio = 0.75;
      auto s = engine->NewSession();
      auto r = s->Generate(prompt, gp);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(r->tokens.size(), 4u);
      EXPECT_EQ(EngineAccess::kv(*s).head_length(3, 1), 150 + 3);
      // A quarter of the tokens kept; the sink and window pages stay f16 (their fixed cost).
      EXPECT_LT(EngineAccess::kv(*s).bytes_held(),
                EngineAccess::kv(*full).bytes_held() * (gp.press->demote.empty() ? 0.5 : 0.8));
    }
  }
}

}  // namespace
}  // namespace cachet
