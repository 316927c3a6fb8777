// Synthetic long-context tasks in the exact formats kvtiny was trained on (RULER-style passkey,
// niah, kv, vt; docs/EVAL.md), generated deterministically from a seed: the same arguments give
// the same prompt bytes on every platform.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet {
class Tokenizer;
}

namespace cachet::eval {

// std::mt19937_64 is specified bit for bit by the standard but the std distributions are not, so
// every draw goes through these. UniformInt is inclusive and unbiased (rejection sampling).
uint64_t UniformInt(std::mt19937_64& rng, uint64_t lo, uint64_t hi);
uint64_t MixSeed(uint64_t a, uint64_t b);  // splitmix64 of a combined with b
uint64_t Fnv1a64(std::string_view s);      // prompt fingerprints

// multiq and multiturn: a niah context with one needle per question, every needle asked in turn
// (a random order) against one cache: multiq drops each question's K/V before the next, as a
// reused cache would; multiturn keeps every question and answer, as a chat does.
// multidoc: a niah context cut into documents (--docs) in a random order, one holding the needle:
// each a chunk of a reused prompt (Session::EvalChunked), as retrieval-augmented prompts are.
enum class TaskKind { kPasskey, kNiah, kKv, kVt, kMultiq, kMultiturn, kMultidoc };
inline constexpr size_t kTaskKinds = 7;
Result<TaskKind> ParseTaskKind(std::string_view name);
const char* TaskName(TaskKind kind);
bool AsksSeveral(TaskKind kind);  // multiq, multiturn

struct TaskSpec {
  TaskKind kind = TaskKind::kPasskey;
  int length = 1024;  // target prompt tokens, BOS included
  int needles = 1;    // niah: 1, 2, 4 or 8; 0: 1, 1, 2, 4, 8 by sample (the training mix);
                      // multiq, multiturn: the questions (one needle each)
  double depth = -1;  // where the needles go, 0 (start) .. 1 (end); < 0: random boundaries
  int docs = 8;       // multidoc: documents the context is cut into
};

struct TaskSample {
  std::string id;        // e.g. "niah4-1024-s1234-7"
  std::string context;   // haystack and needles; ends with "\n\n"
  std::string question;  // "Question: {q}\nAnswer:"
  std::string prompt;    // context + question (the model's BOS is not in the text)
  std::string answer;
  // Every question in the order asked (the first is question) with its answer and tokens (the
  // first's are ids[context_tokens, end)); one for all but multiq and multiturn.
  std::vector<std::string> questions, answers;
  std::vector<std::vector<int32_t>> question_ids;
  std::vector<std::string> needles;  // inserted texts, each ending with "\n\n", in order
  std::vector<int32_t> ids;          // prompt tokens, BOS included
  int context_tokens = 0;            // ids[0, context_tokens) are BOS + context
  double depth = 0;  // where the answer's needle (kv: line) starts, as a fraction of the context
  // multidoc: the documents in the order given, and their tokens (ids is BOS, then these, then
  // the question's).
  std::vector<std::string> docs;
  std::vector<std::vector<int32_t>> doc_ids;
};

// The corpus slices: paragraphs (text between blank lines) of bible, pydocs and fortunes, and
// the key words of niah.
class Haystack {
 public:
  static Result<Haystack> Load(const std::string& dir);
  static constexpr int kSources = 3;
  const std::vector<std::string>& paragraphs(int source) const { return paras_[source]; }
  const std::vector<std::string>& words() const { return words_; }

 private:
  std::vector<std::string> paras_[kSources];
  std::vector<std::string> words_;
};

// data/haystack of the source tree ($CACHET_HAYSTACK_DIR overrides).
std::string DefaultHaystackDir();

class TaskGenerator {
 public:
  TaskGenerator(const Tokenizer& tok, Haystack haystack);
  // Sample `index` of `spec` for `seed`. The prompt is within 2% of spec.length tokens.
  Result<TaskSample> Generate(const TaskSpec& spec, uint64_t seed, int index);

 private:
  struct Needles;  // what a task puts into the haystack, and its question
  struct Piece {   // a paragraph or needle of a context, in order
    std::string text;
    int tokens = 0;
    bool answer = false;  // the needle asked about
  };
  void SplitDocuments(const TaskSpec& spec, const std::vector<Piece>& pieces, std::mt19937_64& rng,
                      TaskSample* s) const;
  Needles MakeNeedles(const TaskSpec& spec, std::mt19937_64& rng) const;
  // One attempt: the haystack gets `adjust` tokens more than the estimate says fit.
  TaskSample Build(const TaskSpec& spec, std::mt19937_64 rng, int adjust);
  // The kv task: a table of hex keys and values instead of a haystack.
  void BuildKvContext(const TaskSpec& spec, std::mt19937_64& rng, int adjust, TaskSample* s);
  int Tokens(std::string_view text) const;
  int ParagraphTokens(int source, size_t index);  // cached: each paragraph is tokenized once

  const Tokenizer& tok_;
  Haystack hay_;
  std::vector<int> para_tokens_[Haystack::kSources];  // -1: not yet tokenized
};

}  // namespace cachet::eval
