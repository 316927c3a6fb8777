// The serving runtime (include/cachet/serving.h) on kvtiny: requests served together by continuous
// batching give each the greedy tokens it gets alone, through preemption too; the prefix cache,
// salts, stop strings, cancellation and bad input; per-request presses (fewer pages, neighbours
// unchanged, pressed again after preemption).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "cachet/model_config.h"
#include "cachet/serving.h"
#include "cachet/tokenizer.h"
#include "kv/press/press.h"
#include "runtime_collector.h"
#include "test_util.h"

namespace cachet {
namespace {

using testing::Collector;

RuntimeOptions Options(const std::string& codec, int kv_mem_mib = 0) {
  RuntimeOptions o;
  o.engine.model_dir = testing::ModelDir();
  o.engine.threads = 2;
  o.engine.kv_codec_k = o.engine.kv_codec_v = codec;
  o.engine.kv_mem_mib = kv_mem_mib;
  o.max_sequences = 8;
  o.batch_tokens = 64;  // prompts take several steps, interleaved with others' decoding
  return o;
}

std::vector<std::vector<int32_t>> Prompts(const Runtime& rt) {
  const char* texts[] = {
      "Once upon a time, there was a little girl named Lily.",
      "The cat sat on the mat and looked at the dog. The dog was big and brown and liked to run "
      "in the park with his friends every day after school.",
      "Tom had a red ball.",
      "One day, a bird flew over the tall tree and saw a shiny thing in the grass below. It was "
      "a key! The bird picked it up and flew home to show its mother what it had found."};
  std::vector<std::vector<int32_t>> out;
  for (const char* t : texts) out.push_back(rt.tokenizer().EncodePrompt(t));
  return out;
}

CompletionRequest Greedy(std::vector<int32_t> prompt, int max_tokens) {
  CompletionRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

// Each prompt alone, then all at once: the same tokens and text, for f32 and f16 KV; with a pool
// too small for all of them at once, preemption and recompute give the same tokens again.
TEST(Runtime, BatchedRequestsEqualAlone) {
  for (const char* codec : {"f32", "f16"}) {
    SCOPED_TRACE(codec);
    auto rt = Runtime::Create(Options(codec));
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    Runtime& r = **rt;
    const auto prompts = Prompts(r);
    std::vector<Collector> alone(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(r.Submit(Greedy(prompts[i], 24), alone[i].Callback()).ok());
      alone[i].Wait();
      EXPECT_EQ(alone[i].last.finish_reason, "length");
      EXPECT_EQ(alone[i].tokens.size(), 24u);
    }
    r.ClearPrefixCache();
    std::vector<Collector> together(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(r.Submit(Greedy(prompts[i], 24), together[i].Callback()).ok());
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      together[i].Wait();
      EXPECT_EQ(together[i].tokens, alone[i].tokens) << "prompt " << i;
      EXPECT_EQ(together[i].text, alone[i].text) << "prompt " << i;
      EXPECT_EQ(together[i].last.usage.prompt_tokens, static_cast<int>(prompts[i].size()));
      EXPECT_EQ(together[i].last.usage.completion_tokens, 24);
      EXPECT_GT(together[i].events, 1);  // streamed, not one final event
    }
    const RuntimeMetrics m = r.Metrics();
    EXPECT_EQ(m.requests_finished, 8);
    EXPECT_EQ(m.generation_tokens, 8 * 24);
    EXPECT_EQ(m.ttft.count, 8u);
    EXPECT_EQ(m.running, 0);
  }
}

TEST(Runtime, PreemptedRequestsResumeWithTheSameTokens) {
  auto big = Runtime::Create(Options("f32"));
  ASSERT_TRUE(big.ok());
  const auto prompts = Prompts(**big);
  std::vector<Collector> alone(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE((*big)->Submit(Greedy(prompts[i], 40), alone[i].Callback()).ok());
    alone[i].Wait();
  }
  // 1 MiB of f32 pages: 128 tokens in all for kvtiny, enough for any one request (at most 85
  // tokens) but not for the four at once.
  RuntimeOptions o = Options("f32", /*kv_mem_mib=*/1);
  o.engine.prefix_cache = false;
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const KvStats kv = (*rt)->kv_stats();
  const int64_t tokens_held = int64_t{kv.pages_total} * kv.page_tokens * kv.page_bytes /
                              static_cast<int64_t>(kv.bytes_per_token * kv.page_tokens);
  int64_t longest = 0, all = 0;
  for (const auto& p : prompts) {
    longest = std::max<int64_t>(longest, p.size() + 40);
    all += static_cast<int64_t>(p.size()) + 40;
  }
  ASSERT_LT(longest + 16, tokens_held);
  ASSERT_GT(all, tokens_held);
  std::vector<Collector> together(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE((*rt)->Submit(Greedy(prompts[i], 40), together[i].Callback()).ok());
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    together[i].Wait();
    EXPECT_TRUE(together[i].last.error.ok()) << together[i].last.error.ToString();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "prompt " << i;
  }
  EXPECT_GT((*rt)->Metrics().preemptions, 0) << "the pool was meant to run dry";
  EXPECT_EQ((*rt)->kv_stats().pages_used, 0);  // every page back (no prefix cache)
}

TEST(Runtime, PrefixCacheSaltsStopsAndCancel) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok());
  Runtime& r = **rt;
  const auto prompt = Prompts(r)[3];
  Collector a, b, c;
  ASSERT_TRUE(r.Submit(Greedy(prompt, 8), a.Callback()).ok());
  a.Wait();
  EXPECT_EQ(a.last.usage.cached_tokens, 0);
  ASSERT_TRUE(r.Submit(Greedy(prompt, 8), b.Callback()).ok());
  b.Wait();
  EXPECT_GT(b.last.usage.cached_tokens, 0);
  EXPECT_EQ(b.tokens, a.tokens);
  CompletionRequest salted = Greedy(prompt, 8);
  salted.cache_salt = "tenant-2";
  ASSERT_TRUE(r.Submit(salted, c.Callback()).ok());
  c.Wait();
  EXPECT_EQ(c.last.usage.cached_tokens, 0);
  EXPECT_EQ(c.tokens, a.tokens);

