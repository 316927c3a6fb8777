// Chat templates: a conversation (typed messages) to the prompt text a model was tuned on.
//
// Models ship their template as Jinja (tokenizer_config.json "chat_template", GGUF
// "tokenizer.chat_template"); Cachet has no Jinja engine. It recognises the common families by
// signature strings in the template text and renders each with a C++ function that produces what
// the family's published template produces. The text or a --chat-template name is parsed once, at
// startup, into a ChatTemplate: an unrecognised template is an error then, never a wrong prompt
// later. Roles given as strings (a request's JSON) are parsed once, at the edge, into ChatRole.
//
// Adding a family: one ChatFamily value and one entry (name, signature, render function, stop
// strings) in the table of chat_template.cc; a missing entry does not compile.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet {

class Tokenizer;

// The flag that names a template (`cachet chat`, and the server's); errors point users to it.
inline constexpr std::string_view kChatTemplateFlag = "--chat-template";

enum class ChatFamily : uint8_t {
  kPlain,      // "User: ...\nAssistant: ..." lines: models without a template (kvtiny, base models)
  kChatMl,     // <|im_start|>role\n...<|im_end|>\n (Qwen, many fine-tunes)
  kLlama3,     // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> (Llama 3.x)
  kLlama2,     // <s>[INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ... </s> (Llama 2 chat)
  kMistral,    // <s> [INST] system\n\nuser [/INST] assistant</s> (Mistral/Mixtral instruct v0.1)
  kMistralV3,  // <s>[INST] user[/INST] assistant</s>[INST] system\n\nuser[/INST] (Mistral-7B
               // v0.3, Mixtral 8x22B; "[INST]user" and no space before replies: Mistral-Nemo)
  kZephyr,     // <|system|>\n...</s>\n<|user|>\n...</s>\n<|assistant|>\n (Zephyr, TinyLlama chat)
  kDeepSeek,  // BOS system<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜> (DeepSeek-R1
              // distills, DeepSeek-V3)
  kCount,  // not a family: the number of families (keep last)
};

enum class ChatRole : uint8_t { kSystem, kUser, kAssistant };

struct ChatMessage {
  ChatRole role = ChatRole::kUser;
  std::string content;
};

// A template: its family and what varies within the family (read from the template's text), plus
// the texts of the Jinja variables bos_token and eos_token.
struct ChatTemplate {
  ChatFamily family = ChatFamily::kPlain;
  // chatml: the system turn rendered when a conversation has none (Qwen2 / Qwen2.5 templates).
  std::string default_system;
  // llama3: set for Llama 3.1+ templates, whose first turn is always a system turn opening with
  // "Cutting Knowledge Date: December 2023\nToday Date: <today_date>\n\n"; unset: Llama 3.0's.
  std::optional<std::string> today_date;
  // deepseek (the R1 distills' templates), chatml (Qwen3's, QwQ's): assistant turns of the
  // history keep only the text after their last "</think>" (the reasoning is dropped; chatml also
  // drops the line breaks after it), and open_think: the generation prompt opens a "<think>\n"
  // block (R1, QwQ, Qwen3's thinking-only models). DeepSeek-V3's and Qwen2.5's templates do
  // neither.
  bool drop_reasoning = false;
  bool open_think = false;
  // chatml (Qwen3's templates): assistant turns after the last user message keep their
  // reasoning, as "<think>\n" + reasoning + "\n</think>\n\n" + the reply (the last one even
  // when it has none).
  bool recent_reasoning = false;
  // chatml (Qwen3's hybrid templates): the template reads enable_thinking, and when it is false
  // the generation prompt holds an empty "<think>\n\n</think>\n\n" (the model answers at once).
  // enable_thinking is the Jinja variable's value (chat_template_kwargs), true unless given.
  bool thinking_switch = false;
  bool enable_thinking = true;
  // mistral-v3: Mistral-Nemo's ("tekken") layout: "[INST]" without the space after it, replies as
  // they are (v0.3 writes " " + the reply stripped).
  bool tight_inst = false;
  // The family's usual texts; UseTokenizerSpecials replaces them with the model's own.
  std::string bos_token;
  std::string eos_token;
};

// chat_template_kwargs (llama-server's flag and request field, vLLM's field): the Jinja variables
// a template reads besides the messages, as a JSON object. Cachet renders templates in C++, so
// only the one it renders is read, enable_thinking (a boolean); another key, or a value of
// another type, is an InvalidArgument naming it. Applied to t.
Status ApplyChatTemplateKwargs(std::string_view json_object, ChatTemplate* t);

std::string_view ChatFamilyName(ChatFamily family);
// "chatml, llama3, llama2, mistral, mistral-v3, zephyr, deepseek, plain": every name
// ChatTemplateByName accepts.
std::string ChatTemplateNames();

// A family by name (the --chat-template flag), with the family's usual variant. An unknown name
// is an InvalidArgument naming the flag and listing the known names.
Result<ChatTemplate> ChatTemplateByName(std::string_view name);
// The family of a model's Jinja template, recognised by its signature strings. A text that no
// family (or more than one) matches is an InvalidArgument naming the --chat-template flag.
Result<ChatTemplate> DetectChatTemplate(std::string_view jinja);

// "system", "user", "assistant" (as OpenAI's API and the Jinja templates spell them).
std::string_view ChatRoleName(ChatRole role);
// An unknown role is an InvalidArgument that lists the known ones; callers prefix where it was.
Result<ChatRole> ParseChatRole(std::string_view role);

// The prompt text for `messages`, followed by the opening of an assistant turn when
// add_generation_prompt is set (llama2 and mistral have none: their prompt ends with [/INST]).
// Fails where the published template raises an error: llama2 and mistral take one optional
// system message first, then user and assistant turns alternating, starting with a user turn.
Result<std::string> RenderChat(const ChatTemplate& t, std::span<const ChatMessage> messages,
                               bool add_generation_prompt);

// The text that ends an assistant turn ("<|im_end|>", "<|eot_id|>", the EOS text, ...).
std::string EndOfTurn(const ChatTemplate& t);
// Strings that end generation of an assistant turn (EndOfTurn first): a server or the CLI stops
// at the first of them and drops it from the reply.
std::vector<std::string> StopStrings(const ChatTemplate& t);

// --- Models

// The template text a model ships: for a directory, chat_template.jinja, else the
// "chat_template" of tokenizer_config.json (a string, or a list of {"name", "template"} from
// which the one named "default" is used, as transformers does); for a .gguf file, the
// "tokenizer.chat_template" key. nullopt when the model has none.
Result<std::optional<std::string>> ReadChatTemplateText(const std::string& model_path);

// The template a chat with this model uses: `name` when it is not empty (the flag overrides),
// else the model's own template recognised, else plain (a model without a template).
Result<ChatTemplate> ResolveChatTemplate(const std::string& model_path, std::string_view name);

// bos_token / eos_token become the texts of the tokenizer's BOS and EOS tokens (empty when it
// has none), as the Jinja template would see them.
void UseTokenizerSpecials(const Tokenizer& tok, ChatTemplate* t);

// Token ids of rendered prompt text. At the start of a sequence (`first`), the tokenizer's own BOS
// comes first when it adds one, and a BOS text the template wrote there is dropped (never
// doubled). BOS and EOS texts inside the prompt become those tokens even with a tokenizer that
// does not match special tokens written in text (SentencePiece).
std::vector<int32_t> EncodeChatPrompt(const Tokenizer& tok, std::string_view text, bool first);

}  // namespace cachet
