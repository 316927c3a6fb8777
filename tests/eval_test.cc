// cachet eval: task generators (formats of docs/EVAL.md, determinism, lengths), methods, the KL
// metric (zero against itself, nonzero when perturbed), a full-cache baseline on kvtiny, reports
// and the CLI.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "cachet/engine.h"
#include "cachet/eval/harness.h"
#include "cachet/eval/method.h"
#include "cachet/eval/report.h"
#include "cachet/eval/tasks.h"
#include "cachet/tokenizer.h"
#include "eval/fidelity.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet::eval {
namespace {

using cachet::testing::ModelDir;
using cachet::testing::ReadFile;
using cachet::testing::TempDir;

std::string HaystackDir() { return std::string(CACHET_SOURCE_DIR) + "/data/haystack"; }

const Tokenizer& Tok() {
  static const std::unique_ptr<Tokenizer> tok = std::move(Tokenizer::Load(ModelDir())).value();
  return *tok;
}

TaskGenerator& Gen() {
  static TaskGenerator gen(Tok(), std::move(Haystack::Load(HaystackDir())).value());
  return gen;
}

TaskSample Sample(TaskKind kind, int length, int index, int needles = 1, double depth = -1,
                  uint64_t seed = 1234) {
  auto s = Gen().Generate({kind, length, needles, depth}, seed, index);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

int Count(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// A needle sits between paragraphs: at the start of the context or after a blank line.
void ExpectBetweenParagraphs(const std::string& context, const std::string& needle) {
  const size_t at = context.find(needle);
  ASSERT_NE(at, std::string::npos) << needle;
  EXPECT_TRUE(at == 0 || context.compare(at - 2, 2, "\n\n") == 0) << needle;
}

std::unique_ptr<Engine> MakeEngine(int n_ctx = 0) {
  EngineOptions o;
  o.model_dir = ModelDir();
  o.threads = 2;
  o.n_ctx = n_ctx;
  o.prefix_cache = false;  // as cachet eval runs it
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

// ---------------------------------------------------------------- determinism

TEST(EvalRandom, UniformIntIsFixedAndInRange) {
  std::mt19937_64 rng(42);
  std::vector<uint64_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(UniformInt(rng, 10000, 99999));
  // std::mt19937_64 is specified bit for bit; so is UniformInt: these hold on every platform.
  EXPECT_EQ(got, (std::vector<uint64_t>{30406, 64824, 41450, 65662, 39381, 28428}));
  for (int i = 0; i < 10000; ++i) {
    const uint64_t v = UniformInt(rng, 3, 7);
    ASSERT_GE(v, 3u);
    ASSERT_LE(v, 7u);
  }
  EXPECT_EQ(UniformInt(rng, 5, 5), 5u);
}

TEST(EvalTasks, FixedSeedGivesFixedPrompts) {
  // Hashes of the prompt bytes (FNV-1a 64): they change only if the generator, the haystack
  // slice or the tokenizer changes. Two calls give the same prompt.
  struct Case {
    TaskKind kind;
    int needles;
    double depth;
    uint64_t hash;
  };
  const Case cases[] = {
      {TaskKind::kPasskey, 1, -1, 0x2c35ac87ffbc49bdull},
      {TaskKind::kPasskey, 1, 0.5, 0x2569c9f0eda8f315ull},
      {TaskKind::kNiah, 1, -1, 0x8c255c10660f224bull},
      {TaskKind::kNiah, 2, -1, 0x49fdd9cc377e5f26ull},
      {TaskKind::kNiah, 4, -1, 0x53f9e244787275b3ull},
      {TaskKind::kNiah, 8, -1, 0x5ee633c3790bf380ull},
      {TaskKind::kKv, 1, -1, 0x915807297f4d7941ull},
      {TaskKind::kVt, 1, -1, 0xe76c3d8f05e5970bull},
  };
  for (const Case& c : cases) {
    const TaskSample a = Sample(c.kind, 1024, 3, c.needles, c.depth);
    const TaskSample b = Sample(c.kind, 1024, 3, c.needles, c.depth);
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_EQ(Fnv1a64(a.prompt), c.hash) << a.id << " " << std::hex << Fnv1a64(a.prompt);
  }
  // Another seed or index gives another prompt.
  EXPECT_NE(Sample(TaskKind::kPasskey, 1024, 0).prompt, Sample(TaskKind::kPasskey, 1024, 1).prompt);
  EXPECT_NE(Sample(TaskKind::kPasskey, 1024, 0, 1, -1, 1).prompt,
            Sample(TaskKind::kPasskey, 1024, 0, 1, -1, 2).prompt);
}

TEST(EvalTasks, PromptLengthWithinTwoPercent) {
  for (int length : {512, 1024, 2048, 4096}) {
    for (TaskKind kind : {TaskKind::kPasskey, TaskKind::kNiah, TaskKind::kKv, TaskKind::kVt}) {
      for (int i = 0; i < 3; ++i) {
        const int needles = kind == TaskKind::kNiah ? 1 << (2 * i) : 1;  // 1, 4, 16
        const TaskSample s = Sample(kind, length, i, needles);
        // Tokens measured with the model's tokenizer, BOS included.
        ASSERT_EQ(s.ids, Tok().EncodePrompt(s.prompt)) << s.id;
        EXPECT_LE(std::abs(int(s.ids.size()) - length), length / 50) << s.id << " " << s.ids.size();
      }
    }
  }
}

TEST(EvalTasks, PasskeyFormat) {
  for (int i = 0; i < 5; ++i) {
    const TaskSample s = Sample(TaskKind::kPasskey, 512, i);
    ASSERT_TRUE(std::regex_match(s.answer, std::regex("[1-9][0-9]{4}"))) << s.answer;
    const std::string needle =
        "The pass key is " + s.answer + ". Remember it. " + s.answer + " is the pass key.\n\n";
    ASSERT_EQ(s.needles, std::vector<std::string>{needle});
    EXPECT_EQ(Count(s.context, needle), 1);
    EXPECT_EQ(Count(s.context, "pass key"), 2);
    ExpectBetweenParagraphs(s.context, needle);
    EXPECT_EQ(s.question, "Question: What is the pass key?\nAnswer:");
    EXPECT_EQ(s.prompt, s.context + s.question);
    EXPECT_EQ(s.context.substr(s.context.size() - 2), "\n\n");
    EXPECT_EQ(s.context.find("\n\n\n"), std::string::npos);  // paragraphs are closed once
  }
}

TEST(EvalTasks, NiahFormatForEveryNeedleCount) {
  for (int needles : {1, 2, 4, 8}) {
    const TaskSample s = Sample(TaskKind::kNiah, 1024, needles, needles);
    ASSERT_EQ(int(s.needles.size()), needles);
    EXPECT_EQ(Count(s.context, "The special magic number for "), needles);
    ASSERT_TRUE(std::regex_match(s.answer, std::regex("[1-9][0-9]{6}"))) << s.answer;
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.question, q,
        std::regex("Question: What is the special magic number for ([a-z']+-[a-z']+)\\?\nAnswer:")))
        << s.question;
    std::set<std::string> keys;
    size_t last = 0;
    for (const std::string& n : s.needles) {
      std::smatch m;
      ASSERT_TRUE(std::regex_match(
          n, m, std::regex("The special magic number for ([^ ]+) is ([1-9][0-9]{6})\\.\n\n")))
          << n;
      keys.insert(m[1]);
      EXPECT_EQ(Count(s.context, n), 1);
      ExpectBetweenParagraphs(s.context, n);
      const size_t at = s.context.find(n);
      EXPECT_GE(at, last);  // in the order they were made
      last = at;
      if (m[1] == q[1].str()) {
        EXPECT_EQ(m[2], s.answer);
      }
    }
    EXPECT_EQ(int(keys.size()), needles);  // keys differ
    EXPECT_TRUE(keys.count(q[1]));
  }
}

TEST(EvalTasks, KvFormat) {
  const TaskSample s = Sample(TaskKind::kKv, 1024, 0);
  ASSERT_TRUE(std::regex_match(s.answer, std::regex("[0-9a-f]{8}"))) << s.answer;
  EXPECT_EQ(s.context.rfind("Below is a table of keys and their values.\n\n", 0), 0u);
  EXPECT_EQ(s.context.substr(s.context.size() - 3), "\n\n\n");  // last line, then a blank line
  std::smatch q;
  ASSERT_TRUE(std::regex_match(
      s.question, q, std::regex("Question: What is the value of ([0-9a-f]{8})\\?\nAnswer:")));
  EXPECT_EQ(Count(s.context, q[1].str() + " => " + s.answer + "\n"), 1);
  const std::string table = s.context.substr(44, s.context.size() - 44 - 2);
  EXPECT_TRUE(std::regex_match(table, std::regex("([0-9a-f]{8} => [0-9a-f]{8}\n)+")));
}

TEST(EvalTasks, VtChainIsCorrect) {
  for (int i = 0; i < 6; ++i) {
    const TaskSample s = Sample(TaskKind::kVt, 1024, i);
    std::smatch q;
    ASSERT_TRUE(std::regex_match(
        s.question, q,
        std::regex(
            "Question: Which variables are assigned the value ([1-9][0-9]{4})\\?\nAnswer:")));
    const std::string value = q[1];
    ASSERT_TRUE(std::regex_match(s.answer, std::regex("[A-Z]{5}( [A-Z]{5}){1,3}"))) << s.answer;
    // Follow the chain through the needles (in context order) and find one distractor.
    std::vector<std::string> chain;
    int distractors = 0;
    for (const std::string& n : s.needles) {
      ExpectBetweenParagraphs(s.context, n);
      std::smatch m;
      if (std::regex_match(n, m, std::regex("VAR ([A-Z]{5}) = ([1-9][0-9]{4})\\.\n\n"))) {
        if (m[2] == value) {
          EXPECT_TRUE(chain.empty());
          chain.push_back(m[1]);
        } else {
          ++distractors;
        }
      } else {
        ASSERT_TRUE(std::regex_match(n, m, std::regex("VAR ([A-Z]{5}) = VAR ([A-Z]{5})\\.\n\n")))
            << n;
        ASSERT_FALSE(chain.empty());
        EXPECT_EQ(m[2], chain.back());
        chain.push_back(m[1]);
      }
    }
    EXPECT_EQ(distractors, 1);
    ASSERT_GE(chain.size(), 2u);
    ASSERT_LE(chain.size(), 4u);
    std::string joined;
    for (const auto& v : chain) joined += (joined.empty() ? "" : " ") + v;
    EXPECT_EQ(joined, s.answer);
  }
}

TEST(EvalTasks, DepthPlacesTheNeedle) {
  const TaskSample start = Sample(TaskKind::kPasskey, 1024, 0, 1, 0.0);
  EXPECT_EQ(start.context.rfind(start.needles[0], 0), 0u);
  const TaskSample end = Sample(TaskKind::kPasskey, 1024, 0, 1, 1.0);
  EXPECT_EQ(end.context.substr(end.context.size() - end.needles[0].size()), end.needles[0]);
  const TaskSample mid = Sample(TaskKind::kPasskey, 1024, 0, 1, 0.5);
  EXPECT_NEAR(mid.depth, 0.5, 0.15);
  // A fixed depth moves the same needle in the same haystack.
  EXPECT_EQ(start.answer, mid.answer);
  EXPECT_EQ(start.context.size(), end.context.size());
}

TEST(EvalTasks, ContextIsATokenPrefix) {
  for (TaskKind kind : {TaskKind::kPasskey, TaskKind::kNiah, TaskKind::kKv, TaskKind::kVt}) {
    const TaskSample s = Sample(kind, 512, 1);
    const std::vector<int32_t> ctx = Tok().EncodePrompt(s.context);
    ASSERT_EQ(int(ctx.size()), s.context_tokens);
    EXPECT_TRUE(std::equal(ctx.begin(), ctx.end(), s.ids.begin()));
    EXPECT_EQ(s.ids.front(), Tok().bos_id());
  }
}

TEST(EvalTasks, MultiQuestionTasksAskEveryNeedleOnce) {
  for (TaskKind kind : {TaskKind::kMultiq, TaskKind::kMultiturn}) {
    SCOPED_TRACE(TaskName(kind));
    const TaskSample s = Sample(kind, 1024, 3, /*needles=*/4);
    ASSERT_EQ(s.questions.size(), 4u);
    ASSERT_EQ(s.answers.size(), 4u);
    ASSERT_EQ(s.question_ids.size(), 4u);
    EXPECT_EQ(s.question, s.questions[0]);
    EXPECT_EQ(s.answer, s.answers[0]);
    EXPECT_EQ(std::set<std::string>(s.answers.begin(), s.answers.end()).size(), 4u);
    EXPECT_EQ(std::set<std::string>(s.questions.begin(), s.questions.end()).size(), 4u);
    EXPECT_EQ(Count(s.context, "The pass key is "), 1);
    EXPECT_EQ(Count(s.context, "The special magic number for "), 3);
    for (size_t q = 0; q < 4; ++q) {
      EXPECT_NE(s.context.find(s.answers[q]), std::string::npos) << s.answers[q];
      EXPECT_TRUE(s.questions[q].starts_with("Question: ")) << s.questions[q];
      EXPECT_EQ(s.question_ids[q],
                q == 0 ? std::vector<int32_t>(s.ids.begin() + s.context_tokens, s.ids.end())
                       : Tok().Encode(s.questions[q]));
    }
    EXPECT_EQ(Sample(kind, 1024, 3, 4).questions, s.questions);  // fixed by the seed
  }
}

TEST(EvalTasks, MultidocCutsTheContextIntoShuffledDocuments) {
  std::set<size_t> needle_docs;
  size_t most = 0;
  for (int index = 0; index < 8; ++index) {
    auto r = Gen().Generate({TaskKind::kMultidoc, 1024, 1, -1, /*docs=*/6}, 1234, index);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const TaskSample& s = *r;
    // A document is one or more whole paragraphs: fewer when the paragraphs are long.
    ASSERT_LE(s.docs.size(), 6u);
    ASSERT_GE(s.docs.size(), 2u);
    ASSERT_EQ(s.doc_ids.size(), s.docs.size());
    most = std::max(most, s.docs.size());
    std::string context;
    std::vector<int32_t> ids = {Tok().bos_id()};
    int holding = 0;
    for (size_t d = 0; d < s.docs.size(); ++d) {
      context += s.docs[d];
      EXPECT_EQ(s.doc_ids[d], Tok().Encode(s.docs[d]));
      ids.insert(ids.end(), s.doc_ids[d].begin(), s.doc_ids[d].end());
      if (s.docs[d].find("The special magic number for") != std::string::npos) {
        ++holding;
        needle_docs.insert(d);
        EXPECT_NE(s.docs[d].find(s.answer), std::string::npos);
      }
    }
    EXPECT_EQ(holding, 1);
    EXPECT_EQ(context, s.context);
    EXPECT_EQ(s.context_tokens, static_cast<int>(ids.size()));
    ids.insert(ids.end(), s.question_ids[0].begin(), s.question_ids[0].end());
    EXPECT_EQ(ids, s.ids);
    EXPECT_NEAR(static_cast<double>(s.ids.size()), 1024, 1024 * 0.02);
  }
  EXPECT_EQ(most, 6u);
  EXPECT_GT(needle_docs.size(), 2u);  // the needle's document lands anywhere
  EXPECT_FALSE(Gen().Generate({TaskKind::kMultidoc, 1024, 1, -1, 0}, 1, 0).ok());
  EXPECT_FALSE(Gen().Generate({TaskKind::kMultidoc, 256, 1, -1, 256}, 1, 0).ok());  // 1-token docs
}

TEST(EvalTasks, BadSpecsAreErrors) {
  EXPECT_FALSE(ParseTaskKind("ruler").ok());
  EXPECT_FALSE(Gen().Generate({TaskKind::kNiah, 1024, -1, -1}, 1, 0).ok());
  EXPECT_FALSE(Gen().Generate({TaskKind::kPasskey, 1024, 1, 1.5}, 1, 0).ok());
  EXPECT_FALSE(Gen().Generate({TaskKind::kNiah, 40, 8, -1}, 1, 0).ok());  // 8 needles > 40 tokens
  // A kv table with no room for a line: an error (it indexed an empty table and crashed).
  for (int len : {16, 32}) EXPECT_FALSE(Gen().Generate({TaskKind::kKv, len, 1, -1}, 1, 0).ok());
}

TEST(EvalTasks, NeedlesZeroIsTheTrainingMix) {
  const int mix[] = {1, 1, 2, 4, 8, 1};
  for (int i = 0; i < 6; ++i) {
    auto s = Gen().Generate({TaskKind::kNiah, 512, 0, -1}, 3, i);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(static_cast<int>(s->needles.size()), mix[i]) << "sample " << i;
  }
}

// ---------------------------------------------------------------- methods

TEST(EvalMethod, NamesAvailabilityAndLabels) {
  EXPECT_TRUE(MethodAvailable(Method{}).ok());
  const Method snap{.press = "snapkv", .ratio = 0.5};
  EXPECT_TRUE(ValidateMethod(snap).ok());
  EXPECT_TRUE(MethodAvailable(snap).ok());
  Method snap_kivi = snap;
  snap_kivi.codec_k = "kivi4";  // evicting re-encodes the changed pages
  EXPECT_TRUE(MethodAvailable(snap_kivi).ok());
  // Demoted tokens are appended one at a time: a cold codec that encodes pages whole cannot.
  EXPECT_EQ(MethodAvailable(Method{.press = "snapkv+demote:kivi4", .ratio = 0.5}).code(),
            StatusCode::kUnimplemented);
  EXPECT_TRUE(ValidateMethod(Method{.press = "snapkv+ada", .ratio = 0.5}).ok());
  EXPECT_EQ(ValidateMethod(Method{.press = "snapkv+ada+max", .ratio = 0.5}).code(),
            StatusCode::kInvalidArgument);
  Method int8;
  int8.codec_k = int8.codec_v = "int8";
  EXPECT_TRUE(MethodAvailable(int8).ok());  // codecs run on an engine of their own
  EXPECT_EQ(ValidateMethod(Method{.press = "magic"}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateMethod(Method{.press = "snapkv", .ratio = 1.0}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateMethod(Method{.press = "full", .ratio = 0.5}).code(),
            StatusCode::kInvalidArgument);

  for (const char* label :
       {"full/f32", "snapkv@0.5/f32", "streaming#256/int8:kivi2", "snapkv+max@0.875/f32"}) {
    auto m = ParseMethod(label);
    ASSERT_TRUE(m.ok()) << label << ": " << m.status().ToString();
    EXPECT_EQ(m->Label(), label);
  }
  EXPECT_EQ(ParseMethod("full")->Label(), "full/f32");
  EXPECT_FALSE(ParseMethod("snapkv@x/f32").ok());
  EXPECT_FALSE(ParseMethod("full/f33").ok());

  auto engine = MakeEngine(64);
  auto session = engine->NewSession();
  const std::vector<int32_t> prompt(60, 42);
  ASSERT_TRUE(session->Eval(prompt, nullptr).ok());
  EXPECT_TRUE(ApplyMethod(Method{}, *session).ok());
  // SnapKV scores by the prompt's attention: without an observed prefill it refuses.
  EXPECT_EQ(ApplyMethod(snap, *session).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(EngineAccess::kv(*session).head_length(0, 0), 60);
  EXPECT_TRUE(ApplyMethod(Method{.press = "streaming", .ratio = 0.5}, *session).ok());
  EXPECT_EQ(EngineAccess::kv(*session).head_length(0, 0), 30);
}

// ---------------------------------------------------------------- KL

TEST(EvalKl, AccumulatorMatchesHandComputedValues) {
  KlAccumulator acc;
  const std::vector<float> ref = {0.0f, std::log(3.0f)};  // p = (1/4, 3/4)
  const std::vector<float> test = {0.0f, 0.0f};           // q = (1/2, 1/2)
  acc.Add(ref, test, 1);
  acc.Add(ref, ref, 0);
  const KlSummary s = acc.Summary();
  const double kl = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  EXPECT_NEAR(s.mean_kl, kl / 2, 1e-7);
  EXPECT_NEAR(s.p99_kl, kl, 1e-7);
  EXPECT_EQ(s.top1_agree, 0.5);  // argmax 1 vs 0 (ties go to the first), then the same
  EXPECT_NEAR(s.ppl_ref, std::exp(-(std::log(0.75) + std::log(0.25)) / 2), 1e-6);
  EXPECT_NEAR(s.ppl, std::exp(-(std::log(0.5) + std::log(0.25)) / 2), 1e-6);
}

KlOptions SmallKl() {
  KlOptions o;
  o.windows = 2;
  o.window_len = 192;
  o.progress = false;
  o.model_name = "kvtiny";
  return o;
}

TEST(EvalKl, ReferenceAgainstItselfIsExactlyZero) {
  auto engine = MakeEngine(256);
  KlOptions o = SmallKl();
  o.methods = {Method{}, Method{.press = "snapkv", .ratio = 0.5}};
  auto rows = RunKlSweep(*engine, o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 2u);
  const ResultRow& full = (*rows)[0];
  EXPECT_EQ(full.status, "ok");
  EXPECT_EQ(full.scored_tokens, 2 * (192 / 2 - 1));
  EXPECT_EQ(*full.mean_kl, 0.0);
  EXPECT_EQ(*full.p99_kl, 0.0);
  EXPECT_EQ(*full.top1_agree, 1.0);
  EXPECT_EQ(*full.ppl, *full.ppl_ref);
  EXPECT_GT(*full.ppl, 1.0);
  EXPECT_GT(*full.kv_bytes_prefill, 0);
  EXPECT_GT(*full.prefill_tok_s, 0);
  // SnapKV at ratio 0.5 really runs: half the KV, some divergence.
  const ResultRow& snap = (*rows)[1];
  EXPECT_EQ(snap.status, "ok");
  EXPECT_GT(*snap.mean_kl, 0.0);
  EXPECT_LT(*snap.kv_bytes_prefill, 0.6 * *full.kv_bytes_prefill);
}

TEST(EvalKl, PerturbedLogitsGiveNonzeroKl) {
  auto engine = MakeEngine(256);
  KlOptions o = SmallKl();
  o.test_perturb_logits = 1.0;
  auto rows = RunKlSweep(*engine, o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  const ResultRow& r = (*rows)[0];
  EXPECT_GT(*r.mean_kl, 1e-3);
  EXPECT_GT(*r.p99_kl, *r.mean_kl);
  EXPECT_LT(*r.top1_agree, 1.0);
  EXPECT_NE(*r.ppl, *r.ppl_ref);
}

TEST(EvalKl, CodecsAreMeasuredOnTheirOwnEngines) {
  auto engine = MakeEngine(256);
  KlOptions o = SmallKl();
  Method q8, q4;
  q8.codec_k = q8.codec_v = "q8_0";
  q4.codec_k = q4.codec_v = "q4_0";
  o.methods = {Method{}, q8, q4};
  auto rows = RunKlSweep(*engine, o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 3u);
  const ResultRow &f32 = (*rows)[0], &r8 = (*rows)[1], &r4 = (*rows)[2];
  EXPECT_EQ(*f32.mean_kl, 0.0);
  EXPECT_GT(*r8.mean_kl, 0.0);
  EXPECT_GT(*r4.mean_kl, *r8.mean_kl);                           // fewer bits, more damage
  EXPECT_LT(*r8.kv_bytes_prefill, 0.6 * *f32.kv_bytes_prefill);  // and really fewer bytes
  EXPECT_LT(*r4.kv_bytes_prefill, *r8.kv_bytes_prefill);
  // Stored bits, scales included (llama.cpp's block formats: 8.5 and 4.5).
  EXPECT_EQ(f32.bits_per_value, 32.0);
  EXPECT_EQ(r8.bits_per_value, 8.5);
  EXPECT_EQ(r4.bits_per_value, 4.5);
}

TEST(EvalKl, DecodeScoringSeesWhatGenerationSees) {
  auto engine = MakeEngine(256);
  KlOptions o = SmallKl();
  Method q4, kivi;
  q4.codec_k = q4.codec_v = "q4_0";
  kivi.codec_k = "kivi4";
  o.methods = {Method{}, q4, kivi};
  auto batch = RunKlSweep(*engine, o);
  o.decode = true;
  auto decode = RunKlSweep(*engine, o);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  ASSERT_TRUE(decode.ok()) << decode.status().ToString();
  ASSERT_EQ(decode->size(), 3u);
  const ResultRow &f32 = (*decode)[0], &r4 = (*decode)[1], &rk = (*decode)[2];
  EXPECT_EQ(f32.task, "text-decode");
  EXPECT_EQ(f32.scored_tokens, (*batch)[0].scored_tokens);
  EXPECT_EQ(*f32.mean_kl, 0.0);
  // q4_0 rows are encoded as they are written, so token-by-token scoring sees the same codes a
  // batch sees: the KL moves only by rounding (a misplaced row of logits would move it a lot).
  EXPECT_NEAR(*r4.mean_kl, *(*batch)[1].mean_kl, 0.05 * *r4.mean_kl);
  // KIVI keys stay f32 until their page is full and sealed after the tokens that filled it have
  // attended: a generated token reads its own page unquantized, a token in a batch its whole
  // chunk (older chunks sealed).
  EXPECT_GT(*rk.mean_kl, 0.0);
  EXPECT_GT(*(*batch)[2].mean_kl, 0.0);
  EXPECT_LT(*(*batch)[2].mean_kl, 0.8 * *rk.mean_kl);
  // Bits held per value: f32 rows (32) plus 32-bit positions (0.25: the plain layout, the
  // reference) plus the partly filled last page; q4_0 4.5 + 16-bit positions (0.125: kvtiny's
  // context fits 16 bits) plus its partial page.
  EXPECT_GT(*f32.kv_bits_held, 32.25);
  EXPECT_GT(*r4.kv_bits_held, 4.625);
  EXPECT_LT(*r4.kv_bits_held, 0.2 * *f32.kv_bits_held);
  EXPECT_NEAR(*(*batch)[1].kv_bits_held, 4.625, 1e-9);  // sampled at 96 and 192 tokens: whole pages
}

// ---------------------------------------------------------------- baseline

TEST(EvalBaseline, PasskeyAt512FullCache) {
  auto engine = MakeEngine(600);
  SweepOptions o;
  o.tasks = {TaskKind::kPasskey};
  o.lengths = {512};
  o.samples = 3;
  o.progress = false;
  o.model_name = "kvtiny";
  Method at_context;
  at_context.compress_at = CompressAt::kContext;
  o.methods = {Method{}, at_context};
  auto rows = RunTaskSweep(*engine, Gen(), o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 2u);
  for (const ResultRow& r : *rows) {
    SCOPED_TRACE(CompressAtName(r.method.compress_at));
    EXPECT_EQ(r.status, "ok");
    EXPECT_EQ(r.samples, 3);
    EXPECT_GE(*r.accuracy, 2.0 / 3.0);  // kvtiny gets ~100% here
    EXPECT_NEAR(r.prompt_tokens, 512, 10);
    // One f32 page per (layer, KV head) per 16 tokens: at least the dense cache.
    EXPECT_GE(*r.kv_bytes_prefill, 512.0 * 8 * 2 * 2 * 64 * 4);
    EXPECT_GE(*r.kv_bytes_peak, *r.kv_bytes_prefill);
    EXPECT_GE(*r.kv_pool_high_water_bytes, *r.kv_bytes_prefill);
    EXPECT_GT(*r.peak_rss_bytes, 0);
    EXPECT_GT(*r.prefill_tok_s, 0);
    EXPECT_GT(*r.decode_tok_s, 0);
    EXPECT_GT(*r.ttft_ms, 0);
  }
  EXPECT_EQ((*rows)[0].correct, (*rows)[1].correct);  // full: both points are the same cache
}

// --reuse-cache: each compressed context saved and loaded again answers exactly what the one in
// memory answered (predictions compared sample by sample), the rows say so and carry the file's
// size, and a press's file is smaller than the full cache's.
TEST(EvalBaseline, ReusedCacheAnswersAsTheCacheInMemory) {
  auto engine = MakeEngine(1100);  // the prefilled context and a loaded copy at once
  testing::TempDir dir;
  SweepOptions o;
  o.tasks = {TaskKind::kPasskey};
  o.lengths = {512};
  o.samples = 3;
  o.progress = false;
  o.model_name = "kvtiny";
  Method full, pressed;
  full.compress_at = pressed.compress_at = CompressAt::kContext;
  pressed.press = "snapkv";
  pressed.ratio = 0.75;
  o.methods = {full, pressed};
  o.predictions = dir.path() + "/memory.jsonl";
  auto memory = RunTaskSweep(*engine, Gen(), o);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  o.predictions = dir.path() + "/reused.jsonl";
  o.reuse_cache_dir = dir.path();
  auto reused = RunTaskSweep(*engine, Gen(), o);
  ASSERT_TRUE(reused.ok()) << reused.status().ToString();
  ASSERT_EQ(reused->size(), 2u);
  auto predictions = [](const std::string& path) {
    std::vector<std::string> out;
    std::istringstream in(testing::ReadFile(path));
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      out.push_back(j["method"].get<std::string>() + ": " + j["prediction"].get<std::string>());
    }
    return out;
  };
  EXPECT_EQ(predictions(dir.path() + "/reused.jsonl"), predictions(dir.path() + "/memory.jsonl"));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_FALSE((*memory)[i].reused_cache);
    EXPECT_TRUE((*reused)[i].reused_cache);
    EXPECT_EQ((*reused)[i].correct, (*memory)[i].correct);
    ASSERT_TRUE((*reused)[i].cache_file_bytes.has_value());
  }
  EXPECT_LT(*(*reused)[1].cache_file_bytes, 0.4 * *(*reused)[0].cache_file_bytes);
}

// The greedy answer to ids as a fresh prompt: the harness's decode (up to a newline or EOS).
std::string FreshAnswer(Engine& engine, const std::vector<int32_t>& ids, int max_new) {
  auto s = engine.NewSession();
  std::vector<float> logits;
  EXPECT_TRUE(s->Eval(ids, &logits).ok());
  std::vector<int32_t> out;
  for (int step = 0; step < max_new; ++step) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (next == Tok().eos_id()) break;
    out.push_back(next);
    if (Tok().TokenBytes(next).find('\n') != std::string::npos) break;
    const int32_t one[1] = {next};
    EXPECT_TRUE(s->Eval(one, &logits).ok());
  }
  std::string text = Tok().Decode(out);
  text = text.substr(0, text.find('\n'));
  const size_t b = text.find_first_not_of(' ');
  return b == std::string::npos ? "" : text.substr(b, text.find_last_not_of(' ') - b + 1);
}

// multiq: every question after the first is answered from the compressed cache without the
// earlier ones, so on the full cache each answer is exactly that of the context and the question
// as a fresh prompt, whether the press point is the prompt or the context, and through a saved
// file (--reuse-cache) too; multiturn keeps the turns, and both report accuracy by question.
TEST(EvalBaseline, MultidocComparesEachBlendWithTheFullPrefill) {
  auto engine = MakeEngine(1600);
  SweepOptions o;
  o.tasks = {TaskKind::kMultidoc};
  o.lengths = {512};
  o.docs = 4;
  o.samples = 2;
  o.progress = false;
  auto rows = RunTaskSweep(*engine, Gen(), o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 4u);
  const std::vector<std::string> labels = {"full/f32", "chunks:none/f32", "chunks:epic:16/f32",
                                           "chunks:cacheblend:0.15/f32"};
  for (size_t i = 0; i < 4; ++i) {
    const ResultRow& r = (*rows)[i];
    EXPECT_EQ(r.method.Label(), labels[i]);
    EXPECT_EQ(r.task, "multidoc");
    EXPECT_EQ(r.docs, 4);
    EXPECT_EQ(r.samples, 2);
    ASSERT_TRUE(r.accuracy && r.answer_kl && r.ttft_ms);
    EXPECT_EQ(r.recomputed_fraction.has_value(), i > 0);
  }
  EXPECT_EQ(*(*rows)[0].answer_kl, 0.0);  // the reference itself
  EXPECT_GT(*(*rows)[1].answer_kl, 0.0);  // the documents never saw each other
  EXPECT_EQ(*(*rows)[1].recomputed_fraction, 0.0);
  EXPECT_NEAR(*(*rows)[2].recomputed_fraction, 4 * 16 / 512.0, 0.02);
  EXPECT_NEAR(*(*rows)[3].recomputed_fraction, 0.15, 0.01);
  EXPECT_LT(*(*rows)[3].answer_kl, *(*rows)[1].answer_kl);
  const std::string md = MarkdownTable(*rows);
  EXPECT_NE(md.find("| multidoc | 512 | 4 | chunks:cacheblend:0.15/f32 |"), std::string::npos)
      << md;
  EXPECT_NE(md.find("TTFT / full"), std::string::npos);
}

TEST(EvalBaseline, MultiqAnswersEachQuestionAsAFreshPrompt) {
  auto engine = MakeEngine(1200);
  testing::TempDir dir;
  SweepOptions o;
  o.tasks = {TaskKind::kMultiq, TaskKind::kMultiturn};
  o.lengths = {512};
  o.questions = 3;
  o.samples = 2;
  o.progress = false;
  Method at_context;
  at_context.compress_at = CompressAt::kContext;
  o.methods = {Method{}, at_context};
  o.predictions = dir.path() + "/memory.jsonl";
  auto rows = RunTaskSweep(*engine, Gen(), o);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 4u);
  for (const ResultRow& r : *rows) {
    EXPECT_EQ(r.questions, 3);
    ASSERT_EQ(r.question_accuracy.size(), 3u);
    double sum = 0;
    for (double a : r.question_accuracy) sum += a;
    EXPECT_NEAR(*r.accuracy, sum / 3, 1e-9);
  }
  int checked = 0;
  std::map<std::string, std::string> memory;  // method, sample, question -> prediction
  std::istringstream in(ReadFile(o.predictions));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    const std::string id = j["id"];
    memory[j["compress_at"].get<std::string>() + id + std::to_string(j["question"].get<int>())] =
        j["prediction"];
    if (!id.starts_with("multiq")) continue;
    const int index = std::stoi(id.substr(id.rfind('-') + 1));
    const TaskSample s = Sample(TaskKind::kMultiq, 512, index, 3);
    const int q = j["question"];
    std::vector<int32_t> ids(s.ids.begin(), s.ids.begin() + s.context_tokens);
    ids.insert(ids.end(), s.question_ids[q].begin(), s.question_ids[q].end());
    EXPECT_EQ(j["prediction"].get<std::string>(), FreshAnswer(*engine, ids, o.max_new)) << line;
    EXPECT_EQ(j["answer"].get<std::string>(), s.answers[q]);
    ++checked;
  }
  EXPECT_EQ(checked, 2 * 2 * 3);  // samples x compress points x questions

  o.tasks = {TaskKind::kMultiq};
  o.methods = {at_context};
  o.predictions = dir.path() + "/reused.jsonl";
  o.reuse_cache_dir = dir.path();
  ASSERT_TRUE(RunTaskSweep(*engine, Gen(), o).ok());
  std::istringstream reused(ReadFile(o.predictions));
  int same = 0;
  for (std::string line; std::getline(reused, line); ++same) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(
        j["prediction"].get<std::string>(),
        memory["context" + j["id"].get<std::string>() + std::to_string(j["question"].get<int>())]);
  }
  EXPECT_EQ(same, 2 * 3);
}

