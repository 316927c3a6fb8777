// The cachet CLI as a user runs it: exit codes, what goes to stdout vs stderr, error messages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "test_util.h"

namespace cachet {
namespace {

using RunResult = testing::CliRun;
using testing::RunCachet;

TEST(Cli, ChatKeepsTheConversationCached) {
  RunResult r = RunCachet("chat -t 1 -n 8 --temp 0", "Hello there\nWhat is the pass key?\n");
  ASSERT_EQ(r.status, 0) << r.err;
  // One stats line per turn: the second turn prefills only its own text.
  size_t first = r.err.find(" tokens in context, ");
  ASSERT_NE(first, std::string::npos) << r.err;
  size_t second = r.err.find(" tokens in context, ", first + 1);
  ASSERT_NE(second, std::string::npos) << r.err;
  int ctx1 = 0, new1 = 0, ctx2 = 0, new2 = 0;
  ASSERT_EQ(std::sscanf(r.err.c_str() + r.err.rfind('[', first), "[%d tokens in context, %d new",
                        &ctx1, &new1),
            2);
  ASSERT_EQ(std::sscanf(r.err.c_str() + r.err.rfind('[', second), "[%d tokens in context, %d new",
                        &ctx2, &new2),
            2);
  EXPECT_GT(ctx2, ctx1);
  EXPECT_LT(new2, ctx2 - 8);  // not the whole conversation again
  EXPECT_FALSE(r.out.empty());
}

// The plain template's end of turn ("\nUser:") is never printed, not even the part of it that
// comes before the token completing it (kvtiny's second reply here writes "\nUser" then ":").
TEST(Cli, ChatPrintsNoPartOfTheStopString) {
  RunResult r = RunCachet("chat -t 1 -n 24 --temp 0",
                          "Hello there\nWhat is the pass key?\nTell me a story about a king.\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("User"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Beware that it beware of them."), std::string::npos) << r.out;
}

// A script with CRLF line ends chats as with LF ones (the \r is not part of the message).
TEST(Cli, ChatReadsCrlfLinesAsLf) {
  const RunResult lf = RunCachet("chat -t 1 -n 12 --temp 0", "Hello there\nTom had a cat.\n");
  const RunResult crlf = RunCachet("chat -t 1 -n 12 --temp 0", "Hello there\r\nTom had a cat.\r\n");
  ASSERT_EQ(lf.status, 0) << lf.err;
  ASSERT_EQ(crlf.status, 0) << crlf.err;
  EXPECT_FALSE(lf.out.empty());
  EXPECT_EQ(crlf.out, lf.out);
}

// --on-full: a 50-turn scripted chat in a 1024-token context runs to the end by shifting or
// pressing, where `error` (the default) stops with a clear error; each policy says when it acts,
// and the context never passes -c. (That the system prompt's fact is still answered after 50
// turns is ContextShift.APassKeySurvivesFiftyTurnsOfShiftingOrPressing, in the format kvtiny
// answers in; it does not answer questions in a chat template at all.)
TEST(Cli, ChatOnFullShiftsOrPressesAndRunsToTheEnd) {
  std::string script;
  for (int i = 0; i < 49; ++i) {
    script += "Tell me a story about the dog and the red ball, part " + std::to_string(i) + ".\n";
  }
  script += "What is the pass key?\n";
  const std::string chat =
      "chat -t 2 -c 1024 -n 24 --temp 0 --system \"The pass key is 52817. Remember it.\" ";
  RunResult error = RunCachet(chat, script);
  EXPECT_NE(error.status, 0);
  EXPECT_NE(error.err.find("context full"), std::string::npos) << error.err;
  for (const char* policy : {"shift", "press:keydiff:0.5", "press:streaming:0.5"}) {
    SCOPED_TRACE(policy);
    RunResult r = RunCachet(chat + "--on-full " + policy, script);
    ASSERT_EQ(r.status, 0) << r.err.substr(r.err.size() > 2000 ? r.err.size() - 2000 : 0);
    int turns = 0, most = 0;
    for (size_t at = r.err.find(" tokens in context, "); at != std::string::npos;
         at = r.err.find(" tokens in context, ", at + 1)) {
      int ctx = 0;
      ASSERT_EQ(std::sscanf(r.err.c_str() + r.err.rfind('[', at), "[%d tokens", &ctx), 1);
      most = std::max(most, ctx);
      ++turns;
    }
    EXPECT_EQ(turns, 50);
    EXPECT_LE(most, 1024);
    const bool shift = std::string(policy) == "shift";
    EXPECT_NE(r.err.find(shift ? "[context full: dropped" : "[context full: pressed"),
              std::string::npos);
  }
  RunResult bad = RunCachet(chat + "--on-full press:snapkv:0.5", "Hi\n");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("the scorer must read the cache alone"), std::string::npos) << bad.err;
  bad = RunCachet(chat + "--on-full press:keydiff:0.5 --ctk f16 --kv-cold q4_0", "Hi\n");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("--on-full press does not combine with --kv-cold"), std::string::npos)
      << bad.err;
  bad = RunCachet(chat + "--on-full drop", "Hi\n");
  EXPECT_NE(bad.err.find("is not error, shift or press:NAME:RATIO"), std::string::npos) << bad.err;
  // One message too long for the context on its own is not sent; the chat goes on.
  std::string huge;
  for (int i = 0; i < 300; ++i) huge += "word ";
  for (const char* policy : {"shift", "press:keydiff:0.5"}) {
    RunResult r = RunCachet(std::string("chat -t 1 -c 256 -n 8 --temp 0 --on-full ") + policy,
                            "Hello there\n" + huge + "\nTom had a red ball.\n");
    ASSERT_EQ(r.status, 0) << policy << ": " << r.err;
    EXPECT_NE(r.err.find("even with every earlier turn gone: not sent"), std::string::npos)
        << r.err;
    int turns = 0;
    for (size_t at = r.err.find(" tokens in context, "); at != std::string::npos;
         at = r.err.find(" tokens in context, ", at + 1)) {
      ++turns;
    }
    EXPECT_EQ(turns, 2) << policy;
  }
}

