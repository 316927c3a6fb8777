// Chat templates: each family renders what its published Jinja template renders (expected strings
// written by hand from the templates in the models' tokenizer_config.json), detection from
// excerpts of those templates, the errors, reading a model's template, and `cachet chat`.
#include "cachet/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>

#include "cachet/tokenizer.h"
#include "model/gguf.h"
#include "test_util.h"

namespace cachet {
namespace {

// Excerpts of published templates (Jinja source as the JSON string decodes to it: `\n` inside a
// Jinja string literal is the two characters backslash and n).
constexpr std::string_view kQwen25 =
    R"({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %})";

constexpr std::string_view kChatMl =
    R"({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})";

constexpr std::string_view kLlama30 =
    R"({% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %})";

constexpr std::string_view kLlama31 = R"({{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %})";

constexpr std::string_view kLlama32 = R"({{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }})";

constexpr std::string_view kLlama2 =
    R"({% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %})";

constexpr std::string_view kMistral = R"({{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- endif %}
{%- endfor %})";

// Zephyr's template holds real line breaks (its JSON string has \n escapes).
constexpr std::string_view kZephyr =
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}";

// Mistral-7B-Instruct-v0.3's template (tool branches left out), and Mistral-Nemo's way of it.
constexpr std::string_view kMistralV3 = R"({%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- endif %}
{%- endfor %})";
constexpr std::string_view kMistralNemo = R"({{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- endif %}
{%- endfor %})";
// Mistral's later layouts: the system prompt in its own [SYSTEM_PROMPT] block.
constexpr std::string_view kMistralV7 =
    R"({{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{%- endif %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %})";

// DeepSeek-R1-Distill's template (tool-call branches left out), and DeepSeek-V3's way of the
// same: no reasoning dropped, no "<think>" opened.
constexpr std::string_view kDeepSeekR1 =
    R"({% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %})";
constexpr std::string_view kDeepSeekV3 =
    R"({{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %})";

// Qwen3's published template (tools and all); the thinking-only models' (2507) open <think>.
constexpr std::string_view kQwen3 = R"JINJA({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})JINJA";

// Families Cachet does not render: they must be errors, not another family's prompt.
constexpr std::string_view kGemma =
    R"({{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %})";
constexpr std::string_view kPhi3 =
    R"({{ bos_token }}{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %})";

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

// --- `cachet chat`

struct CliRun {
  int status = -1;
  std::string out, err;
};

