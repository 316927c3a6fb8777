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

namespace {

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

}  // namespace cachet::eval
