// The chat template families: one table of {family, name, signature, renderer, stop strings}.
// Each renderer reproduces its family's published Jinja template (the one in the model's
// tokenizer_config.json) for conversations of system, user and assistant messages.
#include "cachet/chat_template.h"

#include <array>
#include <ctime>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>

namespace cachet {
namespace {

using Messages = std::span<const ChatMessage>;

// --- Whitespace as Python's str.strip() (Jinja's `trim` and `.strip()`) sees it.

// Bytes of the whitespace character that starts at s[i], 0 if none. Python's str.isspace():
// \t \n \v \f \r, \x1c-\x1f, space, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000.
size_t SpaceAt(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const size_t n = s.size() - i;
  if (n == 0) return 0;
  const unsigned char c = b(0);
  if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return 1;
  if (c == 0xC2 && n >= 2 && (b(1) == 0x85 || b(1) == 0xA0)) return 2;
  if (n < 3) return 0;
  if (c == 0xE1 && b(1) == 0x9A && b(2) == 0x80) return 3;  // U+1680
  if (c == 0xE2 && b(1) == 0x80) {
    const unsigned char d = b(2);
    if (d <= 0x8A || d == 0xA8 || d == 0xA9 || d == 0xAF) return 3;  // U+2000-200A, 2028/9, 202F
  }
  if (c == 0xE2 && b(1) == 0x81 && b(2) == 0x9F) return 3;  // U+205F
  if (c == 0xE3 && b(1) == 0x80 && b(2) == 0x80) return 3;  // U+3000
  return 0;
}

// Bytes of the whitespace character that ends just before s[end], 0 if none.
size_t SpaceBefore(std::string_view s, size_t end) {
  for (size_t len = 1; len <= 3 && len <= end; ++len) {
    if (SpaceAt(s.substr(0, end), end - len) == len) return len;
  }
  return 0;
}

std::string_view Strip(std::string_view s) {
  size_t begin = 0, end = s.size();
  for (size_t n; begin < end && (n = SpaceAt(s.substr(0, end), begin)) > 0;) begin += n;
  for (size_t n; end > begin && (n = SpaceBefore(s, end)) > 0;) end -= n;
  return s.substr(begin, end - begin);
}

void Append(std::string* out, std::initializer_list<std::string_view> parts) {
  for (std::string_view p : parts) out->append(p);
}

// llama2 and mistral: one optional system message first, then user/assistant alternating.
// Returns the system message (if any) and checks the rest as the published templates do (they
// raise an exception); a system message later on is an error too (llama2's template drops it).
Result<std::optional<std::string_view>> SplitSystemAndCheckTurns(std::string_view family,
                                                                 Messages* messages) {
  std::optional<std::string_view> system;
  Messages all = *messages;
  if (!all.empty() && all[0].role == ChatRole::kSystem) {
    system = all[0].content;
    *messages = all.subspan(1);
  }
  const size_t offset = system ? 1 : 0;
  for (size_t i = 0; i < messages->size(); ++i) {
    const ChatRole role = (*messages)[i].role;
    const ChatRole want = i % 2 == 0 ? ChatRole::kUser : ChatRole::kAssistant;
    if (role != want) {
      return InvalidArgument(
          std::string(family) + " chat template: message " + std::to_string(i + offset) + " is a " +
          std::string(ChatRoleName(role)) +
          " message; after one optional system message, roles must alternate user, assistant, "
          "user, ... starting with user");
    }
  }
  return system;
}

// --- Renderers: what each family's published template renders.

// Lines "User: ...", "Assistant: ..." (a system message is its text alone), then "Assistant:"
// for the model to continue. A reply that starts with a space (as generated after "Assistant:")
// keeps it instead of getting a second one.
Result<std::string> RenderPlain(const ChatTemplate&, Messages messages, bool add_generation) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (i > 0) out += '\n';
    switch (m.role) {
      case ChatRole::kSystem:
        break;
      case ChatRole::kUser:
        out += "User: ";
        break;
      case ChatRole::kAssistant:
        out += m.content.starts_with(' ') ? "Assistant:" : "Assistant: ";
        break;
    }
    out += m.content;
  }
  if (add_generation) {
    if (!messages.empty()) out += '\n';
    out += "Assistant:";
  }
  return out;
}

