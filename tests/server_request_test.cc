// The server's edge, without a Runtime or a socket: the request parser on valid and every kind of
// bad input (the status, the field named, the HTTP error it becomes), preparing requests with
// kvtiny's tokenizer, and the exact shapes of responses, SSE chunks, errors and /metrics.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "cachet/chat_template.h"
#include "cachet/tokenizer.h"
#include "server/prepare.h"
#include "server/request.h"
#include "server/response.h"
#include "test_util.h"

namespace cachet::server {
namespace {

using json = nlohmann::json;

ParseLimits Limits() {
  ParseLimits l;
  l.model_name = "kvtiny";
  l.vocab_size = 8192;
  return l;
}

Result<ParsedRequest> Completion(const std::string& body) {
  return ParseRequest(body, Endpoint::kCompletions, Limits());
}
Result<ParsedRequest> Chat(const std::string& body) {
  return ParseRequest(body, Endpoint::kChat, Limits());
}

TEST(ServerRequest, CompletionDefaults) {
  Result<ParsedRequest> r = Completion(R"({"prompt": "Hello"})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->endpoint, Endpoint::kCompletions);
  ASSERT_TRUE(r->prompt_text.has_value());
  EXPECT_EQ(*r->prompt_text, "Hello");
  EXPECT_TRUE(r->prompt_ids.empty());
  EXPECT_FALSE(r->max_tokens.has_value());
  EXPECT_FLOAT_EQ(r->sampling.temperature, 1.0f);  // OpenAI's defaults
  EXPECT_FLOAT_EQ(r->sampling.top_p, 1.0f);
  EXPECT_EQ(r->sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r->sampling.min_p, 0.0f);
  EXPECT_FALSE(r->seed.has_value());
  EXPECT_EQ(r->n, 1);
  EXPECT_EQ(r->logprobs, -1);
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->include_usage);
  EXPECT_FALSE(r->press.has_value());
  EXPECT_TRUE(r->cache_salt.empty());
}

// seed -1 asks for a random seed (llama-server's convention), not the seed 2^64 - 1.
TEST(ServerRequest, SeedMinusOneIsRandom) {
  Result<ParsedRequest> r = Completion(R"({"prompt": "Hi", "seed": -1})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->seed.has_value());
  r = Completion(R"({"prompt": "Hi", "seed": -2})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->seed, uint64_t(-2));
}

TEST(ServerRequest, CompletionEveryField) {
  Result<ParsedRequest> r = Completion(R"({
    "model": "kvtiny", "prompt": "Hi", "max_tokens": 7, "temperature": 0, "top_p": 0.9,
    "top_k": 5, "min_p": 0.1, "seed": 42, "stop": ["\n", "END"], "n": 3, "logprobs": 2,
    "stream": true, "stream_options": {"include_usage": true}, "cache_salt": "tenant-a",
    "kv_press": {"name": "snapkv+max", "ratio": 0.75}, "ignore_eos": true,
    "skip_special_tokens": false, "repetition_penalty": 1.1, "user": "someone", "presence_penalty": 0,
    "frequency_penalty": 0.0, "logit_bias": {}, "echo": false, "best_of": 3,
    "some_unknown_field": [1, 2, 3]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->max_tokens, 7);
  EXPECT_FLOAT_EQ(r->sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r->sampling.top_p, 0.9f);
  EXPECT_EQ(r->sampling.top_k, 5);
  EXPECT_FLOAT_EQ(r->sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(r->sampling.repeat_penalty, 1.1f);
  EXPECT_EQ(r->seed, 42u);
  EXPECT_EQ(r->stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_EQ(r->n, 3);
  EXPECT_EQ(r->logprobs, 2);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->cache_salt, "tenant-a");
  EXPECT_TRUE(r->ignore_eos);
  EXPECT_FALSE(r->skip_special_tokens);
  ASSERT_TRUE(r->press.has_value());
  EXPECT_EQ(r->press->scorer, press::Scorer::kSnapKV);
  EXPECT_EQ(r->press->share, press::ShareLayers::kMax);
  EXPECT_DOUBLE_EQ(r->press->ratio, 0.75);
}

// OpenAI's logit_bias (ids as strings) and presence / frequency penalties, llama.cpp's
// repeat_last_n: typed once here, applied by the sampler.
TEST(ServerRequest, ChatTemplateKwargs) {
  Result<ParsedRequest> r = Chat(R"({"messages": [{"role": "user", "content": "Hi"}],
    "chat_template_kwargs": {"enable_thinking": false}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->enable_thinking, false);
  r = Chat(R"({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->enable_thinking.has_value());
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"messages": [{"role": "user", "content": "Hi"}],
               "chat_template_kwargs": {"enable_thinking": 0}})",
            "chat_template_kwargs.enable_thinking"},
           {R"({"messages": [{"role": "user", "content": "Hi"}],
               "chat_template_kwargs": {"custom": 1}})",
            "chat_template_kwargs"},
           {R"({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": 1})",
            "chat_template_kwargs"}}) {
    Result<ParsedRequest> bad = Chat(body);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(ApiErrorFromStatus(bad.status()).param, param) << bad.status().message();
  }
}

TEST(ServerRequest, ResponseFormatJsonObject) {
  Result<ParsedRequest> r = Chat(R"({"messages": [{"role": "user", "content": "Hi"}],
    "response_format": {"type": "json_object"}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->sampling.format, OutputFormat::kJsonObject);
  r = Chat(R"({"messages": [{"role": "user", "content": "Hi"}],
    "response_format": {"type": "text"}})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->sampling.format, OutputFormat::kText);
}

