// Chunk reuse (Session::EvalChunked): a chunk's cached keys moved to another position equal the
// keys computed there (f32 rounding; each codec within its own error), blending with nothing
// recomputed is plain concatenation and with everything recomputed a full prefill, chunks are
// keyed by tokens and salt, the chunk cache gives its pages back when the pool runs dry, and bad
// input changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cachet/engine.h"
#include "cachet/reuse.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

std::unique_ptr<Engine> Kvtiny(const std::string& codec = "f32", int64_t kv_mib = 0) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.kv_codec_k = o.kv_codec_v = codec;
  o.kv_mem_mib = kv_mib;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

// A prompt of the shape chunk reuse serves: an instruction, two documents, a question.
struct Prompt {
  explicit Prompt(const Tokenizer& tok)
      : head(tok.EncodePrompt("Read the notes and answer.\n\n")),
        doc_a(tok.Encode("Once upon a time, there was a little girl named Lily. She had a red ball "
                         "and a small dog named Max. Every day after school they ran to the park "
                         "by the river.\n\n")),
        doc_b(tok.Encode("The pass key is 52817. Remember it. 52817 is the pass key.\n\n")),
        question(tok.Encode("Question: What is the pass key?\nAnswer:")) {}
  std::vector<PromptPart> Parts() const {
    return {{head, false}, {doc_a, true}, {doc_b, true}, {question, false}};
  }
  std::vector<int32_t> All() const {
    std::vector<int32_t> all = head;
    for (const auto* p : {&doc_a, &doc_b, &question}) all.insert(all.end(), p->begin(), p->end());
    return all;
  }
  std::vector<int32_t> head, doc_a, doc_b, question;
};

std::vector<float> Chunked(Engine& e, const Prompt& p, const std::string& blend,
                           ChunkReuseStats* stats = nullptr, std::string_view salt = {}) {
  auto b = ParseBlend(blend);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  auto s = e.NewSession(salt);
  std::vector<float> logits;
  const std::vector<PromptPart> parts = p.Parts();
  Status st = s->EvalChunked(parts, *b, &logits, stats);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(s->tokens(), p.All());
  EXPECT_EQ(s->n_tokens(), static_cast<int>(p.All().size()));
  return logits;
}

std::vector<float> Prefill(Engine& e, const Prompt& p) {
  auto s = e.NewSession();
  std::vector<float> logits;
  EXPECT_TRUE(s->Eval(p.All(), &logits).ok());
  return logits;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::abs(a[i] - b[i])));
  return d;
}

// Layer 0's K/V depend on the token and its position only: reused and fresh must agree there.
TEST(ChunkReuse, MovedChunkKeysEqualKeysComputedThere) {
  auto ref = Kvtiny();
  ASSERT_TRUE(ref);
  const Prompt p(ref->tokenizer());
  auto fresh_f32 = ref->NewSession();
  ASSERT_TRUE(fresh_f32->Eval(p.All(), nullptr).ok());
  for (const std::string codec : {"f32", "f16", "q8_0", "q4_0", "kivi4", "rot3"}) {
    SCOPED_TRACE(codec);
    auto e = Kvtiny(codec);
    ASSERT_TRUE(e);
    auto fresh = e->NewSession();
    ASSERT_TRUE(fresh->Eval(p.All(), nullptr).ok());
    auto reused = e->NewSession();
    ASSERT_TRUE(reused->EvalChunked(p.Parts(), BlendOptions{}, nullptr).ok());
    // The documents' rows: from the head's end to the question's start.
    const int32_t lo = static_cast<int32_t>(p.head.size());
    const int32_t hi = lo + static_cast<int32_t>(p.doc_a.size() + p.doc_b.size());
    double fresh_err = 0, reused_err = 0;
    for (int h = 0; h < e->config().n_kv_heads; ++h) {
      std::vector<float> k0, v0, kf, vf, kr, vr;
      std::vector<int32_t> pos0, posf, posr;
      EngineAccess::kv(*fresh_f32).Gather(0, h, &k0, &v0, &pos0);
      EngineAccess::kv(*fresh).Gather(0, h, &kf, &vf, &posf);
      EngineAccess::kv(*reused).Gather(0, h, &kr, &vr, &posr);
      ASSERT_EQ(posr, posf);
      const int hd = e->config().head_dim;
      for (int32_t r = lo; r < hi; ++r) {
        for (int d = 0; d < hd; ++d) {
          const size_t i = size_t(r) * hd + d;
          fresh_err = std::max(
              {fresh_err, double(std::abs(kf[i] - k0[i])), double(std::abs(vf[i] - v0[i]))});
          reused_err = std::max(
              {reused_err, double(std::abs(kr[i] - k0[i])), double(std::abs(vr[i] - v0[i]))});
        }
      }
    }
    if (codec == "f32") {
      EXPECT_LT(reused_err, 2e-5);
    } else {
      // Decoded, rotated and encoded again: within about twice the codec's own error.
      EXPECT_LT(reused_err, 2.5 * fresh_err + 1e-4) << "fresh " << fresh_err;
    }
  }
}