std::string_view StripNewlines(std::string_view s, bool front, bool back) {
  while (front && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (back && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// An assistant turn of a Qwen3 / QwQ template: the reply after its last "</think>" and the
// reasoning between its last "<think>" and its first "</think>", as the templates split them.
void AppendQwenReply(const ChatTemplate& t, std::string_view content, bool keep_reasoning,
                     bool last, std::string* out) {
  std::string_view reasoning;
  if (const size_t end = content.rfind("</think>"); end != content.npos) {
    reasoning = StripNewlines(content.substr(0, content.find("</think>")), false, true);
    if (const size_t open = reasoning.rfind("<think>"); open != reasoning.npos) {
      reasoning.remove_prefix(open + std::string_view("<think>").size());
    }
    reasoning = StripNewlines(reasoning, true, false);
    content = StripNewlines(content.substr(end + std::string_view("</think>").size()), true, false);
  }
  if (keep_reasoning && t.recent_reasoning && (last || !reasoning.empty())) {
    // The reasoning is stripped of line breaks already; a reply without "</think>" is not yet.
    Append(out, {"<|im_start|>assistant\n<think>\n", reasoning, "\n</think>\n\n",
                 StripNewlines(content, true, false), "<|im_end|>\n"});
  } else {
    Append(out, {"<|im_start|>assistant\n", content, "<|im_end|>\n"});
  }
}

// Generic ChatML; Qwen2 / Qwen2.5 add their default system turn when the first message is not a
// system message; Qwen3 and QwQ drop a past reply's reasoning (Qwen3 keeps it after the last user
// message) and QwQ and Qwen3's thinking models open the reply's <think>.
Result<std::string> RenderChatMl(const ChatTemplate& t, Messages messages, bool add_generation) {
  std::string out;
  if (!t.default_system.empty() && (messages.empty() || messages[0].role != ChatRole::kSystem)) {
    Append(&out, {"<|im_start|>system\n", t.default_system, "<|im_end|>\n"});
  }
  // Qwen3's last query: the last user message that is not a tool's response.
  size_t last_query = messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& c = messages[i].content;
    if (messages[i].role == ChatRole::kUser &&
        !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>"))) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == ChatRole::kAssistant && t.drop_reasoning) {
      AppendQwenReply(t, m.content, i > last_query, i + 1 == messages.size(), &out);
      continue;
    }
    Append(&out, {"<|im_start|>", ChatRoleName(m.role), "\n", m.content, "<|im_end|>\n"});
  }
  if (add_generation) {
    out += t.open_think ? "<|im_start|>assistant\n<think>\n" : "<|im_start|>assistant\n";
    if (t.thinking_switch && !t.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

// Llama 3.0: BOS, then every message as a header turn, contents trimmed. Llama 3.1+: BOS, a
// system turn always (the dated preamble, then the trimmed system message if the conversation
// starts with one), then the other messages the same way.
Result<std::string> RenderLlama3(const ChatTemplate& t, Messages messages, bool add_generation) {
  std::string out;
  if (t.today_date) {
    std::string_view system;
    if (!messages.empty() && messages[0].role == ChatRole::kSystem) {
      system = Strip(messages[0].content);
      messages = messages.subspan(1);
    }
    Append(&out, {t.bos_token,
                  "<|start_header_id|>system<|end_header_id|>\n\n"
                  "Cutting Knowledge Date: December 2023\nToday Date: ",
                  *t.today_date, "\n\n", system, "<|eot_id|>"});
  } else if (!messages.empty()) {
    out += t.bos_token;
  }
  for (const ChatMessage& m : messages) {
    Append(&out, {"<|start_header_id|>", ChatRoleName(m.role), "<|end_header_id|>\n\n",
                  Strip(m.content), "<|eot_id|>"});
  }
  if (add_generation) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

// Llama 2 chat: every user turn is "<s>[INST] ... [/INST]", the system message goes inside the
// first one between <<SYS>> tags, every assistant turn is " ... </s>"; contents stripped.
Result<std::string> RenderLlama2(const ChatTemplate& t, Messages messages, bool) {
  CACHET_ASSIGN_OR_RETURN(std::optional<std::string_view> system,
                          SplitSystemAndCheckTurns("llama2", &messages));
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    std::string content = m.content;
    if (i == 0 && system) {
      content = "<<SYS>>\n" + std::string(*system) + "\n<</SYS>>\n\n" + m.content;
    }
    if (m.role == ChatRole::kUser) {
      Append(&out, {t.bos_token, "[INST] ", Strip(content), " [/INST]"});
    } else {
      Append(&out, {" ", Strip(content), " ", t.eos_token});
    }
  }
  return out;
}

// Mistral / Mixtral instruct v0.1 (tokenizer v1): one BOS, " [INST] ... [/INST]" user turns with
// the system message before the first user message, " ...</s>" assistant turns; not stripped.
Result<std::string> RenderMistral(const ChatTemplate& t, Messages messages, bool) {
  CACHET_ASSIGN_OR_RETURN(std::optional<std::string_view> system,
                          SplitSystemAndCheckTurns("mistral", &messages));
  std::string out = t.bos_token;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == ChatRole::kUser && i == 0 && system) {
      Append(&out, {" [INST] ", *system, "\n\n", m.content, " [/INST]"});
    } else if (m.role == ChatRole::kUser) {
      Append(&out, {" [INST] ", m.content, " [/INST]"});
    } else {
      Append(&out, {" ", m.content, t.eos_token});
    }
  }
  return out;
}

// Mistral v0.3 (and Mixtral 8x22B, Mistral-Nemo with tight_inst): one BOS, "[INST] ...[/INST]"
// user turns, " " + the reply stripped + EOS; the system message goes into the *last* user turn,
// and only when the conversation ends with one (as the template's `loop.last` has it).
Result<std::string> RenderMistralV3(const ChatTemplate& t, Messages messages, bool) {
  CACHET_ASSIGN_OR_RETURN(std::optional<std::string_view> system,
                          SplitSystemAndCheckTurns("mistral-v3", &messages));
  const std::string_view open = t.tight_inst ? "[INST]" : "[INST] ";
  std::string out = t.bos_token;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == ChatRole::kUser && i + 1 == messages.size() && system) {
      Append(&out, {open, *system, "\n\n", m.content, "[/INST]"});
    } else if (m.role == ChatRole::kUser) {
      Append(&out, {open, m.content, "[/INST]"});
    } else if (t.tight_inst) {
      Append(&out, {m.content, t.eos_token});
    } else {
      Append(&out, {" ", Strip(m.content), t.eos_token});
    }
  }
  return out;
}

// Zephyr: "<|role|>\n" + content + EOS, each followed by a newline (the template's line break
// after each output expression survives trim_blocks); the generation prompt is "<|assistant|>\n".
Result<std::string> RenderZephyr(const ChatTemplate& t, Messages messages, bool add_generation) {
  std::string out;
  for (const ChatMessage& m : messages) {
    Append(&out, {"<|", ChatRoleName(m.role), "|>\n", m.content, t.eos_token, "\n"});
  }
  // The published template opens the assistant turn inside its loop, on the last message.
  if (add_generation && !messages.empty()) out += "<|assistant|>\n";
  return out;
}

// DeepSeek (R1 distills, V3): BOS and the last system message's text, then "<｜User｜>" + content
// and "<｜Assistant｜>" + content + "<｜end▁of▁sentence｜>" turns (the template's literal, the
// models' EOS text: the EOS text here, as EndOfTurn gives it); system messages render nothing
// where they stand. The R1 templates drop an assistant turn's reasoning (up to its last
// "</think>") and open the generation with "<think>\n".
Result<std::string> RenderDeepSeek(const ChatTemplate& t, Messages messages, bool add_generation) {
  std::string_view system;  // the last system message's
  for (const ChatMessage& m : messages) {
    if (m.role == ChatRole::kSystem) system = m.content;
  }
  std::string out = t.bos_token + std::string(system);
  for (const ChatMessage& m : messages) {
    std::string_view content = m.content;
    if (m.role == ChatRole::kUser) {
      Append(&out, {"<｜User｜>", content});
    } else if (m.role == ChatRole::kAssistant) {
      if (const size_t end = content.rfind("</think>"); t.drop_reasoning && end != content.npos) {
        content.remove_prefix(end + std::string_view("</think>").size());
      }
      Append(&out, {"<｜Assistant｜>", content, t.eos_token});
    }
  }
  if (add_generation) out += t.open_think ? "<｜Assistant｜><think>\n" : "<｜Assistant｜>";
  return out;
}

// --- The registry.

using RenderFn = Result<std::string> (*)(const ChatTemplate&, Messages, bool);

// Strings a template text must contain for a family to match. Empty entries are unused.
struct Signature {
  std::array<std::string_view, 3> all_of{};   // every one
  std::array<std::string_view, 3> any_of{};   // at least one, when any is given
  std::array<std::string_view, 3> none_of{};  // none (another family or an unsupported variant)
};

struct FamilyEntry {
  ChatFamily family;
  std::string_view name;
  Signature signature;  // plain has none: it is never detected, only the default or named
  RenderFn render;
  std::string_view bos, eos;              // the family's usual bos_token / eos_token texts
  bool eos_ends_turn;                     // an assistant turn ends with eos_token
  std::array<std::string_view, 3> stops;  // literal stop strings (besides eos_token)
};

constexpr FamilyEntry kFamilies[] = {
    {ChatFamily::kPlain, "plain", {}, RenderPlain, "", "", false, {"\nUser:", "\n\n"}},
    {ChatFamily::kChatMl,
     "chatml",
     {.all_of = {"<|im_start|>"}},
     RenderChatMl,
     "",
     "",
     false,
     {"<|im_end|>", "<|endoftext|>", "<|im_start|>"}},
    {ChatFamily::kLlama3,
     "llama3",
     {.all_of = {"<|start_header_id|>", "<|end_header_id|>"}},
     RenderLlama3,
     "<|begin_of_text|>",
     "<|eot_id|>",
     false,
     {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}},
    {ChatFamily::kLlama2,
     "llama2",
     {.all_of = {"[INST]", "<<SYS>>"}},
     RenderLlama2,
     "<s>",
     "</s>",
     true,
     {"[INST]"}},
    // Only v0.1's spacing (" [INST] ... [/INST]"): the tighter "[INST] ...[/INST]" of Mistral's
    // later tokenizers and [SYSTEM_PROMPT] templates differ, and are left unrecognised.
    {ChatFamily::kMistral,
     "mistral",
     {.all_of = {" [INST] ", " [/INST]"}, .none_of = {"<<SYS>>", "[SYSTEM_PROMPT]"}},
     RenderMistral,
     "<s>",
     "</s>",
     true,
     {"[INST]"}},
    // v0.3's and Nemo's: the system message in the last user turn; no " [/INST]" (v0.1), no
    // [SYSTEM_PROMPT] (later layouts).
    {ChatFamily::kMistralV3,
     "mistral-v3",
     {.all_of = {"[/INST]", "loop.last and system_message is defined"},
      .none_of = {"<<SYS>>", "[SYSTEM_PROMPT]", " [/INST]"}},
     RenderMistralV3,
     "<s>",
     "</s>",
     true,
     {"[INST]"}},
    // Phi-3 also writes <|user|>, but ends turns with <|end|>.
    {ChatFamily::kZephyr,
     "zephyr",
     {.all_of = {"<|user|>", "<|assistant|>"},
      .any_of = {"eos_token", "</s>"},
      .none_of = {"<|end|>"}},
     RenderZephyr,
     "<s>",
     "</s>",
     true,
     {"<|user|>"}},
    {ChatFamily::kDeepSeek,
     "deepseek",
     {.all_of = {"<｜User｜>", "<｜Assistant｜>"}},
     RenderDeepSeek,
     "<｜begin▁of▁sentence｜>",
     "<｜end▁of▁sentence｜>",
     true,
     {"<｜User｜>"}},
};

static_assert(std::size(kFamilies) == static_cast<size_t>(ChatFamily::kCount),
              "one kFamilies entry per ChatFamily");

constexpr bool EntriesComplete() {
  for (size_t i = 0; i < std::size(kFamilies); ++i) {
    const FamilyEntry& e = kFamilies[i];
    if (e.family != static_cast<ChatFamily>(i) || e.name.empty() || e.render == nullptr) {
      return false;
    }
  }
  return true;
}
static_assert(EntriesComplete(), "kFamilies: entries in ChatFamily order, each named and rendered");

const FamilyEntry& Entry(ChatFamily f) { return kFamilies[static_cast<size_t>(f)]; }

bool Matches(const Signature& s, std::string_view text) {
  if (s.all_of[0].empty()) return false;
  const auto has = [&](std::string_view needle) { return text.find(needle) != text.npos; };
  bool any = s.any_of[0].empty();
  for (std::string_view n : s.all_of) {
    if (!n.empty() && !has(n)) return false;
  }
  for (std::string_view n : s.any_of) any |= !n.empty() && has(n);
  for (std::string_view n : s.none_of) {
    if (!n.empty() && has(n)) return false;
  }
  return any;
}

ChatTemplate FamilyDefaults(ChatFamily f) {
  ChatTemplate t;
  t.family = f;
  t.bos_token = std::string(Entry(f).bos);
  t.eos_token = std::string(Entry(f).eos);
  // deepseek by name: the R1 distills' variant, the one CPU users run.
  t.drop_reasoning = t.open_think = f == ChatFamily::kDeepSeek;
  return t;
}

// The text of a Jinja string literal's body, escapes resolved; nullopt if `body` is not plain
// literal text (it holds a quote: an expression such as ' + messages[0]['content'] + ').
std::optional<std::string> JinjaLiteral(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c == '\'' || c == '"' || c == '{' || c == '}') return std::nullopt;
    if (c != '\\' || i + 1 == body.size()) {
      out += c;
      continue;
    }
    const char e = body[++i];
    out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
  }
  return out;
}

