#include "cachet/eval/harness.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cachet/engine.h"
#include "cachet/model_config.h"
#include "cachet/progress.h"
#include "cachet/tokenizer.h"
#include "eval/fidelity.h"
#include "eval/sweep.h"
#include "kv/page_pool.h"
#include "kv/paged_sequence.h"
#include "runtime/sampler.h"
#include "util/thread_pool.h"

namespace cachet::eval {

int64_t PeakRssBytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string DepthName(double depth) {
  if (depth < 0) return "random";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", depth);
  return buf;
}

std::string Strip(std::string_view s) {
  const char* ws = " \t\r\n\f\v";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string_view::npos) return "";
  return std::string(s.substr(a, s.find_last_not_of(ws) - a + 1));
}

Decoder MakeDecoder(const Tokenizer& tok, int max_new) {
  Decoder d{tok, std::vector<char>(tok.vocab_size()), max_new};
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    d.ends_line[id] = tok.TokenBytes(id).find('\n') != std::string::npos;
  }
  return d;
}

Result<Answer> DecodeAnswer(const Decoder& d, Session& session, std::vector<float>* logits,
                            size_t* peak_bytes) {
  Answer a;
  std::vector<int32_t> generated;
  generated.reserve(d.max_new);
  const auto t0 = Clock::now();
  for (int step = 0; step < d.max_new; ++step) {
    const int32_t next = ArgMax(*logits);
    if (next == d.tok.eos_id()) break;
    generated.push_back(next);
    a.last = next;
    if (d.ends_line[next] || step + 1 == d.max_new) {
      a.ended_line = d.ends_line[next];
      break;
    }
    const int32_t one[1] = {next};
    CACHET_RETURN_IF_ERROR(session.Eval(one, logits));
    ++a.evals;
    *peak_bytes = std::max(*peak_bytes, session.kv_bytes());
  }
  a.seconds = SecondsSince(t0);
  const std::string output = d.tok.Decode(generated);
  a.prediction = Strip(output.substr(0, output.find('\n')));
  return a;
}

namespace {

// Splits methods into the runnable ones and rows for those the build cannot run.
struct MethodSet {
  std::vector<Method> runnable;
  std::vector<std::pair<Method, std::string>> unavailable;
};

Result<MethodSet> SortMethods(const std::vector<Method>& methods) {
  MethodSet set;
  for (const Method& m : methods) {
    CACHET_RETURN_IF_ERROR(ValidateMethod(m));
    Status s = MethodAvailable(m);
    if (s.ok()) {
      set.runnable.push_back(m);
    } else {
      set.unavailable.emplace_back(m, s.message());
    }
  }
  return set;
}

double StoredBitsPerValue(const Method& m, const Engine& engine) {
  auto k = codecs::ParseCodec(m.codec_k);
  auto v = codecs::ParseCodec(m.codec_v);
  if (!k.ok() || !v.ok()) return 0;
  const int pt = engine.options().page_tokens, hd = engine.config().head_dim;
  return 0.5 * (codecs::BitsPerValue(*k, codecs::Role::kKey, pt, hd) +
                codecs::BitsPerValue(*v, codecs::Role::kValue, pt, hd));
}

ResultRow UnavailableRow(ResultRow base, const Method& m, const std::string& reason) {
  base.method = m;
  base.status = "unavailable";
  base.reason = reason;
  return base;
}

// Sums over the samples of one cell for one method.
struct TaskAcc {
  int n = 0, correct = 0, asked = 0;
  std::vector<int> correct_by_question;  // multiq, multiturn: by the order asked
  double prompt_tokens = 0, prefill_s = 0, decode_s = 0, ttft_ms = 0, kv_prefill = 0;
  int64_t decode_tokens = 0;
  double kv_peak = 0;
  double cache_file_bytes = 0;  // --reuse-cache
};

// Question q >= 1 of a multi-question sample into *logits. multiq: a fork of `compressed` (the
// cache without the earlier questions: a reused cache; null for multiturn); multiturn: the same
// session after the previous answer, its last token and a blank line (a chat).
Result<std::unique_ptr<Session>> AskNext(const TaskSample& sample, TaskKind kind, size_t q,
                                         const Session* compressed,
                                         std::unique_ptr<Session> previous, const Answer& answered,
                                         const Tokenizer& tok, std::vector<float>* logits) {
  std::vector<int32_t> turn;
  std::unique_ptr<Session> s;
  if (kind == TaskKind::kMultiq) {
    s = compressed->Fork();
    CACHET_RETURN_IF_ERROR(s->Truncate(sample.context_tokens));
  } else {
    s = std::move(previous);
    if (answered.last >= 0) turn.push_back(answered.last);
    const std::vector<int32_t> gap = tok.Encode(answered.ended_line ? "\n" : "\n\n");
    turn.insert(turn.end(), gap.begin(), gap.end());
  }
  turn.insert(turn.end(), sample.question_ids[q].begin(), sample.question_ids[q].end());
  CACHET_RETURN_IF_ERROR(s->Eval(turn, logits));
  return s;
}

// A codec is a property of an engine's pool (pages are encoded as they are written), so each K/V
// codec pair runs on its own engine, built once from the base engine's options.
using EngineCache = std::map<std::string, std::unique_ptr<Engine>>;
Result<Engine*> EngineFor(Engine& base, const Method& m, EngineCache& cache) {
  const EngineOptions& bo = base.options();
  if (m.codec_k == bo.kv_codec_k && m.codec_v == bo.kv_codec_v) return &base;
  const std::string key = m.codec_k + ":" + m.codec_v;
  auto it = cache.find(key);
  if (it == cache.end()) {
    EngineOptions o = bo;
    o.kv_codec_k = m.codec_k;
    o.kv_codec_v = m.codec_v;
    CACHET_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(o));
    it = cache.emplace(key, std::move(e)).first;
  }
  return it->second.get();
}