  // A stop string taken from the middle of the greedy text ends the text before it.
  ASSERT_GE(a.text.size(), 6u);
  const std::string stop = a.text.substr(a.text.size() / 2, 3);
  CompletionRequest stopped = Greedy(prompt, 8);
  stopped.stop = {"@@never@@", stop};
  Collector d;
  ASSERT_TRUE(r.Submit(stopped, d.Callback()).ok());
  d.Wait();
  EXPECT_EQ(d.last.finish_reason, "stop");
  EXPECT_EQ(d.text, a.text.substr(0, a.text.find(stop)));

  // Cancel mid-generation: a final "cancelled" event, and no page left but the prefix cache's.
  Collector e;
  auto id = r.Submit(Greedy(prompt, 4000), e.Callback());
  ASSERT_TRUE(id.ok());
  r.Cancel(*id);
  e.Wait();
  EXPECT_EQ(e.last.finish_reason, "cancelled");
  // Pages only the prefix cache holds are in use but reclaimable: usage counts them free.
  EXPECT_GT(r.kv_stats().pages_cached, 0);
  EXPECT_EQ(r.Metrics().kv_usage, 0);
  r.ClearPrefixCache();
  EXPECT_EQ(r.kv_stats().pages_used, 0);
}

// A request that a stop string ends leaves the conversation up to the stop in the prefix cache,
// without the stop string's tokens: a follow-up whose prompt is that conversation (the prompt and
// the tokens before the stop string, then new text) finds it cached in whole pages, generated
// tokens included, and no cached block holds a token of the stop string.
TEST(Runtime, StopStringTokensAreNotCached) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok());
  Runtime& r = **rt;
  const auto prompt = Prompts(r)[1];
  const int n_prompt = static_cast<int>(prompt.size());
  CompletionRequest greedy = Greedy(prompt, 64);
  greedy.stop_at_eos = false;
  Collector a;
  ASSERT_TRUE(r.Submit(greedy, a.Callback()).ok());
  a.Wait();
  ASSERT_EQ(a.tokens.size(), 64u);
  r.ClearPrefixCache();
  // off[i]: the text of the first i generated tokens.
  std::vector<size_t> off;
  for (size_t i = 0; i <= a.tokens.size(); ++i) {
    const std::string t = r.tokenizer().Decode(std::span(a.tokens).first(i));
    ASSERT_TRUE(a.text.starts_with(t));
    off.push_back(t.size());
  }
  // A stop string made of the text of tokens j .. j + len - 1, first seen there, such that the
  // tokens before it end inside a page (past the prompt's pages) that the tokens evaluated when
  // the stop string is complete (all but its last) fill.
  const int pt = r.kv_stats().page_tokens;
  int j = -1, len = 0;
  for (int jj = 1; jj + 4 < static_cast<int>(a.tokens.size()) && j < 0; ++jj) {
    for (int l = 2; l <= 4 && j < 0; ++l) {
      const int kept = n_prompt + jj, evaluated = kept + l - 1;
      if (kept / pt * pt <= n_prompt || evaluated / pt == kept / pt) continue;
      if (off[jj] == off[jj - 1] || off[jj + l] == off[jj + l - 1]) continue;
      const std::string stop = a.text.substr(off[jj], off[jj + l] - off[jj]);
      if (a.text.find(stop) != off[jj]) continue;
      j = jj;
      len = l;
    }
  }
  ASSERT_GE(j, 0) << "no stop string of the greedy text fits the test";
  CompletionRequest stopped = greedy;
  stopped.stop = {a.text.substr(off[j], off[j + len] - off[j])};
  Collector d;
  ASSERT_TRUE(r.Submit(stopped, d.Callback()).ok());
  d.Wait();
  EXPECT_EQ(d.last.finish_reason, "stop");
  EXPECT_EQ(d.text, a.text.substr(0, off[j]));
  const int kept = n_prompt + j;
  EXPECT_EQ(r.kv_stats().prefix_cached_blocks, kept / pt) << "a block with stop-string tokens";
  std::vector<int32_t> follow = prompt;
  follow.insert(follow.end(), a.tokens.begin(), a.tokens.begin() + j);
  const auto more = Prompts(r)[2];
  follow.insert(follow.end(), more.begin() + 1, more.end());
  Collector e;
  ASSERT_TRUE(r.Submit(Greedy(follow, 4), e.Callback()).ok());
  e.Wait();
  EXPECT_TRUE(e.last.error.ok()) << e.last.error.ToString();
  EXPECT_EQ(e.last.usage.cached_tokens, kept / pt * pt);
  EXPECT_GT(e.last.usage.cached_tokens, n_prompt);  // generated tokens served from the cache
}