// chatml: the system text the template writes as a literal when the conversation has none
// ('<|im_start|>system\nYou are Qwen, ...<|im_end|>\n' in Qwen2.5's), else empty.
std::string DefaultSystem(std::string_view jinja) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  constexpr std::string_view kClose = "<|im_end|>";
  for (size_t at = jinja.find(kOpen); at != jinja.npos; at = jinja.find(kOpen, at + 1)) {
    size_t begin = at + kOpen.size();
    if (jinja.compare(begin, 2, "\\n") == 0) {
      begin += 2;
    } else if (jinja.compare(begin, 1, "\n") == 0) {
      begin += 1;
    } else {
      continue;
    }
    const size_t end = jinja.find(kClose, begin);
    if (end == jinja.npos) break;
    std::optional<std::string> text = JinjaLiteral(jinja.substr(begin, end - begin));
    if (text && !text->empty()) return *text;
  }
  return {};
}

// llama3.1+: the date of the preamble: today's (as strftime_now("%d %b %Y") gives it) when the
// template asks for it, else the literal it sets (Llama 3.1: "26 Jul 2024").
std::string TodayDate(std::string_view jinja) {
  if (jinja.find("strftime_now") != jinja.npos) {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[32];
    if (std::strftime(buf, sizeof buf, "%d %b %Y", &tm) > 0) return buf;
  }
  constexpr std::string_view kSet = "set date_string = ";
  if (size_t at = jinja.find(kSet); at != jinja.npos && at + kSet.size() < jinja.size()) {
    const size_t begin = at + kSet.size() + 1;
    const char quote = jinja[begin - 1];
    const size_t end = jinja.find(quote, begin);
    if ((quote == '"' || quote == '\'') && end != jinja.npos) {
      return std::string(jinja.substr(begin, end - begin));
    }
  }
  return "26 Jul 2024";
}