TEST(ServerRequest, BiasAndPenalties) {
  Result<ParsedRequest> r = Chat(R"({"messages": [{"role": "user", "content": "Hi"}],
    "logit_bias": {"17": -100, "8191": 2.5, "0": 100}, "presence_penalty": 0.5,
    "frequency_penalty": -1.25, "repeat_last_n": -1})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<std::pair<int32_t, float>> bias;
  for (const LogitBias& b : r->sampling.logit_bias) bias.emplace_back(b.token, b.bias);
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias,
            (std::vector<std::pair<int32_t, float>>{{0, 100.0f}, {17, -100.0f}, {8191, 2.5f}}));
  EXPECT_FLOAT_EQ(r->sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r->sampling.frequency_penalty, -1.25f);
  EXPECT_EQ(r->sampling.repeat_last_n, -1);
  Result<ParsedRequest> plain = Completion(R"({"prompt": "x", "logit_bias": {}})");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->sampling.logit_bias.empty());
  EXPECT_EQ(plain->sampling.presence_penalty, 0.0f);
  EXPECT_EQ(plain->sampling.frequency_penalty, 0.0f);
  EXPECT_EQ(plain->sampling.repeat_last_n, 64);
}

TEST(ServerRequest, PromptForms) {
  Result<ParsedRequest> ids = Completion(R"({"prompt": [0, 17, 8191]})");
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_FALSE(ids->prompt_text.has_value());
  EXPECT_EQ(ids->prompt_ids, (std::vector<int32_t>{0, 17, 8191}));
  Result<ParsedRequest> one = Completion(R"({"prompt": ["only one"]})");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->prompt_text, "only one");
  Result<ParsedRequest> nested = Completion(R"({"prompt": [[5, 6]]})");
  ASSERT_TRUE(nested.ok()) << nested.status().ToString();
  EXPECT_EQ(nested->prompt_ids, (std::vector<int32_t>{5, 6}));
  // Integral floats are integers; nulls are defaults.
  Result<ParsedRequest> floats =
      Completion(R"({"prompt": "x", "max_tokens": 16.0, "n": null, "stop": null})");
  ASSERT_TRUE(floats.ok()) << floats.status().ToString();
  EXPECT_EQ(floats->max_tokens, 16);
  EXPECT_EQ(floats->n, 1);
  // A huge max_tokens means "until the context ends".
  Result<ParsedRequest> huge = Completion(R"({"prompt": "x", "max_tokens": 99999999999999})");
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(huge->max_tokens, std::numeric_limits<int32_t>::max());
  // Any seed, negative ones (but -1, SeedMinusOneIsRandom) and those past int64 too.
  EXPECT_EQ(Completion(R"({"prompt": "x", "seed": -5})")->seed, uint64_t(-5));
  EXPECT_EQ(Completion(R"({"prompt": "x", "seed": 18446744073709551615})")->seed, ~uint64_t{0});
}

TEST(ServerRequest, ChatMessages) {
  Result<ParsedRequest> r = Chat(R"({"messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null},
      {"role": "user", "content": "Again", "name": "bob"}],
    "max_tokens": 4, "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 3})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->messages.size(), 4u);
  EXPECT_EQ(r->messages[0].role, ChatRole::kSystem);
  EXPECT_EQ(r->messages[1].role, ChatRole::kUser);
  EXPECT_EQ(r->messages[1].content, "Hello there");
  EXPECT_EQ(r->messages[2].role, ChatRole::kAssistant);
  EXPECT_EQ(r->messages[2].content, "");
  EXPECT_EQ(r->max_tokens, 9);  // max_completion_tokens first
  EXPECT_EQ(r->logprobs, 3);
  Result<ParsedRequest> plain = Chat(R"({"messages": [{"role": "user", "content": "x"}],
                                        "logprobs": true})");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->logprobs, 0);
  Result<ParsedRequest> off = Chat(R"({"messages": [{"role": "user", "content": "x"}],
                                      "logprobs": false})");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->logprobs, -1);
}

struct BadCase {
  Endpoint endpoint;
  std::string body;
  int http_status;
  std::string param;     // "" : null
  std::string contains;  // in the message
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.body.substr(0, 120); }

class ServerBadRequest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ServerBadRequest, IsAClearError) {
  const BadCase& c = GetParam();
  Result<ParsedRequest> r = ParseRequest(c.body, c.endpoint, Limits());
  ASSERT_FALSE(r.ok());
  const ApiError e = ApiErrorFromStatus(r.status());
  EXPECT_EQ(e.http_status, c.http_status) << e.message;
  EXPECT_EQ(e.param, c.param) << e.message;
  EXPECT_NE(e.message.find(c.contains), std::string::npos) << e.message;
  // The error body is the OpenAI shape and valid JSON whatever the message holds.
  const json j = json::parse(ErrorJson(e));
  ASSERT_TRUE(j.contains("error"));
  EXPECT_EQ(j["error"]["message"], e.message);
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  if (c.param.empty()) {
    EXPECT_TRUE(j["error"]["param"].is_null());
  } else {
    EXPECT_EQ(j["error"]["param"], c.param);
  }
  EXPECT_TRUE(j["error"].contains("code"));
}

constexpr Endpoint kC = Endpoint::kCompletions;
constexpr Endpoint kChatE = Endpoint::kChat;
const char kMsgs[] = R"("messages": [{"role": "user", "content": "x"}])";

std::string ChatBody(const std::string& extra) {
  return std::string("{") + kMsgs + (extra.empty() ? "" : ", " + extra) + "}";
}

