// What the sweeps share (harness.cc: the task sweep, kl_sweep.cc: the KL sweep, reuse_sweep.cc):
// timing, the methods sorted and their engines, greedy answers, and the multidoc cell, whose
// configurations are ways of reusing chunks rather than presses.
#pragma once

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/engine.h"
#include "cachet/eval/harness.h"
#include "cachet/eval/method.h"
#include "cachet/progress.h"
#include "cachet/tokenizer.h"

namespace cachet {
class Session;
}

namespace cachet::eval {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0);
std::string DepthName(double depth);
std::string Strip(std::string_view s);

// Splits methods into the runnable ones and rows for those the build cannot run.
struct MethodSet {
  std::vector<Method> runnable;
  std::vector<std::pair<Method, std::string>> unavailable;
};
Result<MethodSet> SortMethods(const std::vector<Method>& methods);
// Bits per value a method's K/V codecs store, metadata included (a full page).
double StoredBitsPerValue(const Method& m, const Engine& engine);
ResultRow UnavailableRow(ResultRow base, const Method& m, const std::string& reason);

// A codec is a property of an engine's pool (pages are encoded as they are written), so each K/V
// codec pair runs on its own engine, built once from the base engine's options.
using EngineCache = std::map<std::string, std::unique_ptr<Engine>>;
Result<Engine*> EngineFor(Engine& base, const Method& m, EngineCache& cache);
// The distinct codec pairs of the methods, in first-seen order.
std::vector<Method> CodecGroups(const std::vector<Method>& methods);
bool SameCodecs(const Method& a, const Method& b);
// The KV pools' high water over the base engine and the codec pairs' engines.
int64_t PoolHighWater(Engine& base, const EngineCache& engines);
// Makes the prefill gather attention weights when a configuration forked from it needs them.
void ObserveIfNeeded(const std::vector<Method>& methods, const Method& group, int32_t end,
                     Session& prefilled);

// What greedy decoding needs beyond the session: which tokens end an answer.
struct Decoder {
  const Tokenizer& tok;
  std::vector<char> ends_line;  // the token's text holds a newline
  int max_new;
};
Decoder MakeDecoder(const Tokenizer& tok, int max_new);

struct Answer {
  std::string prediction;  // the output up to its first newline, stripped
  int64_t evals = 0;       // tokens evaluated after the first
  double seconds = 0;
  int32_t last = -1;  // the last token generated (not evaluated), -1: none (EOS first)
  bool ended_line = false;
};

// Greedy decode from logits until a newline, EOS or max_new tokens. The last token generated is
// not evaluated (nothing reads its logits); *peak_bytes grows with the session.
Result<Answer> DecodeAnswer(const Decoder& d, Session& session, std::vector<float>* logits,
                            size_t* peak_bytes);

// A multidoc cell: each sample's documents as chunks (Session::EvalChunked) with every blend of
// o.blends, and the full prefill of the same tokens; rows carry accuracy, the answer tokens' KL
// against the full prefill, TTFT (the chunks already cached) and the recomputed fraction.
Result<std::vector<ResultRow>> RunReuseCell(Engine& engine, TaskGenerator& gen,
                                            const TaskSpec& spec, const SweepOptions& o,
                                            const Decoder& decoder, ProgressBar* bar,
                                            std::ofstream& preds);

}  // namespace cachet::eval