// ---------------------------------------------------------------- reports

ResultRow FakeRow(const std::string& kind) {
  ResultRow r;
  r.kind = kind;
  r.model = "kvtiny";
  r.task = kind == "kl" ? "text" : "passkey";
  r.length = 512;
  r.prompt_tokens = 512;
  r.samples = 2;
  r.correct = 2;
  if (kind == "kl") {
    r.mean_kl = r.p99_kl = 0.0;
    r.top1_agree = 1.0;
    r.ppl = r.ppl_ref = 3.5;
  } else {
    r.accuracy = 1.0;
    r.decode_tok_s = 80;
    r.ttft_ms = 400;
  }
  r.kv_bytes_prefill = r.kv_bytes_peak = 4 << 20;
  r.kv_pool_high_water_bytes = 4 << 20;
  r.peak_rss_bytes = 60 << 20;
  r.prefill_tok_s = 1200;
  return r;
}

TEST(EvalReport, SinglePointPlotsRenderAndTablesAreWritten) {
  TempDir dir;
  ResultRow unavailable = FakeRow("task");
  unavailable.status = "unavailable";
  unavailable.reason = "press 'snapkv' is not implemented in this build";
  unavailable.method.press = "snapkv";
  unavailable.accuracy.reset();
  const std::vector<ResultRow> rows = {FakeRow("task"), FakeRow("kl"), unavailable};
  std::vector<std::string> notes;
  ASSERT_TRUE(WriteReport(rows, dir.path() + "/r", CurrentMeta(), &notes).ok());
  const std::string html = ReadFile(dir.path() + "/r/index.html");
  const std::string md = ReadFile(dir.path() + "/r/summary.md");
  EXPECT_NE(md.find("| passkey | 512 |"), std::string::npos) << md;
  EXPECT_NE(md.find("unavailable: press 'snapkv'"), std::string::npos);
  EXPECT_NE(md.find("| full/f32 | 512 | 2 |"), std::string::npos);  // the KL table
  EXPECT_NE(html.find("<table>"), std::string::npos);
  // Each plot's canvas grows with its key (a dozen series squeezed the plot to a fifth), and the
  // memory plot, the process's RSS beside small caches, is drawn on a log axis.
  const std::string gp = ReadFile(dir.path() + "/r/plots.gp");
  EXPECT_EQ(Count(gp, "set terminal svg size 760,"), 4);
  const size_t mem = gp.find("set output 'memory_vs_context.svg'");
  ASSERT_NE(mem, std::string::npos);
  EXPECT_NE(gp.find("set logscale y", mem), std::string::npos);
  EXPECT_LT(gp.find("set logscale y", mem), gp.find("unset output", mem));
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    for (const char* f : {"accuracy_vs_ratio.svg", "kl_vs_bits.svg", "memory_vs_context.svg",
                          "speed_vs_context.svg"}) {
      EXPECT_GT(std::filesystem::file_size(dir.path() + "/r/" + f), 1000u) << f;
    }
    EXPECT_EQ(Count(html, "<img "), 4);
    EXPECT_TRUE(notes.empty());
  }
  // Without gnuplot the tables are still written, and the pages say why there are no plots.
  const std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  setenv("PATH", "/nonexistent", 1);
  notes.clear();
  const Status s = WriteReport(rows, dir.path() + "/nogp", CurrentMeta(), &notes);
  setenv("PATH", path.c_str(), 1);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("gnuplot not found"), std::string::npos);
  EXPECT_NE(ReadFile(dir.path() + "/nogp/index.html").find("gnuplot not found"), std::string::npos);
  EXPECT_NE(ReadFile(dir.path() + "/nogp/summary.md").find("| passkey | 512 |"), std::string::npos);
}