INSTANTIATE_TEST_SUITE_P(
    Parser, ServerBadRequest,
    ::testing::Values(
        // The body itself.
        BadCase{kC, "", 400, "", "malformed JSON"},
        BadCase{kC, "{\"prompt\": \"x\"", 400, "", "malformed JSON"},
        BadCase{kC, "{'prompt': 'x'}", 400, "", "malformed JSON"},
        BadCase{kC, "{\"prompt\": \"\xff\xfe\"}", 400, "", "malformed JSON"},
        BadCase{kC, R"({"prompt": [1e999]})", 400, "", "number overflow"},
        BadCase{kC, R"({"prompt": "x", "seed": -1e400})", 400, "", "malformed JSON"},
        BadCase{kC, "[1, 2]", 400, "", "must be a JSON object"},
        BadCase{kC, "\"prompt\"", 400, "", "must be a JSON object"},
        // The model.
        BadCase{kC, R"({"model": "gpt-4", "prompt": "x"})", 404, "model", "'gpt-4' does not exist"},
        BadCase{kC, R"({"model": 4, "prompt": "x"})", 400, "model", "must be a string"},
        // The prompt.
        BadCase{kC, R"({})", 400, "prompt", "required"},
        BadCase{kC, R"({"prompt": null})", 400, "prompt", "required"},
        BadCase{kC, R"({"prompt": ""})", 400, "prompt", "empty"},
        BadCase{kC, R"({"prompt": []})", 400, "prompt", "empty"},
        BadCase{kC, R"({"prompt": 5})", 400, "prompt", "must be a string or an array"},
        BadCase{kC, R"({"prompt": {"text": "x"}})", 400, "prompt", "must be a string or an array"},
        BadCase{kC, R"({"prompt": [1, "a"]})", 400, "prompt[1]", "must be a token id"},
        BadCase{kC, R"({"prompt": [1, 2.5]})", 400, "prompt[1]", "must be a token id"},
        BadCase{kC, R"({"prompt": [-1]})", 400, "prompt[0]", "outside the vocabulary"},
        BadCase{kC, R"({"prompt": [8192]})", 400, "prompt[0]", "outside the vocabulary [0, 8192)"},
        BadCase{kC, R"({"prompt": [1e30]})", 400, "prompt[0]", "must be a token id"},
        BadCase{kC, R"({"prompt": ["a", "b"]})", 400, "prompt", "a list of 2 prompts"},
        BadCase{kC, R"({"prompt": [""]})", 400, "prompt[0]", "empty"},
        BadCase{kC, R"({"prompt": [[]]})", 400, "prompt[0]", "empty"},
        BadCase{kC, R"({"prompt": [[1, -3]]})", 400, "prompt[0][1]", "outside the vocabulary"},
        BadCase{kC, R"({"prompt": [true]})", 400, "prompt[0]", "must be a string or an array"},
        // max_tokens.
        BadCase{kC, R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens", ">= 1, got 0"},
        BadCase{kC, R"({"prompt": "x", "max_tokens": -5})", 400, "max_tokens", ">= 1, got -5"},
        BadCase{kC, R"({"prompt": "x", "max_tokens": "10"})", 400, "max_tokens",
                "must be an integer"},
        BadCase{kC, R"({"prompt": "x", "max_tokens": 1.5})", 400, "max_tokens",
                "must be an integer"},
        BadCase{kChatE, ChatBody(R"("max_completion_tokens": 0)"), 400, "max_completion_tokens",
                "must be an integer"},
        // Sampling.
        BadCase{kC, R"({"prompt": "x", "temperature": -0.5})", 400, "temperature", "[0, 2]"},
        BadCase{kC, R"({"prompt": "x", "temperature": 3})", 400, "temperature", "[0, 2]"},
        BadCase{kC, R"({"prompt": "x", "temperature": "hot"})", 400, "temperature",
                "must be a number"},
        BadCase{kC, R"({"prompt": "x", "top_p": 0})", 400, "top_p", "(0, 1]"},
        BadCase{kC, R"({"prompt": "x", "top_p": 1.5})", 400, "top_p", "(0, 1]"},
        BadCase{kC, R"({"prompt": "x", "top_k": -2})", 400, "top_k", "[-1, "},
        BadCase{kC, R"({"prompt": "x", "top_k": 2.5})", 400, "top_k", "must be an integer"},
        BadCase{kC, R"({"prompt": "x", "min_p": 1.5})", 400, "min_p", "[0, 1]"},
        BadCase{kC, R"({"prompt": "x", "repetition_penalty": 0})", 400, "repetition_penalty",
                "(0, 100]"},
        BadCase{kC, R"({"prompt": "x", "seed": "abc"})", 400, "seed", "must be an integer"},
        BadCase{kC, R"({"prompt": "x", "seed": 0.5})", 400, "seed", "must be an integer"},
        // n, stop, logprobs, stream.
        BadCase{kC, R"({"prompt": "x", "n": 0})", 400, "n", "[1, 64]"},
        BadCase{kC, R"({"prompt": "x", "n": 65})", 400, "n", "[1, 64]"},
        BadCase{kC, R"({"prompt": "x", "n": "2"})", 400, "n", "must be an integer"},
        BadCase{kC, R"({"prompt": "x", "stop": 5})", 400, "stop", "must be a string or an array"},
        BadCase{kC, R"({"prompt": "x", "stop": ""})", 400, "stop", "empty string"},
        BadCase{kC, R"({"prompt": "x", "stop": ["a", ""]})", 400, "stop[1]", "empty string"},
        BadCase{kC, R"({"prompt": "x", "stop": ["a", 3]})", 400, "stop[1]", "must be a string"},
        BadCase{kC,
                R"({"prompt": "x", "stop": ["1","2","3","4","5","6","7","8","9","10","11","12",
                    "13","14","15","16","17"]})",
                400, "stop", "at most 16"},
        BadCase{kC, R"({"prompt": "x", "logprobs": 21})", 400, "logprobs", "[0, 20]"},
        BadCase{kC, R"({"prompt": "x", "logprobs": true})", 400, "logprobs", "must be an integer"},
        BadCase{kChatE, ChatBody(R"("logprobs": 2)"), 400, "logprobs", "true or false"},
        BadCase{kChatE, ChatBody(R"("top_logprobs": 2)"), 400, "top_logprobs",
                "needs \"logprobs\": true"},
        BadCase{kChatE, ChatBody(R"("logprobs": true, "top_logprobs": 50)"), 400, "top_logprobs",
                "[0, 20]"},
        BadCase{kC, R"({"prompt": "x", "stream": "true"})", 400, "stream", "true or false"},
        BadCase{kC, R"({"prompt": "x", "stream_options": {"include_usage": true}})", 400,
                "stream_options", "only allowed when \"stream\" is true"},
        BadCase{kC, R"({"prompt": "x", "stream": true, "stream_options": 1})", 400,
                "stream_options", "must be an object"},
        BadCase{kC, R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})",
                400, "stream_options.include_usage", "true or false"},
        // Cachet's fields.
        BadCase{kC, R"({"prompt": "x", "cache_salt": 5})", 400, "cache_salt", "must be a string"},
        BadCase{kC, R"({"prompt": "x", "kv_press": "snapkv"})", 400, "kv_press",
                "must be an object"},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"ratio": 0.5}})", 400, "kv_press.name",
                "required"},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"name": "squeeze"}})", 400, "kv_press.name",
                "unknown press 'squeeze'"},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"name": "snapkv+bogus"}})", 400,
                "kv_press.name", "unknown press modifier"},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"name": "snapkv", "ratio": 1.5}})", 400,
                "kv_press.ratio", "must be a number in [0, "},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"name": "snapkv", "ratio": 0.5, "budget": 9}})",
                400, "kv_press.budget", "not both"},
        BadCase{kC, R"({"prompt": "x", "kv_press": {"name": "snapkv", "window": 9}})", 400,
                "kv_press.window", "unknown field"},
        // Fields this server cannot honour.
        // Sampling fields out of their ranges.
        BadCase{kC, R"({"prompt": "x", "presence_penalty": -2.5})", 400, "presence_penalty",
                "[-2, 2]"},
        BadCase{kC, R"({"prompt": "x", "frequency_penalty": 5})", 400, "frequency_penalty",
                "[-2, 2]"},
        BadCase{kC, R"({"prompt": "x", "repeat_last_n": -2})", 400, "repeat_last_n", "[-1, "},
        BadCase{kC, R"({"prompt": "x", "logit_bias": [5, 1]})", 400, "logit_bias",
                "must be an object of token ids"},
        BadCase{kC, R"({"prompt": "x", "logit_bias": {"8192": -100}})", 400, "logit_bias",
                "key \"8192\" must be a token id in [0, 8192)"},
        BadCase{kC, R"({"prompt": "x", "logit_bias": {"the": 5}})", 400, "logit_bias",
                "key \"the\" must be a token id"},
        BadCase{kC, R"({"prompt": "x", "logit_bias": {"-1": 5}})", 400, "logit_bias",
                "key \"-1\" must be a token id"},
        BadCase{kC, R"({"prompt": "x", "logit_bias": {"17": 101}})", 400, "logit_bias",
                "key \"17\" must map to a number in [-100, 100], got 101"},
        BadCase{kC, R"({"prompt": "x", "logit_bias": {"17": "ban"}})", 400, "logit_bias",
                "must map to a number in [-100, 100]"},
        // Fields this server cannot honour.
        BadCase{kC, R"({"prompt": "x", "echo": true})", 400, "echo", "not supported"},
        BadCase{kC, R"({"prompt": "x", "suffix": "end"})", 400, "suffix", "not supported"},
        BadCase{kC, R"({"prompt": "x", "best_of": 3})", 400, "best_of", "not supported"},
        BadCase{kChatE, ChatBody(R"("tools": [{"type": "function"}])"), 400, "tools",
                "not supported"},
        BadCase{kChatE,
                ChatBody(R"("response_format": {"type": "json_schema", "json_schema": {}})"), 400,
                "response_format",
                "only {\"type\": \"text\"} and {\"type\": \"json_object\"} are supported (not "
                "\"json_schema\")"},
        BadCase{kChatE, ChatBody(R"("response_format": "json")"), 400, "response_format",
                "only {\"type\": \"text\"}"},
        BadCase{kC, R"({"prompt": "x", "user": 7})", 400, "user", "must be a string"},
        // Messages.
        BadCase{kChatE, R"({"prompt": "x"})", 400, "messages", "required"},
        BadCase{kChatE, R"({"messages": []})", 400, "messages", "empty"},
        BadCase{kChatE, R"({"messages": "hi"})", 400, "messages", "must be an array"},
        BadCase{kChatE, R"({"messages": ["hi"]})", 400, "messages[0]", "must be an object"},
        BadCase{kChatE, R"({"messages": [{"content": "x"}]})", 400, "messages[0].role", "required"},
        BadCase{kChatE, R"({"messages": [{"role": 1, "content": "x"}]})", 400, "messages[0].role",
                "must be a string"},
        BadCase{
            kChatE,
            R"({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})",
            400, "messages[1].role", "unknown role \"tool\""},
        BadCase{kChatE, R"({"messages": [{"role": "user", "content": 5}]})", 400,
                "messages[0].content", "must be a string or an array"},
        BadCase{
            kChatE,
            R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
            400, "messages[0].content[0].type", "\"image_url\" is not supported"},
        BadCase{kChatE, R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", 400,
                "messages[0].content[0].text", "must be a string"},
        BadCase{kChatE, R"({"messages": [{"role": "user", "content": ["x"]}]})", 400,
                "messages[0].content[0]", "must be an object"},
        BadCase{
            kChatE,
            R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}]})",
            400, "messages[0].tool_calls", "not supported"}));

