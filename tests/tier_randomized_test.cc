// The prefix tree over a disk tier, driven by 10^4 random operations against a small pool:
// publish a prompt (computing what RAM and disk do not give), look one up, evict from RAM under
// pressure, restart (a new tree, tier and index over the same directory), and damage or delete
// stored runs. After every step: every page a lookup attaches holds exactly the rows of its
// tokens (never another prompt's, never damaged bytes), and the pool holds exactly the tree's
// pages (nothing leaks).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include "kv/page_pool.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "kv/tiers/disk_tier.h"
#include "kv/tiers/kv_tiers.h"
#include "test_util.h"

namespace cachet {
namespace {

namespace fs = std::filesystem;

constexpr int kLayers = 1, kHeads = 2, kDim = 8, kPageTokens = 4;

// The K row of a token at a position (V is its negation): a function of both, so a page served
// for the wrong tokens or positions shows.
float KValue(int32_t token, int32_t pos, int head, int d) {
  return static_cast<float>(token) + 0.25f * static_cast<float>(pos) + 0.5f * head + d / 64.0f;
}

struct World {
  KvLayout layout{kLayers, kHeads, kDim, kPageTokens};
  PagePool pool{layout, 48 * layout.page_bytes()};  // 24 blocks: eviction is frequent
  std::string dir;
  std::unique_ptr<tiers::KvTiers> tiers;
  std::unique_ptr<PrefixTree> tree;
  int64_t loaded = 0, refused = 0;  // over every restart

  explicit World(std::string d) : dir(std::move(d)) { Restart(); }
  ~World() { tree.reset(); }

  // A new process: RAM's tree gone, the tier re-indexed from the directory.
  void Restart() {
    tree.reset();
    Tally();
    tiers::DiskTierOptions o;
    o.dir = dir;
    o.capacity_bytes = 12 * 1024;  // a handful of runs: the disk evicts too
    auto disk = tiers::DiskTier::Open(o);
    ASSERT_TRUE(disk.ok()) << disk.status().ToString();
    std::vector<std::unique_ptr<tiers::Tier>> stack;
    stack.push_back(std::move(disk).value());
    tiers::TierNamespace ns;
    ns.model_hash = 7;
    ns.codec_k = ns.codec_v = "f32";
    ns.page_tokens = kPageTokens;
    ns.n_layers = kLayers;
    ns.n_kv_heads = kHeads;
    ns.head_dim = kDim;
    tiers = std::make_unique<tiers::KvTiers>(pool, ns, std::move(stack), /*zstd=*/true,
                                             /*run_blocks=*/2);
    tree = std::make_unique<PrefixTree>(pool, 1);
    tree->set_tiers(tiers.get());
  }

  void Tally() {
    if (!tiers) return;
    const tiers::TierReport r = tiers->Report()[0];
    loaded += r.loaded_tokens;
    refused += r.stats.corrupt + r.rejected;
    tiers.reset();
  }

  // Checks the rows of the first n tokens seq holds; false (with a failure) on any difference.
  static bool RowsAre(const PagedSequence& seq, const std::vector<int32_t>& tokens, int n) {
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    for (int h = 0; h < kHeads; ++h) {
      seq.Gather(0, h, &k, &v, &pos);
      if (static_cast<int>(pos.size()) < n) {
        ADD_FAILURE() << "head " << h << " holds " << pos.size() << " tokens, want " << n;
        return false;
      }
      for (int t = 0; t < n; ++t) {
        if (pos[t] != t) {
          ADD_FAILURE() << "token " << t << " at position " << pos[t];
          return false;
        }
        for (int d = 0; d < kDim; ++d) {
          const float want = KValue(tokens[t], t, h, d);
          if (k[size_t(t) * kDim + d] != want || v[size_t(t) * kDim + d] != -want) {
            ADD_FAILURE() << "token " << t << " head " << h << " dim " << d << ": K "
                          << k[size_t(t) * kDim + d] << ", want " << want;
            return false;
          }
        }
      }
    }
    return true;
  }

