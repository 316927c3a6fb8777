// The paged KV cache: pool accounting, all-or-nothing reservation, fork and copy-on-write.
#include <gtest/gtest.h>

#include <algorithm>

#include "kv/paged_sequence.h"

namespace cachet {
namespace {

KvLayout SmallLayout() { return KvLayout{2, 2, 8, 4}; }  // 2 layers x 2 heads, 4-token pages

std::vector<float> Row(float v, int n = 8) { return std::vector<float>(n, v); }

void AppendTokens(PagedSequence& s, int n, float base) {
  ASSERT_TRUE(s.Reserve(n).ok());
  for (int i = 0; i < n; ++i) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        auto k = Row(base + i), v = Row(-(base + i));
        s.Append(l, h, k.data(), v.data(), s.n_tokens() + i);
      }
    }
  }
  s.CommitTokens(n);
}

TEST(KvCache, ReserveIsAllOrNothing) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 10 * lay.page_bytes());  // 10 pages; 4 tables
  EXPECT_EQ(pool.capacity_pages(), 10);
  PagedSequence s(pool);
  AppendTokens(s, 5, 0);  // 2 pages per table = 8
  EXPECT_EQ(pool.used_pages(), 8);
  EXPECT_EQ(pool.used_bytes(), 8 * lay.page_bytes());
  // 4 more tokens need one more page per table (4) but only 2 are free.
  Status st = s.Reserve(4);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("need " + std::to_string(4 * lay.page_bytes()) + " bytes (4 pages)"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(pool.used_pages(), 8);
  EXPECT_EQ(s.pages_held(), 8);
  EXPECT_EQ(s.head_length(1, 1), 5);
  // 3 more fit in the partly filled pages.
  AppendTokens(s, 3, 5);
  EXPECT_EQ(pool.used_pages(), 8);
  EXPECT_EQ(pool.high_water_pages(), 8);
}

TEST(KvCache, ForkSharesAndCopiesOnWrite) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 64 * lay.page_bytes());
  auto parent = std::make_unique<PagedSequence>(pool);
  AppendTokens(*parent, 6, 0);  // pages: one full, one half full, per table
  EXPECT_EQ(pool.used_pages(), 8);
  auto child = parent->Fork();
  EXPECT_EQ(pool.used_pages(), 8);  // shared, nothing copied
  AppendTokens(*child, 1, 100);     // writes into the shared half page: copied first
  EXPECT_EQ(pool.used_pages(), 12);
  // The parent's view is unchanged, the child's holds the new token.
  const kernels::PagedKv pv = parent->View(0, 0), cv = child->View(0, 0);
  EXPECT_EQ(pv.n_tokens, 6);
  EXPECT_EQ(cv.n_tokens, 7);
  EXPECT_EQ(pv.page_ids[0], cv.page_ids[0]);  // the full page stays shared
  EXPECT_NE(pv.page_ids[1], cv.page_ids[1]);
  const float* child_k = pv.slots + cv.page_ids[1] * pv.slot_floats;
  EXPECT_EQ(child_k[1 * 8], 5.0f);    // token 5 copied
  EXPECT_EQ(child_k[2 * 8], 100.0f);  // token 6 written
  const float* parent_k = pv.slots + pv.page_ids[1] * pv.slot_floats;
  EXPECT_EQ(parent_k[1 * 8], 5.0f);
  EXPECT_EQ(pool.position(cv.page_ids[1], 2), 6);
  parent.reset();  // child still holds the shared full pages
  EXPECT_EQ(pool.used_pages(), 8);
  child.reset();
  EXPECT_EQ(pool.used_pages(), 0);
}