TEST(ServerRequest, DeepNestingIsAnErrorNotACrash) {
  const std::string deep =
      "{\"prompt\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  Result<ParsedRequest> r = Completion(deep);
  EXPECT_FALSE(r.ok());
  const std::string unclosed = std::string(200000, '[');
  EXPECT_FALSE(Completion(unclosed).ok());
}

TEST(ServerRequest, TokenizeAndDetokenize) {
  Result<TokenizeRequest> t =
      ParseTokenizeRequest(R"({"content": "a b", "add_special": true, "with_pieces": true})");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->content, "a b");
  EXPECT_TRUE(t->add_special);
  EXPECT_TRUE(t->parse_special);
  EXPECT_TRUE(t->with_pieces);
  EXPECT_EQ(ApiErrorFromStatus(ParseTokenizeRequest("{}").status()).param, "content");
  EXPECT_EQ(ApiErrorFromStatus(ParseTokenizeRequest(R"({"content": 1})").status()).param,
            "content");
  EXPECT_EQ(
      ApiErrorFromStatus(ParseTokenizeRequest(R"({"content": "x", "add_special": "yes"})").status())
          .param,
      "add_special");
  Result<std::vector<int32_t>> d = ParseDetokenizeRequest(R"({"tokens": [1, 2, 3]})", 8192);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d.value(), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(
      ApiErrorFromStatus(ParseDetokenizeRequest(R"({"tokens": [1, 9000]})", 8192).status()).param,
      "tokens[1]");
  EXPECT_EQ(ApiErrorFromStatus(ParseDetokenizeRequest(R"({"tokens": "1"})", 8192).status()).param,
            "tokens");
  EXPECT_FALSE(ParseDetokenizeRequest("nope", 8192).ok());
}