  // Looks tokens up, checks what was attached, computes the rest and publishes: what a request
  // does. Returns the tokens reused, -1 on a wrong row.
  int Serve(const std::vector<int32_t>& tokens) {
    PagedSequence seq(pool);
    const int n = static_cast<int>(tokens.size());
    const int reused = tree->Lookup(tokens, /*salt=*/0, n - 1, seq);
    if (reused % kPageTokens != 0 || reused > n - 1 || !RowsAre(seq, tokens, reused)) return -1;
    if (!seq.Reserve(n - reused).ok()) return reused;  // the pool is full of live pages: skip
    float k[kDim], v[kDim];
    for (int t = reused; t < n; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        for (int d = 0; d < kDim; ++d) k[d] = KValue(tokens[t], t, h, d), v[d] = -k[d];
        seq.Append(0, h, k, v, t);
      }
    }
    seq.CommitTokens(n - reused);
    if (!RowsAre(seq, tokens, n)) return -1;
    tree->Publish(tokens, 0, seq);
    return reused;
  }
};

TEST(TierRandomized, TenThousandStepsNeverServeAWrongPage) {
  testing::TempDir dir;
  World w(dir.path());
  std::mt19937 rng(20261201);
  // Prompts over a small alphabet that share prefixes: branches of a few roots.
  std::vector<std::vector<int32_t>> prompts;
  for (int root = 0; root < 4; ++root) {
    std::vector<int32_t> base;
    for (int i = 0; i < 40; ++i) base.push_back(int32_t(rng() % 5 + 1));
    for (int branch = 0; branch < 5; ++branch) {
      std::vector<int32_t> p(base.begin(), base.begin() + 4 + rng() % 30);
      for (int i = 0; i < 3 + int(rng() % 20); ++i) p.push_back(int32_t(rng() % 5 + 1));
      prompts.push_back(std::move(p));
    }
  }
  int64_t reused_total = 0, from_disk_checks = 0;
  for (int step = 0; step < 10000; ++step) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 55) {
      const int r = w.Serve(prompts[rng() % prompts.size()]);
      ASSERT_GE(r, 0) << "step " << step;
      reused_total += r;
    } else if (op < 75) {
      w.tree->Reclaim(w.layout.page_bytes() * (1 + rng() % 16));
    } else if (op < 82) {
      w.Restart();
      // Right after a restart RAM is empty: whatever is reused comes from disk.
      const int r = w.Serve(prompts[rng() % prompts.size()]);
      ASSERT_GE(r, 0) << "step " << step;
      from_disk_checks += r > 0;
    } else {
      std::vector<fs::path> files;
      for (const auto& f : fs::recursive_directory_iterator(dir.path())) {
        if (f.is_regular_file()) files.push_back(f.path());
      }
      if (files.empty()) continue;
      const fs::path& f = files[rng() % files.size()];
      const int damage = static_cast<int>(rng() % 3);
      if (damage == 0) {
        fs::remove(f);
      } else if (damage == 1) {
        fs::resize_file(f, fs::file_size(f) * (rng() % 100) / 100);
      } else {
        std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
        const auto at = static_cast<std::streamoff>(rng() % fs::file_size(f));
        char c = 0;
        io.seekg(at);
        io.read(&c, 1);
        c = static_cast<char>(c ^ (1 << (rng() % 8)));
        io.seekp(at);
        io.write(&c, 1);
      }
    }
    // No sequence is alive between steps: the pool holds the tree's pages and nothing else.
    ASSERT_EQ(w.pool.used_pages(), w.tree->cached_pages()) << "step " << step;
  }
  EXPECT_GT(reused_total, 0);
  EXPECT_GT(from_disk_checks, 50);  // restarts really were served from disk
  w.tree.reset();
  w.Tally();
  EXPECT_GT(w.loaded, 0);
  EXPECT_GT(w.refused, 0);  // damage was seen, and never served
}

}  // namespace
}  // namespace cachet
