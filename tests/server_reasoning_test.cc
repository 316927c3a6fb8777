// A chat reply's thinking apart from its answer (server/reasoning.h): the splitter on every way a
// stream can cut its tags, the request field and the server's default, and the response shapes.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/tokenizer.h"
#include "server/prepare.h"
#include "server/reasoning.h"
#include "server/request.h"
#include "server/response.h"
#include "test_util.h"

namespace cachet::server {
namespace {

using json = nlohmann::json;

struct Split {
  std::string reasoning, content;
  bool reasoned = false;
};

// The reply fed in pieces of `step` bytes (0: whole).
Split SplitReply(std::string_view reply, bool opened, size_t step = 0) {
  ReasoningSplit s(opened);
  Split out;
  auto add = [&](const ReasoningSplit::Piece& p) {
    out.reasoning += p.reasoning;
    out.content += p.content;
  };
  if (step == 0) step = reply.size() + 1;
  for (size_t at = 0; at < reply.size(); at += step) add(s.Feed(reply.substr(at, step)));
  add(s.Finish());
  out.reasoned = s.reasoned();
  return out;
}

TEST(ReasoningSplit, ThinkingGoesApartHoweverTheStreamCutsIt) {
  struct Case {
    const char* reply;
    bool opened;
    const char* reasoning;
    const char* content;
    bool reasoned;
  };
  const Case cases[] = {
      // R1: the prompt opened <think>; the reply closes it, then white space, then the answer.
      {"Let me see.\n</think>\n\nParis.", true, "Let me see.\n", "Paris.", true},
      // A reply that opens the tag itself (QwQ, R1 templates that do not open it).
      {"  <think>hmm</think>Paris.", false, "hmm", "Paris.", true},
      // Never closed (max_tokens ran out): all of it was thinking.
      {"<think>still going </thi", false, "still going </thi", "", true},
      {"still going", true, "still going", "", true},
      // No tag: all content, white space included.
      {"  Paris.", false, "", "  Paris.", false},
      {"<thinking> is not the tag", false, "", "<thinking> is not the tag", false},
      {"<th", false, "", "<th", false},
      {"", false, "", "", false},
      // Thought nothing, answered; only the first </think> closes.
      {"<think></think>A </think> B", false, "", "A </think> B", true},
      {"</think>\n", true, "", "", true},
      // A tag-like text inside the thinking is thinking.
      {"a <b> </thin k</think>x", true, "a <b> </thin k", "x", true},
  };
  for (const Case& c : cases) {
    for (size_t step : {0, 1, 2, 3, 5}) {
      const Split s = SplitReply(c.reply, c.opened, step);
      EXPECT_EQ(s.reasoning, c.reasoning) << c.reply << " step " << step;
      EXPECT_EQ(s.content, c.content) << c.reply << " step " << step;
      EXPECT_EQ(s.reasoned, c.reasoned) << c.reply << " step " << step;
    }
  }
}

// What a piece can be told apart is given at once: only a possible tag's start is held back.
TEST(ReasoningSplit, HoldsBackOnlyWhatMayBeATag) {
  ReasoningSplit s(true);
  EXPECT_EQ(s.Feed("one two").reasoning, "one two");
  ReasoningSplit::Piece p = s.Feed(" three </th");
  EXPECT_EQ(p.reasoning, " three ");
  p = s.Feed("ink>  ");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "");
  p = s.Feed(" Answer");
  EXPECT_EQ(p.content, "Answer");
  EXPECT_EQ(s.Feed(" more").content, " more");
  EXPECT_EQ(s.Finish().content, "");
}

ParseLimits Limits() {
  ParseLimits l;
  l.model_name = "kvtiny";
  l.vocab_size = 8192;
  return l;
}

TEST(ReasoningSplit, FormatsParseAtTheEdge) {
  EXPECT_EQ(ParseReasoningFormat("none").value(), ReasoningFormat::kNone);
  EXPECT_EQ(ParseReasoningFormat("deepseek").value(), ReasoningFormat::kDeepSeek);
  EXPECT_EQ(ParseReasoningFormat("auto").value(), ReasoningFormat::kDeepSeek);
  const Status bad = ParseReasoningFormat("qwen").status();
  EXPECT_NE(bad.message().find("'qwen' is not a reasoning format (none, deepseek, auto)"),
            std::string::npos)
      << bad.message();

  const std::string msgs = R"("messages": [{"role": "user", "content": "Hi"}])";
  auto none =
      ParseRequest("{" + msgs + R"(, "reasoning_format": "none"})", Endpoint::kChat, Limits());
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->reasoning_format, ReasoningFormat::kNone);
  auto unset = ParseRequest("{" + msgs + "}", Endpoint::kChat, Limits());
  ASSERT_TRUE(unset.ok());
  EXPECT_FALSE(unset->reasoning_format.has_value());
  for (const std::string& body :
       {"{" + msgs + R"(, "reasoning_format": "xml"})", "{" + msgs + R"(, "reasoning_format": 1})",
        std::string(R"({"prompt": "x", "reasoning_format": "none"})")}) {
    const Endpoint e =
        body.find("prompt") != std::string::npos ? Endpoint::kCompletions : Endpoint::kChat;
    auto r = ParseRequest(body, e, Limits());
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ApiErrorFromStatus(r.status()).param, "reasoning_format") << body;
  }
}