TEST(ServerError, StatusesAndParams) {
  ApiError e = ApiErrorFromStatus(InvalidArgument("max_tokens: must be >= 1"));
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_EQ(e.type, "invalid_request_error");
  e = ApiErrorFromStatus(InvalidArgument("malformed JSON in the request body: x"));
  EXPECT_EQ(e.param, "");
  e = ApiErrorFromStatus(OutOfRange("prompt: too long"));
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "prompt");
  e = ApiErrorFromStatus(NotFound("model: no"));
  EXPECT_EQ(e.http_status, 404);
  EXPECT_EQ(e.code, "model_not_found");
  e = ApiErrorFromStatus(ResourceExhausted("too many requests waiting (256)"));
  EXPECT_EQ(e.http_status, 503);
  EXPECT_EQ(e.type, "server_error");
  e = ApiErrorFromStatus(Internal("prompt: broken step"));
  EXPECT_EQ(e.http_status, 500);
  EXPECT_EQ(e.param, "");
  e = UnauthorizedError();
  EXPECT_EQ(e.http_status, 401);
  EXPECT_EQ(e.code, "invalid_api_key");
  const json j = json::parse(ErrorJson(e));
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "invalid_api_key");
}

// --- Prepare, on kvtiny's tokenizer

class ServerPrepare : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = Tokenizer::Load(testing::ModelDir());
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tok_ = std::move(tok).value();
    auto tmpl = ResolveChatTemplate(testing::ModelDir(), "");
    ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
    model_.name = "kvtiny";
    model_.tokenizer = tok_.get();
    model_.chat_template = tmpl.value();
    UseTokenizerSpecials(*tok_, &model_.chat_template);
    model_.n_ctx = 64;
    model_.vocab_size = 8192;
    model_.pool_pages = 1000;
    model_.page_tokens = 16;
    model_.heads_total = 16;
  }
  std::unique_ptr<Tokenizer> tok_;
  ServedModel model_;
};

TEST_F(ServerPrepare, CompletionPrompt) {
  Result<ParsedRequest> parsed = Completion(R"({"prompt": "In the beginning", "stop": "x"})");
  ASSERT_TRUE(parsed.ok());
  Result<PreparedRequest> p = Prepare(parsed.value(), model_, 1234);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->request.prompt, tok_->EncodePrompt("In the beginning"));
  EXPECT_EQ(p->request.max_tokens, kDefaultCompletionTokens);
  EXPECT_EQ(p->request.sampling.seed, 1234u);
  EXPECT_EQ(p->request.stop, std::vector<std::string>{"x"});  // no template stops
  EXPECT_TRUE(p->request.stop_at_eos);
  EXPECT_EQ(p->request.top_logprobs, -1);
  EXPECT_FALSE(p->request.press.has_value());
  EXPECT_EQ(ChoiceRequest(p.value(), 2).sampling.seed, 1236u);
}

TEST_F(ServerPrepare, TokenIdsAreUsedAsGiven) {
  Result<ParsedRequest> parsed =
      Completion(R"({"prompt": [5, 6, 7], "seed": 9, "max_tokens": 3, "logprobs": 1,
                     "ignore_eos": true, "cache_salt": "s",
                     "kv_press": {"name": "knorm", "budget": 8}})");
  ASSERT_TRUE(parsed.ok());
  Result<PreparedRequest> p = Prepare(parsed.value(), model_, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->request.prompt, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(p->request.sampling.seed, 9u);
  EXPECT_EQ(p->request.max_tokens, 3);
  EXPECT_EQ(p->request.top_logprobs, 1);
  EXPECT_FALSE(p->request.stop_at_eos);
  EXPECT_EQ(p->request.cache_salt, "s");
  ASSERT_TRUE(p->request.press.has_value());
  EXPECT_EQ(p->request.press->scorer, press::Scorer::kKNorm);
  EXPECT_EQ(p->request.press->budget, 8);
}

TEST_F(ServerPrepare, ChatRendersTheTemplateAndAddsItsStops) {
  Result<ParsedRequest> parsed = Chat(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
          "stop": ["zz"]})");
  ASSERT_TRUE(parsed.ok());
  Result<PreparedRequest> p = Prepare(parsed.value(), model_, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<ChatMessage> messages = {{ChatRole::kSystem, "S"}, {ChatRole::kUser, "Hi"}};
  const std::string text = RenderChat(model_.chat_template, messages, true).value();
  EXPECT_EQ(p->request.prompt, EncodeChatPrompt(*tok_, text, true));
  ASSERT_FALSE(p->request.stop.empty());
  EXPECT_EQ(p->request.stop[0], "zz");
  for (const std::string& s : StopStrings(model_.chat_template)) {
    EXPECT_NE(std::find(p->request.stop.begin(), p->request.stop.end(), s), p->request.stop.end())
        << s;
  }
  // Chat's default max_tokens: the rest of the context.
  EXPECT_EQ(p->request.max_tokens, model_.n_ctx - static_cast<int>(p->request.prompt.size()));
}