// The distinct codec pairs of the methods, in first-seen order.
std::vector<Method> CodecGroups(const std::vector<Method>& methods) {
  std::vector<Method> groups;
  for (const Method& m : methods) {
    if (std::none_of(groups.begin(), groups.end(), [&](const Method& g) {
          return g.codec_k == m.codec_k && g.codec_v == m.codec_v;
        })) {
      groups.push_back(m);
    }
  }
  return groups;
}

int64_t PoolHighWater(Engine& base, const EngineCache& engines) {
  int64_t n = static_cast<int64_t>(base.kv_stats().bytes_high_water);
  for (const auto& [key, e] : engines) n += static_cast<int64_t>(e->kv_stats().bytes_high_water);
  return n;
}

bool SameCodecs(const Method& a, const Method& b) {
  return a.codec_k == b.codec_k && a.codec_v == b.codec_v;
}

// Makes the prefill gather attention weights when a configuration forked from it needs them.
void ObserveIfNeeded(const std::vector<Method>& methods, const Method& group, int32_t end,
                     Session& prefilled) {
  int window = 0;
  uint32_t gatherings = 0;
  for (const Method& m : methods) {
    if (!SameCodecs(m, group) || !NeedsAttention(m)) continue;
    window = std::max(window, m.window);
    gatherings |= Gatherings(m);
  }
  if (window > 0) prefilled.ObserveForPress(end, window, gatherings);
}

Status OpenOutput(const std::string& path, std::ofstream* out) {
  if (path.empty()) return OkStatus();
  out->open(path, std::ios::binary | std::ios::trunc);
  if (!*out) return InvalidArgument(path + ": cannot open for writing");
  return OkStatus();
}

}  // namespace

std::string PromptJsonLine(const TaskSample& s, const TaskSpec& spec, uint64_t seed, int index) {
  const nlohmann::ordered_json j = {
      {"id", s.id},
      {"task", TaskName(spec.kind)},
      {"length", spec.length},
      {"needles", spec.kind == TaskKind::kNiah || AsksSeveral(spec.kind) ? spec.needles : 1},
      {"depth", DepthName(spec.depth)},
      {"seed", seed},
      {"index", index},
      {"tokens", s.ids.size()},
      {"bos", true},
      {"text", s.prompt},
      {"question", s.question},
      {"answer", s.answer}};
  if (s.questions.size() > 1) {
    nlohmann::ordered_json more = j;
    more["questions"] = s.questions;
    more["answers"] = s.answers;
    return more.dump() + "\n";
  }
  return j.dump() + "\n";
}

std::vector<TaskSpec> TaskCells(const SweepOptions& o) {
  std::vector<TaskSpec> cells;
  for (TaskKind kind : o.tasks) {
    for (int length : o.lengths) {
      const std::vector<int> needles = kind == TaskKind::kNiah ? o.needles
                                       : AsksSeveral(kind)     ? std::vector<int>{o.questions}
                                                               : std::vector<int>{1};
      for (int n : needles) {
        for (double depth : o.depths) cells.push_back({kind, length, n, depth, o.docs});
      }
    }
  }
  return cells;
}

