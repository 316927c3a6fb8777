// The KL sweep (`cachet eval --kl`): windows of a text, each scored on its second half by every
// method's cache against the reference cache's logits, in batch or one token at a time.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <sstream>

#include "cachet/engine.h"
#include "cachet/eval/harness.h"
#include "cachet/eval/tasks.h"
#include "cachet/progress.h"
#include "cachet/tokenizer.h"
#include "eval/fidelity.h"
#include "eval/sweep.h"

namespace cachet::eval {

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