TEST_F(ServerPrepare, TemplateErrorsNameMessages) {
  model_.chat_template = ChatTemplateByName("llama2").value();
  Result<ParsedRequest> parsed = Chat(R"({"messages": [{"role": "assistant", "content": "A"}]})");
  ASSERT_TRUE(parsed.ok());
  Result<PreparedRequest> p = Prepare(parsed.value(), model_, 1);
  ASSERT_FALSE(p.ok());
  const ApiError e = ApiErrorFromStatus(p.status());
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages");
}

TEST_F(ServerPrepare, PromptLongerThanTheContext) {
  std::string words;
  for (int i = 0; i < 100; ++i) words += " word";
  Result<PreparedRequest> p =
      Prepare(Completion(json({{"prompt", words}}).dump()).value(), model_, 1);
  ASSERT_FALSE(p.ok());
  const ApiError e = ApiErrorFromStatus(p.status());
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "prompt");
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_NE(e.message.find("context holds 64"), std::string::npos) << e.message;
  // Exactly n_ctx ids leave no room either; n_ctx - 1 do.
  json ids = json::array();
  for (int i = 0; i < model_.n_ctx; ++i) ids.push_back(10);
  EXPECT_FALSE(Prepare(Completion(json({{"prompt", ids}}).dump()).value(), model_, 1).ok());
  ids.erase(ids.begin());
  EXPECT_TRUE(Prepare(Completion(json({{"prompt", ids}}).dump()).value(), model_, 1).ok());
  // In chat the field is messages.
  Result<PreparedRequest> c =
      Prepare(Chat(json({{"messages", {{{"role", "user"}, {"content", words}}}}}).dump()).value(),
              model_, 1);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(ApiErrorFromStatus(c.status()).param, "messages");
}

// cachet serve --on-full shift: the oldest turns after the system prompt go until the chat
// leaves max_tokens of room; the system prompt and the last message stay.
TEST_F(ServerPrepare, ChatsThatDoNotFitDropTheirOldestTurnsWithShift) {
  json messages = json::array();
  messages.push_back({{"role", "system"}, {"content", "Be brief."}});
  for (int turn = 0; turn < 6; ++turn) {
    messages.push_back(
        {{"role", "user"}, {"content", "Tell me about turn " + std::to_string(turn)}});
    messages.push_back({{"role", "assistant"}, {"content", "It was turn " + std::to_string(turn)}});
  }
  messages.push_back({{"role", "user"}, {"content", "And the last one?"}});
  const std::string body = json({{"messages", messages}, {"max_tokens", 8}}).dump();
  model_.n_ctx = 96;
  EXPECT_FALSE(Prepare(Chat(body).value(), model_, 1).ok());  // error: the default
  model_.on_full.kind = press::OnFull::Kind::kShift;
  Result<PreparedRequest> p = Prepare(Chat(body).value(), model_, 1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_GT(p->dropped_messages, 0);
  EXPECT_EQ(p->dropped_messages % 2, 0);  // whole turns: the kept ones start with a user message
  EXPECT_LE(static_cast<int>(p->request.prompt.size()) + 8, model_.n_ctx);
  const std::string text = tok_->Decode(p->request.prompt);
  EXPECT_NE(text.find("Be brief."), std::string::npos) << text;
  EXPECT_NE(text.find("And the last one?"), std::string::npos) << text;
  EXPECT_EQ(text.find("turn 0"), std::string::npos) << text;
  // What fits is not touched.
  model_.n_ctx = 4096;
  p = Prepare(Chat(body).value(), model_, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->dropped_messages, 0);
  // A last message that alone does not fit is still an error.
  model_.n_ctx = 16;
  EXPECT_FALSE(Prepare(Chat(body).value(), model_, 1).ok());
}

TEST_F(ServerPrepare, PromptThatNoPoolCanHold) {
  model_.pool_pages = 16;  // one page per (layer, KV head): 16 tokens
  json ids = json::array();
  for (int i = 0; i < 20; ++i) ids.push_back(10);
  Result<PreparedRequest> p =
      Prepare(Completion(json({{"prompt", ids}}).dump()).value(), model_, 1);
  ASSERT_FALSE(p.ok());
  const ApiError e = ApiErrorFromStatus(p.status());
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "prompt");
  EXPECT_NE(e.message.find("--kv-mem"), std::string::npos) << e.message;
}

// --- Response shapes

std::string TokenName(int32_t id) {
  std::string s = "t";
  s += std::to_string(id);
  return s;
}

ResponseMeta Meta(Endpoint endpoint, bool logprobs = false) {
  ResponseMeta m;
  m.endpoint = endpoint;
  m.id = endpoint == Endpoint::kChat ? "chatcmpl-1" : "cmpl-1";
  m.created = 1700000000;
  m.model = "kvtiny";
  m.logprobs = logprobs;
  return m;
}

TEST(ServerResponse, CompletionShape) {
  std::vector<ChoiceOutput> choices(2);
  choices[0] = {"Hello", {}, "length"};
  choices[1] = {"Bye", {}, "stop"};
  const Usage usage{.prompt_tokens = 5, .cached_tokens = 3, .completion_tokens = 7};
  const json j =
      json::parse(CompletionResponse(Meta(Endpoint::kCompletions), choices, usage, TokenName));
  EXPECT_EQ(j["id"], "cmpl-1");
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["created"], 1700000000);
  EXPECT_EQ(j["model"], "kvtiny");
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["text"], "Hello");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"],
            json::parse(R"({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 3}})"));
}

