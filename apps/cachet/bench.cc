// cachet bench: prefill and decode speed at several context lengths, with the decode roofline.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "cachet/commands.h"
#include "model/config.h"
#include "model/transformer.h"
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
    return m.rows * m.cols * int64_t(DTypeSize(m.dtype));
  };
  int64_t total = bytes(w.lm_head);
  for (const LayerWeights& L : w.layers) {
    for (const auto* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      total += bytes(*m);
    }
  }
  return total;
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
  };
  auto o = std::make_shared<Opts>();
  AddEngineFlags(*cmd, o->engine);
  cmd->add_option("--ctx", o->ctx, "Context lengths to measure, e.g. 512,4096")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--reps", o->reps, "Runs per measurement (the median is reported)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--n-decode", o->n_decode, "Tokens decoded after each prefill")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", o->json, "Print one JSON object instead of a table");
  cmd->add_flag("!--no-roofline", o->roofline, "Skip the memory-bandwidth roofline measurement");
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
    out["model"] = engine->options().model_dir;
    out["threads"] = engine->pool().size();
    out["reps"] = o->reps;
    out["n_decode"] = o->n_decode;
    ProgressBar progress("bench", int64_t(o->ctx.size()) * o->reps);
    for (int ctx : o->ctx) {
      std::vector<double> prefill, decode;
      for (int rep = 0; rep < o->reps; ++rep) {
        auto session = engine->NewSession();
        auto t0 = Clock::now();
        Status s = session->Eval(std::span<const int32_t>(tokens.data(), ctx), nullptr);
        const double pf = std::chrono::duration<double>(Clock::now() - t0).count();
        if (!s.ok()) {
          std::fprintf(stderr, "cachet: %s\n", s.ToString().c_str());
          throw CLI::RuntimeError(1);
        }
        auto t1 = Clock::now();
        for (int i = 0; i < o->n_decode; ++i) {
          const int32_t one[1] = {tokens[i % ctx]};
          s = session->Eval(one, nullptr);
          if (!s.ok()) throw CLI::RuntimeError(1);
        }
        const double dc = std::chrono::duration<double>(Clock::now() - t1).count();
        prefill.push_back(ctx / pf);
        decode.push_back(o->n_decode / dc);
        progress.Add();
      }
      const Summary p = Summarize(prefill), d = Summarize(decode);
      const std::string key = std::to_string(ctx);
      out["prefill_tok_s"][key] = p.median;
      out["decode_tok_s"][key] = d.median;
      out["prefill_tok_s_min_max"][key] = {p.min, p.max};
      out["decode_tok_s_min_max"][key] = {d.min, d.max};
    }
    if (o->roofline) {
      const double bw = MeasureReadBandwidth(engine->pool());
      const int64_t wbytes = WeightBytesPerToken(engine->transformer());
      out["read_bandwidth_gb_s"] = bw / 1e9;
      out["weight_bytes_per_token"] = wbytes;
      for (int ctx : o->ctx) {
        const double bytes = double(wbytes) + double(c.KvBytesPerToken(4)) * ctx;
        out["decode_roofline_tok_s"][std::to_string(ctx)] = bw / bytes;
      }
    }
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
          "read bandwidth %.1f GB/s; decode reads %.1f MB of weights + %lld B of KV per "
          "context token per token\n",
          out["read_bandwidth_gb_s"].get<double>(),
          out["weight_bytes_per_token"].get<double>() / 1e6,
          static_cast<long long>(c.KvBytesPerToken(4)));
    }
  });
}

}  // namespace cachet::cli