// Each turn is closed as the template renders it (chatml's "<|im_end|>\n" after the reply, which
// the reply's stop string leaves out of the session), and --on-full error stops before a reply
// that could not fit (it generated a cut reply, then failed a turn later).
TEST(Cli, ChatClosesEachTurnAndStopsBeforeAReplyThatCannotFit) {
  RunResult r = RunCachet(
      "chat -t 1 -n 6 --temp 0 --chat-template chatml --system S --verbose-prompt", "Hi\nBye\n");
  ASSERT_EQ(r.status, 0) << r.err;
  size_t closed = 0;
  for (size_t at = r.err.find("--- end of turn\n<|im_end|>\n"); at != std::string::npos;
       at = r.err.find("--- end of turn\n<|im_end|>\n", at + 1)) {
    ++closed;
  }
  EXPECT_EQ(closed, 2u) << r.err;
  std::string script;
  for (int i = 1; i <= 12; ++i)
    script += "Tell me about the kings of Israel number " + std::to_string(i) + "\n";
  r = RunCachet("chat -t 1 -n 16 --temp 0 -c 128", script);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("context full: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exceed -c 128"), std::string::npos) << r.err;
  int most = 0;
  for (size_t at = r.err.find(" tokens in context, "); at != std::string::npos;
       at = r.err.find(" tokens in context, ", at + 1)) {
    int ctx = 0;
    ASSERT_EQ(std::sscanf(r.err.c_str() + r.err.rfind('[', at), "[%d tokens", &ctx), 1);
    most = std::max(most, ctx);
  }
  EXPECT_GT(most, 0);
  EXPECT_LT(most, 128) << "a reply was cut at the context's end";
}

// Output that never reaches stdout (a full device) fails the command (it exited 0).
TEST(Cli, StdoutThatCannotBeWrittenIsAFailure) {
  ASSERT_TRUE(std::filesystem::is_character_file("/dev/full"));  // never created by the redirect
  for (const char* cmd : {"run -t 1 -p \"In the beginning\" -n 20 --temp 0 -q", "inspect"}) {
    RunResult r = RunCachet(std::string(cmd) + " > /dev/full");
    EXPECT_NE(r.status, 0) << cmd;
    EXPECT_NE(r.err.find("writing to stdout failed"), std::string::npos) << r.err;
  }
}