// kvtiny as the server describes it to Prepare (its template set by each test).
ServedModel Kvtiny(const Tokenizer& tok) {
  ServedModel model;
  model.name = "kvtiny";
  model.tokenizer = &tok;
  model.n_ctx = 4096;
  model.vocab_size = 8192;
  return model;
}

// Which chat requests split, and whether they start inside the tag: the template's generation
// prompt (R1's opens <think>), the server's default and the request's own field.
TEST(ReasoningSplit, PreparedFromTheTemplateAndTheRequest) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ServedModel model = Kvtiny(*tok.value());
  auto deepseek = ChatTemplateByName("deepseek");
  ASSERT_TRUE(deepseek.ok());
  auto chatml = ChatTemplateByName("chatml");
  ASSERT_TRUE(chatml.ok());
  const std::string msgs = R"("messages": [{"role": "user", "content": "Hi"}])";
  auto prepare = [&](const ChatTemplate& t, ReasoningFormat server, const std::string& body,
                     Endpoint e = Endpoint::kChat) {
    model.chat_template = t;
    model.reasoning_format = server;
    auto parsed = ParseRequest(body, e, Limits());
    EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
    auto p = Prepare(parsed.value(), model, 1);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return std::pair(p->split_reasoning, p->reasoning_opened);
  };
  EXPECT_EQ(prepare(*deepseek, ReasoningFormat::kDeepSeek, "{" + msgs + "}"),
            std::pair(true, true));
  EXPECT_EQ(prepare(*chatml, ReasoningFormat::kDeepSeek, "{" + msgs + "}"), std::pair(true, false));
  EXPECT_EQ(prepare(*deepseek, ReasoningFormat::kNone, "{" + msgs + "}"), std::pair(false, false));
  EXPECT_EQ(prepare(*deepseek, ReasoningFormat::kDeepSeek,
                    "{" + msgs + R"(, "reasoning_format": "none"})"),
            std::pair(false, false));
  EXPECT_EQ(
      prepare(*deepseek, ReasoningFormat::kNone, "{" + msgs + R"(, "reasoning_format": "auto"})"),
      std::pair(true, true));
  EXPECT_EQ(prepare(*deepseek, ReasoningFormat::kDeepSeek,
                    "{" + msgs + R"(, "response_format": {"type": "json_object"}})"),
            std::pair(false, false));  // a JSON-mode reply is the object, never thinking
  EXPECT_EQ(
      prepare(*deepseek, ReasoningFormat::kDeepSeek, R"({"prompt": "Hi"})", Endpoint::kCompletions),
      std::pair(false, false));
}

// chat_template_kwargs.enable_thinking renders the request's messages with its own template: a
// Qwen3-style template (thinking_switch) then ends the prompt with an empty think block.
TEST(ReasoningSplit, EnableThinkingFalseClosesAnEmptyThinkBlock) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ServedModel model = Kvtiny(*tok.value());
  model.chat_template = ChatTemplateByName("chatml").value();
  model.chat_template.thinking_switch = true;
  auto prompt_of = [&](const std::string& extra) {
    auto parsed = ParseRequest(R"({"messages": [{"role": "user", "content": "Hi"}])" + extra + "}",
                               Endpoint::kChat, Limits());
    EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
    auto p = Prepare(parsed.value(), model, 1);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return tok.value()->Decode(p->request.prompt);
  };
  const std::string on = prompt_of(""),
                    off = prompt_of(R"(, "chat_template_kwargs": {"enable_thinking": false})");
  EXPECT_TRUE(on.ends_with("<|im_start|>assistant\n")) << on;
  EXPECT_EQ(off, on + "<think>\n\n</think>\n\n");
  EXPECT_TRUE(model.chat_template.enable_thinking);  // the served template is untouched
}

ResponseMeta ChatMeta() {
  ResponseMeta m;
  m.endpoint = Endpoint::kChat;
  m.id = "chatcmpl-1";
  m.model = "kvtiny";
  return m;
}

std::string NoText(int32_t) { return ""; }

TEST(ReasoningSplit, ResponsesCarryReasoningContent) {
  std::vector<ChoiceOutput> choices(2);
  choices[0].text = "Paris.";
  choices[0].reasoning = "hmm";
  choices[0].reasoned = true;
  choices[1].text = "Rome.";
  const json j = json::parse(CompletionResponse(ChatMeta(), choices, Usage{}, NoText));
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Paris.");
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], "hmm");
  EXPECT_EQ(j["choices"][1]["message"]["content"], "Rome.");
  EXPECT_FALSE(j["choices"][1]["message"].contains("reasoning_content"));

  ChunkContent c;
  c.reasoning = "hm";
  json d = json::parse(StreamChunk(ChatMeta(), c, NoText, false))["choices"][0]["delta"];
  EXPECT_EQ(d, json({{"reasoning_content", "hm"}}));
  c.text = "Par";
  d = json::parse(StreamChunk(ChatMeta(), c, NoText, false))["choices"][0]["delta"];
  EXPECT_EQ(d, json({{"reasoning_content", "hm"}, {"content", "Par"}}));
  c.reasoning = "";
  d = json::parse(StreamChunk(ChatMeta(), c, NoText, false))["choices"][0]["delta"];
  EXPECT_EQ(d, json({{"content", "Par"}}));
}

}  // namespace
}  // namespace cachet::server
