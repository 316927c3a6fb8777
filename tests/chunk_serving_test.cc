// Chunk reuse in the server: "chunks" and "blend" parsed and checked at the edge, the prompt cut
// and tokenized so that each chunk has its own tokens wherever it stands, and the Runtime serving
// chunked requests as Session::EvalChunked computes them, chunks found cached the second time.
#include <gtest/gtest.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/engine.h"
#include "cachet/serving.h"
#include "cachet/tokenizer.h"
#include "runtime_collector.h"
#include "server/prepare.h"
#include "server/request.h"
#include "test_util.h"

namespace cachet {
namespace {

const char* kDocA =
    "Once upon a time, there was a little girl named Lily. She had a red ball and a small dog.\n\n";
const char* kDocB = "The pass key is 52817. Remember it. 52817 is the pass key.\n\n";

server::ParseLimits Limits() {
  server::ParseLimits l;
  l.model_name = "kvtiny";
  l.vocab_size = 8192;
  return l;
}

TEST(ServerChunks, ParsedAndCheckedAtTheEdge) {
  using server::Endpoint;
  using server::ParseRequest;
  auto r = ParseRequest(R"({"prompt": "a b", "chunks": ["a", "b"], "blend": "cacheblend:0.2"})",
                        Endpoint::kCompletions, Limits());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->chunks, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r->blend.kind, BlendOptions::Kind::kCacheBlend);
  EXPECT_DOUBLE_EQ(r->blend.recompute, 0.2);
  // A separator: the pieces between two separators are the chunks, the separators go.
  auto sep =
      ParseRequest(R"({"prompt": "Notes:@@doc one@@doc two@@Question?", "chunk_separator": "@@"})",
                   Endpoint::kCompletions, Limits());
  ASSERT_TRUE(sep.ok()) << sep.status().ToString();
  EXPECT_EQ(*sep->prompt_text, "Notes:doc onedoc twoQuestion?");
  EXPECT_EQ(sep->chunks, (std::vector<std::string>{"doc one", "doc two"}));
  const std::pair<const char*, const char*> bad[] = {
      {R"({"prompt": "a@b", "chunks": ["a"], "chunk_separator": "@"})",
       "chunk_separator: not with \"chunks\""},
      {R"({"prompt": "a", "chunk_separator": ""})", "chunk_separator: empty string"},
      {R"({"prompt": "a", "chunks": "a"})", "chunks: must be an array"},
      {R"({"prompt": "a", "chunks": [""]})", "chunks[0]: empty string"},
      {R"({"prompt": "a", "chunks": [3]})", "chunks[0]: must be a string"},
      {R"({"prompt": "a", "blend": "none"})", "blend: only with \"chunks\" or"},
      {R"({"prompt": "a", "chunks": ["a"], "blend": "mix"})", "blend: 'mix': expected"},
      {R"({"prompt": "a", "chunks": ["a"], "cache_id": "kvc-1"})", "chunks: not with cache_id"},
      {R"({"prompt": "a", "chunks": ["a"], "kv_press": {"name": "snapkv", "ratio": 0.5}})",
       "chunks: not with kv_press"},
      {R"({"prompt": [1, 2], "chunks": ["a"]})", "chunks: need a text prompt"},
  };
  for (const auto& [body, want] : bad) {
    auto b = ParseRequest(body, Endpoint::kCompletions, Limits());
    ASSERT_FALSE(b.ok()) << body;
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << body;
    EXPECT_TRUE(b.status().message().starts_with(want)) << b.status().message();
  }
}

TEST(ServerChunks, EachChunkIsTokenizedOnItsOwnWhereverItStands) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok());
  server::ServedModel model;
  model.name = "kvtiny";
  model.tokenizer = tok->get();
  model.n_ctx = 512;
  model.vocab_size = 8192;
  const std::string prompt = std::string("Notes: ") + kDocB + kDocA + "Question: the key?";
  server::ParsedRequest parsed;
  parsed.prompt_text = prompt;
  parsed.chunks = {kDocA, kDocB};
  auto p = server::Prepare(parsed, model, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const CompletionRequest& r = p->request;
  ASSERT_EQ(r.chunks.size(), 2u);
  const auto range = [&](int i) {
    return std::vector<int32_t>(r.prompt.begin() + r.chunks[i].first,
                                r.prompt.begin() + r.chunks[i].second);
  };
  EXPECT_EQ(range(0), (*tok)->Encode(kDocB));  // in the prompt's order
  EXPECT_EQ(range(1), (*tok)->Encode(kDocA));
  std::vector<int32_t> want = (*tok)->EncodePrompt("Notes: ");
  for (const auto& ids :
       {(*tok)->Encode(kDocB), (*tok)->Encode(kDocA), (*tok)->Encode("Question: the key?")}) {
    want.insert(want.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(r.prompt, want);
  parsed.chunks = {kDocA, "not in the prompt"};
  auto missing = server::Prepare(parsed, model, 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().message().starts_with("chunks[1]: not found"))
      << missing.status().ToString();
}

TEST(RuntimeChunks, ServedAsEvalChunkedComputesThemAndFoundCachedTheSecondTime) {
  RuntimeOptions o;
  o.engine.model_dir = testing::ModelDir();
  o.engine.threads = 2;
  o.batch_tokens = 64;
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const Tokenizer& tok = (*rt)->tokenizer();
  const std::vector<int32_t> head = tok.EncodePrompt("Read the notes.\n\n");
  const std::vector<int32_t> a = tok.Encode(kDocA), b = tok.Encode(kDocB);
  const std::vector<int32_t> q = tok.Encode("Question: What is the pass key?\nAnswer:");
  for (const std::string blend : {"none", "cacheblend:0.3"}) {
    SCOPED_TRACE(blend);
    // What a session computes with the same parts, greedy.
    EngineOptions eo = o.engine;
    auto engine = Engine::Create(eo);
    ASSERT_TRUE(engine.ok());
    auto s = (*engine)->NewSession();
    const std::vector<PromptPart> parts = {{head, false}, {a, true}, {b, true}, {q, false}};
    ASSERT_TRUE(s->EvalChunked(parts, ParseBlend(blend).value(), nullptr).ok());
    GenerateOptions g;
    g.max_tokens = 6;
    g.sampling.temperature = 0;
    auto want = s->Generate({}, g);
    ASSERT_TRUE(want.ok());
    // The runtime, twice: the chunks are computed the first time and found the second.
    for (int round = 0; round < 2; ++round) {
      CompletionRequest r;
      r.prompt = head;
      for (const auto* p : {&a, &b, &q}) r.prompt.insert(r.prompt.end(), p->begin(), p->end());
      const int32_t at = static_cast<int32_t>(head.size());
      r.chunks = {{at, at + int32_t(a.size())},
                  {at + int32_t(a.size()), at + int32_t(a.size() + b.size())}};
      r.blend = ParseBlend(blend).value();
      r.max_tokens = 6;
      r.sampling.temperature = 0;
      testing::Collector d;
      const int64_t computed = (*rt)->Metrics().prompt_tokens;
      ASSERT_TRUE((*rt)->Submit(r, d.Callback()).ok());
      d.Wait();
      EXPECT_TRUE(d.last.error.ok()) << d.last.error.ToString();
      EXPECT_EQ(d.tokens, want->tokens) << "round " << round;
      EXPECT_EQ(d.last.usage.cached_tokens, round == 0 ? 0 : int(a.size() + b.size()));
      // Prompt tokens computed: all of them, then all but the cached chunks', and blending
      // computes some chunk tokens again (in place, after splicing them).
      const int64_t now_computed = (*rt)->Metrics().prompt_tokens - computed;
      const int64_t fresh = int64_t(r.prompt.size()) - d.last.usage.cached_tokens;
      if (blend == "none") {
        EXPECT_EQ(now_computed, fresh);
      } else {
        EXPECT_GT(now_computed, fresh);
        EXPECT_LT(now_computed, fresh + int64_t(a.size() + b.size()));
      }
    }
    (*rt)->ClearPrefixCache();  // the next blend computes its chunks again
  }
  const RuntimeMetrics m = (*rt)->Metrics();
  EXPECT_EQ(m.chunk_misses, 4);
  EXPECT_EQ(m.chunk_hits, 4);
  EXPECT_GT(m.chunk_recomputed_tokens, 0);
  // Bad ranges are refused up front.
  CompletionRequest bad;
  bad.prompt = head;
  bad.chunks = {{2, 1}};
  EXPECT_EQ((*rt)->Submit(bad, [](const TokenEvent&) {}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cachet
