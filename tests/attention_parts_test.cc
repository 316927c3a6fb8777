// A decode step's attention split over its pages (AttnBatch::part, flash decoding): the parts'
// rows merged by MergeAttnParts equal one pass over every page, whatever the layout reads them
// (plain f32 page tables, codec pages through PageRows, rotated bases, a cold pool), with parts
// that see no key and more parts than pages.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kv/page_pool.h"
#include "kv/paged_sequence.h"

namespace cachet {
namespace {

using codecs::Codec;

// One pass over the sequence's (layer 0, KV head 0) and the same pass in n_parts parts, merged.
void ExpectPartsMerge(const PagedSequence& seq, int n_heads, int hd, int32_t q_pos, int n_parts,
                      uint32_t seed, float tol) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> q(size_t(n_heads) * hd);
  for (float& x : q) x = u(rng);
  kernels::AttnBatch b;
  b.q = q.data();
  b.q_stride = n_heads * hd;
  b.out_stride = n_heads * hd;
  b.q_pos = &q_pos;
  b.n_tok = 1;
  b.n_heads = n_heads;
  b.scale = 1.0f / std::sqrt(float(hd));
  b.decode = true;
  std::vector<float> whole(q.size()), merged(q.size(), -7.0f);
  b.out = whole.data();
  seq.Attend(0, 0, b);

  std::vector<float> outs(size_t(n_parts) * q.size()), maxes(size_t(n_parts) * n_heads, -7.0f),
      sums(size_t(n_parts) * n_heads, -7.0f);
  for (int p = 0; p < n_parts; ++p) {
    kernels::AttnBatch part = b;
    part.part = p;
    part.n_parts = n_parts;
    part.out = outs.data() + size_t(p) * q.size();
    part.row_max = maxes.data() + size_t(p) * n_heads;
    part.row_sum = sums.data() + size_t(p) * n_heads;
    seq.Attend(0, 0, part);
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    ASSERT_GE(sums[i], 0.0f) << "row statistics written for every row of every part";
    if (sums[i] == 0.0f) {
      EXPECT_EQ(maxes[i], -std::numeric_limits<float>::infinity());
    }
  }
  b.out = merged.data();
  kernels::MergeAttnParts(outs.data(), maxes.data(), sums.data(), n_parts, hd, b);
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_NEAR(merged[i], whole[i], tol * std::max(1.0f, std::fabs(whole[i])))
        << "parts " << n_parts << " q_pos " << q_pos << " i " << i;
  }
}

TEST(AttentionParts, MergedPartsEqualOnePass) {
  struct Case {
    Codec k, v;
    int sinks;
    bool cold;  // older pages aged into a q4_0 cold pool
  };
  const Case cases[] = {{Codec::kF32, Codec::kF32, 0, false},    // plain page table
                        {Codec::kF16, Codec::kF16, 0, false},    // read in place
                        {Codec::kQ4_0, Codec::kQ4_0, 0, false},  // block keys, quantized query
                        {Codec::kQ8_0, Codec::kF16, 16, false},  // first page raw
                        {Codec::kKivi4, Codec::kQ8_0, 0, false},
                        {Codec::kRot4, Codec::kRot4, 0, false},  // rotated basis, turned back
                        {Codec::kF16, Codec::kF16, 0, true}};
  const int hd = 64, pt = 16, n_heads = 4;
  for (const Case& c : cases) {
    for (int n_keys : {1, 40, 333}) {
      SCOPED_TRACE(std::string(codecs::CodecName(c.k)) + "/" + codecs::CodecName(c.v) +
                   (c.cold ? " cold" : "") + " keys " + std::to_string(n_keys));
      KvLayout lay{1, 1, hd, pt, c.k, c.v, c.sinks};
      KvLayout cold_lay{1, 1, hd, pt, Codec::kQ4_0, Codec::kQ4_0};
      PagePool pool(lay, size_t{1} << 22), cold(cold_lay, size_t{1} << 22);
      PagedSequence seq(pool);
      if (c.cold) {
        seq.set_cold_pool(&cold, 1.0);
        seq.set_age_out(64);
      }
      std::mt19937 rng(5 + n_keys);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      std::vector<float> k(hd), v(hd);
      for (int j = 0; j < n_keys; ++j) {
        ASSERT_TRUE(seq.Reserve(1).ok());
        for (float& x : k) x = 3.0f * u(rng);
        for (float& x : v) x = u(rng);
        seq.Append(0, 0, k.data(), v.data(), j);
        seq.SealAged(0);
        seq.CommitTokens(1);
      }
      if (c.cold && n_keys == 333) {
        ASSERT_GT(seq.cold_length(0, 0), 0);
      }
      // q4_0 values are summed with each page's weights rounded to 8 bits where the CPU has the
      // int8 kernels: a part's weights are the whole pass's times a constant, which the rounding
      // follows but for the rare weight the float products put on the other side of a half
      // (kernels/cpu/value_sums_int8.cc). 2.5e-5 - 9e-5 here.
      const bool q4_values = (c.v == Codec::kQ4_0 || c.cold) && kernels::cpu::HasInt8Kernels();
      const float tol = q4_values ? 5e-4f : 2e-5f;
      for (int n_parts : {2, 3, 7, 40}) {
        ExpectPartsMerge(seq, n_heads, hd, n_keys - 1, n_parts, 100 + n_parts, tol);
        // Early keys only: the later parts see none.
        ExpectPartsMerge(seq, n_heads, hd, n_keys / 3, n_parts, 200 + n_parts, tol);
      }
    }
  }
}

