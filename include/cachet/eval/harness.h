// The evaluation harness: task sweeps (accuracy) and text fidelity (KL, perplexity) over
// compression methods, each result row carrying the memory and speed measured in the same run.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cachet/eval/method.h"
#include "cachet/eval/tasks.h"
#include "cachet/status.h"

namespace cachet {
class Engine;
}

namespace cachet::eval {

// One configuration over one cell (task, length, needles, depth) or one KL run.
struct ResultRow {
  std::string kind = "task";  // "task" or "kl"
  std::string status = "ok";  // "ok" or "unavailable" (the method cannot run in this build)
  std::string reason;         // why unavailable
  std::string model;
  std::string task;          // passkey, niah, kv, vt; "text" for kl rows
  int length = 0;            // target prompt tokens (kl: window length)
  double prompt_tokens = 0;  // mean measured prompt tokens, BOS included
  int needles = 0;
  std::string depth;  // "random" or the requested depth
  Method method;
  // Stored bits per K/V value of the method's codecs on this model: codes and their scales,
  // norms or zero points (the pages' token positions not counted). 0 for unavailable rows.
  double bits_per_value = 0;
  uint64_t seed = 0;
  int samples = 0;    // task samples, or kl windows
  int questions = 1;  // asked per sample (multiq, multiturn: --questions)
  int docs = 0;       // multidoc: documents per context, each a reused chunk
  int correct = 0;    // answers right, of samples x questions
  std::optional<double> accuracy;
  std::vector<double> question_accuracy;  // multiq, multiturn: by the order asked
  std::optional<double> mean_kl, p99_kl, top1_agree, ppl_ref, ppl;
  // multidoc: KL(full prefill || this) per answer token (the right answer teacher-forced), and
  // the fraction of the chunks' tokens computed in place.
  std::optional<double> answer_kl, recomputed_fraction;
  int64_t scored_tokens = 0;  // kl: positions scored
  // Cost. kv_bytes_*: this configuration's own cache (pages held x page bytes); the peak counts
  // the uncompressed prefill for methods that compress after it. The pool's high water and the
  // peak RSS are process-wide and monotonic (their value when the row was finished).
  std::optional<double> kv_bytes_prefill, kv_bytes_peak;
  // kl: bits per K/V value the cache held while the scored half ran, as the pool stores them
  // (codes, raw staging and sink pages, token positions): the mean over decode steps with
  // --kl-decode, else of the start and the end of the scored half.
  std::optional<double> kv_bits_held;
  std::optional<int64_t> kv_pool_high_water_bytes, peak_rss_bytes;
  std::optional<double> prefill_tok_s, decode_tok_s, ttft_ms;
  // --reuse-cache: the question was answered from the saved, reloaded context; its file's bytes.
  bool reused_cache = false;
  std::optional<double> cache_file_bytes;
  int threads = 0;
  double wall_s = 0;
};

struct SweepOptions {
  std::vector<TaskKind> tasks{TaskKind::kPasskey};
  std::vector<int> lengths{1024};
  std::vector<int> needles{1};  // niah only
  int questions = 4;            // multiq, multiturn: questions per context, one needle each
  int docs = 8;                 // multidoc: documents per context
  // multidoc: the ways of reusing the documents as chunks, each beside the full prefill.
  std::vector<BlendOptions> blends{
      BlendOptions{}, {BlendOptions::Kind::kEpic}, {BlendOptions::Kind::kCacheBlend}};
  std::vector<double> depths{-1};  // < 0: random
  int samples = 20;
  uint64_t seed = 1234;
  int max_new = 16;
  std::vector<Method> methods{Method{}};
  std::string model_name;
  // Optional outputs: the prompts as jsonl (id, task, length, text, answer), and one line per
  // sample and configuration with the prediction.
  std::string dump_prompts, predictions;
  bool progress = true;
  // Non-empty: under compress_at context every method's compressed context is saved to a file
  // in this directory (Session::Save) and the question is answered by a session loaded from it
  // (Engine::LoadSession), as a later request or process reusing the cache would be; TTFT then
  // counts the load and the question, not the prefill, and rows record the file's bytes.
  std::string reuse_cache_dir;
};

// The cells (task, length, needles or questions, depth) a sweep runs, in its order.
std::vector<TaskSpec> TaskCells(const SweepOptions& o);

// Runs every cell x sample; each sample is prefilled once (per compress_at) and forked for each
// runnable method. Methods that cannot run give 'unavailable' rows.
Result<std::vector<ResultRow>> RunTaskSweep(Engine& engine, TaskGenerator& gen,
                                            const SweepOptions& o);

struct KlOptions {
  std::string text_file;  // empty: <haystack>/pydocs.txt from offset
  int64_t offset = -1;    // byte offset in text_file; < 0: a quarter into the file
  int windows = 8;
  int window_len = 1024;  // tokens, BOS included; the second half is scored
  std::vector<Method> methods{Method{}};
  Method reference;  // full f32
  uint64_t seed = 1234;
  std::string model_name;
  bool progress = true;
  // If set, each window is written there as a JSON line {"window", "score_from", "ids"}, so
  // another engine can be scored on the same tokens (bench/peers).
  std::string dump_windows;
  // Score the second half one token at a time, as generation sees the cache (KIVI's full-precision
  // residual and --kv-window act as they do while decoding). Otherwise it runs in ubatch chunks:
  // row-wise codecs store a chunk's K/V before it attends, as llama.cpp's perplexity tool does;
  // staged layouts (KIVI keys, --kv-window) seal the pages it aged after it has attended.
  bool decode = false;
  // Test-only: Gaussian noise of this stddev added to the tested configurations' logits (never
  // the reference's), to show the metric can fail. 0 in real runs.
  double test_perturb_logits = 0;
};

// For each window: BOS + window_len-1 tokens of text; the first half is prefilled once, then
// each configuration (reference included) is forked, the method applied, and the second half
// evaluated. Scores logits at positions [L/2, L-2] (each predicts the next token of the window).
Result<std::vector<ResultRow>> RunKlSweep(Engine& engine, const KlOptions& o);

// One --dump-prompts line (JSON and a newline): id, task, length, needles, depth, seed, index,
// tokens, bos, text (the prompt without BOS), question, answer.
std::string PromptJsonLine(const TaskSample& s, const TaskSpec& spec, uint64_t seed, int index);

// Peak resident set size of this process in bytes (getrusage).
int64_t PeakRssBytes();

}  // namespace cachet::eval