TEST(Runtime, BadRequestsAreRejectedUpFront) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok());
  Runtime& r = **rt;
  auto noop = [](const TokenEvent&) {};
  EXPECT_EQ(r.Submit(Greedy({}, 4), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Submit(Greedy({1, -3}, 4), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Submit(Greedy({1, 1 << 30}, 4), noop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Submit(Greedy({1, 2}, 0), noop).status().code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> too_long(r.n_ctx(), 1);
  const Status s = r.Submit(Greedy(too_long, 4), noop).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("context"), std::string::npos) << s.ToString();
  EXPECT_EQ(r.Metrics().requests_finished, 0);
}

// A prompt more than the whole pool can hold could never run: InvalidArgument (a client error),
// not the ResourceExhausted of a full queue that a retry may get past.
TEST(Runtime, PromptBeyondThePoolIsInvalid) {
  RuntimeOptions o = Options("f32", /*kv_mem_mib=*/1);
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const int fits = testing::TokensThePoolHolds(r);
  ASSERT_LT(fits + 1, r.n_ctx());
  std::vector<int32_t> prompt(fits + 1, 10);
  const Status s = r.Submit(Greedy(prompt, 4), [](const TokenEvent&) {}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("--kv-mem"), std::string::npos) << s.ToString();
}

// A request alone whose cache outgrows the pool while it generates has nothing left to preempt:
// it ends as at the end of the context (finish_reason length, its tokens kept), not with the
// ResourceExhausted that tells a client to retry. Chunked-prompt metrics count what was computed.
TEST(Runtime, RequestOutgrowingThePoolEndsWithLength) {
  auto rt = Runtime::Create(Options("f32", /*kv_mem_mib=*/1));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const int fits = testing::TokensThePoolHolds(r);
  ASSERT_LT(fits + 8, r.n_ctx());
  CompletionRequest q = Greedy(std::vector<int32_t>(fits - 8, 10), r.n_ctx());
  q.stop_at_eos = false;
  Collector c;
  ASSERT_TRUE(r.Submit(q, c.Callback()).ok());
  c.Wait();
  EXPECT_TRUE(c.last.error.ok()) << c.last.error.ToString();
  EXPECT_EQ(c.last.finish_reason, "length");
  EXPECT_GE(c.last.usage.completion_tokens, 8);
  EXPECT_LE(c.last.usage.prompt_tokens + c.last.usage.completion_tokens, fits + 1);
  EXPECT_EQ(static_cast<int>(c.tokens.size()), c.last.usage.completion_tokens);
  EXPECT_EQ(r.Metrics().prompt_tokens, fits - 8);
}

// Runs q to its end; c collects its events, the result is every event's logprobs in order.
std::vector<TokenLogprob> Logprobs(Runtime& r, const CompletionRequest& q, Collector* c) {
  std::vector<TokenLogprob> lps;
  EventCallback inner = c->Callback();
  EXPECT_TRUE(r.Submit(q, [&](const TokenEvent& e) {
                 lps.insert(lps.end(), e.logprobs.begin(), e.logprobs.end());
                 inner(e);
               }).ok());
  c->Wait();
  return lps;
}

// Special tokens are tokens of the reply but none of its text unless asked (vLLM's
// skip_special_tokens); one that is a stop string ends the reply as EOS does. After an EOS in the
// prompt kvtiny's greedy next token is BOS.
TEST(Runtime, SpecialTokensAddNoTextAndMayStop) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const Tokenizer& tok = r.tokenizer();
  std::vector<int32_t> prompt = tok.EncodePrompt("Tom had a red ball. The end.");
  prompt.push_back(tok.eos_id());
  const std::string bos_text = tok.TokenBytes(tok.bos_id());
  std::string texts[2];
  for (bool skip : {true, false}) {
    CompletionRequest q = Greedy(prompt, 3);
    q.skip_special_tokens = skip;
    q.top_logprobs = 0;
    Collector c;
    const std::vector<TokenLogprob> lps = Logprobs(r, q, &c);
    ASSERT_FALSE(c.tokens.empty());
    ASSERT_EQ(c.tokens[0], tok.bos_id());
    texts[skip] = c.text;
    // Each token's text_offset is where its text starts in the reply's (characters; the text
    // here is ASCII): BOS's text is none of it when skipped.
    ASSERT_EQ(lps.size(), c.tokens.size());
    EXPECT_EQ(lps[0].text_offset, 0);
    for (size_t i = 1; i < lps.size(); ++i) {
      const std::string piece = tok.TokenBytes(c.tokens[i]);
      EXPECT_EQ(c.text.compare(lps[i].text_offset, piece.size(), piece), 0)
          << i << " at " << lps[i].text_offset << " in '" << c.text << "'";
    }
  }
  EXPECT_EQ(texts[1].find(bos_text), std::string::npos) << texts[1];
  EXPECT_TRUE(texts[0].starts_with(bos_text)) << texts[0];
  EXPECT_EQ(texts[0].substr(bos_text.size()), texts[1]);
  CompletionRequest q = Greedy(prompt, 3);
  q.stop = {bos_text};
  Collector c;
  ASSERT_TRUE(r.Submit(q, c.Callback()).ok());
  c.Wait();
  EXPECT_EQ(c.last.finish_reason, "stop");
  EXPECT_TRUE(c.tokens.empty());
  EXPECT_EQ(c.text, "");
}

// Logprobs go out with their tokens' text: a token whose text is held back (it may start a stop
// string) sends its logprobs when the text goes, and the tokens of a stop string never do, so
// every text_offset lies inside the text sent (they listed tokens the text did not hold).
TEST(Runtime, LogprobsGoWithTheirText) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const std::vector<int32_t> prompt = r.tokenizer().EncodePrompt("In the beginning");
  Collector plain;
  ASSERT_TRUE(r.Submit(Greedy(prompt, 16), plain.Callback()).ok());
  plain.Wait();
  ASSERT_GE(plain.text.size(), 12u) << plain.text;
  // A stop string across a token boundary, starting past the first few characters.
  const size_t at = plain.text.size() / 2;
  CompletionRequest q = Greedy(prompt, 16);
  q.stop = {plain.text.substr(at, 4)};
  q.top_logprobs = 1;
  std::vector<TokenLogprob> lps;
  std::string sent;
  bool released_early = false;
  Collector c;
  EventCallback inner = c.Callback();
  ASSERT_TRUE(r.Submit(q, [&](const TokenEvent& e) {
                 sent += e.text;
                 for (const TokenLogprob& lp : e.logprobs) {
                   released_early |= !e.finished && lp.text_offset >= static_cast<int>(sent.size());
                   lps.push_back(lp);
                 }
                 inner(e);
               }).ok());
  c.Wait();
  EXPECT_EQ(c.last.finish_reason, "stop");
  const std::string text = plain.text.substr(0, plain.text.find(q.stop[0]));
  ASSERT_EQ(c.text, text);
  EXPECT_FALSE(released_early);
  ASSERT_FALSE(lps.empty());
  for (const TokenLogprob& lp : lps) {
    EXPECT_LT(lp.text_offset, static_cast<int>(text.size())) << text;
  }
  // The tokens whose text starts before the stop string, each once, in order.
  size_t expect = 0;
  for (size_t i = 0, offset = 0; i < plain.tokens.size() && offset < text.size(); ++i) {
    offset += r.tokenizer().TokenBytes(plain.tokens[i]).size();
    ++expect;
  }
  ASSERT_EQ(lps.size(), expect);
  for (size_t i = 0; i < lps.size(); ++i) EXPECT_EQ(lps[i].token, plain.tokens[i]) << i;
}