std::string Excerpt(std::string_view text) {
  std::string s(text.substr(0, 60));
  for (char& c : s) c = c == '\n' ? ' ' : c;
  return "\"" + s + (text.size() > 60 ? "...\"" : "\"");
}

}  // namespace

std::string_view ChatFamilyName(ChatFamily family) {
  return family < ChatFamily::kCount ? Entry(family).name : "?";
}

std::string ChatTemplateNames() {
  std::string names;
  // Detected families in table order, then plain (the default without a template).
  for (const FamilyEntry& e : kFamilies) {
    if (e.family != ChatFamily::kPlain) names += std::string(e.name) + ", ";
  }
  return names + std::string(Entry(ChatFamily::kPlain).name);
}

Result<ChatTemplate> ChatTemplateByName(std::string_view name) {
  for (const FamilyEntry& e : kFamilies) {
    if (e.name == name) return FamilyDefaults(e.family);
  }
  return InvalidArgument(std::string(kChatTemplateFlag) + ": unknown chat template \"" +
                         std::string(name) + "\"; known: " + ChatTemplateNames());
}

Status ApplyChatTemplateKwargs(std::string_view json_object, ChatTemplate* t) {
  const nlohmann::json j = nlohmann::json::parse(json_object, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("chat_template_kwargs: not a JSON object");
  }
  std::optional<bool> enable_thinking;  // applied once every key is read: an error changes nothing
  for (const auto& [key, value] : j.items()) {
    if (key != "enable_thinking") {
      return InvalidArgument("chat_template_kwargs: \"" + key +
                             "\" is not read (templates are rendered in C++: only enable_thinking "
                             "is)");
    }
    if (!value.is_boolean()) {
      return InvalidArgument("chat_template_kwargs.enable_thinking: must be true or false");
    }
    enable_thinking = value.get<bool>();
  }
  if (enable_thinking) t->enable_thinking = *enable_thinking;
  return OkStatus();
}