// More threads than CPUs would spin against each other between a step's parallel parts (-t 1000
// on 2 cores took over a minute for 4 tokens): the engine keeps one per CPU and says so.
TEST(Cli, MoreThreadsThanCpusAreCappedWithAWarning) {
  const std::string run = "run -p \"In the beginning\" -n 8 --temp 0 -q ";
  const RunResult many = RunCachet(run + "-t 1000");
  const RunResult own = RunCachet(run + "-t 0");
  ASSERT_EQ(many.status, 0) << many.err;
  ASSERT_EQ(own.status, 0) << own.err;
  EXPECT_EQ(many.out, own.out);
  const size_t at = many.err.find("-t 1000 is more threads than the CPUs this process may run on");
  ASSERT_NE(at, std::string::npos) << many.err;
  int cpus = 0;
  ASSERT_EQ(
      std::sscanf(many.err.c_str() + at,
                  "-t 1000 is more threads than the CPUs this process may run on (%d)", &cpus),
      1);
  EXPECT_GE(cpus, 1);
  EXPECT_LT(cpus, 1000);
  EXPECT_EQ(own.err.find("more threads than"), std::string::npos) << own.err;
  // One per CPU of the affinity mask, not of the machine: taskset (util-linux, in every Debian).
  const RunResult one = RunCachet("bench --ctx 64 --reps 1 --n-decode 1 --json --no-roofline -t 0",
                                  "", "taskset -c 0");
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(nlohmann::json::parse(one.out)["threads"], 1) << one.out;
  const RunResult two = RunCachet("run -p hi -n 2 -q -t 2", "", "taskset -c 0");
  EXPECT_NE(two.err.find("-t 2 is more threads than the CPUs this process may run on (1): using 1"),
            std::string::npos)
      << two.err;
}

// A context far past the model's: a warning, and no bookkeeping for it up front (the pool's
// filled 1.6 GB and took 5 s for -c 99999999 before the prompt started).
TEST(Cli, AHugeContextWarnsAndCostsNothingUpFront) {
  const RunResult huge = RunCachet("run -p \"In the beginning\" -n 8 --temp 0 -c 99999999");
  const RunResult own = RunCachet("run -p \"In the beginning\" -n 8 --temp 0");
  ASSERT_EQ(huge.status, 0) << huge.err;
  ASSERT_EQ(own.status, 0) << own.err;
  EXPECT_EQ(huge.out, own.out);
  EXPECT_NE(huge.err.find("-c 99999999 is past the context the model was trained for (4096 "
                          "tokens)"),
            std::string::npos)
      << huge.err;
  EXPECT_EQ(own.err.find("past the context"), std::string::npos) << own.err;
  const size_t at = huge.err.find("peak RSS ");
  ASSERT_NE(at, std::string::npos) << huge.err;
  EXPECT_LT(std::stod(huge.err.substr(at + 9)), 300) << huge.err;
}

// --response-format json_object: what comes out is one JSON object, closed where the text ends
// with EOS; the flag's bad value is named.
TEST(Cli, ResponseFormatJsonObjectWritesAnObject) {
  int closed = 0;
  for (int seed = 1; seed <= 6; ++seed) {
    const RunResult r = RunCachet("run -p \"Reply in JSON:\" -n 150 --temp 1.2 --seed " +
                                  std::to_string(seed) + " --response-format json_object");
    ASSERT_EQ(r.status, 0) << r.err;
    const std::string text = r.out.substr(0, r.out.size() - (r.out.ends_with('\n') ? 1 : 0));
    ASSERT_TRUE(text.starts_with("{")) << text;
    if (r.err.find("finish: stop") == std::string::npos) continue;
    ++closed;
    EXPECT_TRUE(nlohmann::json::accept(text) && nlohmann::json::parse(text).is_object()) << text;
  }
  EXPECT_GE(closed, 2);
  const RunResult bad = RunCachet("run -p hi --response-format yaml");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("'yaml' is not text or json_object"), std::string::npos) << bad.err;
}

// --chat-template-kwargs: read at start (a bad one stops chat and serve before the model loads),
// and ignored by a template that reads no such variable (kvtiny's plain one), as Jinja would.
TEST(Cli, ChatTemplateKwargsAreCheckedAtStart) {
  const RunResult chat =
      RunCachet("chat --chat-template-kwargs '{\"enable_thinking\": false}' -n 4 --temp 0", "Hi\n");
  EXPECT_EQ(chat.status, 0) << chat.err;
  for (const char* cmd : {"chat", "serve --port 0"}) {
    const RunResult bad =
        RunCachet(std::string(cmd) + " --chat-template-kwargs '{\"add_vision_id\": true}'");
    EXPECT_NE(bad.status, 0) << cmd;
    EXPECT_NE(bad.err.find("\"add_vision_id\" is not read"), std::string::npos) << bad.err;
  }
}

// A bench point whose cache cannot fit the machine is refused before its prompt starts (it ran
// until the OOM killer came). kvtiny's f32 KV holds 8256 bytes a token: twice the memory's worth.
TEST(Cli, BenchRefusesAContextLargerThanMemory) {
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  const long long ctx = static_cast<long long>(2 * ram / 8192);
  ASSERT_LT(ctx, 1LL << 31) << "more memory than this test can outgrow with an int --ctx";
  const RunResult r =
      RunCachet("bench --ctk f32 --ctv f32 --reps 1 --n-decode 1 --ctx " + std::to_string(ctx));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("GiB of KV cache (f32), more than this machine's"), std::string::npos)
      << r.err;
}

