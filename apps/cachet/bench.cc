// cachet bench: prefill and decode speed at several context lengths, with the decode roofline.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <tuple>

#include "cachet/commands.h"
#include "eval/harness.h"
#include "kv/codecs/codec.h"
#include "kv/press/press.h"
#include "model/config.h"
#include "model/transformer.h"
#include "runtime/sampler.h"
#include "util/progress.h"
#include "util/thread_pool.h"

namespace cachet::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct Summary {
  double median = 0, min = 0, max = 0;
};

Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Summary s;
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

// Read bandwidth of all threads streaming a buffer far larger than the caches, in bytes/s.
double MeasureReadBandwidth(ThreadPool& pool) {
  const size_t n = (size_t{512} << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  std::vector<uint64_t> sums(pool.size());
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    const int tasks = pool.size();
    pool.Run(tasks, [&](int64_t t, int thread) {
      const size_t lo = n * t / tasks, hi = n * (t + 1) / tasks;
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (size_t i = lo; i + 4 <= hi; i += 4) {
        s0 += buf[i], s1 += buf[i + 1], s2 += buf[i + 2], s3 += buf[i + 3];
      }
      sums[thread] += s0 + s1 + s2 + s3;
    });
    runs.push_back(n * sizeof(uint64_t) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (std::accumulate(sums.begin(), sums.end(), uint64_t{0}) == 0) std::fputs("", stderr);
  return Summarize(runs).median;
}

int64_t WeightBytesPerToken(const Transformer& model) {
  const ModelWeights& w = model.weights();
  auto bytes = [](const kernels::Matrix& m) {
    return m.rows * int64_t(DTypeRowBytes(m.dtype, m.cols));
  };
  int64_t total = bytes(w.lm_head);
  for (const LayerWeights& L : w.layers) {
    for (const auto* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      total += bytes(*m);
    }
  }
  return total;
}

// Fraction of a cold prefill's FLOPs left when the first f*N tokens are cached: weights (all
// projections and the LM head) for the uncached tokens, attention of each over all before it.
double RemainingWorkFraction(const ModelConfig& c, int n, int cached) {
  const double d = c.hidden_size, q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim;
  const double w = 2.0 * (c.n_layers * (2 * d * q + 2 * d * kv + 3 * d * c.intermediate_size) +
                          d * c.vocab_size);
  const double a = 4.0 * c.n_layers * q;  // q.k and p.v per key
  auto work = [&](double from) { return (n - from) * w + a * (double(n) * n - from * from) / 2.0; };
  return work(cached) / work(0);
}

nlohmann::json PrefixHitBench(Engine& engine, const std::vector<int32_t>& tokens,
                              const std::vector<double>& fractions, int reps) {
  const ModelConfig& c = engine.config();
  const int n = static_cast<int>(tokens.size());
  const int page = engine.options().page_tokens;
  nlohmann::json out;
  out["model"] = engine.options().model_dir;
  out["threads"] = engine.pool().size();
  out["ctx"] = n;
  out["reps"] = reps;
  ProgressBar progress("bench --prefix-hit", int64_t(fractions.size()) * reps);
  double ttft0 = 0;
  for (double f : fractions) {
    const int cached = static_cast<int>(f * n) / page * page;
    std::vector<double> ms;
    for (int rep = 0; rep < reps; ++rep) {
      engine.ClearPrefixCache();
      if (cached > 0) {  // a previous request with the same first `cached` tokens
        auto warm = engine.NewSession();
        if (!warm->Eval(std::span(tokens).first(cached + 1), nullptr).ok()) continue;
        warm->Publish();
      }
      auto session = engine.NewSession();
      std::vector<float> logits;
      auto t0 = Clock::now();
      Status s = session->Eval(tokens, &logits);
      const int32_t first = ArgMax(logits);
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (!s.ok() || first < 0) {
        std::fprintf(stderr, "cachet: %s\n", s.ToString().c_str());
        throw CLI::RuntimeError(1);
      }
      if (f == fractions.front() && rep == 0) {
        out["kv_bytes_per_token"] = double(engine.kv_stats().bytes_used) / n;
      }
      progress.Add();
    }
    const Summary sm = Summarize(ms);
    char key[32];
    std::snprintf(key, sizeof key, "%g", f);
    if (cached == 0) ttft0 = sm.median;
    out["ttft_ms"][key] = sm.median;
    out["ttft_ms_min_max"][key] = {sm.min, sm.max};
    out["cached_tokens"][key] = cached;
    out["r"][key] = RemainingWorkFraction(c, n, cached);
    out["ttft_ratio"][key] = ttft0 > 0 ? sm.median / ttft0 : 0.0;
  }
  return out;
}

}  // namespace

void AddBench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench",
                                 "Measure prefill and decode tokens/s at several "
                                 "context lengths (median of --reps runs, min/max)");
  struct Opts {
    EngineOptions engine;
    std::vector<int> ctx{512, 4096};
    int reps = 3;
    int n_decode = 32;
    bool json = false;
    bool roofline = true;
    std::vector<double> prefix_hit;
    std::vector<std::string> vs;  // other cache types, K[:V]
    GenerateOptions gen;          // its press, if any
  };
  auto o = std::make_shared<Opts>();
  AddEngineFlags(*cmd, o->engine);
  AddPressFlags(*cmd, o->gen);
  cmd->add_option("--ctx", o->ctx, "Context lengths to measure, e.g. 512,4096")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--reps", o->reps, "Runs per measurement (the median is reported)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--n-decode", o->n_decode, "Tokens decoded after each prefill")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--vs", o->vs,
                  "Also measure these KV cache types (K[:V], e.g. q4_0 or q8_0:q4_0), one engine "
                  "each, running every rep on each engine in turn so that machine noise hits them "
                  "alike; reports each one's tok/s and the median over reps of its ratio to the "
                  "--ctk/--ctv cache's rep just before (JSON key vs)")
      ->delimiter(',');
  cmd->add_flag("--json", o->json, "Print one JSON object instead of a table");
  cmd->add_flag("!--no-roofline", o->roofline, "Skip the memory-bandwidth roofline measurement");
  cmd->add_option("--prefix-hit", o->prefix_hit,
                  "Instead: time to first token at each largest --ctx when this fraction of the "
                  "prompt is already in the prefix cache, e.g. 0,0.5,0.9 (JSON key ttft_ms)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  cmd->callback([o] {
    EngineOptions eo = o->engine;
    const int max_ctx = *std::max_element(o->ctx.begin(), o->ctx.end());
    eo.n_ctx = std::max(eo.n_ctx, max_ctx + o->n_decode);
    auto engine = LoadEngine(eo);
    if (!engine) throw CLI::RuntimeError(1);
    const ModelConfig& c = engine->config();
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> dist(3, c.vocab_size - 1);
    std::vector<int32_t> tokens(max_ctx);
    for (int32_t& t : tokens) t = dist(rng);

    nlohmann::json out;
    if (!o->prefix_hit.empty()) {
      out = PrefixHitBench(*engine, tokens, o->prefix_hit, o->reps);
      if (o->json) {
        std::printf("%s\n", out.dump().c_str());
      } else {
        std::printf("ctx %d, %d threads, median of %d runs\n", max_ctx, engine->pool().size(),
                    o->reps);
        std::printf("%8s  %10s  %16s  %8s  %10s\n", "hit", "TTFT ms", "TTFT/TTFT(0)", "r(f)",
                    "ratio/r");
        for (const auto& [k, v] : out["ttft_ms"].items()) {
          const double ratio = out["ttft_ratio"][k].get<double>(), r = out["r"][k].get<double>();
          std::printf("%8s  %10.1f  %16.3f  %8.3f  %10.3f\n", k.c_str(), v.get<double>(), ratio, r,
                      ratio / r);
        }
        std::printf("KV bytes/token measured by the pool %.1f, theoretical (f32) %lld\n",
                    out["kv_bytes_per_token"].get<double>(),
                    static_cast<long long>(c.KvBytesPerToken(4)));
      }
      return;
    }
    // --vs: one more engine per cache type, each rep run on every engine in turn.
    std::vector<std::unique_ptr<Engine>> others;
    for (const std::string& kv : o->vs) {
      EngineOptions vo = eo;
      std::tie(vo.kv_codec_k, vo.kv_codec_v) = codecs::SplitKv(kv);
      others.push_back(LoadEngine(vo));
      if (!others.back()) throw CLI::RuntimeError(1);
    }
    out["model"] = engine->options().model_dir;
    out["threads"] = engine->pool().size();
    out["reps"] = o->reps;
    out["n_decode"] = o->n_decode;
    ProgressBar progress("bench", int64_t(o->ctx.size()) * o->reps * (1 + others.size()));
    const auto& press = o->gen.press;
    if (press) out["press"] = press::PressSpec(*press);
    struct Rep {
      double prefill = 0, decode = 0;  // tok/s
      double press_ms = 0, kv_before = 0, kv_after = 0;
    };
    auto run_rep = [&](Engine& e, int ctx) {
      Rep r;
      auto session = e.NewSession();
      if (press) session->PrepareForPress(*press, ctx);  // Quest: page bounds built in prefill
      auto t0 = Clock::now();
      Status s = session->Eval(std::span<const int32_t>(tokens.data(), ctx), nullptr);
      const double pf = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!s.ok()) {
        std::fprintf(stderr, "cachet: %s\n", s.ToString().c_str());
        throw CLI::RuntimeError(1);
      }
      if (press) {  // scoring, planning and compaction, timed apart from the prefill
        r.kv_before = double(session->kv().bytes_held());
        auto tp = Clock::now();
        auto pr = session->Compress(*press);
        r.press_ms = std::chrono::duration<double, std::milli>(Clock::now() - tp).count();
        if (!pr.ok()) {
          std::fprintf(stderr, "cachet: %s\n", pr.status().ToString().c_str());
          throw CLI::RuntimeError(1);
        }
        r.kv_after = double(session->kv().bytes_held());
      }
      auto t1 = Clock::now();
      for (int i = 0; i < o->n_decode; ++i) {
        const int32_t one[1] = {tokens[i % ctx]};
        s = session->Eval(one, nullptr);
        if (!s.ok()) throw CLI::RuntimeError(1);
      }
      const double dc = std::chrono::duration<double>(Clock::now() - t1).count();
      r.prefill = ctx / pf;
      r.decode = o->n_decode / dc;
      progress.Add();
      return r;
    };
    for (int ctx : o->ctx) {
      std::vector<double> prefill, decode, press_ms, kv_before, kv_after;
      // Per other engine: its tok/s and its ratio to the main engine's rep run just before.
      std::vector<std::vector<double>> vs_pf(others.size()), vs_dc(others.size()),
          vs_pf_x(others.size()), vs_dc_x(others.size());
      for (int rep = 0; rep < o->reps; ++rep) {
        const Rep r = run_rep(*engine, ctx);
        prefill.push_back(r.prefill);
        decode.push_back(r.decode);
        press_ms.push_back(r.press_ms);
        kv_before.push_back(r.kv_before);
        kv_after.push_back(r.kv_after);
        for (size_t i = 0; i < others.size(); ++i) {
          const Rep v = run_rep(*others[i], ctx);
          vs_pf[i].push_back(v.prefill);
          vs_dc[i].push_back(v.decode);
          vs_pf_x[i].push_back(v.prefill / r.prefill);
          vs_dc_x[i].push_back(v.decode / r.decode);
        }
      }
      for (size_t i = 0; i < others.size(); ++i) {
        nlohmann::json& j = out["vs"][o->vs[i]][std::to_string(ctx)];
        j["prefill_tok_s"] = Summarize(vs_pf[i]).median;
        j["decode_tok_s"] = Summarize(vs_dc[i]).median;
        j["prefill_ratio"] = Summarize(vs_pf_x[i]).median;
        const Summary x = Summarize(vs_dc_x[i]);
        j["decode_ratio"] = x.median;
        j["decode_ratio_min_max"] = {x.min, x.max};
      }
      const Summary p = Summarize(prefill), d = Summarize(decode);
      const std::string key = std::to_string(ctx);
      out["prefill_tok_s"][key] = p.median;
      out["decode_tok_s"][key] = d.median;
      out["prefill_tok_s_min_max"][key] = {p.min, p.max};
      out["decode_tok_s_min_max"][key] = {d.min, d.max};
      if (press) {
        const double ms = Summarize(press_ms).median;
        out["press_ms"][key] = ms;
        out["press_fraction_of_prefill"][key] = ms / 1e3 / (ctx / p.median);
        out["kv_bytes_before_press"][key] = Summarize(kv_before).median;
        out["kv_bytes_after_press"][key] = Summarize(kv_after).median;
      }
    }
    if (o->roofline) {
      const double bw = MeasureReadBandwidth(engine->pool());
      const int64_t wbytes = WeightBytesPerToken(engine->transformer());
      out["read_bandwidth_gb_s"] = bw / 1e9;
      out["weight_bytes_per_token"] = wbytes;
      // KV bytes a decode step reads per context token, as the cache stores them (codes, scales
      // and positions of a full page).
      const KvLayout& lay = engine->kv_pool().layout();
      const double kv_token = double(lay.page_bytes()) * lay.heads_total() / lay.page_tokens;
      out["kv_bytes_per_context_token"] = kv_token;
      for (int ctx : o->ctx) {
        const double bytes = double(wbytes) + kv_token * ctx;
        out["decode_roofline_tok_s"][std::to_string(ctx)] = bw / bytes;
      }
    }
    out["peak_rss_bytes"] = eval::PeakRssBytes();
    if (o->json) {
      std::printf("%s\n", out.dump().c_str());
      return;
    }
    std::printf("model %s, %d threads, median of %d runs (min-max)\n",
                engine->options().model_dir.c_str(), engine->pool().size(), o->reps);
    std::printf("%8s  %24s  %24s  %12s\n", "ctx", "prefill tok/s", "decode tok/s", "roofline");
    for (int ctx : o->ctx) {
      const std::string k = std::to_string(ctx);
      char pf[64], dc[64], rl[32] = "-";
      std::snprintf(pf, sizeof pf, "%.1f (%.1f-%.1f)", out["prefill_tok_s"][k].get<double>(),
                    out["prefill_tok_s_min_max"][k][0].get<double>(),
                    out["prefill_tok_s_min_max"][k][1].get<double>());
      std::snprintf(dc, sizeof dc, "%.1f (%.1f-%.1f)", out["decode_tok_s"][k].get<double>(),
                    out["decode_tok_s_min_max"][k][0].get<double>(),
                    out["decode_tok_s_min_max"][k][1].get<double>());
      if (o->roofline) {
        std::snprintf(rl, sizeof rl, "%.1f", out["decode_roofline_tok_s"][k].get<double>());
      }
      std::printf("%8d  %24s  %24s  %12s\n", ctx, pf, dc, rl);
    }
    if (o->roofline) {
      std::printf(
          "read bandwidth %.1f GB/s; decode reads %.1f MB of weights + %.0f B of KV per "
          "context token per token\n",
          out["read_bandwidth_gb_s"].get<double>(),
          out["weight_bytes_per_token"].get<double>() / 1e6,
          out["kv_bytes_per_context_token"].get<double>());
    }
    if (press) {
      std::printf("press %s: KV MiB before -> after, press ms (fraction of the prefill)\n",
                  out["press"].get<std::string>().c_str());
      for (int ctx : o->ctx) {
        const std::string k = std::to_string(ctx);
        std::printf("%8d  %8.2f -> %8.2f  %8.1f ms (%.1f%%)\n", ctx,
                    out["kv_bytes_before_press"][k].get<double>() / 1048576.0,
                    out["kv_bytes_after_press"][k].get<double>() / 1048576.0,
                    out["press_ms"][k].get<double>(),
                    100 * out["press_fraction_of_prefill"][k].get<double>());
      }
    }
    if (!others.empty()) {
      std::printf(
          "vs %s (reps interleaved; x = median of per-rep ratios, decode min-max)\n",
          engine->options().kv_codec_k == engine->options().kv_codec_v
              ? engine->options().kv_codec_k.c_str()
              : (engine->options().kv_codec_k + ":" + engine->options().kv_codec_v).c_str());
      std::printf("%8s  %-12s  %14s  %6s  %14s  %18s\n", "ctx", "cache", "prefill tok/s", "x",
                  "decode tok/s", "x");
      for (const std::string& name : o->vs) {
        for (int ctx : o->ctx) {
          const nlohmann::json& j = out["vs"][name][std::to_string(ctx)];
          char x[48];
          std::snprintf(x, sizeof x, "%.2f (%.2f-%.2f)", j["decode_ratio"].get<double>(),
                        j["decode_ratio_min_max"][0].get<double>(),
                        j["decode_ratio_min_max"][1].get<double>());
          std::printf("%8d  %-12s  %14.1f  %6.2f  %14.1f  %18s\n", ctx, name.c_str(),
                      j["prefill_tok_s"].get<double>(), j["prefill_ratio"].get<double>(),
                      j["decode_tok_s"].get<double>(), x);
        }
      }
    }
  });
}

}  // namespace cachet::cli