TEST(ChunkReuse, NothingRecomputedIsConcatenationEverythingRecomputedIsPrefill) {
  auto e = Kvtiny();
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  const std::vector<float> full = Prefill(*e, p);
  ChunkReuseStats none_stats, all_stats, zero_stats;
  const std::vector<float> none = Chunked(*e, p, "none", &none_stats);
  EXPECT_EQ(none_stats.chunk_misses, 2);
  EXPECT_EQ(none_stats.recomputed_tokens, 0);
  EXPECT_EQ(none_stats.chunk_tokens, static_cast<int>(p.doc_a.size() + p.doc_b.size()));
  const std::vector<float> zero = Chunked(*e, p, "cacheblend:0", &zero_stats);
  EXPECT_EQ(zero_stats.chunk_hits, 2);
  EXPECT_EQ(zero_stats.recomputed_tokens, 0);
  EXPECT_LT(MaxAbsDiff(zero, none), 1e-5);
  const std::vector<float> all = Chunked(*e, p, "cacheblend:1", &all_stats);
  EXPECT_LT(testing::RelErr(all, full), 1e-5);
  EXPECT_EQ(all_stats.recomputed_tokens,
            static_cast<int>(p.doc_a.size() + p.doc_b.size()));  // the region: both documents
  const std::vector<float> epic_all = Chunked(*e, p, "epic:1000");
  EXPECT_LT(testing::RelErr(epic_all, full), 1e-5);
  // Reuse without blending really differs from the prefill (the documents never saw the head).
  EXPECT_GT(testing::RelErr(none, full), 1e-3);
  // CacheBlend's picked tokens and EPIC's first tokens move it towards the prefill.
  const std::vector<float> blend = Chunked(*e, p, "cacheblend:0.5");
  const std::vector<float> epic = Chunked(*e, p, "epic:16");
  EXPECT_LT(testing::RelErr(blend, full), testing::RelErr(none, full));
  EXPECT_LT(testing::RelErr(epic, full), testing::RelErr(none, full));
}

TEST(ChunkReuse, ChunksAreKeyedByTheirTokensAndTheSalt) {
  auto e = Kvtiny();
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  ChunkReuseStats s1, s2, s3;
  Chunked(*e, p, "none", &s1);
  EXPECT_EQ(s1.chunk_misses, 2);
  EXPECT_GT(s1.chunk_compute_ms, 0);
  // The same documents in the other order, after another instruction: both hit.
  auto s = e->NewSession();
  const std::vector<int32_t> other = e->tokenizer().EncodePrompt("Notes:\n");
  const std::vector<PromptPart> swapped = {
      {other, false}, {p.doc_b, true}, {p.doc_a, true}, {p.question, false}};
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalChunked(swapped, BlendOptions{}, &logits, &s2).ok());
  EXPECT_EQ(s2.chunk_hits, 2);
  EXPECT_EQ(s2.chunk_misses, 0);
  // Another tenant's salt shares nothing.
  Chunked(*e, p, "none", &s3, "tenant-b");
  EXPECT_EQ(s3.chunk_misses, 2);
  const KvStats ks = e->kv_stats();
  EXPECT_EQ(ks.chunk_entries, 4);
  EXPECT_GT(ks.chunk_bytes, 0);
  EXPECT_EQ(ks.chunk_hits, 2);
  // A prompt that ends in a chunk: the last token is computed for its logits, the chunk still hits.
  auto t = e->NewSession();
  ChunkReuseStats s4;
  const std::vector<PromptPart> ends = {{p.head, false}, {p.doc_a, true}};
  ASSERT_TRUE(t->EvalChunked(ends, BlendOptions{}, &logits, &s4).ok());
  EXPECT_EQ(s4.chunk_hits, 1);
  EXPECT_EQ(t->n_tokens(), static_cast<int>(p.head.size() + p.doc_a.size()));
  EXPECT_EQ(logits.size(), size_t(e->config().vocab_size));
  e->ClearPrefixCache();
  EXPECT_EQ(e->kv_stats().chunk_entries, 0);
}