namespace {

// A sample prefilled once per codec pair (up to its context, or all of it), which the pair's
// methods fork.
struct PrefilledSample {
  const TaskSample& sample;
  TaskKind kind;
  CompressAt at;
  std::span<const int32_t> prefix;
  Session& session;
  const std::vector<float>& logits;
  double seconds;
  size_t kv_bytes;
};

// Where a method's run on a sample is written: its accumulator, and --predictions.
struct SampleOut {
  TaskAcc& acc;
  std::ofstream& preds;
};

// Method m on a prefilled sample: its cache (a fork of the prefill, pressed, or its own prefill
// pressed chunk by chunk; through a file with --reuse-cache), then every question answered.
Status RunSampleMethod(const Method& m, Engine& ge, const PrefilledSample& p, const SweepOptions& o,
                       const Decoder& decoder, const Tokenizer& tok, std::vector<float>& logits,
                       SampleOut out) {
  const TaskSample& sample = p.sample;
  const std::span<const int32_t> ids(sample.ids);
  std::unique_ptr<Session> session;
  size_t own_peak = p.kv_bytes;
  auto t1 = Clock::now();
  if (CompressesDuringPrefill(m)) {  // its own prefill, pressed chunk by chunk
    session = ge.NewSession();
    CACHET_RETURN_IF_ERROR(PrefillCompressing(m, p.prefix, *session, &logits, &own_peak));
  } else {
    session = p.session.Fork();
    const int32_t segments[2] = {0, sample.context_tokens};
    CACHET_RETURN_IF_ERROR(ApplyMethod(
        m, *session, std::span(segments, p.at == CompressAt::kPrompt ? 2 : 1), &own_peak));
    logits = p.logits;
  }
  const double apply_s = SecondsSince(t1);
  double question_s = 0;
  TaskAcc& a = out.acc;
  const bool reuse = p.at == CompressAt::kContext && !o.reuse_cache_dir.empty();
  if (reuse) {  // through a file, as a later request would reuse it
    const std::string path = o.reuse_cache_dir + "/context.ckv";
    CACHET_RETURN_IF_ERROR(session->Save(path, m.Label()));
    a.cache_file_bytes += double(std::filesystem::file_size(path));
    session.reset();  // its pages back to the pool: the loaded copy shares none
    auto t2 = Clock::now();
    CACHET_ASSIGN_OR_RETURN(session, ge.LoadSession(path));
    question_s += SecondsSince(t2);
  }
  if (p.at == CompressAt::kContext) {
    auto t2 = Clock::now();
    CACHET_RETURN_IF_ERROR(session->Eval(ids.subspan(sample.context_tokens), &logits));
    question_s = SecondsSince(t2);
  }
  const size_t start_bytes = session->kv_bytes();
  size_t peak_bytes = std::max(own_peak, start_bytes);
  // multiq asks every question of the cache as it was compressed: kept aside.
  std::unique_ptr<Session> compressed;
  if (p.kind == TaskKind::kMultiq && sample.questions.size() > 1) {
    compressed = session->Fork();
    CACHET_RETURN_IF_ERROR(compressed->Truncate(sample.context_tokens));
  }
  a.n += 1;
  a.prompt_tokens += static_cast<double>(ids.size());
  a.prefill_s += p.seconds + question_s;
  // Reused: a later request pays the load and its question, not the prefill.
  a.ttft_ms += 1e3 * (reuse ? question_s : p.seconds + apply_s + question_s);
  a.kv_prefill += double(start_bytes);
  a.correct_by_question.resize(std::max(a.correct_by_question.size(), sample.questions.size()));
  for (size_t q = 0; q < sample.questions.size(); ++q) {
    CACHET_ASSIGN_OR_RETURN(const Answer answer,
                            DecodeAnswer(decoder, *session, &logits, &peak_bytes));
    const bool correct = answer.prediction == sample.answers[q];
    a.asked += 1;
    a.correct += correct;
    a.correct_by_question[q] += correct;
    a.decode_s += answer.seconds;
    a.decode_tokens += answer.evals;
    if (out.preds.is_open()) {
      nlohmann::ordered_json j = {{"id", sample.id},
                                  {"method", m.Label()},
                                  {"compress_at", CompressAtName(m.compress_at)},
                                  {"question", q},
                                  {"prediction", answer.prediction},
                                  {"answer", sample.answers[q]},
                                  {"correct", correct},
                                  {"needle_depth", sample.depth},
                                  {"prompt_tokens", ids.size()},
                                  {"ttft_ms", 1e3 * (p.seconds + apply_s + question_s)}};
      out.preds << j.dump() << '\n';
    }
    if (q + 1 == sample.questions.size()) break;
    CACHET_ASSIGN_OR_RETURN(session, AskNext(sample, p.kind, q + 1, compressed.get(),
                                             std::move(session), answer, tok, &logits));
    peak_bytes = std::max(peak_bytes, session->kv_bytes());
  }
  a.kv_peak = std::max(a.kv_peak, double(peak_bytes));
  return OkStatus();
}

// A method's row of a task cell from what its samples accumulated.
ResultRow TaskRow(const ResultRow& base, const Method& m, const TaskAcc& a, const TaskSpec& spec,
                  const SweepOptions& o, Engine& engine, const EngineCache& engines) {
  ResultRow r = base;
  r.method = m;
  r.bits_per_value = StoredBitsPerValue(r.method, engine);
  r.samples = a.n;
  r.correct = a.correct;
  r.accuracy = double(a.correct) / a.asked;
  if (AsksSeveral(spec.kind)) {
    for (int c : a.correct_by_question) r.question_accuracy.push_back(double(c) / a.n);
  }
  r.prompt_tokens = a.prompt_tokens / a.n;
  r.kv_bytes_prefill = a.kv_prefill / a.n;
  r.kv_bytes_peak = a.kv_peak;
  r.kv_pool_high_water_bytes = PoolHighWater(engine, engines);
  r.peak_rss_bytes = PeakRssBytes();
  r.prefill_tok_s = a.prompt_tokens / a.prefill_s;
  if (a.decode_tokens > 0) r.decode_tok_s = a.decode_tokens / a.decode_s;
  r.ttft_ms = a.ttft_ms / a.n;
  if (r.method.compress_at == CompressAt::kContext && !o.reuse_cache_dir.empty()) {
    r.reused_cache = true;
    r.cache_file_bytes = a.cache_file_bytes / a.n;
  }
  return r;
}

}  // namespace

