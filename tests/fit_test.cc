// Chats longer than the context, pressed to fit (Session::EvalFitting; `cachet serve --on-full
// press:NAME:RATIO`): the protected start and the last turn stay whole, the history between them
// is pressed as often as it takes, a pass key in the system prompt is still answered, and the
// Runtime serves such a request as the session computes it.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/engine.h"
#include "cachet/press.h"
#include "cachet/serving.h"
#include "cachet/tokenizer.h"
#include "runtime/engine_access.h"
#include "runtime_collector.h"
#include "server/prepare.h"
#include "server/request.h"
#include "test_util.h"

namespace cachet {
namespace {

const char* kKey = "The pass key is 52817. Remember it. 52817 is the pass key.\n\n";
const char* kQuestion = "Question: What is the pass key?\nAnswer:";

std::string Story(int paragraphs) {
  const char* kTopics[] = {"the dog", "a red ball", "the river", "school", "the park", "Lily"};
  std::string s;
  for (int i = 0; i < paragraphs; ++i) {
    s += "Every day after school " + std::string(kTopics[i % 6]) + " was there, and turn " +
         std::to_string(i) + " of the story went on by the water until the evening came.\n\n";
  }
  return s;
}

FitOptions KeydiffFit(int protect, int tail, int reserve) {
  Result<press::OnFull> on_full = press::ParseOnFull("press:keydiff:0.5");
  EXPECT_TRUE(on_full.ok());
  return FitOptions{on_full->press, protect, tail, reserve};
}

// kvtiny in a context of n_ctx, 2 threads, no prefix cache.
EngineOptions FitEngine(int n_ctx) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.threads = 2;
  o.n_ctx = n_ctx;
  o.prefix_cache = false;
  return o;
}

TEST(FitSession, APromptThreeTimesTheContextKeepsItsEndsAndAnswers) {
  const EngineOptions o = FitEngine(1024);
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const Tokenizer& tok = (*engine)->tokenizer();
  const std::vector<int32_t> key = tok.EncodePrompt(kKey);
  const std::vector<int32_t> story = tok.Encode(Story(100));
  const std::vector<int32_t> question = tok.Encode(kQuestion);
  std::vector<int32_t> prompt = key;
  prompt.insert(prompt.end(), story.begin(), story.end());
  const int tail = static_cast<int>(prompt.size());
  prompt.insert(prompt.end(), question.begin(), question.end());
  ASSERT_GT(prompt.size(), 3u * o.n_ctx);

  auto s = (*engine)->NewSession();
  std::vector<float> logits;
  auto away = s->EvalFitting(prompt, KeydiffFit(int(key.size()), tail, 16), &logits);
  ASSERT_TRUE(away.ok()) << away.status().ToString();
  EXPECT_EQ(*away, int(prompt.size()) - s->n_tokens());
  EXPECT_LE(s->n_tokens() + 16, o.n_ctx);
  EXPECT_EQ(logits.size(), size_t((*engine)->config().vocab_size));
  // The protected start and the tail, whole and where they belong.
  const std::vector<int32_t>& held = s->tokens();
  ASSERT_EQ(held.size(), size_t(s->n_tokens()));
  EXPECT_TRUE(std::equal(key.begin(), key.end(), held.begin()));
  EXPECT_TRUE(std::equal(question.begin(), question.end(), held.end() - question.size()));
  GenerateOptions g;
  g.max_tokens = 8;
  g.sampling.temperature = 0;
  auto answer = s->Generate({}, g);
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  EXPECT_TRUE(tok.Decode(answer->tokens).starts_with(" 52817")) << tok.Decode(answer->tokens);

  // A prompt that fits is evaluated as it is.
  s.reset();  // its pages back: the pool holds one context
  auto short_one = (*engine)->NewSession();
  auto none =
      short_one->EvalFitting(std::span(prompt).first(300), KeydiffFit(10, 290, 16), &logits);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(*none, 0);
  EXPECT_EQ(short_one->n_tokens(), 300);

  // Errors leave the session empty.
  auto fresh = (*engine)->NewSession();
  auto too_long =
      fresh->EvalFitting(prompt, KeydiffFit(600, int(prompt.size()) - 500, 16), &logits);
  EXPECT_EQ(too_long.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(too_long.status().message().find("however much the history"), std::string::npos)
      << too_long.status().message();
  FitOptions snapkv = KeydiffFit(int(key.size()), tail, 16);
  ASSERT_TRUE(press::ParsePressSpec("snapkv+max", &snapkv.press).ok());
  EXPECT_EQ(fresh->EvalFitting(prompt, snapkv, &logits).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(fresh->n_tokens(), 0);
  EXPECT_EQ(short_one->EvalFitting(prompt, KeydiffFit(1, tail, 16), &logits).status().code(),
            StatusCode::kFailedPrecondition);
}

// With precision by age (--kv-cold) the prompt is pressed to fit before any page ages (a page
// moved to the cold pool is outside the press's token set: CompactPositions refused it, a 500 in
// serve), and pages age again in the decode steps after it.
TEST(FitSession, AgingWaitsForTheFit) {
  EngineOptions o = FitEngine(512);
  o.kv_codec_k = o.kv_codec_v = "f16";
  o.kv_cold = "q4_0";
  o.kv_cold_after = 32;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const Tokenizer& tok = (*engine)->tokenizer();
  const std::vector<int32_t> key = tok.EncodePrompt(kKey);
  std::vector<int32_t> prompt = key;
  const std::vector<int32_t> story = tok.Encode(Story(40));
  prompt.insert(prompt.end(), story.begin(), story.end());
  const int tail = static_cast<int>(prompt.size());
  const std::vector<int32_t> question = tok.Encode(kQuestion);
  prompt.insert(prompt.end(), question.begin(), question.end());
  ASSERT_GT(prompt.size(), 2u * o.n_ctx);
  auto s = (*engine)->NewSession();
  std::vector<float> logits;
  auto away = s->EvalFitting(prompt, KeydiffFit(int(key.size()), tail, 64), &logits);
  ASSERT_TRUE(away.ok()) << away.status().ToString();
  EXPECT_GT(*away, 0);
  EXPECT_EQ(EngineAccess::kv(*s).cold_length(0, 0), 0);
  EXPECT_EQ(EngineAccess::kv(*s).age_out(), 32);
  GenerateOptions g;
  g.max_tokens = 4;
  g.sampling.temperature = 0;
  ASSERT_TRUE(s->Generate({}, g).ok());
  EXPECT_GT(EngineAccess::kv(*s).cold_length(0, 0), 0);
}

TEST(FitSession, OnFullPoliciesParseOnce) {
  auto press = press::ParseOnFull("press:streaming:0.25");
  ASSERT_TRUE(press.ok()) << press.status().ToString();
  EXPECT_EQ(press->kind, press::OnFull::Kind::kPress);
  EXPECT_DOUBLE_EQ(press->press.ratio, 0.25);
  EXPECT_EQ(press->press.share, press::ShareLayers::kMax);
  EXPECT_EQ(press::ParseOnFull("shift")->kind, press::OnFull::Kind::kShift);
  EXPECT_EQ(press::ParseOnFull("error")->kind, press::OnFull::Kind::kError);
  for (const char* bad : {"drop", "press:keydiff", "press:keydiff:1.5", "press:snapkv:0.5",
                          "press:kvzip:0.5", "press:keydiff+chunked:0.5"}) {
    EXPECT_EQ(press::ParseOnFull(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

server::ServedModel Model(const Tokenizer& tok, const char* on_full) {
  server::ServedModel m;
  m.name = "kvtiny";
  m.tokenizer = &tok;
  m.chat_template = ResolveChatTemplate(testing::ModelDir(), "chatml").value();
  UseTokenizerSpecials(tok, &m.chat_template);
  m.n_ctx = 1024;
  m.vocab_size = 8192;
  m.on_full = press::ParseOnFull(on_full).value();
  return m;
}

std::vector<ChatMessage> LongChat(int turns, const std::string& last) {
  std::vector<ChatMessage> m = {{ChatRole::kSystem, kKey}};
  for (int i = 0; i < turns; ++i) {
    m.push_back({ChatRole::kUser, Story(2)});
    m.push_back({ChatRole::kAssistant, "Then the story went on, part " + std::to_string(i) + "."});
  }
  m.push_back({ChatRole::kUser, last});
  return m;
}

TEST(FitServing, TheHistoryBetweenTheSystemPromptAndTheLastMessageIsPressed) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok());
  const server::ServedModel model = Model(**tok, "press:keydiff:0.5");
  server::ParsedRequest parsed;
  parsed.endpoint = server::Endpoint::kChat;
  parsed.messages = LongChat(30, "What is the pass key?");
  auto p = server::Prepare(parsed, model, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const CompletionRequest& r = p->request;
  ASSERT_TRUE(r.fit.has_value());
  EXPECT_TRUE(p->history_pressed);
  EXPECT_GT(int(r.prompt.size()), model.n_ctx);
  EXPECT_EQ(r.fit->reserve, model.n_ctx / 4);
  EXPECT_EQ(r.max_tokens, model.n_ctx / 4);
  // The system prompt's tokens are the protected ones; the tail is the last message on.
  const std::string system =
      RenderChat(model.chat_template, std::span(parsed.messages).first(1), false).value();
  EXPECT_EQ(r.fit->protect, int(EncodeChatPrompt(**tok, system, true).size()));
  const std::string last =
      (*tok)->Decode(std::vector<int32_t>(r.prompt.begin() + r.fit->tail, r.prompt.end()));
  EXPECT_NE(last.find("What is the pass key?"), std::string::npos) << last;
  EXPECT_EQ(last.find("part 29."), std::string::npos) << last;

  // A chat that fits is left alone; a last message too long for any pressing is an error; so is
  // shifting's and pressing's absence.
  parsed.messages = LongChat(2, "What is the pass key?");
  auto fits = server::Prepare(parsed, model, 1);
  ASSERT_TRUE(fits.ok());
  EXPECT_FALSE(fits->request.fit.has_value());
  EXPECT_FALSE(fits->history_pressed);
  parsed.messages = LongChat(30, Story(30));
  auto huge = server::Prepare(parsed, model, 1);
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(huge.status().message().find("however much the history"), std::string::npos)
      << huge.status().message();
  parsed.messages = LongChat(30, "What is the pass key?");
  EXPECT_EQ(server::Prepare(parsed, Model(**tok, "error"), 1).status().code(),
            StatusCode::kOutOfRange);
  // A max_tokens no policy can make room for is refused by each of them, shift too (it dropped
  // every turn and answered anyway).
  parsed.messages = LongChat(2, "What is the pass key?");
  parsed.max_tokens = model.n_ctx - 8;
  for (const char* policy : {"error", "shift", "press:keydiff:0.5"}) {
    auto r = server::Prepare(parsed, Model(**tok, policy), 1);
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange)
        << policy << ": " << r.status().ToString();
    const std::string& m = r.status().message();
    EXPECT_TRUE(m.find("max_tokens") != std::string::npos ||
                m.find("leave less than") != std::string::npos)
        << policy << ": " << m;
  }
}

TEST(FitServing, TheRuntimeServesWhatEvalFittingComputes) {
  RuntimeOptions o;
  o.engine.model_dir = testing::ModelDir();
  o.engine.threads = 2;
  o.engine.n_ctx = 512;
  o.batch_tokens = 64;
  auto rt = Runtime::Create(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const Tokenizer& tok = (*rt)->tokenizer();
  std::vector<int32_t> prompt = tok.EncodePrompt(kKey);
  const int protect = static_cast<int>(prompt.size());
  const std::vector<int32_t> story = tok.Encode(Story(40)), question = tok.Encode(kQuestion);
  prompt.insert(prompt.end(), story.begin(), story.end());
  const int tail = static_cast<int>(prompt.size());
  prompt.insert(prompt.end(), question.begin(), question.end());

  CompletionRequest r;
  r.prompt = prompt;
  r.fit = KeydiffFit(protect, tail, 16);
  r.max_tokens = 8;
  r.sampling.temperature = 0;
  // What a session computes: the prompt but its last token fitted (with room for that token),
  // then the last token and the reply.
  auto engine = Engine::Create(o.engine);
  ASSERT_TRUE(engine.ok());
  auto s = (*engine)->NewSession();
  FitOptions f = *r.fit;
  f.reserve += 1;
  auto fitted = s->EvalFitting(std::span(prompt).first(prompt.size() - 1), f, nullptr);
  ASSERT_TRUE(fitted.ok()) << fitted.status().ToString();
  GenerateOptions g;
  g.max_tokens = 8;
  g.sampling.temperature = 0;
  auto want = s->Generate(std::span(prompt).last(1), g);
  ASSERT_TRUE(want.ok());

  testing::Collector d;
  auto id = (*rt)->Submit(r, d.Callback());
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  d.Wait();
  ASSERT_TRUE(d.last.error.ok()) << d.last.error.ToString();
  EXPECT_EQ(d.tokens, want->tokens);
  EXPECT_TRUE(tok.Decode(d.tokens).starts_with(" 52817")) << tok.Decode(d.tokens);
  EXPECT_EQ(d.last.usage.prompt_tokens, int(prompt.size()));
  const RuntimeMetrics m = (*rt)->Metrics();
  EXPECT_EQ(m.fit_requests, 1);
  EXPECT_EQ(m.prompt_tokens, int64_t(prompt.size()));  // each computed once, then pressed
  EXPECT_GT(m.fit_pressed_tokens, int64_t(prompt.size()) - o.engine.n_ctx);
  // Of its pages only the protected start's full ones went to the prefix cache (a chat's system
  // prompt, shared): the rest lacks tokens.
  const KvStats kv = (*rt)->kv_stats();
  EXPECT_EQ(kv.prefix_cached_blocks, protect / kv.page_tokens);

  // Refused up front: too long a tail, or with a press of its own.
  CompletionRequest bad = r;
  bad.fit->tail = 100;
  EXPECT_EQ((*rt)->Submit(bad, [](const TokenEvent&) {}).status().code(),
            StatusCode::kInvalidArgument);
  bad = r;
  bad.press = press::PressOptions{};
  EXPECT_EQ((*rt)->Submit(bad, [](const TokenEvent&) {}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cachet