// A chunk right after BOS is a prefix: requests on it share its pages (many agents on one
// document) and get a prefill's exact logits.
TEST(ChunkReuse, AChunkRightAfterBosIsSharedThroughThePrefixCache) {
  auto e = Kvtiny();
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  std::vector<int32_t> doc = p.doc_a;
  doc.insert(doc.end(), p.doc_a.begin(), p.doc_a.end());  // long enough for several pages
  const std::vector<int32_t> bos = {e->tokenizer().bos_id()};
  std::vector<std::unique_ptr<Session>> agents;
  std::vector<int32_t> pages_after;
  for (const auto* q : {&p.question, &p.head}) {
    agents.push_back(e->NewSession());
    const std::vector<PromptPart> parts = {{bos, false}, {doc, true}, {*q, false}};
    std::vector<float> logits;
    ChunkReuseStats stats;
    ASSERT_TRUE(agents.back()->EvalChunked(parts, BlendOptions{}, &logits, &stats).ok());
    EXPECT_EQ(stats.recomputed_tokens, 0);
    pages_after.push_back(e->kv_stats().pages_used);
    // Exact: the same logits as a prefill of the same tokens.
    std::vector<int32_t> all = bos;
    all.insert(all.end(), doc.begin(), doc.end());
    all.insert(all.end(), q->begin(), q->end());
    auto fresh = e->NewSession();
    std::vector<float> want;
    ASSERT_TRUE(fresh->Eval(all, &want).ok());
    EXPECT_LT(MaxAbsDiff(logits, want), 1e-5);
  }
  // The second agent holds the document's full pages once more only by reference.
  const int tables = e->config().n_layers * e->config().n_kv_heads;
  const int doc_pages = int(doc.size() + 1) / 16 * tables;
  EXPECT_LT(pages_after[1] - pages_after[0], doc_pages) << pages_after[0] << " " << pages_after[1];
}

TEST(ChunkReuse, BlocksFromTheFirstChunkOnAreNotPublished) {
  auto e = Kvtiny();
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  {
    auto s = e->NewSession();
    ASSERT_TRUE(s->EvalChunked(p.Parts(), BlendOptions{}, nullptr).ok());
    s->Publish();
  }
  auto s = e->NewSession();
  const int64_t before = e->kv_stats().prefix_hit_tokens;
  ASSERT_TRUE(s->Eval(p.All(), nullptr).ok());
  EXPECT_LE(e->kv_stats().prefix_hit_tokens - before, static_cast<int64_t>(p.head.size()));
}