Result<ChatTemplate> DetectChatTemplate(std::string_view jinja) {
  std::vector<ChatFamily> found;
  for (const FamilyEntry& e : kFamilies) {
    if (Matches(e.signature, jinja)) found.push_back(e.family);
  }
  if (found.size() != 1) {
    std::string which;
    for (ChatFamily f : found) which += (which.empty() ? "" : " and ") + std::string(Entry(f).name);
    return InvalidArgument("the model's chat template " + Excerpt(jinja) +
                           (found.empty() ? " matches no known family" : " looks like " + which) +
                           "; choose one with " + std::string(kChatTemplateFlag) + " NAME (" +
                           ChatTemplateNames() + ")");
  }
  ChatTemplate t = FamilyDefaults(found[0]);
  if (t.family == ChatFamily::kChatMl) {
    t.default_system = DefaultSystem(jinja);
    t.drop_reasoning = jinja.find("split('</think>')") != jinja.npos;
    t.recent_reasoning = t.drop_reasoning && jinja.find("last_query_index") != jinja.npos;
    t.open_think = jinja.find("'<|im_start|>assistant\\n<think>\\n'") != jinja.npos;
    t.thinking_switch = jinja.find("enable_thinking is false") != jinja.npos;
  }
  if (t.family == ChatFamily::kMistralV3) {
    t.tight_inst =
        jinja.find("\"[INST]\" +") != jinja.npos || jinja.find("'[INST]' +") != jinja.npos;
  }
  if (t.family == ChatFamily::kDeepSeek) {
    t.drop_reasoning = jinja.find("split('</think>')") != jinja.npos;
    t.open_think = jinja.find("<｜Assistant｜><think>") != jinja.npos;
  }
  if (t.family == ChatFamily::kLlama3 && jinja.find("Cutting Knowledge Date") != jinja.npos) {
    t.today_date = TodayDate(jinja);
  }
  return t;
}