// bench reports where the weights sit: kvtiny's 31 MB of bf16 weights, all read by a step (the LM
// head is the tied embedding), resident, some in 2 MiB pages or none.
TEST(Cli, BenchReportsTheWeightsPages) {
  const std::string bench = "bench -t 1 --ctx 16 --reps 1 --n-decode 1 --no-roofline";
  const RunResult j = RunCachet(bench + " --json");
  ASSERT_EQ(j.status, 0) << j.err;
  const auto out = nlohmann::json::parse(j.out);
  const auto resident = out["weights_resident_bytes"].get<int64_t>();
  EXPECT_GE(resident, 25'000'000);
  EXPECT_LE(resident, 40'000'000);
  EXPECT_LE(out["weights_huge_page_bytes"].get<int64_t>(), resident);
  const RunResult text = RunCachet(bench);
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("% in 2 MiB pages"), std::string::npos) << text.out;
}

// --logit-bias as llama.cpp writes it: a ban changes the text, +100 repeats one token, a token
// past the vocabulary or a malformed bias is a clear error.
TEST(Cli, LogitBiasBansOrForcesATokenAndRefusesBadOnes) {
  const std::string run = "run -t 1 -p \"In the beginning\" -n 8 --temp 0 -q --ignore-eos --ids ";
  const RunResult plain = RunCachet(run);
  ASSERT_EQ(plain.status, 0) << plain.err;
  const auto first = nlohmann::json::parse(plain.out)["completion"][0].get<int>();
  const RunResult banned = RunCachet(run + "--logit-bias " + std::to_string(first) + "-inf");
  ASSERT_EQ(banned.status, 0) << banned.err;
  EXPECT_NE(nlohmann::json::parse(banned.out)["completion"][0].get<int>(), first);
  const RunResult forced = RunCachet(run + "--logit-bias 17+100 --logit-bias 5+3");
  ASSERT_EQ(forced.status, 0) << forced.err;
  EXPECT_EQ(nlohmann::json::parse(forced.out)["completion"],
            nlohmann::json(std::vector<int>(8, 17)));
  RunResult bad = RunCachet(run + "--logit-bias 8192+1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("token 8192 is past the model's vocabulary of 8192"), std::string::npos)
      << bad.err;
  for (const char* v : {"17", "17+101", "17*2", "-17+1", "17+-1", "17+inf"}) {
    bad = RunCachet(run + "--logit-bias=" + v);
    EXPECT_NE(bad.status, 0) << v;
    EXPECT_NE(bad.err.find("is not ID+BIAS or ID-BIAS"), std::string::npos) << v << ": " << bad.err;
  }
}

// cache save / info / run --cache: a compressed context saved once answers later prompts; the
// file's layout is adopted unless flags say otherwise, which is a clear error.
TEST(Cli, CacheSaveInfoAndRunFromIt) {
  testing::TempDir dir;
  std::string doc;
  for (int i = 0; i < 40; ++i)
    doc +=
        "The pass key of door " + std::to_string(i) + " is " + std::to_string(1000 + 7 * i) + ". ";
  const std::string text = dir.Write("doc.txt", doc), ckv = dir.path() + "/doc.ckv";
  RunResult r = RunCachet("cache save -t 1 -f " + text +
                          " --press snapkv --ratio 0.75 --ctk q4_0 --ctv q4_0 -o " + ckv);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("KV q4_0/q4_0"), std::string::npos) << r.err;
  r = RunCachet("cache info " + ckv);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("compression: snapkv ratio 0.750"), std::string::npos) << r.err;
  const std::string run =
      "run -t 1 --temp 0 -n 8 --cache " + ckv + " -p \" The pass key of door 3 is\"";
  RunResult a = RunCachet(run), b = RunCachet(run);
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_FALSE(a.out.empty());
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.err.find("cached tokens from " + ckv), std::string::npos) << a.err;
  r = RunCachet(run + " --ctk f32");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("(this engine: f32/q4_0)"), std::string::npos) << r.err;
  const std::string bytes = testing::ReadFile(ckv);
  const std::string bad = dir.Write("bad.ckv", bytes.substr(0, bytes.size() / 2));
  r = RunCachet("cache info " + bad);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("checksum mismatch"), std::string::npos) << r.err;
  r = RunCachet("run --cache " + ckv + " --press snapkv -p x");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("excludes"), std::string::npos) << r.err;
  // A saved cache is read whole: a tier beside it would be created and never used.
  r = RunCachet("run --cache " + ckv + " --disk-cache " + dir.path() + "/unused -p x");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--disk-cache excludes --cache"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/unused"));
  // An empty tier path or address is an error, not the tier switched off.
  for (const char* flag : {"--disk-cache", "--redis"}) {
    r = RunCachet(std::string("run -t 1 -n 1 -p x ") + flag + " \"\"");
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_NE(r.err.find(std::string(flag) + ": an empty value names nothing"), std::string::npos)
        << r.err;
  }
  // --ids after a cache: the question's ids and the completion's, as JSON (it printed text).
  r = RunCachet(run + " --ids");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["completion"].size(), 8u);
  EXPECT_FALSE(j["prompt"].empty());
  // No context given: an error, not a BOS-only cache.
  r = RunCachet("cache save -t 1 -o " + dir.path() + "/empty.ckv");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("-p TEXT or -f FILE"), std::string::npos) << r.err;
  // With a disk tier (it failed: "drop --no-prefix-cache") the context's pages go there too.
  r = RunCachet("cache save -t 1 -f " + text + " --disk-cache " + dir.path() + "/tier -o " +
                dir.path() + "/t.ckv");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(std::filesystem::is_empty(dir.path() + "/tier"));
  // cache info names the age at which pages go cold, and a .kvcal for what it is.
  r = RunCachet("cache save -t 1 -f " + text + " --ctk q8_0 --ctv q8_0 --kv-cold q4_0 " +
                "--kv-cold-after 64 -o " + dir.path() + "/aged.ckv");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("cold q4_0 after 64 tokens"), std::string::npos) << r.err;
  const std::string kvcal =
      dir.Write("x.kvcal", std::string("CKVCAL\n\0", 8) + std::string(64, 'x'));
  r = RunCachet("cache info " + kvcal);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("this is a KV calibration (.kvcal"), std::string::npos) << r.err;
}

