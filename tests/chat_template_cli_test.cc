// `cachet chat` with the chat templates: the transcript kvtiny continues, the flag, turns that
// close with the template's end of turn and append only their own text, startup errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "chat_template_texts.h"
#include "test_util.h"

namespace cachet {
namespace {

using namespace chat_templates;  // NOLINT: the templates' texts

using testing::CliRun;

CliRun Cachet(const std::string& args, const std::string& stdin_text) {
  return testing::RunCachet(args, stdin_text);
}

// kvtiny's files in dir, its tokenizer_config.json with this chat template.
void KvtinyWithTemplate(const testing::TempDir& dir, std::string_view jinja) {
  for (const auto& e : std::filesystem::directory_iterator(testing::ModelDir())) {
    if (e.path().filename() != "tokenizer_config.json") {
      std::filesystem::create_symlink(e.path(), dir.path() + "/" + e.path().filename().string());
    }
  }
  nlohmann::json cfg =
      nlohmann::json::parse(testing::ReadFile(testing::ModelDir() + "/tokenizer_config.json"));
  cfg["chat_template"] = std::string(jinja);
  dir.Write("tokenizer_config.json", cfg.dump());
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
  KvtinyWithTemplate(dir, kQwen3);
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
  KvtinyWithTemplate(dir, kGemma);
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