// A token holding a lone byte that starts no valid character comes out as U+FFFD when the next
// token arrives: that character is the lone byte's, and the next token's text_offset is after it
// (it was one short, and every offset after it). Sampled hot over non-ASCII text, kvtiny writes
// such tokens (seeds as found by a client).
TEST(Runtime, TextOffsetsCountReplacedBytes) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const Tokenizer& tok = r.tokenizer();
  const std::vector<int32_t> prompt = tok.EncodePrompt(
      "Caf\u00e9 M\u00fcller: \u00abd\u00e9j\u00e0 vu\u00bb \u2014 na\u00efve fa\u00e7ade, "
      "\u65e5\u672c\u8a9e, \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac, "
      "\u0440\u0443\u0441\u0441\u043a\u0438\u0439, \U0001f30d.");
  int lone = 0;
  for (uint64_t seed : {7, 16, 25}) {
    CompletionRequest q;
    q.prompt = prompt;
    q.max_tokens = 60;
    q.sampling.temperature = 1.5f;  // and no truncation, as the server's OpenAI defaults
    q.sampling.top_k = 0;
    q.sampling.top_p = 1.0f;
    q.sampling.min_p = 0.0f;
    q.sampling.seed = seed;
    q.stop_at_eos = false;
    q.top_logprobs = 0;
    Collector c;
    const std::vector<TokenLogprob> lps = Logprobs(r, q, &c);
    // Byte offset of each character of the text.
    std::vector<size_t> at;
    for (size_t i = 0; i < c.text.size(); ++i) {
      if ((static_cast<unsigned char>(c.text[i]) & 0xC0) != 0x80) at.push_back(i);
    }
    at.push_back(c.text.size());
    for (const TokenLogprob& lp : lps) {
      const std::string bytes = tok.TokenBytes(lp.token);
      if (tok.IsSpecial(lp.token)) continue;
      StreamDecoder alone(tok);  // bytes that are not whole characters come out as U+FFFD
      if (alone.Push(lp.token) + alone.Flush() != bytes) {
        ++lone;
        continue;
      }
      ASSERT_LT(size_t(lp.text_offset), at.size()) << seed;
      EXPECT_EQ(c.text.compare(at[lp.text_offset], bytes.size(), bytes), 0)
          << "seed " << seed << ": '" << bytes << "' at " << lp.text_offset << " in '" << c.text
          << "'";
    }
  }
  EXPECT_GT(lone, 0) << "no lone-byte token sampled: the test checks nothing";
}