TEST(Cli, CalibrateThenRunWithAPcaCache) {
  testing::TempDir dir;
  const std::string cal = dir.path() + "/kvtiny.kvcal";
  RunResult r = RunCachet("calibrate -t 1 --tokens 2048 --window 1024 --no-progress -o " + cal);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("wrote " + cal), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pydocs.txt (first quarter), 2048 tokens"), std::string::npos) << r.err;
  const std::string run = "run -t 1 --temp 0 -n 8 -p \"The pass key is 12345. The pass key is\"";
  r = RunCachet(run + " --ctk pca4 --ctv pca3 --kv-calibration " + cal);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  r = RunCachet(run + " --ctk pca4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--kv-calibration FILE"), std::string::npos) << r.err;
  const std::string bad = dir.Write("bad.kvcal", testing::ReadFile(cal).substr(0, 1000));
  r = RunCachet(run + " --ctk pca4 --kv-calibration " + bad);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  r = RunCachet("calibrate --ctk q4_0 -o " + cal);  // rows are measured in f32: no such flag
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--ctk"), std::string::npos) << r.err;
  // Too few rows for head_dim's principal axes (the pca codecs decoded NaN from such a file), or
  // windows too short to measure: refused, nothing written.
  const std::string small = dir.path() + "/small.kvcal";
  r = RunCachet("calibrate -t 1 --tokens 64 --no-progress -o " + small);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("at least 256"), std::string::npos) << r.err;
  r = RunCachet("calibrate -t 1 --tokens 512 --window 4 --no-progress -o " + small);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--window: Value 4 not in range 16"), std::string::npos) << r.err;
  EXPECT_FALSE(std::ifstream(small).good());
}