TEST(ServerResponse, ChatShape) {
  std::vector<ChoiceOutput> choices = {{"Hi!", {}, "stop"}};
  const json j =
      json::parse(CompletionResponse(Meta(Endpoint::kChat), choices, Usage{}, TokenName));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hi!");
  EXPECT_TRUE(j["choices"][0]["message"]["refusal"].is_null());
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

std::vector<TokenLogprob> SomeLogprobs() {
  TokenLogprob a{.token = 1, .logprob = -0.5f, .top = {{1, -0.5f}, {2, -1.5f}}, .text_offset = 0};
  TokenLogprob b{.token = 22,
                 .logprob = -std::numeric_limits<float>::infinity(),
                 .top = {{3, -0.25f}, {22, -std::numeric_limits<float>::infinity()}},
                 .text_offset = 2};
  return {a, b};
}

TEST(ServerResponse, CompletionLogprobs) {
  std::vector<ChoiceOutput> choices = {{"t1t22", SomeLogprobs(), "length"}};
  const json j = json::parse(
      CompletionResponse(Meta(Endpoint::kCompletions, true), choices, Usage{}, TokenName));
  const json& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json::parse(R"(["t1", "t22"])"));
  EXPECT_EQ(lp["token_logprobs"][0], -0.5);
  EXPECT_EQ(lp["token_logprobs"][1], -9999.0);  // -inf, as vLLM writes it
  EXPECT_EQ(lp["top_logprobs"][0], json::parse(R"({"t1": -0.5, "t2": -1.5})"));
  EXPECT_EQ(lp["top_logprobs"][1], json::parse(R"({"t3": -0.25, "t22": -9999.0})"));
  EXPECT_EQ(lp["text_offset"], json::parse("[0, 2]"));
  // A sampled token outside the top alternatives is listed beside them.
  std::vector<TokenLogprob> sampled = SomeLogprobs();
  sampled[0].token = 5;
  sampled[0].logprob = -3.0f;
  choices = {{"t5t22", sampled, "length"}};
  const json k = json::parse(
      CompletionResponse(Meta(Endpoint::kCompletions, true), choices, Usage{}, TokenName));
  EXPECT_EQ(k["choices"][0]["logprobs"]["top_logprobs"][0],
            json::parse(R"({"t1": -0.5, "t2": -1.5, "t5": -3.0})"));
}

TEST(ServerResponse, ChatLogprobs) {
  std::vector<ChoiceOutput> choices = {{"x", SomeLogprobs(), "stop"}};
  const json j =
      json::parse(CompletionResponse(Meta(Endpoint::kChat, true), choices, Usage{}, TokenName));
  const json& lp = j["choices"][0]["logprobs"];
  EXPECT_TRUE(lp["refusal"].is_null());
  ASSERT_EQ(lp["content"].size(), 2u);
  const json& first = lp["content"][0];
  EXPECT_EQ(first["token"], "t1");
  EXPECT_EQ(first["logprob"], -0.5);
  EXPECT_EQ(first["bytes"], json::parse("[116, 49]"));
  ASSERT_EQ(first["top_logprobs"].size(), 2u);
  EXPECT_EQ(first["top_logprobs"][1],
            json::parse(R"({"token": "t2", "logprob": -1.5, "bytes": [116, 50]})"));
}

TEST(ServerResponse, SseFraming) {
  EXPECT_EQ(SseEvent(R"({"a":1})"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
  const std::string err = StreamError(ApiErrorFromStatus(Internal("boom")));
  ASSERT_TRUE(err.starts_with("data: "));
  ASSERT_TRUE(err.ends_with("\n\n"));
  EXPECT_EQ(json::parse(err.substr(6))["error"]["message"], "boom");
}

TEST(ServerResponse, ChatStreamChunks) {
  const ResponseMeta meta = Meta(Endpoint::kChat);
  ChunkContent role;
  role.index = 1;
  role.role_only = true;
  json j = json::parse(StreamChunk(meta, role, TokenName, false));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_FALSE(j.contains("usage"));
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 1);
  EXPECT_EQ(j["choices"][0]["delta"], json::parse(R"({"role": "assistant", "content": ""})"));
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());

  ChunkContent text;
  text.text = "Hel";
  j = json::parse(StreamChunk(meta, text, TokenName, true));
  EXPECT_EQ(j["choices"][0]["delta"], json::parse(R"({"content": "Hel"})"));
  EXPECT_TRUE(j.contains("usage"));
  EXPECT_TRUE(j["usage"].is_null());

  ChunkContent last;
  last.finish_reason = "length";
  j = json::parse(StreamChunk(meta, last, TokenName, false));
  EXPECT_EQ(j["choices"][0]["delta"], json::object());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  const Usage usage{.prompt_tokens = 4, .cached_tokens = 0, .completion_tokens = 2};
  j = json::parse(UsageChunk(meta, usage));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  EXPECT_EQ(j["choices"], json::array());
  EXPECT_EQ(j["usage"]["total_tokens"], 6);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

TEST(ServerResponse, CompletionStreamChunks) {
  const ResponseMeta meta = Meta(Endpoint::kCompletions, true);
  const std::vector<TokenLogprob> lps = SomeLogprobs();
  ChunkContent c;
  c.text = "t1t22";
  c.logprobs = lps;
  json j = json::parse(StreamChunk(meta, c, TokenName, false));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "t1t22");
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], json::parse("[0, 2]"));
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
  ChunkContent last;
  last.finish_reason = "stop";
  j = json::parse(StreamChunk(meta, last, TokenName, false));
  EXPECT_EQ(j["choices"][0]["text"], "");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST(ServerResponse, PartialUtf8NeverThrows) {
  ChunkContent c;
  c.text = "caf\xc3";  // a token ending inside a character
  const json chunk = json::parse(StreamChunk(Meta(Endpoint::kChat), c, TokenName, false));
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "caf\xef\xbf\xbd");  // U+FFFD
  std::vector<ChoiceOutput> choices = {{"\xff", {}, "stop"}};
  const json full =
      json::parse(CompletionResponse(Meta(Endpoint::kChat), choices, Usage{}, TokenName));
  EXPECT_EQ(full["choices"][0]["message"]["content"], "\xef\xbf\xbd");
}