Result<std::vector<ResultRow>> RunTaskSweep(Engine& engine, TaskGenerator& gen,
                                            const SweepOptions& o) {
  CACHET_ASSIGN_OR_RETURN(MethodSet methods, SortMethods(o.methods));
  if (o.samples < 1) return InvalidArgument("--samples must be >= 1");
  if (o.max_new < 1) return InvalidArgument("--max-new must be >= 1");
  std::ofstream dump, preds;
  CACHET_RETURN_IF_ERROR(OpenOutput(o.dump_prompts, &dump));
  CACHET_RETURN_IF_ERROR(OpenOutput(o.predictions, &preds));

  const Tokenizer& tok = engine.tokenizer();
  EngineCache engines;
  const Decoder decoder = MakeDecoder(tok, o.max_new);

  const std::vector<TaskSpec> cells = TaskCells(o);
  // Progress counts prompt tokens, so the ETA holds when lengths differ 8x.
  std::unique_ptr<ProgressBar> bar;
  if (o.progress && !methods.runnable.empty()) {
    int64_t total = 0;
    for (const TaskSpec& spec : cells) total += int64_t(spec.length) * o.samples;
    bar = std::make_unique<ProgressBar>("eval (prompt tokens)", total);
  }

  std::vector<ResultRow> rows;
  std::vector<float> prefill_logits, logits;
  for (const TaskSpec& spec : cells) {
    if (spec.kind == TaskKind::kMultidoc) {
      CACHET_ASSIGN_OR_RETURN(std::vector<ResultRow> cell,
                              RunReuseCell(engine, gen, spec, o, decoder, bar.get(), preds));
      rows.insert(rows.end(), cell.begin(), cell.end());
      continue;
    }
    ResultRow base;
    base.model = o.model_name;
    base.task = TaskName(spec.kind);
    base.length = spec.length;
    base.needles = spec.kind == TaskKind::kNiah || AsksSeveral(spec.kind) ? spec.needles : 1;
    base.questions = AsksSeveral(spec.kind) ? spec.needles : 1;
    base.depth = DepthName(spec.depth);
    base.seed = o.seed;
    base.threads = engine.threads();
    const auto cell_start = Clock::now();
    std::vector<TaskAcc> acc(methods.runnable.size());

    for (int index = 0; index < o.samples && !methods.runnable.empty(); ++index) {
      CACHET_ASSIGN_OR_RETURN(TaskSample sample, gen.Generate(spec, o.seed, index));
      if (dump.is_open()) dump << PromptJsonLine(sample, spec, o.seed, index);
      for (CompressAt at : {CompressAt::kPrompt, CompressAt::kContext}) {
        if (std::none_of(methods.runnable.begin(), methods.runnable.end(),
                         [&](const Method& m) { return m.compress_at == at; })) {
          continue;
        }
        // One prefill per sample and codec pair; every configuration forks it (copy-on-write).
        const std::span<const int32_t> ids(sample.ids);
        const auto prefix = at == CompressAt::kPrompt ? ids : ids.first(sample.context_tokens);
        for (const Method& group : CodecGroups(methods.runnable)) {
          CACHET_ASSIGN_OR_RETURN(Engine * ge, EngineFor(engine, group, engines));
          auto prefilled = ge->NewSession();
          ObserveIfNeeded(methods.runnable, group, static_cast<int32_t>(prefix.size()), *prefilled);
          auto t0 = Clock::now();
          CACHET_RETURN_IF_ERROR(prefilled->Eval(prefix, &prefill_logits));
          const PrefilledSample p{sample,
                                  spec.kind,
                                  at,
                                  prefix,
                                  *prefilled,
                                  prefill_logits,
                                  SecondsSince(t0),
                                  prefilled->kv_bytes()};
          for (size_t mi = 0; mi < methods.runnable.size(); ++mi) {
            const Method& m = methods.runnable[mi];
            if (m.compress_at != at || !SameCodecs(m, group)) continue;
            CACHET_RETURN_IF_ERROR(
                RunSampleMethod(m, *ge, p, o, decoder, tok, logits, SampleOut{acc[mi], preds}));
          }
        }
      }
      if (bar) bar->Add(spec.length);
    }

    const double cell_s = SecondsSince(cell_start);
    for (size_t mi = 0; mi < methods.runnable.size(); ++mi) {
      rows.push_back(TaskRow(base, methods.runnable[mi], acc[mi], spec, o, engine, engines));
      rows.back().wall_s = cell_s;
    }
    for (const auto& [m, reason] : methods.unavailable) {
      rows.push_back(UnavailableRow(base, m, reason));
    }
  }
  return rows;
}