TEST(Cli, OversizePromptIsAClearError) {
  RunResult r = RunCachet("run -t 1 -c 16 -p \"" + std::string(200, 'a') + " b c d e f\"");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("context full"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("n_ctx 16"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(Cli, RunReusesChunkFilesWithEachBlend) {
  testing::TempDir dir;
  const std::string a = dir.Write(
      "a.txt", "Once upon a time, there was a little girl named Lily. She had a red ball.\n\n");
  const std::string b =
      dir.Write("b.txt", "The pass key is 52817. Remember it. 52817 is the pass key.\n\n");
  for (const std::string blend : {"none", "epic:4", "cacheblend:0.3"}) {
    SCOPED_TRACE(blend);
    RunResult r =
        RunCachet("run -t 1 --temp 0 -n 6 --chunk-file " + a + " --chunk-file " + b + " --blend " +
                  blend + " -p \"Question: What is the pass key?\nAnswer:\"");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(r.out.starts_with(" 52817")) << r.out;
    EXPECT_NE(r.err.find("2 computed on their own"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("(" + blend + ")"), std::string::npos) << r.err;
  }
  // Chunks between separators of the prompt itself.
  RunResult r = RunCachet(
      "run -t 1 --temp 0 -n 4 --chunk-sep @@ -p \"Notes:\n@@The pass key is 52817. Remember "
      "it.\n\n@@Question: What is the pass key?\nAnswer:\"");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("1 computed on their own"), std::string::npos) << r.err;
  r = RunCachet("run --chunk-file " + a + " --blend cacheblend:7 -p x");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cacheblend:R takes a fraction in [0, 1]"), std::string::npos) << r.err;
  r = RunCachet("run --chunk-file " + a + " --press snapkv -p x");
  EXPECT_NE(r.status, 0);
  r = RunCachet("run --help");
  EXPECT_NE(r.out.find("--chunk-file"), std::string::npos);
  EXPECT_NE(r.out.find("--blend"), std::string::npos);
}

TEST(Cli, FullKvPoolIsAClearError) {
  testing::TempDir dir;
  const std::string prompt = dir.Write(
      "p.txt", testing::ReadFile(std::string(CACHET_SOURCE_DIR) + "/data/haystack/bible.txt")
                   .substr(0, 12000));
  RunResult r = RunCachet("run -t 1 -n 4 --kv-mem 1 -f " + prompt);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("RESOURCE_EXHAUSTED: KV pool exhausted"), std::string::npos) << r.err;
}

TEST(Cli, BadModelDirNamesIt) {
  testing::TempDir dir;
  RunResult r = RunCachet("run -m " + dir.path() + " -p hi");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find(dir.path() + "/config.json"), std::string::npos) << r.err;
  r = RunCachet("runn -p hi");  // a mistyped command is named (it was "A subcommand is required")
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("unknown command 'runn' (commands: run, chat,"), std::string::npos) << r.err;
}

TEST(Cli, InspectAndKvStats) {
  RunResult r = RunCachet("inspect");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("architecture     llama"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("f32 8192"), std::string::npos) << r.out;
  // What a page holds besides: bench's measured 8256 = 8192 + 64.
  EXPECT_NE(r.out.find("position: 64 more"), std::string::npos) << r.out;
  // kvtiny's safetensors: 57 bf16 matrices (the tied embedding, 8 layers x 7).
  EXPECT_NE(r.out.find("weights          bf16 x 57 (30.0 MiB)"), std::string::npos) << r.out;
  r = RunCachet("inspect --tensors");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("  blk.0.attn_v       bf16"), std::string::npos) << r.out;
  r = RunCachet("run -t 1 -n 4 --temp 0 --kv-stats -p \"In the beginning\"");
  ASSERT_EQ(r.status, 0) << r.err;
  // f16 pages unless told otherwise, as llama.cpp's cache; eval's reference stays f32.
  EXPECT_NE(r.err.find("[kv] codec f16"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("prefix cache:"), std::string::npos) << r.err;
  r = RunCachet("run -t 1 -n 4 --temp 0 --kv-stats --ctk f32 --ctv f32 -p \"In the beginning\"");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("[kv] codec f32"), std::string::npos) << r.err;
}

TEST(Cli, BenchAgentsShareOneContext) {
  RunResult r =
      RunCachet("bench -t 1 --agents 4 --ctx 512 --n-decode 4 --json --press knorm --ratio 0.5");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["agents"], 4);
  EXPECT_NEAR(j["independent"]["kv_bytes_vs_one_agent"].get<double>(), 4.0, 0.2);
  // Forks hold the context's pages once: each agent adds its instruction and its tokens only.
  EXPECT_LT(j["shared"]["kv_bytes_vs_one_agent"].get<double>(), 1.3);
  EXPECT_LT(j["shared_pressed"]["kv_bytes"].get<double>(), j["shared"]["kv_bytes"].get<double>());
  EXPECT_LT(j["shared"]["ttft_all_ms"].get<double>(),
            j["independent"]["ttft_all_ms"].get<double>());
  r = RunCachet("bench -t 1 --agents 2 --ctx 256 --n-decode 2");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("vs one agent"), std::string::npos) << r.out;
}

