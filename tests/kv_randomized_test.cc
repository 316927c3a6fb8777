// A randomized test of the KV cache (pool, block tables, fork/copy-on-write, prefix tree, LRU
// eviction) against a simple model of the expected state, checking invariants after every step.
// As in a real model, a token's K/V depends only on the tokens up to it, so every sequence's
// expected contents follow from its token list, whoever computed or shares the pages.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"

namespace cachet {
namespace {

constexpr int kLayers = 2, kHeads = 2, kDim = 4, kPageTokens = 4;

// The K value of the token at index i of tokens (V is its negation), per (layer, head).
float Tag(const std::vector<int32_t>& tokens, size_t i, int layer, int head) {
  uint64_t h = 1469598103934665603ull + layer * 31 + head;
  for (size_t j = 0; j <= i; ++j) h = (h ^ static_cast<uint64_t>(tokens[j])) * 1099511628211ull;
  return static_cast<float>(h % 1000003);
}

struct Seq {
  std::unique_ptr<PagedSequence> kv;
  std::vector<int32_t> tokens;
  uint64_t salt = 0;
};

class Harness {
 public:
  explicit Harness(int capacity_pages)
      : layout_{kLayers, kHeads, kDim, kPageTokens},
        pool_(layout_, capacity_pages * layout_.page_bytes()),
        tree_(pool_, /*model_id=*/42) {}

  // Appends n random tokens; on ResourceExhausted checks that nothing changed.
  void Append(Seq& s, int n, std::mt19937& rng) {
    const auto before = Snapshot();
    Status st = s.kv->Reserve(n);
    if (!st.ok()) {
      ASSERT_EQ(st.code(), StatusCode::kResourceExhausted);
      ASSERT_EQ(Snapshot(), before) << "a failed reservation changed the pool";
      ++exhausted;
      return;
    }
    for (int i = 0; i < n; ++i) {
      s.tokens.push_back(static_cast<int32_t>(rng() % 3));  // tiny alphabet: prefixes repeat
      const size_t idx = s.tokens.size() - 1;
      for (int l = 0; l < kLayers; ++l) {
        for (int h = 0; h < kHeads; ++h) {
          const float t = Tag(s.tokens, idx, l, h);
          std::vector<float> k(kDim, t), v(kDim, -t);
          s.kv->Append(l, h, k.data(), v.data(), static_cast<int32_t>(idx));
        }
      }
    }
    s.kv->CommitTokens(n);
  }

  // A new sequence over tokens, reusing what the prefix tree has, then computing the rest.
  Seq Lookup(std::vector<int32_t> tokens, uint64_t salt, std::mt19937& rng) {
    Seq s{std::make_unique<PagedSequence>(pool_), {}, salt};
    const int reused = tree_.Lookup(tokens, salt, static_cast<int>(tokens.size()) - 1, *s.kv);
    EXPECT_EQ(reused % kPageTokens, 0);
    EXPECT_LE(reused, static_cast<int>(tokens.size()) - 1);
    hit_tokens += reused;
    s.tokens.assign(tokens.begin(), tokens.begin() + reused);
    (void)rng;
    return s;
  }

  void Publish(const Seq& s) { tree_.Publish(s.tokens, s.salt, *s.kv); }
  PrefixTree& tree() { return tree_; }
  PagePool& pool() { return pool_; }

  // Refcounts equal the references held; free + used = capacity; accounting exact; every live
  // sequence sees exactly its own expected K/V and positions.
  void CheckInvariants(const std::vector<Seq>& seqs) {
    std::map<int32_t, int> refs;
    for (const Seq& s : seqs) {
      ASSERT_EQ(s.kv->n_tokens(), static_cast<int>(s.tokens.size()));
      for (int l = 0; l < kLayers; ++l) {
        for (int h = 0; h < kHeads; ++h) {
          const kernels::PagedKv v = s.kv->View(l, h);
          ASSERT_EQ(v.n_tokens, static_cast<int>(s.tokens.size()));
          const int pages = (v.n_tokens + kPageTokens - 1) / kPageTokens;
          for (int p = 0; p < pages; ++p) ++refs[v.page_ids[p]];
          for (int i = 0; i < v.n_tokens; ++i) {
            const int32_t page = v.page_ids[i / kPageTokens];
            const float* k = v.slots + page * v.slot_floats + (i % kPageTokens) * kDim;
            const float* val = k + kPageTokens * kDim;
            const float want = Tag(s.tokens, i, l, h);
            ASSERT_EQ(k[0], want) << "token " << i << " layer " << l << " head " << h;
            ASSERT_EQ(val[kDim - 1], -want);
            ASSERT_EQ(v.positions[page * kPageTokens + i % kPageTokens], i);
          }
        }
      }
      // Reserved-but-unfilled pages are held too.
      ASSERT_GE(s.kv->pages_held(), 0);
    }
    std::vector<int32_t> tree_pages;
    tree_.CollectPages(&tree_pages);
    for (int32_t p : tree_pages) ++refs[p];
    int held = 0;
    for (const Seq& s : seqs) held += s.kv->pages_held();
    int32_t referenced = 0;
    for (int32_t p = 0; p < pool_.capacity_pages(); ++p) {
      const int32_t rc = pool_.refcount(p);
      if (rc > 0) ++referenced;
      if (refs.count(p)) {
        ASSERT_LE(refs[p], rc) << "page " << p;
      }
    }
    ASSERT_EQ(referenced, pool_.used_pages());
    ASSERT_EQ(pool_.used_pages() + pool_.free_pages(), pool_.capacity_pages());
    ASSERT_EQ(pool_.used_bytes(), static_cast<size_t>(pool_.used_pages()) * layout_.page_bytes());
    // Sum of refcounts = references held by sequences (incl. reserved pages) and the tree.
    int64_t rc_sum = 0;
    for (int32_t p = 0; p < pool_.capacity_pages(); ++p) rc_sum += pool_.refcount(p);
    ASSERT_EQ(rc_sum, held + static_cast<int64_t>(tree_pages.size()));
    ASSERT_LE(pool_.used_pages(), pool_.high_water_pages());
  }