// ---------------------------------------------------------------- CLI

struct CliRun {
  int code;
  std::string err;
};

CliRun Cachet(const std::string& args, const TempDir& dir) {
  const std::string err = dir.path() + "/stderr.txt";
  const std::string cmd = std::string(CACHET_BINARY) + " eval -t 2 --no-progress " + args + " > " +
                          dir.path() + "/stdout.txt 2> " + err;
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, ReadFile(err)};
}

TEST(EvalCli, SmokeWritesReportJsonAndCsv) {
  TempDir dir;
  const std::string d = dir.path();
  const CliRun r = Cachet("--task passkey --len 512 --samples 2 --report " + d + "/rep --json " +
                              d + "/rows.jsonl --csv " + d + "/rows.csv",
                          dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string html = ReadFile(d + "/rep/index.html");
  EXPECT_TRUE(html.find("<img") != std::string::npos || html.find("<svg") != std::string::npos ||
              html.find("gnuplot not found") != std::string::npos);
  EXPECT_NE(ReadFile(d + "/rep/summary.md").find("| passkey | 512 |"), std::string::npos);

  const std::string jsonl = ReadFile(d + "/rows.jsonl");
  const auto row = nlohmann::json::parse(jsonl.substr(0, jsonl.find('\n')));
  for (const char* key :
       {"accuracy", "kv_bytes_prefill", "kv_bytes_peak", "peak_rss_bytes", "prefill_tok_s",
        "decode_tok_s", "ttft_ms", "model", "task", "length", "press", "ratio", "budget", "codec_k",
        "codec_v", "compress_at", "needles", "depth", "seed"}) {
    EXPECT_TRUE(row.contains(key)) << key;
  }
  EXPECT_EQ(row["model"], "kvtiny");
  EXPECT_EQ(row["samples"], 2);
  EXPECT_EQ(row["status"], "ok");

  const std::string csv = ReadFile(d + "/rows.csv");
  std::string header;
  for (const std::string& c : RowColumns()) header += (header.empty() ? "" : ",") + c;
  EXPECT_EQ(csv.substr(0, csv.find('\n')), header);
  EXPECT_EQ(Count(csv, "\n"), 2);
  EXPECT_NE(csv.find("\ntask,ok,,kvtiny,passkey,512,"), std::string::npos) << csv;
}

TEST(EvalCli, UnavailablePressGivesRowsNotACrash) {
  TempDir dir;
  const CliRun r = Cachet(
      "--task passkey --len 256 --samples 1 --press snapkv+demote:kivi4,streaming+demote:kivi2 "
      "--ratio 0.5,0.875 --json " +
          dir.path() + "/rows.jsonl",
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("snapkv+demote:kivi4@0.5/f32 unavailable: press 'snapkv+demote:kivi4': "
                       "demoted tokens are appended one by one"),
            std::string::npos)
      << r.err;
  const std::string jsonl = ReadFile(dir.path() + "/rows.jsonl");
  EXPECT_EQ(Count(jsonl, "\"status\":\"unavailable\""), 4);
  EXPECT_EQ(Count(jsonl, "\"accuracy\":null"), 4);
}

TEST(EvalCli, UnknownNamesAreErrors) {
  TempDir dir;
  CliRun r = Cachet("--press magic --len 256 --samples 1", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("unknown press 'magic'"), std::string::npos) << r.err;
  r = Cachet("--task ruler --len 256 --samples 1", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--task: unknown task 'ruler'"), std::string::npos) << r.err;
  r = Cachet("--codec q4_0:q5 --len 256 --samples 1", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--codec: unknown KV codec 'q5'"), std::string::npos) << r.err;
  // A report directory that cannot be made is said before the evaluation, not after it.
  const std::string file = dir.Write("taken", "x");
  r = Cachet("--kl --task niah --windows 1 --window-len 64", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--task sets the tasks, which --kl does not run"), std::string::npos)
      << r.err;
  const std::string rows = dir.path() + "/rows.jsonl";
  r = Cachet("--len 256 --samples 1 --json " + rows + " --report " + file, dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--report " + file + ": cannot create the directory"), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(rows));  // nothing ran (the rows came before the error)
  // Past the trained context (kvtiny's 4096) only when -c asks for it (it ran silently).
  r = Cachet("--kl --windows 1 --window-len 6000", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--window-len 6000 passes the model's trained context of 4096"),
            std::string::npos)
      << r.err;
  r = Cachet("--task passkey --len 5000 --samples 1", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--len 5000 passes"), std::string::npos) << r.err;
}

TEST(EvalCli, DumpedPromptsAreTheGeneratorsPrompts) {
  TempDir dir;
  const std::string f = dir.path() + "/prompts.jsonl";
  const CliRun r = Cachet(
      "--task passkey,niah --needles 2 --len 512 --samples 2 --prompts-only "
      "--dump-prompts " +
          f,
      dir);
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(ReadFile(f));
  int n = 0;
  for (std::string line; std::getline(lines, line); ++n) {
    const auto j = nlohmann::json::parse(line);
    const TaskKind kind = ParseTaskKind(j["task"].get<std::string>()).value();
    const TaskSample s = Sample(kind, 512, j["index"], j["needles"]);
    EXPECT_EQ(j["id"], s.id);
    EXPECT_EQ(j["text"], s.prompt);
    EXPECT_EQ(j["answer"], s.answer);
    EXPECT_EQ(j["length"], 512);
    EXPECT_EQ(j["tokens"], s.ids.size());
  }
  EXPECT_EQ(n, 4);
}

}  // namespace
}  // namespace cachet::eval