TEST(Cli, BenchComparesCacheTypesRepByRep) {
  RunResult r = RunCachet(
      "bench -t 1 --ctx 40 --reps 2 --n-decode 2 --no-roofline --json --ctk f16 --ctv f16 "
      "--vs q4_0,q8_0:q4_0");
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* key : {"\"q4_0\":{\"40\":{", "\"q8_0:q4_0\":{\"40\":{", "\"decode_ratio\":"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key << " in " << r.out;
  }
  r = RunCachet("bench -t 1 --ctx 40 --reps 1 --n-decode 2 --no-roofline --vs q5_9");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("q5_9"), std::string::npos) << r.err;
  // --prefix-hit without 0: the uncached run is measured all the same (the ratios were 0 or NaN),
  // and a hit of 1 still computes the last token.
  r = RunCachet("bench -t 1 --ctx 64 --reps 1 --prefix-hit 0.5,1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ttft_ratio"]["0"].get<double>(), 1.0);
  for (const char* f : {"0.5", "1"}) {
    const double ratio = j["ttft_ratio"][f].get<double>();
    EXPECT_TRUE(ratio > 0 && ratio < 2) << f << ": " << ratio;
  }
  EXPECT_EQ(j["cached_tokens"]["1"].get<int>(), 48);  // 63 tokens, rounded down to pages
}

TEST(Cli, PressesRunAndBadSpecsAreErrors) {
  testing::TempDir dir;
  const std::string prompt = dir.Write(
      "p.txt", testing::ReadFile(std::string(CACHET_SOURCE_DIR) + "/data/haystack/bible.txt")
                   .substr(0, 3000));
  RunResult r = RunCachet(
      "run -t 1 -n 4 --temp 0 --kv-stats --no-prefix-cache --press snapkv+max "
      "--ratio 0.75 --demote q4_0 -f " +
      prompt);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("cold q4_0"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[cachet] press: KV "), std::string::npos) << r.err;
  r = RunCachet("run -t 1 -n 2 --np 2 --press h2o --budget 64 --decode-every 1 -f " + prompt);
  ASSERT_EQ(r.status, 0) << r.err;
  // What the press cost is printed with each completion, the probe pass apart.
  r = RunCachet("run -t 1 -n 2 --press kvzip --ratio 0.5 -f " + prompt);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("(probe pass "), std::string::npos) << r.err;
  r = RunCachet("run -t 1 -n 2 --press snapkv+sideways -p hi");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("unknown press modifier 'sideways'"), std::string::npos) << r.err;
  // Nonsense that ran silently: two modifiers of one kind, press flags without a press, an empty
  // press, Quest's page count for another press.
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--press snapkv+ada+pyramid", "gives two per-head allocators ('ada' and 'pyramid')"},
           {"--press snapkv+max+mean", "gives two cross-layer selections"},
           {"--press pyramidkv+ada", "gives two per-head allocators"},
           {"--ratio 0.5", "--ratio requires --press"},
           {"--sinks 4", "--sinks requires --press"},
           {"--press \"\"", "--press: an empty value names nothing"},
           {"--press snapkv --quest-pages 2", "sets the pages --press quest reads"}}) {
    r = RunCachet("run -t 1 -n 2 -p hi " + args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << ": " << r.err;
  }
  r = RunCachet("run -t 1 -n 2 --press snapkv --demote kivi2 -f " + prompt);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cold codec must be row-wise"), std::string::npos) << r.err;
  // --share-layers is the +max modifier as a flag: the same greedy token ids.
  const std::string greedy =
      "run -t 1 -n 8 --temp 0 --ids --no-prefix-cache --ratio 0.9 -f " + prompt;
  const RunResult by_flag = RunCachet(greedy + " --press snapkv --share-layers max");
  const RunResult by_spec = RunCachet(greedy + " --press snapkv+max");
  ASSERT_EQ(by_flag.status, 0) << by_flag.err;
  ASSERT_EQ(by_spec.status, 0) << by_spec.err;
  EXPECT_NE(by_flag.out.find("\"completion\":["), std::string::npos) << by_flag.out;
  EXPECT_EQ(by_flag.out, by_spec.out);
  r = RunCachet("run -t 1 -n 2 --press snapkv --share-layers sideways -p hi");
  EXPECT_NE(r.status, 0);
  r = RunCachet("run -t 1 -n 4 --temp 0 --press quest --quest-pages 2 -f " + prompt);
  ASSERT_EQ(r.status, 0) << r.err;
}

TEST(Cli, ParallelSamplingPrintsEachCompletion) {
  RunResult r = RunCachet("run -t 1 -n 6 --np 3 --temp 1 -p \"The quick brown fox\"");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("completion 3 of 3"), std::string::npos) << r.err;
  int lines = 0;
  for (char ch : r.out) lines += ch == '\n';
  EXPECT_GE(lines, 3);
}