CliRun Cachet(const std::string& args, const std::string& stdin_text) {
  testing::TempDir dir;
  const std::string in = dir.Write("stdin.txt", stdin_text);
  const std::string err = dir.path() + "/stderr.txt";
  CliRun r;
  FILE* p =
      popen((std::string(CACHET_BINARY) + " " + args + " < " + in + " 2> " + err).c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.out.append(buf.data(), n);
  r.status = pclose(p);
  r.err = testing::ReadFile(err);
  return r;
}

TEST(ChatTemplateCli, KvtinyKeepsThePlainTranscript) {
  CliRun r = Cachet("chat -t 1 -n 4 --temp 0 --verbose-prompt", "Hello there\nBye\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("cachet chat (plain template)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--- prompt\nUser: Hello there\nAssistant:\n---\n"), std::string::npos)
      << r.err;
  // The second turn prefills only its own text.
  EXPECT_NE(r.err.find("--- prompt\n\nUser: Bye\nAssistant:\n---\n"), std::string::npos) << r.err;
}

TEST(ChatTemplateCli, FlagOverridesTheTemplate) {
  CliRun r = Cachet("chat -t 1 -n 4 --temp 0 --verbose-prompt --chat-template chatml --system Hi",
                    "Hello\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--- prompt\n<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\nHello"
                       "<|im_end|>\n<|im_start|>assistant\n\n---\n"),
            std::string::npos)
      << r.err;
  r = Cachet("chat --help", "");
  EXPECT_NE(r.out.find("--chat-template"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("chatml, llama3, llama2, mistral, mistral-v3, zephyr, deepseek, plain"),
            std::string::npos);
}

// DeepSeek-R1's generation prompt ("<think>\n") is no prefix of its rendering of the reply, yet
// each turn still ends with the EOS text in the cache and the next one appends only its own text.
TEST(ChatTemplateCli, DeepSeekTurnsCloseWithTheEosAndAppend) {
  const CliRun r = Cachet("chat -t 1 -n 6 --temp 0 --verbose-prompt --chat-template deepseek",
                          "Hello there\nWhat is the pass key?\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--- prompt\n<|bos|><｜User｜>Hello there<｜Assistant｜><think>\n\n---"),
            std::string::npos)
      << r.err;
  const size_t second =
      r.err.find("--- prompt\n<｜User｜>What is the pass key?<｜Assistant｜><think>");
  ASSERT_NE(second, std::string::npos) << r.err;
  const size_t closed = r.err.find("--- end of turn\n<|eos|>\n---");
  EXPECT_LT(closed, second) << r.err;
  // plain has no end of turn after a reply ("\nUser:" opens the next one): over three turns none
  // is added (an earlier turn's "\nUser:" was once taken for it, and the history copied again).
  const CliRun plain = Cachet("chat -t 1 -n 4 --temp 0 --verbose-prompt", "Hi\nAnd?\nBye\n");
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_EQ(plain.err.find("--- end of turn"), std::string::npos) << plain.err;
}

// kvtiny with Qwen3's template: each turn prefills only its own text (the reply's empty think
// block, which the template writes while the reply is last, must not make the next turn start
// over), and closes with <|im_end|>.
TEST(ChatTemplateCli, Qwen3TurnsAppend) {
  testing::TempDir dir;
  for (const auto& e : std::filesystem::directory_iterator(testing::ModelDir())) {
    if (e.path().filename() != "tokenizer_config.json") {
      std::filesystem::create_symlink(e.path(), dir.path() + "/" + e.path().filename().string());
    }
  }
  nlohmann::json cfg =
      nlohmann::json::parse(testing::ReadFile(testing::ModelDir() + "/tokenizer_config.json"));
  cfg["chat_template"] = std::string(kQwen3);
  dir.Write("tokenizer_config.json", cfg.dump());
  const CliRun r = Cachet("chat -t 1 -n 6 --temp 0 --verbose-prompt -m " + dir.path(),
                          "Hello there\nAnd then?\nBye\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("cachet chat (chatml template)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--- prompt\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>"
                       "assistant\n\n---"),
            std::string::npos)
      << r.err;
  for (const char* turn : {"And then?", "Bye"}) {
    const std::string want = std::string("--- prompt\n<|im_start|>user\n") + turn +
                             "<|im_end|>\n<|im_start|>assistant\n";
    EXPECT_NE(r.err.find(want), std::string::npos) << turn << "\n" << r.err;
  }
  EXPECT_EQ(r.err.find("--- prompt\n<|im_start|>user\nHello there", r.err.find("And then?")),
            std::string::npos)
      << "a later turn prefilled the history again\n"
      << r.err;
}

TEST(ChatTemplateCli, UnknownNameOrTemplateIsAStartupError) {
  CliRun r = Cachet("chat -t 1 --chat-template llama4", "Hello\n");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--chat-template: unknown chat template \"llama4\"; known: chatml, llama3, "
                       "llama2, mistral, mistral-v3, zephyr, deepseek, plain"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty());
  // kvtiny's files with a template no family matches.
  testing::TempDir dir;
  for (const auto& e : std::filesystem::directory_iterator(testing::ModelDir())) {
    if (e.path().filename() != "tokenizer_config.json") {
      std::filesystem::create_symlink(e.path(), dir.path() + "/" + e.path().filename().string());
    }
  }
  nlohmann::json cfg =
      nlohmann::json::parse(testing::ReadFile(testing::ModelDir() + "/tokenizer_config.json"));
  cfg["chat_template"] = std::string(kGemma);
  dir.Write("tokenizer_config.json", cfg.dump());
  r = Cachet("chat -t 1 -n 4 -m " + dir.path(), "Hello\n");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("matches no known family; choose one with --chat-template NAME"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty());
  r = Cachet("chat -t 1 -n 4 --temp 0 --chat-template plain -m " + dir.path(), "Hello\n");
  EXPECT_EQ(r.status, 0) << r.err;
}

}  // namespace
}  // namespace cachet
