// libFuzzer target for the chat templates: the input is both a template text to recognise and a
// conversation to render with every family. Checks, besides ASan/UBSan: each role name parses
// back, and a conversation rendered without the generation prompt is a prefix of the same one
// rendered with it (what `cachet chat` relies on to prefill only new text); a violation aborts.
// Build and run: scripts/fuzz.sh [seconds] chat_template.
//
// Input: byte 0 picks options (bit 0: a default system turn for chatml, bit 1: a Llama 3.1
// dated system turn, bits 2-4: drop_reasoning, recent_reasoning, open_think), then messages
// separated by '\0', each a role byte (mod 3) and its content.
//
// With CACHET_FUZZ_SEED_DIR set, LLVMFuzzerInitialize first writes seed inputs there.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/chat_template.h"

namespace {

void WriteSeeds(const std::string& dir) {
  using namespace std::string_literals;
  const std::string seeds[] = {
      "\x00\x00You are helpful.\0\x01Hi\0\x02Hello!"s,
      "\x03\x01 What is 2+2? \0\x02 4 </s>\0\x01<|im_end|>[INST]"s,
      "\x1c\x01Hi\0\x02<think>\nr\n</think>\n\nA</think>B\0\x02<think>x"s,
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"s,
      "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }} <<SYS>>"s,
  };
  int i = 0;
  for (const std::string& s : seeds) {
    std::ofstream(dir + "/seed-" + std::to_string(i++), std::ios::binary) << s;
  }
}

[[noreturn]] void Fail(const char* what, const std::string& a, const std::string& b) {
  std::fprintf(stderr, "chat_template_fuzz: %s\n--- a\n%s\n--- b\n%s\n", what, a.c_str(),
               b.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("CACHET_FUZZ_SEED_DIR")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cachet;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)DetectChatTemplate(text);
  (void)ParseChatRole(text);
  if (size == 0) return 0;

  std::vector<ChatMessage> messages;
  for (std::string_view rest = text.substr(1); !rest.empty();) {
    const size_t end = std::min(rest.find('\0'), rest.size());
    const std::string_view m = rest.substr(0, end);
    rest.remove_prefix(end == rest.size() ? end : end + 1);
    if (m.empty()) continue;
    messages.push_back(
        {static_cast<ChatRole>(static_cast<uint8_t>(m[0]) % 3), std::string(m.substr(1))});
  }
  for (const ChatMessage& m : messages) {
    Result<ChatRole> back = ParseChatRole(ChatRoleName(m.role));
    if (!back.ok() || back.value() != m.role) Fail("role does not parse back", "", "");
  }
  for (int f = 0; f < static_cast<int>(ChatFamily::kCount); ++f) {
    Result<ChatTemplate> t = ChatTemplateByName(ChatFamilyName(static_cast<ChatFamily>(f)));
    if (!t.ok()) Fail("a family's own name is unknown", t.status().message(), "");
    ChatTemplate tmpl = t.value();
    if (data[0] & 1) tmpl.default_system = "Default system.";
    if (data[0] & 2) tmpl.today_date = "26 Jul 2024";
    tmpl.drop_reasoning |= (data[0] & 4) != 0;  // the reasoning variants (Qwen3, QwQ, R1)
    tmpl.recent_reasoning |= (data[0] & 8) != 0;
    tmpl.open_think |= (data[0] & 16) != 0;
    (void)StopStrings(tmpl);
    Result<std::string> without = RenderChat(tmpl, messages, false);
    Result<std::string> with = RenderChat(tmpl, messages, true);
    if (without.ok() != with.ok()) Fail("generation prompt changes validity", "", "");
    if (without.ok() && with.value().compare(0, without.value().size(), without.value()) != 0) {
      Fail("render without the generation prompt is not a prefix", without.value(), with.value());
    }
  }
  return 0;
}