TEST(Cli, ConvertSyntheticAndLogitsOf) {
  testing::TempDir dir;
  const std::string shape = dir.Write("tiny.json", R"({"model_type": "llama",
      "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
      "intermediate_size": 128, "vocab_size": 400})");
  const std::string model = dir.path() + "/tiny.gguf";
  RunResult r = RunCachet("convert --synthetic " + shape + " " + model + " --type q8_0 -t 1");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("wrote " + model), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;

  const std::string ids = dir.Write("ids.json", "[5, 77, 300, 9, 120]");
  r = RunCachet("run -t 1 -m " + model + " --logits-of " + ids);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["n"], 5);
  ASSERT_EQ(j["argmax"].size(), 5u);
  ASSERT_EQ(j["margin"].size(), 5u);
  for (const auto& m : j["margin"]) EXPECT_GE(m.get<double>(), 0.0);
  r = RunCachet("run -t 1 -m " + model + " --logits-of " + dir.Write("bad.json", "{}"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("bad.json: not a non-empty JSON array of token ids"), std::string::npos)
      << r.err;
  // 2^32 + 5 once wrapped to 5; ids past the vocabulary and beyond -c are named.
  r = RunCachet("run -t 1 -m " + model + " --logits-of " +
                dir.Write("big.json", "[1, 4294967301]"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("[1] = 4294967301 is not a token id (0 to 399)"), std::string::npos)
      << r.err;
  r = RunCachet("run -t 1 -c 4 -m " + model + " --logits-of " + ids);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("5 tokens do not fit in the context of 4 (-c)"), std::string::npos) << r.err;
  // Integer flags name the bound they missed.
  r = RunCachet("run -t 1 -m " + model + " --ubatch 0 -p x");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--ubatch: value 0 must be > 0"), std::string::npos) << r.err;
  r = RunCachet("run -t 1 -m " + model + " --ubatch lots -p x");
  EXPECT_NE(r.err.find("--ubatch: value 'lots' is not a number"), std::string::npos) << r.err;
  // Seeds: -1 draws one (llama.cpp's), anything else outside 0 .. 2^64 - 1 is an error (CLI11
  // saturated it); windows and counts below their meaning are errors.
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--seed 99999999999999999999", "is not a seed"},
           {"--seed -2", "is not a seed"},
           {"--repeat-last-n -5", "--repeat-last-n: value -5 must be >= -1"}}) {
    r = RunCachet("run -t 1 -n 1 -p x -m " + model + " " + args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << ": " << r.err;
  }
  r = RunCachet("run -t 1 -n 1 -p x -m " + model + " --tier-zstd");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--tier-zstd is ignored without --disk-cache or --redis"), std::string::npos)
      << r.err;
  // Flags the layout ignores say so.
  const std::string f32 = " --ctk f32 --ctv f32";
  r = RunCachet("run -t 1 -m " + model + " -n 1 -p x --kv-cold q4_0" + f32);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--kv-cold q4_0 is ignored in the plain f32 layout"), std::string::npos)
      << r.err;
  r = RunCachet("run -t 1 -m " + model + " -n 1 -p x --kv-window 16 --kv-sinks 4" + f32);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--kv-window 16 is ignored in the plain f32 layout"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--kv-sinks 4 is ignored in the plain f32 layout"), std::string::npos)
      << r.err;
  r = RunCachet("run -t 1 -m " + model + " -n 1 -p x --kv-window 16");
  EXPECT_EQ(r.err.find("is ignored"), std::string::npos) << r.err;

  // Written to a temporary file, then renamed: nothing else is left beside the output.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  r = RunCachet("convert --synthetic " + shape + " " + dir.path() + "/no/such/dir.gguf");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cannot create"), std::string::npos) << r.err;

  r = RunCachet("convert --synthetic no-such-shape " + model);
  EXPECT_EQ(r.status >> 8, 1);
  EXPECT_NE(r.err.find("unknown shape 'no-such-shape'"), std::string::npos) << r.err;
  r = RunCachet("convert --synthetic " + shape + " somedir " + model);
  EXPECT_EQ(r.status >> 8, 2);
  EXPECT_NE(r.err.find("--synthetic takes OUT.gguf only"), std::string::npos) << r.err;
  r = RunCachet("convert " + model);
  EXPECT_EQ(r.status >> 8, 2);
  EXPECT_NE(r.err.find("needs DIR OUT.gguf"), std::string::npos) << r.err;
  // An unknown type names every one there is; nothing is written.
  r = RunCachet("convert --synthetic " + shape + " " + dir.path() + "/q3.gguf --type q3_k_s");
  EXPECT_EQ(r.status >> 8, 2);
  EXPECT_NE(r.err.find("unknown --type 'q3_k_s' (one of: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, "
                       "q4_1, q4_k, q5_k, q6_k, q4_k_m, q5_k_m, q3_k_m, q2_k)"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/q3.gguf"));
}

}  // namespace
}  // namespace cachet