std::string_view ChatRoleName(ChatRole role) {
  switch (role) {
    case ChatRole::kSystem:
      return "system";
    case ChatRole::kUser:
      return "user";
    case ChatRole::kAssistant:
      return "assistant";
  }
  return "?";
}

Result<ChatRole> ParseChatRole(std::string_view role) {
  for (ChatRole r : {ChatRole::kSystem, ChatRole::kUser, ChatRole::kAssistant}) {
    if (ChatRoleName(r) == role) return r;
  }
  return InvalidArgument("unknown role \"" + std::string(role) +
                         "\"; known: system, user, assistant");
}

Result<std::string> RenderChat(const ChatTemplate& t, std::span<const ChatMessage> messages,
                               bool add_generation_prompt) {
  if (t.family >= ChatFamily::kCount) return InvalidArgument("RenderChat: not a chat family");
  return Entry(t.family).render(t, messages, add_generation_prompt);
}

std::string EndOfTurn(const ChatTemplate& t) {
  if (t.family >= ChatFamily::kCount) return {};
  const FamilyEntry& e = Entry(t.family);
  return e.eos_ends_turn ? t.eos_token : std::string(e.stops[0]);
}

std::vector<std::string> StopStrings(const ChatTemplate& t) {
  std::vector<std::string> stops;
  if (t.family >= ChatFamily::kCount) return stops;
  const FamilyEntry& e = Entry(t.family);
  if (e.eos_ends_turn && !t.eos_token.empty()) stops.push_back(t.eos_token);
  for (std::string_view s : e.stops) {
    if (!s.empty()) stops.emplace_back(s);
  }
  return stops;
}

}  // namespace cachet