namespace {

Result<std::vector<int32_t>> TextTokens(const Tokenizer& tok, const std::string& path,
                                        int64_t offset, size_t need) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open (--text)");
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  size_t start = offset < 0 ? text.size() / 4 : static_cast<size_t>(offset);
  if (start >= text.size()) {
    return OutOfRange(path + ": offset " + std::to_string(start) + " is past the end");
  }
  // Start on a paragraph boundary, so the first window does not open mid-word.
  if (start > 0) {
    const size_t para = text.find("\n\n", start);
    if (para != std::string::npos) start = para + 2;
  }
  // Tokenize only what the windows need (about 4 bytes a token), growing if that was short.
  for (size_t bytes = need * 6 + 4096;; bytes *= 2) {
    const size_t n = std::min(bytes, text.size() - start);
    std::vector<int32_t> ids = tok.Encode(std::string_view(text).substr(start, n));
    const bool whole = n == text.size() - start;
    // Beyond the cut, the last tokens may be split differently: keep a margin unless at the end.
    if (ids.size() >= need + (whole ? 0 : 16)) {
      ids.resize(need);
      return ids;
    }
    if (whole) {
      return OutOfRange(path + " has " + std::to_string(ids.size()) + " tokens after byte " +
                        std::to_string(start) + "; the windows need " + std::to_string(need));
    }
  }
}

