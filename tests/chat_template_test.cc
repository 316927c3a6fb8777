// Chat templates: each family renders what its published Jinja template renders (expected strings
// written by hand from the templates in the models' tokenizer_config.json), detection from
// excerpts of those templates (chat_template_texts.h), the errors, reading a model's template.
// `cachet chat` with them: chat_template_cli_test.cc.
#include "cachet/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <regex>

#include "cachet/tokenizer.h"
#include "chat_template_texts.h"
#include "model/gguf.h"
#include "test_util.h"

namespace cachet {
namespace {

using namespace chat_templates;  // NOLINT: the templates' texts

const std::vector<ChatMessage> kThree = {
    {ChatRole::kSystem, "You are a helpful assistant."},
    {ChatRole::kUser, "What is the capital of France?"},
    {ChatRole::kAssistant, "Paris."},
};

std::string Render(const ChatTemplate& t, const std::vector<ChatMessage>& messages,
                   bool add_generation_prompt = true) {
  Result<std::string> r = RenderChat(t, messages, add_generation_prompt);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : "";
}

ChatTemplate Named(std::string_view name) {
  Result<ChatTemplate> t = ChatTemplateByName(name);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? t.value() : ChatTemplate{};
}

ChatTemplate Detected(std::string_view jinja) {
  Result<ChatTemplate> t = DetectChatTemplate(jinja);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? t.value() : ChatTemplate{};
}

TEST(ChatTemplate, ChatMlRendersThreeMessages) {
  EXPECT_EQ(Render(Named("chatml"), kThree),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\nParis.<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(Render(Named("chatml"), kThree, false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\nParis.<|im_end|>\n");
}

TEST(ChatTemplate, QwenDefaultSystemComesFromTheTemplate) {
  const ChatTemplate t = Detected(kQwen25);
  EXPECT_EQ(t.family, ChatFamily::kChatMl);
  EXPECT_EQ(t.default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_EQ(Render(t, {{ChatRole::kUser, "Hi"}}),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // A system message of the conversation replaces the default.
  EXPECT_EQ(Render(t, kThree), Render(Named("chatml"), kThree));
  // Generic ChatML has no default system turn.
  EXPECT_EQ(Detected(kChatMl).default_system, "");
}

TEST(ChatTemplate, Llama3RendersThreeMessages) {
  std::vector<ChatMessage> m = kThree;
  // Contents are trimmed of what Python's str.strip() strips: Unicode spaces too.
  m[1].content = "  What is the capital of France?\n";
  m[2].content = "\xC2\xA0Paris.\xE3\x80\x80\t";
  EXPECT_EQ(Render(Named("llama3"), m),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "You are a helpful assistant.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(
      Render(Named("llama3"), {{ChatRole::kUser, "\xC3\xA9t\xC3\xA9 \xE2\x80\x83"}}, false),
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n\xC3\xA9t\xC3\xA9<|eot_id|>");
  EXPECT_EQ(Detected(kLlama30).family, ChatFamily::kLlama3);
  EXPECT_FALSE(Detected(kLlama30).today_date.has_value());
}

TEST(ChatTemplate, Llama31OpensWithTheDatedSystemTurn) {
  const ChatTemplate t = Detected(kLlama31);
  ASSERT_EQ(t.family, ChatFamily::kLlama3);
  ASSERT_EQ(t.today_date.value_or(""), "26 Jul 2024");
  EXPECT_EQ(Render(t, kThree),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            "You are a helpful assistant.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  // Without a system message the system turn is still there, empty after the preamble.
  EXPECT_EQ(Render(t, {{ChatRole::kUser, "Hi"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  // Llama 3.2's template dates the prompt today (strftime_now("%d %b %Y")).
  const ChatTemplate t32 = Detected(kLlama32);
  ASSERT_TRUE(t32.today_date.has_value());
  EXPECT_TRUE(std::regex_match(*t32.today_date, std::regex("[0-3][0-9] [A-Z][a-z]{2} 20[0-9]{2}")))
      << *t32.today_date;
}

TEST(ChatTemplate, Llama2PutsTheSystemPromptInTheFirstInst) {
  const ChatTemplate t = Named("llama2");
  EXPECT_EQ(Render(t, kThree),
            "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\n"
            "What is the capital of France? [/INST] Paris. </s>");
  std::vector<ChatMessage> four = kThree;
  four.push_back({ChatRole::kUser, "And of Italy? "});
  EXPECT_EQ(Render(t, four),
            "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\n"
            "What is the capital of France? [/INST] Paris. </s><s>[INST] And of Italy? [/INST]");
  EXPECT_EQ(Render(t, {{ChatRole::kUser, "Hi"}}), "<s>[INST] Hi [/INST]");
  EXPECT_EQ(Detected(kLlama2).family, ChatFamily::kLlama2);
}

TEST(ChatTemplate, MistralPrependsTheSystemPromptAndHasOneBos) {
  const ChatTemplate t = Named("mistral");
  EXPECT_EQ(Render(t, kThree),
            "<s> [INST] You are a helpful assistant.\n\nWhat is the capital of France? [/INST] "
            "Paris.</s>");
  std::vector<ChatMessage> four = kThree;
  four.push_back({ChatRole::kUser, "And of Italy?"});
  EXPECT_EQ(Render(t, four),
            "<s> [INST] You are a helpful assistant.\n\nWhat is the capital of France? [/INST] "
            "Paris.</s> [INST] And of Italy? [/INST]");
  EXPECT_EQ(Detected(kMistral).family, ChatFamily::kMistral);
}

// Expected strings as jinja2 3.1 renders Mistral-7B-Instruct-v0.3's template (and Nemo's way).
TEST(ChatTemplate, MistralV3PutsTheSystemPromptInTheLastUserTurn) {
  const ChatTemplate v3 = Detected(kMistralV3);
  ASSERT_EQ(v3.family, ChatFamily::kMistralV3);
  EXPECT_FALSE(v3.tight_inst);
  std::vector<ChatMessage> m = kThree;
  m[2].content = "  Paris.\n";
  // Ending with a reply, the conversation has no user turn for the system prompt: it is left out.
  EXPECT_EQ(Render(v3, m), "<s>[INST] What is the capital of France?[/INST] Paris.</s>");
  m.push_back({ChatRole::kUser, "And of Italy?"});
  EXPECT_EQ(Render(v3, m),
            "<s>[INST] What is the capital of France?[/INST] Paris.</s>"
            "[INST] You are a helpful assistant.\n\nAnd of Italy?[/INST]");
  EXPECT_EQ(Render(Named("mistral-v3"), m), Render(v3, m));
  const ChatTemplate nemo = Detected(kMistralNemo);
  ASSERT_EQ(nemo.family, ChatFamily::kMistralV3);
  EXPECT_TRUE(nemo.tight_inst);
  EXPECT_EQ(Render(nemo, m),
            "<s>[INST]What is the capital of France?[/INST]  Paris.\n</s>"
            "[INST]You are a helpful assistant.\n\nAnd of Italy?[/INST]");
  // v0.1's template stays mistral.
  EXPECT_EQ(Detected(kMistral).family, ChatFamily::kMistral);
  // Roles must alternate after one optional system message, as the template raises.
  const std::vector<ChatMessage> twice = {{ChatRole::kUser, "a"}, {ChatRole::kUser, "b"}};
  EXPECT_FALSE(RenderChat(v3, twice, true).ok());
}

TEST(ChatTemplate, ZephyrRendersThreeMessages) {
  EXPECT_EQ(Render(Named("zephyr"), kThree),
            "<|system|>\nYou are a helpful assistant.</s>\n"
            "<|user|>\nWhat is the capital of France?</s>\n"
            "<|assistant|>\nParis.</s>\n"
            "<|assistant|>\n");
  EXPECT_EQ(Detected(kZephyr).family, ChatFamily::kZephyr);
}

// Expected strings as jinja2 3.1 renders kQwen3 (and its thinking variant: the generation prompt
// "<|im_start|>assistant\n<think>\n").
TEST(ChatTemplate, Qwen3DropsPastReasoningKeepsRecentAndMayOpenThink) {
  const ChatTemplate q = Detected(kQwen3);
  ASSERT_EQ(q.family, ChatFamily::kChatMl);
  EXPECT_TRUE(q.drop_reasoning);
  EXPECT_TRUE(q.recent_reasoning);
  EXPECT_FALSE(q.open_think);
  EXPECT_EQ(q.default_system, "");
  std::vector<ChatMessage> m = kThree;
  m[2].content = "<think>\nThe capital of France is Paris.\n</think>\n\nParis.";
  m.push_back({ChatRole::kUser, "And Spain?"});
  const std::string follow_up =
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the "
      "capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\n"
      "And Spain?<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(Render(q, m), follow_up);
  EXPECT_EQ(Render(q,
                   {{ChatRole::kUser, "Hi"},
                    {ChatRole::kAssistant, "<think>\nr1\n\n</think>\n\n\nHello"}},
                   false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\n"
            "Hello<|im_end|>\n");
  EXPECT_EQ(Render(q, {{ChatRole::kUser, "Hi"}, {ChatRole::kAssistant, "Hello"}}, false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            "Hello<|im_end|>\n");
  EXPECT_EQ(Render(q, {{ChatRole::kUser, "Hi"},
                       {ChatRole::kAssistant, "<think>a</think>b</think>\nc"},
                       {ChatRole::kUser, "x"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n<|im_start|>user\n"
            "x<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(Render(q, {{ChatRole::kUser, "Hi"},
                       {ChatRole::kAssistant, "<think>\nx\n</think>\n\nA"},
                       {ChatRole::kAssistant, "B"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\nA<|im_"
            "end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n<|im_start|>"
            "assistant\n");

  std::string thinking(kQwen3);
  const std::string gen = "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking";
  const size_t at = thinking.find(gen);
  ASSERT_NE(at, std::string::npos);
  const size_t end = thinking.find("{%- endif %}", at) + std::string("{%- endif %}").size();
  thinking.replace(at, end - at, "{{- '<|im_start|>assistant\\n<think>\\n' }}");
  const ChatTemplate t = Detected(thinking);
  EXPECT_TRUE(t.open_think);
  EXPECT_EQ(Render(t, m), follow_up + "<think>\n");
  // enable_thinking false (chat_template_kwargs): an empty think block after the generation
  // prompt, as jinja2 renders it; a template without the switch ignores the variable.
  EXPECT_TRUE(q.thinking_switch);
  EXPECT_FALSE(t.thinking_switch);
  ChatTemplate off = q;
  ASSERT_TRUE(ApplyChatTemplateKwargs(R"({"enable_thinking": false})", &off).ok());
  EXPECT_FALSE(off.enable_thinking);
  EXPECT_EQ(Render(off, {{ChatRole::kUser, "Hi"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(Render(off, {{ChatRole::kUser, "Hi"}}, false), "<|im_start|>user\nHi<|im_end|>\n");
  ChatTemplate plain_off = Named("chatml");
  ASSERT_TRUE(ApplyChatTemplateKwargs(R"({"enable_thinking": false})", &plain_off).ok());
  EXPECT_EQ(Render(plain_off, {{ChatRole::kUser, "Hi"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // Bad kwargs are errors naming what is wrong, and change nothing.
  for (const auto& [text, want] : std::vector<std::pair<const char*, const char*>>{
           {R"({"enable_thinking": "no"})", "enable_thinking: must be true or false"},
           {R"({"enable_thinking": true, "tools_in_user_message": 1})",
            "\"tools_in_user_message\" is not read"},
           {R"([true])", "not a JSON object"},
           {"{", "not a JSON object"}}) {
    ChatTemplate same = off;
    const Status s = ApplyChatTemplateKwargs(text, &same);
    EXPECT_FALSE(s.ok()) << text;
    EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
    EXPECT_FALSE(same.enable_thinking) << text;
  }
  // Qwen2.5's template (no split) keeps a reply as it is.
  EXPECT_FALSE(Named("chatml").drop_reasoning);
  EXPECT_EQ(Render(Named("chatml"), {{ChatRole::kAssistant, "<think>a</think>b"}}, false),
            "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n");
}

// Expected strings as jinja2 3.1 renders kDeepSeekR1 (bos_token "<｜begin▁of▁sentence｜>").
TEST(ChatTemplate, DeepSeekR1DropsTheReasoningOfPastRepliesAndOpensThink) {
  const ChatTemplate r1 = Detected(kDeepSeekR1);
  ASSERT_EQ(r1.family, ChatFamily::kDeepSeek);
  EXPECT_TRUE(r1.drop_reasoning);
  EXPECT_TRUE(r1.open_think);
  std::vector<ChatMessage> m = kThree;
  m[2].content = "<think>\nThe capital of France is Paris.\n</think>\n\nParis.";
  EXPECT_EQ(Render(r1, m),
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the capital of "
            "France?<｜Assistant｜>\n\nParis.<｜end▁of▁sentence｜><｜Assistant｜><think>\n");
  EXPECT_EQ(Render(r1, m, false),
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the capital of "
            "France?<｜Assistant｜>\n\nParis.<｜end▁of▁sentence｜>");
  // The last system message's text goes first, wherever it stands; a reply keeps what follows
  // its last "</think>".
  EXPECT_EQ(
      Render(r1, {{ChatRole::kUser, "Hi"},
                  {ChatRole::kSystem, "S1"},
                  {ChatRole::kAssistant, "a</think>b</think> c"},
                  {ChatRole::kSystem, "S2"},
                  {ChatRole::kUser, "Bye"}}),
      "<｜begin▁of▁sentence｜>S2<｜User｜>Hi<｜Assistant｜> c<｜end▁of▁sentence｜><｜User｜>Bye"
      "<｜Assistant｜><think>\n");
  // By name: the R1 variant.
  EXPECT_EQ(Render(Named("deepseek"), m), Render(r1, m));
  // DeepSeek-V3's: the reply as given, the generation prompt alone.
  const ChatTemplate v3 = Detected(kDeepSeekV3);
  ASSERT_EQ(v3.family, ChatFamily::kDeepSeek);
  EXPECT_FALSE(v3.drop_reasoning);
  EXPECT_FALSE(v3.open_think);
  EXPECT_EQ(Render(v3, m),
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the capital of "
            "France?<｜Assistant｜><think>\nThe capital of France is Paris.\n</think>\n\nParis."
            "<｜end▁of▁sentence｜><｜Assistant｜>");
}

TEST(ChatTemplate, PlainIsTheTranscriptKvtinyContinues) {
  const ChatTemplate t = Named("plain");
  EXPECT_EQ(Render(t, {{ChatRole::kUser, "Hello there"}}), "User: Hello there\nAssistant:");
  // A generated reply keeps its leading space; a given one gets one.
  EXPECT_EQ(Render(t, {{ChatRole::kUser, "Hello there"},
                       {ChatRole::kAssistant, " Hi."},
                       {ChatRole::kUser, "Bye"}}),
            "User: Hello there\nAssistant: Hi.\nUser: Bye\nAssistant:");
  EXPECT_EQ(Render(t, kThree),
            "You are a helpful assistant.\nUser: What is the capital of France?\n"
            "Assistant: Paris.\nAssistant:");
  EXPECT_EQ(Render(t, {}), "Assistant:");
}

TEST(ChatTemplate, NamesAndUnknownName) {
  EXPECT_EQ(ChatTemplateNames(),
            "chatml, llama3, llama2, mistral, mistral-v3, zephyr, deepseek, plain");
  for (auto [name, family] : {std::pair{"chatml", ChatFamily::kChatMl},
                              {"llama3", ChatFamily::kLlama3},
                              {"llama2", ChatFamily::kLlama2},
                              {"mistral", ChatFamily::kMistral},
                              {"mistral-v3", ChatFamily::kMistralV3},
                              {"zephyr", ChatFamily::kZephyr},
                              {"deepseek", ChatFamily::kDeepSeek},
                              {"plain", ChatFamily::kPlain}}) {
    EXPECT_EQ(Named(name).family, family) << name;
    EXPECT_EQ(ChatFamilyName(family), name);
  }
  Result<ChatTemplate> bad = ChatTemplateByName("llama4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--chat-template"), std::string::npos);
  EXPECT_NE(bad.status().message().find("\"llama4\""), std::string::npos);
  EXPECT_NE(bad.status().message().find(
                "chatml, llama3, llama2, mistral, mistral-v3, zephyr, deepseek, plain"),
            std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(ChatTemplateByName("").ok());
  EXPECT_FALSE(ChatTemplateByName("ChatML").ok());
}

TEST(ChatTemplate, UnknownTemplateTextIsAnError) {
  for (std::string_view text :
       {kGemma, kPhi3, kMistralV7, std::string_view("{{ messages }}"), std::string_view("")}) {
    Result<ChatTemplate> t = DetectChatTemplate(text);
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_NE(t.status().message().find("matches no known family"), std::string::npos);
    EXPECT_NE(t.status().message().find("--chat-template"), std::string::npos);
    EXPECT_NE(t.status().message().find(
                  "chatml, llama3, llama2, mistral, mistral-v3, zephyr, deepseek, plain"),
              std::string::npos);
  }
  // Two families' signatures in one text: ambiguous, also an error.
  Result<ChatTemplate> both = DetectChatTemplate(std::string(kChatMl) + std::string(kLlama30));
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("looks like chatml and llama3"), std::string::npos)
      << both.status().message();
}

TEST(ChatTemplate, Roles) {
  for (ChatRole r : {ChatRole::kSystem, ChatRole::kUser, ChatRole::kAssistant}) {
    Result<ChatRole> parsed = ParseChatRole(ChatRoleName(r));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, r);
  }
  Result<ChatRole> bad = ParseChatRole("tool");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "unknown role \"tool\"; known: system, user, assistant");
  EXPECT_FALSE(ParseChatRole("User").ok());
}

TEST(ChatTemplate, Llama2AndMistralRejectWhatTheirTemplatesReject) {
  for (std::string_view name : {"llama2", "mistral"}) {
    const ChatTemplate t = Named(name);
    const std::vector<std::vector<ChatMessage>> bad = {
        {{ChatRole::kAssistant, "Hi"}},
        {{ChatRole::kUser, "a"}, {ChatRole::kUser, "b"}},
        {{ChatRole::kSystem, "s"}, {ChatRole::kAssistant, "a"}},
        {{ChatRole::kUser, "a"}, {ChatRole::kSystem, "s"}},
    };
    for (const auto& m : bad) {
      Result<std::string> r = RenderChat(t, m, true);
      ASSERT_FALSE(r.ok()) << name;
      EXPECT_NE(r.status().message().find("roles must alternate"), std::string::npos);
    }
  }
  const std::vector<ChatMessage> late_system = {{ChatRole::kUser, "a"}, {ChatRole::kSystem, "s"}};
  Result<std::string> r = RenderChat(Named("llama2"), late_system, true);
  EXPECT_EQ(r.status().message(),
            "llama2 chat template: message 1 is a system message; after one optional system "
            "message, roles must alternate user, assistant, user, ... starting with user");
}

TEST(ChatTemplate, StopStringsEndTheAssistantTurn) {
  using V = std::vector<std::string>;
  EXPECT_EQ(StopStrings(Named("chatml")), (V{"<|im_end|>", "<|endoftext|>", "<|im_start|>"}));
  EXPECT_EQ(StopStrings(Named("llama3")), (V{"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}));
  EXPECT_EQ(StopStrings(Named("llama2")), (V{"</s>", "[INST]"}));
  EXPECT_EQ(StopStrings(Named("mistral")), (V{"</s>", "[INST]"}));
  EXPECT_EQ(StopStrings(Named("mistral-v3")), (V{"</s>", "[INST]"}));
  EXPECT_EQ(StopStrings(Named("zephyr")), (V{"</s>", "<|user|>"}));
  EXPECT_EQ(StopStrings(Named("deepseek")), (V{"<｜end▁of▁sentence｜>", "<｜User｜>"}));
  EXPECT_EQ(StopStrings(Named("plain")), (V{"\nUser:", "\n\n"}));
  EXPECT_EQ(EndOfTurn(Named("chatml")), "<|im_end|>");
  EXPECT_EQ(EndOfTurn(Named("llama3")), "<|eot_id|>");
  ChatTemplate z = Named("zephyr");
  z.eos_token = "<|eos|>";  // a model's own EOS text ends its turns
  EXPECT_EQ(EndOfTurn(z), "<|eos|>");
  EXPECT_EQ(StopStrings(z)[0], "<|eos|>");
  EXPECT_EQ(Render(z, {{ChatRole::kUser, "Hi"}}), "<|user|>\nHi<|eos|>\n<|assistant|>\n");
}

// Each family's render without the generation prompt is a prefix of its render with it, and
// of the render with one more turn: what `cachet chat` relies on to prefill only the new text.
// (Not so DeepSeek-R1's, whose generation prompt opens "<think>", which the history drops, nor
// Mistral v0.3's with a system prompt, which moves to the last user turn; DeepSeek-V3's way grows
// by appending.)
TEST(ChatTemplate, ConversationsGrowByAppending) {
  ChatTemplate v3 = Named("deepseek");
  v3.drop_reasoning = v3.open_think = false;
  for (std::string_view name : {"chatml", "llama3", "llama2", "mistral", "zephyr", "v3", "plain"}) {
    const ChatTemplate t = name == "v3" ? v3 : Named(name);
    std::vector<ChatMessage> m = {kThree[0], kThree[1]};
    const std::string first = Render(t, m);
    m.push_back(kThree[2]);
    m.push_back({ChatRole::kUser, "And of Italy?"});
    const std::string second = Render(t, m);
    EXPECT_EQ(second.substr(0, first.size()), first) << name;
    EXPECT_EQ(second.substr(0, Render(t, m, false).size()), Render(t, m, false)) << name;
  }
}

// --- Models

TEST(ChatTemplate, ReadsTokenizerConfig) {
  testing::TempDir dir;
  const std::string cfg = dir.path() + "/tokenizer_config.json";
  auto read = [&](const std::string& json) {
    std::ofstream(cfg, std::ios::binary) << json;
    return ReadChatTemplateText(dir.path());
  };
  auto r = read(R"({"bos_token": "<s>"})");
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
  r = read(nlohmann::json{{"chat_template", std::string(kChatMl)}}.dump());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(**r, kChatMl);
  r = read(nlohmann::json{{"chat_template",
                           {{{"name", "tool_use"}, {"template", "x"}},
                            {{"name", "default"}, {"template", std::string(kZephyr)}}}}}
               .dump());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(**r, kZephyr);
  r = read(R"({"chat_template": [{"name": "rag", "template": "x"}]})");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no template named \"default\" (it has: rag)"),
            std::string::npos)
      << r.status().message();
  r = read(R"({"chat_template": 3})");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tokenizer_config.json: chat_template is number"),
            std::string::npos)
      << r.status().message();
  // chat_template.jinja, where newer transformers save it, comes first.
  dir.Write("chat_template.jinja", std::string(kLlama31));
  r = read(nlohmann::json{{"chat_template", std::string(kChatMl)}}.dump());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(**r, kLlama31);
}

TEST(ChatTemplate, ReadsGgufMetadata) {
  testing::TempDir dir;
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("tokenizer.chat_template", std::string(kLlama2));
  ASSERT_TRUE(w.Write(dir.path() + "/with.gguf").ok());
  auto r = ReadChatTemplateText(dir.path() + "/with.gguf");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(**r, kLlama2);
  auto t = ResolveChatTemplate(dir.path() + "/with.gguf", "");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->family, ChatFamily::kLlama2);
  GgufWriter none;
  none.SetString("general.architecture", "llama");
  ASSERT_TRUE(none.Write(dir.path() + "/without.gguf").ok());
  t = ResolveChatTemplate(dir.path() + "/without.gguf", "");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->family, ChatFamily::kPlain);
}

TEST(ChatTemplate, ResolvesKvtinyToPlainAndNamesOverride) {
  auto t = ResolveChatTemplate(testing::ModelDir(), "");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->family, ChatFamily::kPlain);
  t = ResolveChatTemplate(testing::ModelDir(), "zephyr");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->family, ChatFamily::kZephyr);
  testing::TempDir dir;
  dir.Write("tokenizer_config.json", nlohmann::json{{"chat_template", std::string(kGemma)}}.dump());
  t = ResolveChatTemplate(dir.path(), "");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message().find(dir.path() + ": the model's chat template"), 0u)
      << t.status().message();
  t = ResolveChatTemplate(dir.path(), "chatml");  // the flag overrides an unknown template
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->family, ChatFamily::kChatMl);
}

// A SentencePiece-like tokenizer: one token per byte, no special tokens matched in text.
class ByteTokenizer final : public Tokenizer {
 public:
  explicit ByteTokenizer(bool add_bos) {
    bos_id_ = 1;
    eos_id_ = 2;
    add_bos_ = add_bos;
  }
  std::vector<int32_t> Encode(std::string_view text, bool) const override {
    std::vector<int32_t> ids;
    for (char c : text) ids.push_back(3 + static_cast<unsigned char>(c));
    return ids;
  }
  std::string TokenBytes(int32_t id) const override {
    return id == 1 ? "<s>" : id == 2 ? "</s>" : std::string(1, static_cast<char>(id - 3));
  }
  int32_t vocab_size() const override { return 259; }
  bool IsSpecial(int32_t id) const override { return id < 3; }
  std::string_view kind() const override { return "bytes"; }
};

std::vector<int32_t> Bytes(std::string_view s) { return ByteTokenizer(false).Encode(s, true); }

TEST(ChatTemplate, EncodesBosAndEosTextsAsTokens) {
  const ByteTokenizer adds_bos(true), no_bos(false);
  const std::string prompt =
      Render(Named("llama2"),
             {{ChatRole::kUser, "a"}, {ChatRole::kAssistant, "b"}, {ChatRole::kUser, "c"}});
  ASSERT_EQ(prompt, "<s>[INST] a [/INST] b </s><s>[INST] c [/INST]");
  // The tokenizer's BOS first, the template's BOS text not doubled; </s><s> as tokens.
  std::vector<int32_t> want = {1};
  for (auto part :
       {Bytes("[INST] a [/INST] b "), std::vector<int32_t>{2, 1}, Bytes("[INST] c [/INST]")}) {
    want.insert(want.end(), part.begin(), part.end());
  }
  EXPECT_EQ(EncodeChatPrompt(adds_bos, prompt, /*first=*/true), want);
  // A tokenizer that adds no BOS gets the template's, as a token.
  EXPECT_EQ(EncodeChatPrompt(no_bos, prompt, /*first=*/true), want);
  // Later turns add no BOS of their own.
  std::vector<int32_t> later = {2, 1};
  for (int32_t id : Bytes("[INST] c [/INST]")) later.push_back(id);
  EXPECT_EQ(EncodeChatPrompt(adds_bos, " </s><s>[INST] c [/INST]", false).size(), later.size() + 1);
  EXPECT_EQ(EncodeChatPrompt(adds_bos, "</s><s>[INST] c [/INST]", false), later);
  // A template without BOS (ChatML) gets the tokenizer's at the start only.
  EXPECT_EQ(EncodeChatPrompt(adds_bos, "x", true), (std::vector<int32_t>{1, 3 + 'x'}));
  EXPECT_EQ(EncodeChatPrompt(no_bos, "x", true), (std::vector<int32_t>{3 + 'x'}));
}

TEST(ChatTemplate, UsesTheTokenizersSpecialTexts) {
  auto tok = Tokenizer::Load(testing::ModelDir());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ChatTemplate t = Named("llama2");
  UseTokenizerSpecials(**tok, &t);
  EXPECT_EQ(t.bos_token, "<|bos|>");
  EXPECT_EQ(t.eos_token, "<|eos|>");
  const std::string prompt = Render(t, {{ChatRole::kUser, "Hi"}});
  EXPECT_EQ(prompt, "<|bos|>[INST] Hi [/INST]");
  const std::vector<int32_t> ids = EncodeChatPrompt(**tok, prompt, /*first=*/true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], (*tok)->bos_id());
  EXPECT_EQ(std::count(ids.begin(), ids.end(), (*tok)->bos_id()), 1);
}

}  // namespace
}  // namespace cachet
