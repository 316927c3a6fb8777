// What the task sweeps share (harness.cc, reuse_sweep.cc): timing, greedy answers, and the
// multidoc cell, whose configurations are ways of reusing chunks rather than presses.
#pragma once

#include <chrono>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/eval/harness.h"
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
