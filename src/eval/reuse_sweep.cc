// The multidoc cell of a task sweep: documents reused as chunks (Session::EvalChunked) with each
// blend, against the full prefill of the same tokens (docs/REUSE.md).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cachet/engine.h"
#include "eval/fidelity.h"
#include "eval/sweep.h"

namespace cachet::eval {
namespace {

struct ReuseAcc {
  int n = 0, correct = 0, chunk_misses = 0;
  double ttft_ms = 0, prompt_tokens = 0, chunk_tokens = 0, recomputed = 0, kv_bytes = 0;
  double decode_s = 0;
  int64_t decode_tokens = 0;
  KlAccumulator kl;
};

// The logits at every answer position: after the prompt, then after each answer token but the
// last (teacher-forced on a fork, the session left as it was).
Result<std::vector<std::vector<float>>> AnswerLogits(const Session& s,
                                                     const std::vector<float>& prompt_logits,
                                                     std::span<const int32_t> answer, int vocab) {
  std::vector<std::vector<float>> rows{prompt_logits};
  if (answer.size() > 1) {
    auto fork = s.Fork();
    std::vector<float> all;
    CACHET_RETURN_IF_ERROR(fork->Eval(answer.first(answer.size() - 1), &all, true));
    for (size_t i = 0; i + 1 < answer.size(); ++i) {
      rows.emplace_back(all.begin() + i * vocab, all.begin() + (i + 1) * vocab);
    }
  }
  return rows;
}

}  // namespace

Result<std::vector<ResultRow>> RunReuseCell(Engine& engine, TaskGenerator& gen,
                                            const TaskSpec& spec, const SweepOptions& o,
                                            const Decoder& decoder, ProgressBar* bar,
                                            std::ofstream& preds) {
  const Tokenizer& tok = engine.tokenizer();
  const int vocab = engine.config().vocab_size;
  std::vector<Method> methods(1);
  methods[0].codec_k = engine.options().kv_codec_k;
  methods[0].codec_v = engine.options().kv_codec_v;
  for (const BlendOptions& b : o.blends) {
    methods.push_back(methods[0]);
    methods.back().blend = b;
  }
  std::vector<ReuseAcc> acc(methods.size());
  const auto cell_start = Clock::now();
  std::vector<float> logits;
  for (int index = 0; index < o.samples; ++index) {
    CACHET_ASSIGN_OR_RETURN(TaskSample sample, gen.Generate(spec, o.seed, index));
    const std::span<const int32_t> ids(sample.ids);
    size_t doc_tokens = 0;
    for (const auto& d : sample.doc_ids) doc_tokens += d.size();
    const size_t lead = ids.size() - doc_tokens - sample.question_ids[0].size();
    std::vector<PromptPart> parts{{ids.first(lead), false}};
    for (const auto& d : sample.doc_ids) parts.push_back({d, true});
    parts.push_back({sample.question_ids[0], false});
    const std::vector<int32_t> answer = tok.Encode(" " + sample.answer);
    std::vector<std::vector<float>> reference;
    for (size_t mi = 0; mi < methods.size(); ++mi) {
      const Method& m = methods[mi];
      if (mi == 1) {  // the chunks cached before the timed runs, as a reused document is
        auto warm = engine.NewSession();
        CACHET_RETURN_IF_ERROR(warm->EvalChunked(parts, BlendOptions{}, nullptr));
      }
      ReuseAcc& a = acc[mi];
      auto session = engine.NewSession();
      ChunkReuseStats stats;
      const auto t0 = Clock::now();
      if (m.blend) {
        CACHET_RETURN_IF_ERROR(session->EvalChunked(parts, *m.blend, &logits, &stats));
      } else {
        CACHET_RETURN_IF_ERROR(session->Eval(ids, &logits));
      }
      const double ttft_ms = 1e3 * SecondsSince(t0);
      CACHET_ASSIGN_OR_RETURN(auto rows, AnswerLogits(*session, logits, answer, vocab));
      if (mi == 0) reference = rows;
      for (size_t i = 0; i < rows.size(); ++i) a.kl.Add(reference[i], rows[i], answer[i]);
      size_t peak = session->kv_bytes();
      a.kv_bytes += double(peak);
      CACHET_ASSIGN_OR_RETURN(const Answer ans, DecodeAnswer(decoder, *session, &logits, &peak));
      const bool correct = ans.prediction == sample.answer;
      a.n += 1;
      a.correct += correct;
      a.ttft_ms += ttft_ms;
      a.prompt_tokens += double(ids.size());
      a.chunk_tokens += stats.chunk_tokens;
      a.recomputed += stats.recomputed_tokens;
      a.chunk_misses += stats.chunk_misses;
      a.decode_s += ans.seconds;
      a.decode_tokens += ans.evals;
      if (preds.is_open()) {
        nlohmann::ordered_json j = {{"id", sample.id},
                                    {"method", m.Label()},
                                    {"prediction", ans.prediction},
                                    {"answer", sample.answer},
                                    {"correct", correct},
                                    {"needle_depth", sample.depth},
                                    {"prompt_tokens", ids.size()},
                                    {"ttft_ms", ttft_ms}};
        preds << j.dump() << '\n';
      }
    }
    if (bar) bar->Add(spec.length);
  }
  std::vector<ResultRow> rows;
  for (size_t mi = 0; mi < methods.size(); ++mi) {
    const ReuseAcc& a = acc[mi];
    if (a.chunk_misses > 0) {
      std::fprintf(stderr,
                   "[eval] multidoc %s: %d chunks were not in the chunk cache when timed (the "
                   "KV pool is too small to keep them: raise --kv-mem)\n",
                   methods[mi].Label().c_str(), a.chunk_misses);
    }
    ResultRow r;
    r.model = o.model_name;
    r.task = TaskName(spec.kind);
    r.length = spec.length;
    r.needles = 1;
    r.docs = spec.docs;
    r.depth = DepthName(spec.depth);
    r.method = methods[mi];
    r.seed = o.seed;
    r.threads = engine.threads();
    r.samples = a.n;
    r.correct = a.correct;
    r.accuracy = double(a.correct) / a.n;
    r.answer_kl = a.kl.Summary().mean_kl;
    if (methods[mi].blend) r.recomputed_fraction = a.recomputed / std::max(1.0, a.chunk_tokens);
    r.prompt_tokens = a.prompt_tokens / a.n;
    r.kv_bytes_prefill = a.kv_bytes / a.n;
    r.peak_rss_bytes = PeakRssBytes();
    r.ttft_ms = a.ttft_ms / a.n;
    r.prefill_tok_s = a.prompt_tokens / (a.ttft_ms / 1e3);
    if (a.decode_tokens > 0) r.decode_tok_s = a.decode_tokens / a.decode_s;
    r.wall_s = SecondsSince(cell_start);
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace cachet::eval