// A press as `cachet run --press SPEC --ratio R` sets it (the same parser).
press::PressOptions Press(const char* spec, double ratio) {
  press::PressOptions p;
  p.ratio = ratio;
  EXPECT_TRUE(press::ParsePressSpec(spec, &p).ok()) << spec;
  return p;
}

// The four texts `rounds` times over (BOS once): about 115 tokens a round.
std::vector<int32_t> LongPrompt(const Runtime& rt, int rounds = 2) {
  std::vector<int32_t> out;
  for (int round = 0; round < rounds; ++round) {
    for (const auto& p : Prompts(rt)) {
      out.insert(out.end(), p.begin() + (out.empty() ? 0 : 1), p.end());
    }
  }
  return out;
}

CompletionRequest Pressed(std::vector<int32_t> prompt, int max_tokens, const char* spec,
                          double ratio) {
  CompletionRequest r = Greedy(std::move(prompt), max_tokens);
  r.stop_at_eos = false;  // `max_tokens` tokens, whatever the model says
  r.press = Press(spec, ratio);
  return r;
}

// Requests on one prompt submitted together (a shared system prompt, the `n` choices of a
// request): the first computes it, the others wait for it to be published and reuse its full
// pages, so the prompt is computed about once, and each still gets the tokens it gets alone.
TEST(Runtime, RequestsOnOnePromptComputeItOnce) {
  auto rt = Runtime::Create(Options("f32"));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const auto prompt = LongPrompt(r);
  const int n = static_cast<int>(prompt.size());
  ASSERT_GT(n, 150);
  Collector alone;
  ASSERT_TRUE(r.Submit(Greedy(prompt, 8), alone.Callback()).ok());
  alone.Wait();
  r.ClearPrefixCache();
  const int64_t before = r.Metrics().prompt_tokens;
  std::vector<Collector> together(4);
  for (Collector& c : together) ASSERT_TRUE(r.Submit(Greedy(prompt, 8), c.Callback()).ok());
  for (Collector& c : together) c.Wait();
  const int page = r.kv_stats().page_tokens;
  EXPECT_EQ(together[0].last.usage.cached_tokens, 0);
  for (size_t i = 0; i < together.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone.tokens) << "request " << i;
    if (i > 0) {
      EXPECT_EQ(together[i].last.usage.cached_tokens, (n - 1) / page * page) << "request " << i;
    }
  }
  // Once in full, then each other request's last partial block.
  EXPECT_LE(r.Metrics().prompt_tokens - before, n + 3 * page);
}