// The reference kernel's statistics: contiguous keys cut in two, merged, equal the whole.
TEST(AttentionParts, ReferenceStatisticsMerge) {
  const int hd = 32, n_heads = 3, n = 50, cut = 21;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> q(size_t(n_heads) * hd), k(size_t(n) * hd), v(size_t(n) * hd);
  for (float& x : q) x = u(rng);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  std::vector<int32_t> pos(n);
  for (int j = 0; j < n; ++j) pos[j] = j;
  for (int32_t q_pos : {n - 1, cut / 2}) {
    kernels::AttnBatch b;
    b.q = q.data();
    b.q_stride = b.out_stride = n_heads * hd;
    b.q_pos = &q_pos;
    b.n_tok = 1;
    b.n_heads = n_heads;
    b.scale = 0.3f;
    std::vector<float> whole(q.size()), merged(q.size()), outs(2 * q.size());
    std::vector<float> maxes(2 * n_heads), sums(2 * n_heads);
    b.out = whole.data();
    kernels::ref::ContiguousAttention(b, k.data(), v.data(), pos.data(), n, hd);
    const int begin[2] = {0, cut}, count[2] = {cut, n - cut};
    for (int p = 0; p < 2; ++p) {
      kernels::AttnBatch part = b;
      part.out = outs.data() + p * q.size();
      part.row_max = maxes.data() + p * n_heads;
      part.row_sum = sums.data() + p * n_heads;
      kernels::ref::ContiguousAttention(part, k.data() + begin[p] * hd, v.data() + begin[p] * hd,
                                        pos.data() + begin[p], count[p], hd);
    }
    if (q_pos < cut) {
      EXPECT_EQ(sums[n_heads], 0.0f);
    }
    b.out = merged.data();
    kernels::MergeAttnParts(outs.data(), maxes.data(), sums.data(), 2, hd, b);
    for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(merged[i], whole[i], 1e-5f) << i;
  }
}

// A sequence splits a decode step by its longest table and the threads, not when a pass must see
// every key.
TEST(AttentionParts, DecodePartsFollowTheLongestTable) {
  KvLayout lay{2, 6, 32, 16, Codec::kF16, Codec::kF16};
  PagePool pool(lay, size_t{1} << 24);
  PagedSequence seq(pool);
  EXPECT_EQ(seq.DecodeParts(8), 1);
  const int n = 3 * PagedSequence::kKeysPerPart + 5;
  ASSERT_TRUE(seq.Reserve(n).ok());
  std::vector<float> row(32, 0.5f);
  for (int j = 0; j < n; ++j) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 6; ++h) seq.Append(l, h, row.data(), row.data(), j);
    }
  }
  seq.CommitTokens(n);
  EXPECT_EQ(seq.DecodeParts(8), 3);  // by the keys
  EXPECT_EQ(seq.DecodeParts(1), 1);  // one thread: nothing to share
  EXPECT_EQ(seq.DecodeParts(2), 2);  // four tasks a thread over six KV heads: two parts
  EXPECT_EQ(seq.DecodeParts(1000), 3);
  seq.set_quest(0, 0.25);
  EXPECT_EQ(seq.DecodeParts(8), 1);  // Quest picks pages per pass
  seq.set_quest(0, 1.0);
  EXPECT_EQ(seq.DecodeParts(8), 3);
}

}  // namespace
}  // namespace cachet
