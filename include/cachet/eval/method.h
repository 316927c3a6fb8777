// A KV compression configuration as the harness sweeps it: a press (which entries to keep) and a
// codec per K and V (how they are stored). ApplyMethod is the one place where a press plugs in;
// codecs are a property of the engine that prefilled the session.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/reuse.h"
#include "cachet/status.h"

namespace cachet {
class Session;
}

namespace cachet::eval {

enum class CompressAt {
  kPrompt,   // prefill the whole prompt (question included), then compress
  kContext,  // prefill the context, compress, then append the question
};
const char* CompressAtName(CompressAt c);
Result<CompressAt> ParseCompressAt(std::string_view name);

struct Method {
  std::string press = "full";  // "full" or a press spec (kv/press: "snapkv", "snapkv+ada", ...)
  double ratio = 0;            // fraction of the KV entries removed, in [0, 1)
  int budget = 0;              // tokens kept instead of a ratio (0: use ratio)
  std::string codec_k = "f32", codec_v = "f32";
  CompressAt compress_at = CompressAt::kPrompt;
  int window = 32;              // press observation window (SnapKV, expected attention)
  int sinks = 4;                // first tokens every press keeps
  double demote_fetch = 0.125;  // presses with +demote:CODEC: cold pages read per decode step
  std::vector<std::string> probe_texts{};  // lookahead's questions (empty: its generic ones)
  // multidoc: the documents reused as chunks with this blend (none: a full prefill of the prompt).
  std::optional<BlendOptions> blend{};

  // "full/f32", "snapkv@0.5/int8", "streaming#256/int8:kivi2", "chunks:cacheblend:0.15/f32"
  // (compress_at not included).
  std::string Label() const;
};

// Every press and codec name the harness accepts, runnable or not.
const std::vector<std::string>& KnownPresses();

// Parses a Label() back (e.g. for --kl-ref): press[@ratio|#budget][/codec[:codec_v]].
Result<Method> ParseMethod(std::string_view label);

// InvalidArgument for unknown names or out-of-range ratio/budget.
Status ValidateMethod(const Method& m);
// Unimplemented (with the reason) when the engine cannot run m yet.
Status MethodAvailable(const Method& m);
// Whether m's press scores by attention weights, which the prefill must gather
// (Session::ObserveForPress before the prefill that m's session forks).
bool NeedsAttention(const Method& m);
uint32_t Gatherings(const Method& m);  // press::GatheringsFor m's press
// Presses with "+chunked" compress while prefilling, so they cannot fork a shared prefill:
// PrefillCompressing evaluates the prompt into a fresh session instead of ApplyMethod.
bool CompressesDuringPrefill(const Method& m);
Status PrefillCompressing(const Method& m, std::span<const int32_t> prompt, Session& session,
                          std::vector<float>* logits, size_t* peak_bytes);

// Applies m to a session that holds a prefilled prompt or context. The session was forked from
// the prefill, so one prefill per sample serves every configuration of a sweep.
// segment_starts: where the prompt's segments start (BOS + context, question), for presses
// with boundary protection. *peak_bytes (when given) is raised to the most the press held (the
// cache plus, for kvzip and lookahead, their probe pass).
Status ApplyMethod(const Method& m, Session& session, std::span<const int32_t> segment_starts = {},
                   size_t* peak_bytes = nullptr);

}  // namespace cachet::eval