TEST(ServerResponse, ModelsAndTokenize) {
  json j = json::parse(ModelsJson("kvtiny", 1700000000, 4096));
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "kvtiny");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(j["data"][0]["owned_by"], "cachet");
  EXPECT_EQ(j["data"][0]["max_model_len"], 4096);
  EXPECT_EQ(json::parse(ModelJson("kvtiny", 1700000000, 4096)), j["data"][0]);

  const std::vector<int32_t> ids = {1, 2};
  EXPECT_EQ(json::parse(TokenizeJson(ids, false, TokenName)), json::parse(R"({"tokens": [1, 2]})"));
  auto pieces = [](int32_t id) { return id == 1 ? std::string("ab") : std::string("\xe2\x82"); };
  EXPECT_EQ(json::parse(TokenizeJson(ids, true, pieces)),
            json::parse(R"({"tokens": [{"id": 1, "piece": "ab"},
                                       {"id": 2, "piece": [226, 130]}]})"));
  EXPECT_EQ(json::parse(DetokenizeJson("x y")), json::parse(R"({"content": "x y"})"));
}

// --- /metrics

RuntimeMetrics SomeMetrics() {
  RuntimeMetrics m;
  m.running = 2;
  m.waiting = 1;
  m.kv_usage = 0.25;
  m.prompt_tokens = 100;
  m.generation_tokens = 40;
  m.prefix_query_tokens = 80;
  m.prefix_hit_tokens = 32;
  m.preemptions = 1;
  m.requests_finished = 3;
  m.kv_evicted_tokens = 16;
  m.kv_bytes_by_codec = {{"f16", 4096}, {"q4_0", 1024}};
  m.ttft.buckets.assign(std::size(RuntimeMetrics::kLatencyBuckets) + 1, 0);
  for (size_t i = 3; i < m.ttft.buckets.size(); ++i) m.ttft.buckets[i] = 2;
  m.ttft.sum = 0.03;
  m.ttft.count = 2;
  return m;  // inter_token and e2e never observed: empty bucket vectors
}

TEST(ServerMetrics, PrometheusTextFormat) {
  KvStats kv;
  kv.pages_total = 100;
  kv.pages_used = 30;
  kv.pages_cached = 20;
  kv.pages_reclaimable = 10;
  const std::string text = MetricsText(SomeMetrics(), kv, "kv\"tiny");
  ASSERT_TRUE(text.ends_with("\n"));
  // Every sample line: name{labels} value; every family declared by HELP and TYPE before its
  // samples; label values escaped.
  const std::regex sample(
      R"re(^(cachet:[a-zA-Z_][a-zA-Z0-9_]*)\{model_name="kv\\"tiny"(,[a-z_]+="[^"]*")*\} (-?[0-9.e+-]+|\+Inf|NaN)$)re");
  std::istringstream in(text);
  std::set<std::string> typed;
  std::map<std::string, double> values;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("# HELP ")) continue;
    if (line.starts_with("# TYPE ")) {
      std::istringstream f(line.substr(7));
      std::string name, type;
      f >> name >> type;
      EXPECT_TRUE(type == "gauge" || type == "counter" || type == "histogram") << line;
      EXPECT_TRUE(typed.insert(name).second) << "declared twice: " << line;
      continue;
    }
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
    std::string family = m[1];
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (family.ends_with(suffix) && !typed.contains(family)) {
        family.resize(family.size() - std::strlen(suffix));
      }
    }
    EXPECT_TRUE(typed.contains(family)) << "sample before its TYPE: " << line;
    const std::string key = line.substr(0, line.rfind(' '));
    values[key] = std::stod(
        line.substr(line.rfind(' ') + 1) == "+Inf" ? "inf" : line.substr(line.rfind(' ') + 1));
  }
  for (const char* name :
       {"kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
        "num_requests_running", "num_requests_waiting", "num_preemptions_total",
        "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "e2e_request_latency_seconds", "kv_evicted_tokens_total",
        "kv_bytes", "kv_pages_used", "kv_pages_reclaimable"}) {
    EXPECT_TRUE(typed.contains(std::string("cachet:") + name)) << name;
  }
  const std::string l = "{model_name=\"kv\\\"tiny\"";
  EXPECT_EQ(values["cachet:kv_cache_usage_perc" + l + "}"], 0.25);
  EXPECT_EQ(values["cachet:num_requests_running" + l + "}"], 2);
  EXPECT_EQ(values["cachet:prefix_cache_hits_total" + l + "}"], 32);
  EXPECT_EQ(values["cachet:kv_bytes" + l + ",codec=\"q4_0\"}"], 1024);
  EXPECT_EQ(values["cachet:kv_pages_reclaimable" + l + "}"], 10);
  // Histograms: cumulative buckets ending in +Inf = _count.
  EXPECT_EQ(values["cachet:time_to_first_token_seconds_bucket" + l + ",le=\"0.001\"}"], 0);
  EXPECT_EQ(values["cachet:time_to_first_token_seconds_bucket" + l + ",le=\"0.025\"}"], 2);
  EXPECT_EQ(values["cachet:time_to_first_token_seconds_bucket" + l + ",le=\"1.0\"}"], 2);
  EXPECT_EQ(values["cachet:time_to_first_token_seconds_bucket" + l + ",le=\"+Inf\"}"], 2);
  EXPECT_EQ(values["cachet:time_to_first_token_seconds_count" + l + "}"], 2);
  EXPECT_DOUBLE_EQ(values["cachet:time_to_first_token_seconds_sum" + l + "}"], 0.03);
  EXPECT_EQ(values["cachet:e2e_request_latency_seconds_bucket" + l + ",le=\"+Inf\"}"], 0);
  EXPECT_EQ(values["cachet:e2e_request_latency_seconds_count" + l + "}"], 0);
}

}  // namespace
}  // namespace cachet::server
