// The server's edge for kept caches (/v1/caches, cache_id), without a Runtime: parsing, preparing
// a cache's context and the prompts that follow one (with kvtiny's tokenizer and plain template,
// and ChatML's), the response shapes, the 404's code and the metrics.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

TEST(ServerCaches, CacheIdIsParsedAndRefusedWithAPress) {
  auto r =
      ParseRequest(R"({"prompt": "x", "cache_id": "kvc-1"})", Endpoint::kCompletions, Limits());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cache_id, "kvc-1");
  auto pressed = ParseRequest(R"({"messages": [{"role": "user", "content": "x"}],
      "cache_id": "kvc-1", "kv_press": {"name": "snapkv"}})",
                              Endpoint::kChat, Limits());
  ASSERT_FALSE(pressed.ok());
  EXPECT_EQ(ApiErrorFromStatus(pressed.status()).param, "kv_press");
  for (const char* bad :
       {R"({"prompt": "x", "cache_id": ""})", R"({"prompt": "x", "cache_id": 7})"}) {
    auto e = ParseRequest(bad, Endpoint::kCompletions, Limits());
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(ApiErrorFromStatus(e.status()).param, "cache_id") << bad;
  }
}

TEST(ServerCaches, CacheRequestBodies) {
  auto text = ParseCacheRequest(
      R"({"prompt": "doc", "cache_salt": "t", "kv_press": {"name": "snapkv", "budget": 64}})",
      Limits());
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(text->prompt_text, "doc");
  EXPECT_EQ(text->cache_salt, "t");
  ASSERT_TRUE(text->press.has_value());
  EXPECT_EQ(text->press->budget, 64);
  auto chat = ParseCacheRequest(R"({"messages": [{"role": "system", "content": "S"}]})", Limits());
  ASSERT_TRUE(chat.ok());
  ASSERT_EQ(chat->messages.size(), 1u);
  EXPECT_EQ(chat->messages[0].role, ChatRole::kSystem);
  const std::pair<const char*, const char*> bad[] = {
      {R"({})", "prompt"},
      {R"({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})", "messages"},
      {R"({"prompt": ""})", "prompt"},
      {R"({"prompt": "a", "kv_press": {"name": "snapkv", "ratio": 2}})", "kv_press.ratio"},
      {R"({"prompt": "a", "cache_salt": 5})", "cache_salt"},
      {R"([1])", ""},
      // A completion's fields do nothing here: refused, not dropped.
      {R"({"prompt": "a", "cache_id": "kvc-1"})", "cache_id"},
      {R"({"prompt": "a", "stream": true})", "stream"},
      {R"({"prompt": "a", "max_tokens": 5})", "max_tokens"},
      {R"({"prompt": "a", "chunks": ["a"]})", "chunks"},
  };
  for (const auto& [body, param] : bad) {
    auto r = ParseCacheRequest(body, Limits());
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(ApiErrorFromStatus(r.status()).param, param) << body << ": " << r.status().message();
  }
  EXPECT_EQ(ParseCacheRequest(R"({"prompt": "a", "model": "other"})", Limits()).status().code(),
            StatusCode::kNotFound);
}

TEST(ServerCaches, ChatNoteRoundTrip) {
  const std::vector<ChatMessage> m = {{ChatRole::kSystem, "S \"q\"\n"}, {ChatRole::kUser, "U"}};
  auto back = ParseChatNote(ChatNote(m));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].content, m[0].content);
  EXPECT_EQ((*back)[1].role, ChatRole::kUser);
  EXPECT_TRUE(ChatNote({}).empty());
  EXPECT_TRUE(ParseChatNote("")->empty());
  EXPECT_FALSE(ParseChatNote("{\"messages\": [{\"role\": \"robot\"}]}").ok());
  EXPECT_FALSE(ParseChatNote("not json").ok());
}

class ServerCachePrepare : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = Tokenizer::Load(testing::ModelDir());
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tok_ = std::move(tok).value();
    auto tmpl = ResolveChatTemplate(testing::ModelDir(), "");
    ASSERT_TRUE(tmpl.ok());
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

TEST_F(ServerCachePrepare, ContextsAreTokenizedAsCompletionsAndChatsAre) {
  ParsedCacheRequest text;
  text.prompt_text = "In the beginning";
  text.cache_salt = "t";
  auto c = PrepareCache(text, model_);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->prompt, tok_->EncodePrompt("In the beginning"));  // with BOS
  EXPECT_EQ(c->cache_salt, "t");
  EXPECT_TRUE(c->note.empty());
  ParsedCacheRequest chat;
  chat.messages = {{ChatRole::kSystem, "You are brief."}, {ChatRole::kUser, "Hello"}};
  auto m = PrepareCache(chat, model_);
  ASSERT_TRUE(m.ok());
  auto rendered = RenderChat(model_.chat_template, chat.messages, false);
  EXPECT_EQ(m->prompt, EncodeChatPrompt(*tok_, *rendered, true));  // no generation prompt
  EXPECT_FALSE(m->note.empty());
  ParsedCacheRequest long_one;
  long_one.prompt_text = std::string(400, 'x') + " y z";
  auto too_long = PrepareCache(long_one, model_);
  EXPECT_EQ(too_long.status().code(), StatusCode::kOutOfRange);
}