// A runtime over a disk tier: a second runtime (a restarted server) serves a repeated prompt from
// disk, with the tokens the first computed, and says where its prompt tokens came from.
TEST(Runtime, RestartedRuntimeServesPromptsFromDisk) {
  testing::TempDir dir;
  RuntimeOptions o = Options("q8_0");
  o.engine.disk_cache_dir = dir.path();
  std::vector<int32_t> prompt;
  Collector first, second;
  {
    auto rt = Runtime::Create(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    prompt = LongPrompt(**rt);
    ASSERT_TRUE((*rt)->Submit(Greedy(prompt, 8), first.Callback()).ok());
    first.Wait();
    EXPECT_EQ(first.last.usage.cached_tokens, 0);
  }
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  ASSERT_TRUE((*rt)->Submit(Greedy(prompt, 8), second.Callback()).ok());
  second.Wait();
  const int page = (*rt)->kv_stats().page_tokens;
  const int whole = (static_cast<int>(prompt.size()) - 1) / page * page;
  EXPECT_EQ(second.last.usage.cached_tokens, whole);
  EXPECT_EQ(second.tokens, first.tokens);
  const RuntimeMetrics m = (*rt)->Metrics();
  ASSERT_EQ(m.prompt_tokens_by_source.size(), 3u);
  EXPECT_EQ(m.prompt_tokens_by_source[2].first, "disk");
  EXPECT_EQ(m.prompt_tokens_by_source[2].second, whole);
  EXPECT_EQ(m.prompt_tokens_by_source[1].second, 0);  // nothing from RAM
  EXPECT_EQ(m.prompt_tokens_by_source[0].second, static_cast<int>(prompt.size()) - whole);
  ASSERT_EQ(m.kv_tiers.size(), 1u);
  EXPECT_GE(m.kv_tiers[0].hits, 1);
}

// KV pages in use, as the runtime's snapshot has them when each of a request's events after the
// first is sent (the snapshot of the step before: the prompt pressed, if it was, and the tokens
// decoded so far): the most seen.
struct PageWatch {
  Collector c;
  std::atomic<int> most{0};
  EventCallback Callback(Runtime& rt) {
    return [this, &rt, inner = c.Callback()](const TokenEvent& e) {
      if (!e.finished && c.events > 0) {
        most = std::max(most.load(), rt.kv_stats().pages_used);
      }
      inner(e);
    };
  }
};

// snapkv at 0.5 on a prompt of a few hundred tokens: the request holds about half the pages the
// same request holds unpressed while it decodes, and still generates every token asked for.
TEST(Runtime, PressedRequestHoldsFewerPages) {
  RuntimeOptions o = Options("f32");
  o.engine.prefix_cache = false;  // pages_used counts the request's pages only
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const auto prompt = LongPrompt(r);
  ASSERT_GT(prompt.size(), 150u);
  PageWatch full, pressed;
  CompletionRequest plain = Greedy(prompt, 16);
  plain.stop_at_eos = false;
  ASSERT_TRUE(r.Submit(plain, full.Callback(r)).ok());
  full.c.Wait();
  ASSERT_TRUE(r.Submit(Pressed(prompt, 16, "snapkv", 0.5), pressed.Callback(r)).ok());
  pressed.c.Wait();
  for (Collector* c : {&full.c, &pressed.c}) {
    EXPECT_TRUE(c->last.error.ok()) << c->last.error.ToString();
    EXPECT_EQ(c->last.finish_reason, "length");
    EXPECT_EQ(c->tokens.size(), 16u);
    EXPECT_EQ(c->last.usage.completion_tokens, 16);
  }
  const KvStats kv = r.kv_stats();
  const int heads = r.config().n_layers * r.config().n_kv_heads;
  // Unpressed: every token held in whole pages. The last event but the final one (the 15th) sees
  // the snapshot of the step that sampled the 14th token, so evaluated the 13th.
  const int held = static_cast<int>(prompt.size()) + 13;
  EXPECT_EQ(full.most, (held + kv.page_tokens - 1) / kv.page_tokens * heads);
  // Pressed: half the prompt kept, a page per table at most for what was decoded after it.
  const int kept = (static_cast<int>(prompt.size()) + 1) / 2 + 13;
  EXPECT_LE(pressed.most, (kept + kv.page_tokens - 1) / kv.page_tokens * heads + heads);
  EXPECT_LT(pressed.most * 10, full.most * 7) << pressed.most << " vs " << full.most;
  EXPECT_EQ(r.kv_stats().pages_used, 0);  // every page back
  // The press evicted half the prompt from every (layer, KV head): the metric counts those.
  const int64_t evicted = r.Metrics().kv_evicted_tokens;
  EXPECT_GE(evicted, int64_t(prompt.size()) / 2 - 1);
  EXPECT_LE(evicted, int64_t(prompt.size()) / 2 + 1);
  EXPECT_EQ(r.Metrics().kv_usage, 0);
}

// A pressed and an unpressed request served together: the unpressed one gets the greedy tokens
// it gets alone (the press evicts from its own sequence only), the pressed one its `length`.
TEST(Runtime, PressedAndUnpressedRequestsTogether) {
  auto rt = Runtime::Create(Options("f16"));
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const auto prompts = Prompts(r);
  const auto long_prompt = LongPrompt(r);
  Collector alone;
  ASSERT_TRUE(r.Submit(Greedy(prompts[1], 24), alone.Callback()).ok());
  alone.Wait();
  r.ClearPrefixCache();
  Collector plain, pressed;
  // The pressed one first: its prompt chunks and its press run in the steps that prefill and
  // decode the other.
  ASSERT_TRUE(r.Submit(Pressed(long_prompt, 24, "snapkv+max", 0.5), pressed.Callback()).ok());
  ASSERT_TRUE(r.Submit(Greedy(prompts[1], 24), plain.Callback()).ok());
  plain.Wait();
  pressed.Wait();
  EXPECT_EQ(plain.tokens, alone.tokens);
  EXPECT_EQ(plain.text, alone.text);
  EXPECT_TRUE(pressed.last.error.ok()) << pressed.last.error.ToString();
  EXPECT_EQ(pressed.last.finish_reason, "length");
  EXPECT_EQ(pressed.tokens.size(), 24u);
  EXPECT_EQ(pressed.last.usage.cached_tokens, 0);  // a pressed prompt is never looked up
  EXPECT_EQ(r.Metrics().preemptions, 0);
}

// A pressed request preempted after its press (an unpressed neighbour outgrows a small pool) is
// recomputed as it first ran: its prompt, pressed again at the prompt's end, then the tokens it
// had generated; it goes on with the tokens it gets alone. Presses are refused where the runtime
// cannot honour them.
TEST(Runtime, PreemptedPressedRequestIsPressedAgain) {
  RuntimeOptions o = Options("f16", /*kv_mem_mib=*/1);  // 252 pages: 15 per table and a bit
  o.engine.prefix_cache = false;
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  Runtime& r = **rt;
  const auto prompts = Prompts(r);
  const auto long_prompt = LongPrompt(r, 1);
  CompletionRequest grow = Greedy(prompts[0], 150);
  grow.stop_at_eos = false;
  const CompletionRequest pressed_req = Pressed(long_prompt, 100, "snapkv", 0.5);
  Collector alone;
  ASSERT_TRUE(r.Submit(pressed_req, alone.Callback()).ok());
  alone.Wait();
  ASSERT_TRUE(alone.last.error.ok()) << alone.last.error.ToString();
  ASSERT_EQ(alone.tokens.size(), 100u);
  // Alone, the unpressed one and the pressed one each fit; together they outgrow the pool.
  const KvStats kv = r.kv_stats();
  const int per_table = kv.pages_total / (r.config().n_layers * r.config().n_kv_heads);
  auto pages = [&](size_t tokens) { return static_cast<int>((tokens + 15) / 16); };
  ASSERT_LE(pages(long_prompt.size() + 1), per_table);
  ASSERT_LE(pages(prompts[0].size() + 150), per_table);
  ASSERT_GT(pages(prompts[0].size() + 150) + pages(long_prompt.size() / 2 + 100), per_table);

  Collector g, p;
  ASSERT_TRUE(r.Submit(grow, g.Callback()).ok());
  ASSERT_TRUE(r.Submit(pressed_req, p.Callback()).ok());
  g.Wait();
  p.Wait();
  EXPECT_TRUE(g.last.error.ok()) << g.last.error.ToString();
  EXPECT_TRUE(p.last.error.ok()) << p.last.error.ToString();
  EXPECT_EQ(g.tokens.size(), 150u);
  EXPECT_EQ(p.tokens, alone.tokens);
  EXPECT_GT(r.Metrics().preemptions, 0) << "the pool was meant to run dry";
  EXPECT_EQ(r.kv_stats().pages_used, 0);

  auto noop = [](const TokenEvent&) {};
  CompletionRequest again = Pressed(prompts[0], 4, "h2o", 0.5);
  again.press->decode_every = 8;
  EXPECT_EQ(r.Submit(again, noop).status().code(), StatusCode::kInvalidArgument);
  CompletionRequest bad_ratio = Pressed(prompts[0], 4, "snapkv", 0.5);
  bad_ratio.press->ratio = 1.5;
  EXPECT_EQ(r.Submit(bad_ratio, noop).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cachet