// Test-only logit noise: portable Box-Muller over 53-bit uniforms.
void Perturb(std::span<float> logits, double stddev, std::mt19937_64& rng) {
  auto uniform = [&] { return (double(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for (float& x : logits) {
    x += static_cast<float>(stddev * std::sqrt(-2 * std::log(uniform())) *
                            std::cos(6.283185307179586 * uniform()));
  }
}

struct KlRun {
  KlAccumulator kl;
  double prefill_s = 0, kv_prefill = 0, kv_peak = 0;
  int64_t tokens = 0;
  double held_bytes = 0, held_values = 0;  // sums over the samples of kv_bits_held
};

}  // namespace

namespace {

// The scored half of a KL window: the logits of every position of its second half, in one
// batch or (decode) one token at a time; a run counts the bits held before and after each step.
struct SecondHalf {
  std::span<const int32_t> ids;
  int half;
  bool decode;
  int vocab;
  double values_per_token;

  Status Score(Session& session, std::vector<float>* out, KlRun* run,
               std::vector<float>* step_logits) const {
    auto held = [&] {
      if (!run) return;
      run->held_bytes += double(session.kv_bytes());
      run->held_values += double(session.n_tokens()) * values_per_token;
    };
    held();
    if (!decode) {
      CACHET_RETURN_IF_ERROR(session.Eval(ids.subspan(half), out, /*all_logits=*/true));
      held();
      return OkStatus();
    }
    out->resize((ids.size() - half) * size_t(vocab));
    for (size_t i = half; i < ids.size(); ++i) {
      CACHET_RETURN_IF_ERROR(session.Eval(ids.subspan(i, 1), step_logits));
      std::copy(step_logits->begin(), step_logits->end(), out->begin() + (i - half) * vocab);
      held();
    }
    return OkStatus();
  }
};

// A method's row of the KL sweep from what its windows accumulated.
ResultRow KlRow(const ResultRow& base, const Method& m, const KlRun& run, int windows,
                Engine& engine, const EngineCache& engines) {
  const KlSummary s = run.kl.Summary();
  ResultRow r = base;
  r.method = m;
  r.bits_per_value = StoredBitsPerValue(r.method, engine);
  r.scored_tokens = s.positions;
  r.mean_kl = s.mean_kl;
  r.p99_kl = s.p99_kl;
  r.top1_agree = s.top1_agree;
  r.ppl_ref = s.ppl_ref;
  r.ppl = s.ppl;
  r.kv_bytes_prefill = run.kv_prefill / windows;
  r.kv_bytes_peak = run.kv_peak;
  r.kv_bits_held = 8 * run.held_bytes / run.held_values;
  r.kv_pool_high_water_bytes = PoolHighWater(engine, engines);
  r.peak_rss_bytes = PeakRssBytes();
  r.prefill_tok_s = run.tokens / run.prefill_s;
  return r;
}

}  // namespace

Result<std::vector<ResultRow>> RunKlSweep(Engine& engine, const KlOptions& o) {
  if (o.windows < 1) return InvalidArgument("--windows must be >= 1");
  if (o.window_len < 8) return InvalidArgument("--window-len must be >= 8");
  if (o.window_len > engine.n_ctx()) {
    return InvalidArgument("--window-len " + std::to_string(o.window_len) +
                           " exceeds the context size " + std::to_string(engine.n_ctx()));
  }
  if (Status s = MethodAvailable(o.reference); !s.ok()) {
    return InvalidArgument("the KL reference must be runnable: " + s.message());
  }
  CACHET_ASSIGN_OR_RETURN(MethodSet methods, SortMethods(o.methods));

  const Tokenizer& tok = engine.tokenizer();
  const bool bos = tok.add_bos() && tok.bos_id() >= 0;
  const int L = o.window_len, half = L / 2, text_per_window = L - (bos ? 1 : 0);
  const std::string path = o.text_file.empty() ? DefaultHaystackDir() + "/pydocs.txt" : o.text_file;
  CACHET_ASSIGN_OR_RETURN(std::vector<int32_t> text,
                          TextTokens(tok, path, o.offset, size_t(o.windows) * text_per_window));

  const int vocab = engine.config().vocab_size;
  const ModelConfig& cfg = engine.config();
  const double values_per_token = 2.0 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim;
  EngineCache engines;
  std::mt19937_64 noise(MixSeed(o.seed, 0x6e6f697365));
  std::vector<KlRun> runs(methods.runnable.size());
  std::vector<int32_t> window(L);
  std::vector<float> ref_logits, logits, step_logits;
  std::ofstream dump;
  if (!o.dump_windows.empty()) {
    dump.open(o.dump_windows, std::ios::binary | std::ios::trunc);
    if (!dump) return NotFound(o.dump_windows + ": cannot open for writing (--dump-windows)");
  }
  std::unique_ptr<ProgressBar> bar;
  if (o.progress && !methods.runnable.empty()) bar = std::make_unique<ProgressBar>("kl", o.windows);
  const auto start = Clock::now();

  for (int w = 0; w < o.windows && !methods.runnable.empty(); ++w) {
    window.clear();
    if (bos) window.push_back(tok.bos_id());
    window.insert(window.end(), text.begin() + size_t(w) * text_per_window,
                  text.begin() + size_t(w + 1) * text_per_window);
    const std::span<const int32_t> ids(window);
    const SecondHalf half_of{ids, half, o.decode, vocab, values_per_token};
    if (dump.is_open()) {
      dump << nlohmann::json{{"window", w}, {"score_from", half}, {"ids", window}}.dump() << '\n';
    }
    {
      CACHET_ASSIGN_OR_RETURN(Engine * re, EngineFor(engine, o.reference, engines));
      auto reference = re->NewSession();
      ObserveIfNeeded({o.reference}, o.reference, static_cast<int32_t>(half), *reference);
      CACHET_RETURN_IF_ERROR(reference->Eval(ids.first(half), nullptr));
      CACHET_RETURN_IF_ERROR(ApplyMethod(o.reference, *reference));
      CACHET_RETURN_IF_ERROR(half_of.Score(*reference, &ref_logits, nullptr, &step_logits));
    }
    for (const Method& group : CodecGroups(methods.runnable)) {
      CACHET_ASSIGN_OR_RETURN(Engine * ge, EngineFor(engine, group, engines));
      auto prefilled = ge->NewSession();
      ObserveIfNeeded(methods.runnable, group, static_cast<int32_t>(half), *prefilled);
      auto t0 = Clock::now();
      CACHET_RETURN_IF_ERROR(prefilled->Eval(ids.first(half), nullptr));
      const double prefill_s = SecondsSince(t0);
      const size_t prefill_bytes = prefilled->kv_bytes();

      for (size_t mi = 0; mi < methods.runnable.size(); ++mi) {
        if (!SameCodecs(methods.runnable[mi], group)) continue;
        KlRun& run = runs[mi];
        const Method& m = methods.runnable[mi];
        std::unique_ptr<Session> session;
        size_t own_peak = prefill_bytes;
        auto t1 = Clock::now();
        if (CompressesDuringPrefill(m)) {
          session = ge->NewSession();
          CACHET_RETURN_IF_ERROR(
              PrefillCompressing(m, ids.first(half), *session, nullptr, &own_peak));
        } else {
          session = prefilled->Fork();
          CACHET_RETURN_IF_ERROR(ApplyMethod(m, *session, {}, &own_peak));
        }
        const size_t start_bytes = session->kv_bytes();
        CACHET_RETURN_IF_ERROR(half_of.Score(*session, &logits, &run, &step_logits));
        run.prefill_s += prefill_s + SecondsSince(t1);
        run.tokens += L;
        run.kv_prefill += double(start_bytes);
        run.kv_peak = std::max(run.kv_peak, double(std::max(own_peak, session->kv_bytes())));
        if (o.test_perturb_logits > 0) Perturb(logits, o.test_perturb_logits, noise);
        // Row p holds the logits at position half + p, predicting token half + p + 1.
        for (int p = 0; half + p + 1 < L; ++p) {
          const size_t off = size_t(p) * vocab;
          run.kl.Add(std::span<const float>(ref_logits).subspan(off, vocab),
                     std::span<const float>(logits).subspan(off, vocab), window[half + p + 1]);
        }
      }
    }
    if (bar) bar->Add();
  }

  ResultRow base;
  base.kind = "kl";
  base.model = o.model_name;
  base.task = o.decode ? "text-decode" : "text";
  base.length = L;
  base.prompt_tokens = L;
  base.seed = o.seed;
  base.threads = engine.threads();
  base.samples = o.windows;
  base.depth = "";
  std::vector<ResultRow> rows;
  for (size_t mi = 0; mi < methods.runnable.size(); ++mi) {
    ResultRow r = KlRow(base, methods.runnable[mi], runs[mi], o.windows, engine, engines);
    r.wall_s = SecondsSince(start);
    rows.push_back(std::move(r));
  }
  for (const auto& [m, reason] : methods.unavailable)
    rows.push_back(UnavailableRow(base, m, reason));
  return rows;
}

}  // namespace cachet::eval