TEST(ChunkReuse, BadInputChangesNothing) {
  auto e = Kvtiny();
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  auto s = e->NewSession();
  std::vector<float> logits;
  ASSERT_TRUE(s->Eval(p.head, &logits).ok());
  const std::vector<float> before = logits;
  const std::vector<int32_t> bad = {5, 1 << 20};
  std::vector<PromptPart> parts = {{p.doc_a, true}, {bad, true}};
  Status st = s->EvalChunked(parts, BlendOptions{}, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("prompt part 1"), std::string::npos) << st.ToString();
  const std::vector<int32_t> huge(e->n_ctx(), 5);
  parts = {{huge, true}};
  EXPECT_EQ(s->EvalChunked(parts, BlendOptions{}, &logits).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s->tokens(), p.head);
  std::vector<float> again;
  ASSERT_TRUE(s->Eval({}, &again).ok());
  EXPECT_EQ(again, before);
  EXPECT_FALSE(ParseBlend("cacheblend:2").ok());
  EXPECT_FALSE(ParseBlend("epic:x").ok());
  EXPECT_FALSE(ParseBlend("blend").ok());
  EXPECT_EQ(BlendName(ParseBlend("cacheblend").value()), "cacheblend:0.15");
  EXPECT_EQ(BlendName(ParseBlend("epic").value()), "epic:16");
  // Observing for a press: chunk reuse comes first.
  auto o = e->NewSession();
  o->ObserveForPress(100, 8);
  parts = {{p.head, false}, {p.doc_a, true}};
  EXPECT_EQ(o->EvalChunked(parts, BlendOptions{}, &logits).code(), StatusCode::kFailedPrecondition);
}

// A chunk is computed as a prompt of BOS and its tokens, which the prefix cache's tiers keep:
// another engine (a restarted process) on the same disk cache loads its full blocks; an engine of
// another KV layout does not.
TEST(ChunkReuse, ChunksComeFromTheDiskTierOfAnotherEngineOfTheSameLayout) {
  testing::TempDir dir;
  auto engine = [&](const std::string& codec) {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    o.kv_codec_k = o.kv_codec_v = codec;
    o.disk_cache_dir = dir.path();
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  };
  auto first = engine("f32");
  const Prompt p(first->tokenizer());
  ChunkReuseStats computed, loaded, other;
  const std::vector<float> want = Chunked(*first, p, "cacheblend:0.3", &computed);
  EXPECT_EQ(computed.chunk_misses, 2);
  EXPECT_EQ(computed.prefix_tokens, 0);
  first.reset();
  auto second = engine("f32");
  const std::vector<float> got = Chunked(*second, p, "cacheblend:0.3", &loaded);
  EXPECT_EQ(loaded.chunk_misses, 2);  // not in this engine's RAM
  // Whole 16-token blocks of BOS + the chunk come from the disk; the last token is computed.
  const size_t pt = 16;
  EXPECT_EQ(loaded.prefix_tokens, int(p.doc_a.size() / pt * pt + p.doc_b.size() / pt * pt));
  EXPECT_EQ(MaxAbsDiff(got, want), 0.0);
  auto third = engine("q8_0");
  Chunked(*third, p, "none", &other);
  EXPECT_EQ(other.prefix_tokens, 0);  // another layout's blocks are not this one's
}

// A full pool: the chunk cache gives its pages back; a prompt that cannot fit at all fails with
// the session as it was.
TEST(ChunkReuse, TheChunkCacheGivesWayWhenThePoolRunsDry) {
  auto e = Kvtiny("f32", 4);  // 4 MiB: about 512 tokens of kvtiny's f32 K/V
  ASSERT_TRUE(e);
  const Prompt p(e->tokenizer());
  Chunked(*e, p, "cacheblend:0.3");
  EXPECT_EQ(e->kv_stats().chunk_entries, 2);
  auto s = e->NewSession();
  std::vector<int32_t> long_prompt = e->tokenizer().EncodePrompt("");
  while (long_prompt.size() < 450) long_prompt.push_back(100 + long_prompt.size() % 50);
  ASSERT_TRUE(s->Eval(long_prompt, nullptr).ok());
  EXPECT_LT(e->kv_stats().chunk_entries, 2);
  EXPECT_GT(e->kv_stats().chunk_evicted, 0);
  // No room for the documents now: ResourceExhausted, the session unchanged.
  const std::vector<PromptPart> parts = {{p.doc_a, true}, {p.doc_b, true}, {p.question, false}};
  Status st = s->EvalChunked(parts, BlendOptions{}, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(s->tokens(), long_prompt);
}

}  // namespace
}  // namespace cachet