// A decode step takes a page per table every page_tokens tokens. Taken as they come, one table's
// pages would lie heads_total() slots apart; a long table takes its next pages from a claim of
// free slots, so they lie side by side. Claimed slots stay free capacity: the pool's used pages
// are the tables' own, and another sequence can still take every free page.
TEST(KvCache, DecodePagesOfATableLieSideBySide) {
  KvLayout lay = SmallLayout();
  lay.max_tokens = 4096;
  const int n = 1024;  // 256 pages a table
  PagePool pool(lay, 4 * 300 * lay.page_bytes());
  PagedSequence s(pool);
  for (int i = 0; i < n; ++i) AppendTokens(s, 1, float(i));
  ASSERT_EQ(s.n_tokens(), n);
  EXPECT_EQ(pool.used_pages(), 4 * n / 4);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      const kernels::PagedKv v = s.View(l, h);
      int side_by_side = 0;
      for (int p = 1; p < n / 4; ++p) side_by_side += v.page_ids[p] == v.page_ids[p - 1] + 1;
      EXPECT_GT(side_by_side, n / 4 * 3 / 4) << l << " " << h;  // runs of up to 16 (213 of 255)
      std::vector<int32_t> pos;
      s.Positions(l, h, &pos);
      ASSERT_EQ(pos.size(), size_t(n));
      EXPECT_EQ(pos.back(), n - 1);
    }
  }
  // The rest of the pool, claimed slots included, goes to another sequence.
  std::vector<int32_t> rest;
  ASSERT_TRUE(pool.Alloc(pool.free_pages(), &rest).ok());
  EXPECT_EQ(pool.free_pages(), 0);
  for (int32_t p : rest) pool.Unref(p);
  // A pool with room for exactly the context decodes to its end.
  PagePool tight(lay, 4 * (n / 4) * lay.page_bytes());
  PagedSequence t(tight);
  for (int i = 0; i < n; ++i) AppendTokens(t, 1, float(i));
  EXPECT_EQ(tight.free_pages(), 0);
  EXPECT_FALSE(t.Reserve(1).ok());
}

// A context computed again in the slots a finished one freed lies as the first did: each table's
// pages in consecutive ascending slots. A free stack gave them back in reverse (the last table's
// last page first), and read from the highest address down a 16k-token context decoded 1.5x
// slower.
TEST(KvCache, FreedSlotsAreHandedOutAscending) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 64 * lay.page_bytes());
  auto expect_side_by_side = [&](const PagedSequence& s) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        const kernels::PagedKv v = s.View(l, h);
        for (int p = 1; p < 16; ++p) EXPECT_EQ(v.page_ids[p], v.page_ids[p - 1] + 1) << l << h << p;
      }
    }
  };
  {
    PagedSequence first(pool);
    AppendTokens(first, 64, 0.0f);  // 16 pages a table, fresh slots
    expect_side_by_side(first);
  }
  EXPECT_EQ(pool.used_pages(), 0);
  PagedSequence again(pool);
  AppendTokens(again, 64, 0.0f);  // every slot a freed one
  expect_side_by_side(again);
  // A claim's slots too (taken front first).
  again.Clear();
  ASSERT_EQ(pool.used_pages(), 0);
  const int32_t d = pool.Claim(false, 8);
  ASSERT_GE(d, 0);
  int32_t prev = pool.TakeClaimed(d);
  for (int i = 1; i < 8; ++i) {
    const int32_t next = pool.TakeClaimed(d);
    EXPECT_GT(next, prev) << i;
    prev = next;
  }
  pool.ReleaseClaim(d);
  EXPECT_EQ(pool.used_pages(), 8);
}

// Claims: taken front first, given back whole, and their slots taken by Alloc when no other is
// free; the bytes they hold are free until taken.
TEST(KvCache, ClaimsHoldFreeSlots) {
  const KvLayout lay = SmallLayout();
  PagePool pool(lay, 8 * lay.page_bytes());
  const int32_t c = pool.Claim(false, 5);
  ASSERT_GE(c, 0);
  EXPECT_EQ(pool.free_pages(), 8);
  const int32_t a = pool.TakeClaimed(c), b = pool.TakeClaimed(c);
  EXPECT_EQ(b, a + 1);  // a fresh pool's slots in order
  EXPECT_EQ(pool.used_pages(), 2);
  std::vector<int32_t> rest;
  ASSERT_TRUE(pool.Alloc(6, &rest).ok());  // 3 unclaimed slots, then 3 claimed ones
  EXPECT_EQ(pool.TakeClaimed(c), -1);      // the claim's slots were taken
  EXPECT_FALSE(pool.Alloc(1, &rest).ok());
  for (int32_t p : rest) pool.Unref(p);
  rest.clear();
  pool.ReleaseClaim(c);
  const int32_t d = pool.Claim(false, 3);
  ASSERT_GE(d, 0);
  pool.ReleaseClaim(d);
  ASSERT_TRUE(pool.Alloc(6, &rest).ok());  // everything but a and b
  pool.Unref(a);
  pool.Unref(b);
  for (int32_t p : rest) pool.Unref(p);
  EXPECT_EQ(pool.used_pages(), 0);
}