  std::vector<int32_t> Snapshot() const {
    std::vector<int32_t> s;
    for (int32_t p = 0; p < pool_.capacity_pages(); ++p) s.push_back(pool_.refcount(p));
    s.push_back(pool_.free_pages());
    s.push_back(static_cast<int32_t>(tree_.cached_blocks()));
    return s;
  }

  int exhausted = 0;
  int64_t hit_tokens = 0;

 private:
  KvLayout layout_;
  PagePool pool_;
  PrefixTree tree_;
};

TEST(KvRandomized, ModelCheckedOperations) {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    Harness hx(/*capacity_pages=*/96);
    std::vector<Seq> seqs;
    int forks = 0, lookups = 0, frees = 0, publishes = 0;
    for (int step = 0; step < 3000; ++step) {
      const int op = rng() % 100;
      if (seqs.empty() || op < 10) {
        if (seqs.size() < 8)
          seqs.push_back({std::make_unique<PagedSequence>(hx.pool()), {}, rng() % 2});
      } else if (op < 50) {
        Seq& s = seqs[rng() % seqs.size()];
        hx.Append(s, 1 + rng() % 9, rng);  // often lands in a shared, partly filled page
      } else if (op < 62) {
        const Seq& s = seqs[rng() % seqs.size()];
        if (seqs.size() < 8) {
          seqs.push_back({s.kv->Fork(), s.tokens, s.salt});
          ++forks;
        }
      } else if (op < 75) {
        seqs.erase(seqs.begin() + rng() % seqs.size());
        ++frees;
      } else if (op < 87) {
        hx.Publish(seqs[rng() % seqs.size()]);
        ++publishes;
      } else if (op < 97) {
        // A new request whose prompt starts like an existing sequence.
        const Seq& s = seqs[rng() % seqs.size()];
        if (seqs.size() < 8 && !s.tokens.empty()) {
          std::vector<int32_t> prompt(s.tokens.begin(),
                                      s.tokens.begin() + 1 + rng() % s.tokens.size());
          for (int i = 0, extra = rng() % 6; i < extra; ++i) prompt.push_back(rng() % 3);
          const uint64_t salt = rng() % 4 == 0 ? s.salt ^ 1 : s.salt;
          Seq n = hx.Lookup(prompt, salt, rng);
          hx.Append(n, static_cast<int>(prompt.size() - n.tokens.size()), rng);
          seqs.push_back(std::move(n));
          ++lookups;
        }
      } else {
        hx.tree().Reclaim(1 + rng() % 8);
      }
      hx.CheckInvariants(seqs);
      if (::testing::Test::HasFatalFailure()) return;
    }
    seqs.clear();
    hx.tree().Clear();
    EXPECT_EQ(hx.pool().used_pages(), 0) << "leaked pages";
    EXPECT_GT(forks, 100);
    EXPECT_GT(lookups, 50);
    EXPECT_GT(hx.hit_tokens, 0) << "the prefix tree never hit";
    EXPECT_GT(hx.exhausted, 0) << "the pool never ran dry: the test misses that path";
    EXPECT_GT(hx.tree().stats().evicted_blocks, 0) << "nothing was ever evicted";
    (void)frees;
    (void)publishes;
  }
}

TEST(KvRandomized, SaltsNeverShare) {
  std::mt19937 rng(9);
  Harness hx(64);
  Seq a{std::make_unique<PagedSequence>(hx.pool()), {}, 1};
  hx.Append(a, 12, rng);
  hx.Publish(a);
  Seq same = hx.Lookup(a.tokens, 1, rng);
  EXPECT_EQ(same.tokens.size(), 8u);  // two full pages; the last token is left to compute
  Seq other = hx.Lookup(a.tokens, 2, rng);
  EXPECT_EQ(other.tokens.size(), 0u);
}

}  // namespace
}  // namespace cachet