TEST_F(ServerCachePrepare, PromptsAfterACache) {
  KvCacheInfo cache;
  cache.id = "kvc-1";
  cache.tokens = 40;
  auto parsed = ParseRequest(R"({"prompt": " and the earth", "cache_id": "kvc-1"})",
                             Endpoint::kCompletions, Limits());
  ASSERT_TRUE(parsed.ok());
  auto p = Prepare(*parsed, model_, 1, &cache);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->request.prompt, tok_->Encode(" and the earth"));  // no BOS
  EXPECT_EQ(p->request.cache_id, "kvc-1");
  // The context counts against the window: 40 + this prompt leave none.
  cache.tokens = 64 - static_cast<int>(p->request.prompt.size());
  auto full = Prepare(*parsed, model_, 1, &cache);
  EXPECT_EQ(full.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(full.status().message().find("after the cache's"), std::string::npos);

  // Chat after a cache made from messages: only what the new turn adds (plain template).
  cache.tokens = 10;
  const std::vector<ChatMessage> context = {{ChatRole::kSystem, "Doc."}};
  cache.note = ChatNote(context);
  const std::vector<ChatMessage> turn = {{ChatRole::kUser, "Q?"}};
  auto ids = ChatAfterCache(model_, cache, turn);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_EQ(*ids, tok_->Encode("\nUser: Q?\nAssistant:"));
  // After a prompt cache, the turn alone without a BOS.
  cache.note.clear();
  auto alone = ChatAfterCache(model_, cache, turn);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(*alone, tok_->Encode("User: Q?\nAssistant:"));
}

TEST_F(ServerCachePrepare, ChatMlKeepsItsPreambleInTheCacheOnce) {
  auto chatml = ChatTemplateByName("chatml");
  ASSERT_TRUE(chatml.ok());
  model_.chat_template = *chatml;
  model_.chat_template.default_system = "You are Qwen.";
  KvCacheInfo cache;
  cache.tokens = 10;
  cache.note = ChatNote(std::vector<ChatMessage>{{ChatRole::kUser, "Doc."}});
  auto ids = ChatAfterCache(model_, cache, std::vector<ChatMessage>{{ChatRole::kUser, "Q?"}});
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  const std::string added = tok_->Decode(*ids);
  EXPECT_EQ(added.find("You are Qwen."), std::string::npos) << added;  // the default system turn
  EXPECT_NE(added.find("Q?"), std::string::npos) << added;
  // llama2 folds a system message into the first user turn and needs turns to alternate: a
  // second user turn after a cached one is refused, naming messages.
  auto llama2 = ChatTemplateByName("llama2");
  ASSERT_TRUE(llama2.ok());
  model_.chat_template = *llama2;
  auto refused = ChatAfterCache(model_, cache, std::vector<ChatMessage>{{ChatRole::kUser, "Q?"}});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(ApiErrorFromStatus(refused.status()).param, "messages");
  // What works there: cache a system message and a user turn, send the reply and the next turn.
  cache.note = ChatNote(
      std::vector<ChatMessage>{{ChatRole::kSystem, "Be brief."}, {ChatRole::kUser, "Doc."}});
  auto next = ChatAfterCache(
      model_, cache,
      std::vector<ChatMessage>{{ChatRole::kAssistant, "Read."}, {ChatRole::kUser, "Q?"}});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  const std::string turn = tok_->Decode(*next);
  EXPECT_EQ(turn.find("Be brief."), std::string::npos) << turn;
  EXPECT_NE(turn.find("[INST] Q? [/INST]"), std::string::npos) << turn;
}

TEST(ServerCaches, ResponsesErrorsAndMetrics) {
  KvCacheInfo c;
  c.id = "kvc-abc";
  c.created = 1700000000;
  c.tokens = 32;
  c.held_rows = 256;
  c.bytes = 4096;
  c.compression = "snapkv ratio 0.750";
  c.note = "private";
  const json one = json::parse(CacheJson(c));
  EXPECT_EQ(one, json::parse(R"({"id": "kvc-abc", "object": "kv_cache", "created": 1700000000,
      "tokens": 32, "held_rows": 256, "bytes": 4096, "compression": "snapkv ratio 0.750"})"));
  const std::vector<KvCacheInfo> list = {c, c};
  const json all = json::parse(CacheListJson(list));
  EXPECT_EQ(all["object"], "list");
  EXPECT_EQ(all["data"].size(), 2u);
  EXPECT_EQ(json::parse(CacheDeletedJson("kvc-abc")),
            json::parse(R"({"id": "kvc-abc", "object": "kv_cache.deleted", "deleted": true})"));
  const ApiError e = ApiErrorFromStatus(NotFound("cache_id: no cache 'kvc-x'"));
  EXPECT_EQ(e.http_status, 404);
  EXPECT_EQ(e.code, "cache_not_found");
  EXPECT_EQ(ApiErrorFromStatus(NotFound("model: no")).code, "model_not_found");
  RuntimeMetrics m;
  m.kv_caches = 3;
  m.kv_cache_bytes = 123456;
  const std::string text = MetricsText(m, KvStats(), "kvtiny");
  EXPECT_NE(text.find("# TYPE cachet:kv_caches gauge\ncachet:kv_caches{model_name=\"kvtiny\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("cachet:kv_cache_bytes{model_name=\"kvtiny\"} 123456\n"), std::string::npos);
}

}  // namespace
}  // namespace cachet::server