// A pool's bookkeeping grows with the slots it hands out, not its capacity: a billion-page pool
// starts at once, hands out slots from 0 in order, reuses the lowest freed first, and runs out
// exactly at its capacity (a small one; the large one only to its first pages).
TEST(KvCache, SlotsAreHandedOutLazilyInOrder) {
  const KvLayout lay = SmallLayout();
  PagePool huge(lay, size_t(1) << 36);
  EXPECT_GT(huge.capacity_pages(), 1 << 20);
  EXPECT_EQ(PagePool(lay, size_t(1) << 50).capacity_pages(), INT32_MAX);  // saturated
  std::vector<int32_t> got;
  ASSERT_TRUE(huge.Alloc(3, &got).ok());
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(huge.refcount(2), 1);
  EXPECT_EQ(huge.refcount(1000), 0);  // never handed out
  huge.Unref(1);
  got.clear();
  ASSERT_TRUE(huge.Alloc(2, &got).ok());
  EXPECT_EQ(got, (std::vector<int32_t>{1, 3}));

  PagePool pool(lay, 100 * lay.page_bytes());
  got.clear();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(pool.Alloc(1, &got).ok()) << i;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], i);
  EXPECT_EQ(pool.Alloc(1, &got).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Claim(false, 1), -1);
  pool.Unref(42);
  pool.Unref(7);
  EXPECT_EQ(pool.free_pages(), 2);
  ASSERT_TRUE(pool.Alloc(1, &got).ok());
  EXPECT_EQ(got.back(), 7);  // the lowest, not the last freed
  ASSERT_TRUE(pool.Alloc(1, &got).ok());
  EXPECT_EQ(got.back(), 42);
  got.erase(got.begin() + 42);  // freed above, taken again last
  got.erase(got.begin() + 7);
  for (int32_t p : got) pool.Unref(p);
  EXPECT_EQ(pool.used_pages(), 0);
}

// Codec layouts whose context fits 16 bits store positions in 16: two bytes a token and table
// less, and the same values read back (in place where they are 32-bit, widened otherwise).
TEST(KvCache, PositionsIn16BitsWhereTheContextFits) {
  KvLayout lay = SmallLayout();
  lay.codec_k = lay.codec_v = codecs::Codec::kF16;
  for (int64_t max_tokens : {int64_t{0}, int64_t{65536}, int64_t{65537}}) {
    lay.max_tokens = max_tokens;
    const bool narrow = max_tokens == 65536;
    EXPECT_EQ(lay.short_positions(), narrow) << max_tokens;
    EXPECT_EQ(lay.codec_page_bytes(),
              lay.codec_k_bytes() + lay.codec_v_bytes() + 4 * (narrow ? 2 : 4));
    PagePool pool(lay, 8 * lay.page_bytes());
    std::vector<int32_t> raw, codec;
    ASSERT_TRUE(pool.Alloc(1, 1, &raw, &codec).ok());
    const int32_t at[4] = {0, 1, 40000, 65535};
    pool.SetPositions(codec[0], 0, at, 4);
    pool.set_position(raw[0], 2, 65535);
    int32_t buf[4] = {-1, -1, -1, -1};
    const int32_t* p = pool.Positions(codec[0], 4, buf);
    EXPECT_EQ(p == buf, narrow);
    EXPECT_TRUE(std::equal(p, p + 4, at));
    EXPECT_EQ(pool.position(raw[0], 2), 65535);
    pool.CopyPositions(codec[0], raw[0], 2);
    int32_t out[4];
    pool.ReadPositions(raw[0], 3, out);
    EXPECT_EQ(out[0], 0);
    EXPECT_EQ(out[1], 1);
    EXPECT_EQ(out[2], 65535);
  }
  // The plain layout (f32, the reference) keeps 32-bit positions: its kernel reads them in place.
  KvLayout plain = SmallLayout();
  plain.max_tokens = 100;
  EXPECT_FALSE(plain.short_positions());
  EXPECT_EQ(plain.raw_page_bytes(), plain.raw_data_bytes() + 16);
}

}  // namespace
}  // namespace cachet
