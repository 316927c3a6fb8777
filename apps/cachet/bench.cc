// cachet bench: prefill and decode speed at several context lengths, with the decode roofline;
// its other scenarios (--prefix-hit, --serve-capacity, --tier-ttft: bench_scenarios.cc;
// --agents: bench_agents.cc) are run from here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "cachet/eval/harness.h"
#include "cachet/kv_codecs.h"
#include "cachet/machine.h"
#include "cachet/model_config.h"
#include "cachet/press.h"
#include "cachet/progress.h"
#include "cachet/sampling.h"
#include "cachet/serving.h"
#include "commands.h"

namespace cachet::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Where decode streams the weights from: a step takes a TLB miss per page, and 4 KiB pages cost
// one-thread q4_0 decode about 15% on the Zen 4 VM (docs/BENCHMARKS.md, "Weights in 2 MiB pages").
void PrintWeightPages(const Engine::WeightResidency& w) {
  if (w.resident_bytes == 0) return;  // no /proc/self/smaps
  const double share = double(w.huge_page_bytes) / double(w.resident_bytes);
  std::printf("weights: %.0f MiB resident, %.0f%% in 2 MiB pages\n", w.resident_bytes / 1048576.0,
              100 * share);
  if (share < 0.5 && w.resident_bytes >= (int64_t{64} << 20)) {
    std::printf(
        "  (4 KiB pages: the filesystem or the system gives the mapping no 2 MiB ones; --no-mmap "
        "reads the weights into them: README, \"Huge pages\")\n");
  }
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
    int serve_capacity = 0;       // requests served at once through the Runtime
    int batch_tokens = 0;         // its tokens per step; 0: a whole prompt and every decode
    bool tier_ttft = false;
    int agents = 0;
  };
  auto o = std::make_shared<Opts>();
  AddEngineFlags(*cmd, o->engine);
  AddPressFlags(*cmd, o->gen);
  cmd->add_option("--ctx", o->ctx, "Context lengths to measure, e.g. 512,4096")
      ->delimiter(',')
      ->check(Positive());
  cmd->add_option("--reps", o->reps, "Runs per measurement (the median is reported)")
      ->check(Positive());
  auto* n_decode =
      cmd->add_option("--n-decode", o->n_decode,
                      "Tokens decoded after each prefill (--serve-capacity: by each request; "
                      "default there: N, at least 8)")
          ->check(Positive());
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
  cmd->add_flag("--tier-ttft", o->tier_ttft,
                "Instead: time to first token of a prompt of the largest --ctx computed, from "
                "the prefix cache in RAM, from --disk-cache after a restart (a new engine) and "
                "from --redis in another engine (as another process would), with the bytes read "
                "and GB/s (JSON keys ttft_ms, ttft_ratio, disk_gb_s, redis_gb_s)");
  cmd->add_option("--serve-capacity", o->serve_capacity,
                  "Instead: submit N requests at once to the serving runtime (continuous "
                  "batching, prefix cache off), each a prompt of distinct random tokens that "
                  "then decodes --n-decode tokens, ending at the largest --ctx; the KV pool is "
                  "--kv-mem in --ctk/--ctv, every request pressed with --press if given. Reports "
                  "how many decoded at once before any preemption and the KV bytes a sequence "
                  "holds (JSON keys concurrent, seq_kv_bytes)")
      ->check(Positive());
  cmd->add_option("--batch-tokens", o->batch_tokens,
                  "--serve-capacity: tokens per runtime step (default: the --ctx plus N, a whole "
                  "prompt and every request's next token)")
      ->check(Positive());
  cmd->add_option("--agents", o->agents,
                  "Instead: N agents that share one context of the largest --ctx (random tokens) "
                  "and differ in a 32-token instruction and --n-decode greedy tokens: KV bytes "
                  "of all of them and the time until each has its first token, as N independent "
                  "copies, as forks of one prefilled context, and (with --press) of one pressed "
                  "context (JSON keys independent, shared, shared_pressed)")
      ->check(CLI::Range(1, 256));
  cmd->callback([o, n_decode] {
    if (o->agents > 0) {
      const int ctx = *std::max_element(o->ctx.begin(), o->ctx.end());
      const int gen = n_decode->count() > 0 ? o->n_decode : 16;
      const nlohmann::json out = AgentsBench(o->engine, ctx, o->agents, gen, o->gen.press);
      if (o->json) {
        std::printf("%s\n", out.dump().c_str());
      } else {
        PrintAgents(out);
      }
      return;
    }
    if (o->serve_capacity > 0) {
      const int ctx = *std::max_element(o->ctx.begin(), o->ctx.end());
      const int n = o->serve_capacity;
      const int gen = n_decode->count() > 0 ? o->n_decode : std::max(8, n);
      if (gen < 2 || gen >= ctx) {
        std::fprintf(stderr, "cachet: --n-decode must be in [2, --ctx) with --serve-capacity\n");
        throw CLI::RuntimeError(1);
      }
      const nlohmann::json out =
          ServeCapacityBench(o->engine, ctx, n, gen, o->batch_tokens, o->gen.press);
      if (o->json) {
        std::printf("%s\n", out.dump().c_str());
        return;
      }
      const double mib = 1.0 / (1 << 20);
      char press_desc[96] = "none";
      if (o->gen.press) {
        std::snprintf(press_desc, sizeof press_desc, "%s at ratio %g",
                      out["press"].get<std::string>().c_str(), o->gen.press->ratio);
      }
      std::printf(
          "serve capacity: %d requests of %d tokens (prompt %d + %d decoded), %s KV pool of "
          "%.1f MiB (%lld pages), press %s\n",
          n, ctx, ctx - gen, gen, out["codec"].get<std::string>().c_str(),
          out["pool_bytes"].get<double>() * mib, out["pool_pages"].get<long long>(), press_desc);
      std::printf(
          "a sequence holds %.2f MiB of KV at its largest (%lld pages; %.2f MiB "
          "unpressed): the pool fits %lld\n",
          out["seq_kv_bytes"].get<double>() * mib, out["seq_kv_pages"].get<long long>(),
          out["seq_kv_bytes_unpressed"].get<double>() * mib, out["fits"].get<long long>());
      std::printf(
          "decoding at once before any preemption: %d (peak running %d); preemptions "
          "%lld, errors %d\n",
          out["concurrent"].get<int>(), out["peak_running"].get<int>(),
          out["preemptions"].get<long long>(), out["errors"].get<int>());
      std::printf("%lld requests, %lld prompt + %lld generated tokens in %.1f s (%.0f tok/s)\n",
                  out["finished"].get<long long>(), out["prompt_tokens_total"].get<long long>(),
                  out["generated_tokens"].get<long long>(), out["wall_s"].get<double>(),
                  out["tok_s"].get<double>());
      if (out["errors"].get<int>() > 0) {
        std::printf("first error: %s\n", out["first_error"].get<std::string>().c_str());
      }
      return;
    }
    if (o->tier_ttft) {
      if (o->engine.disk_cache_dir.empty() && o->engine.redis_url.empty()) {
        std::fprintf(stderr, "cachet: --tier-ttft needs --disk-cache DIR and/or --redis URL\n");
        throw CLI::RuntimeError(1);
      }
      const int ctx = *std::max_element(o->ctx.begin(), o->ctx.end());
      const nlohmann::json out = TierTtftBench(o->engine, ctx, o->reps);
      if (o->json) {
        std::printf("%s\n", out.dump().c_str());
        return;
      }
      std::printf("ctx %d, KV %s, %d threads, median of %d runs\n", ctx,
                  out["codec"].get<std::string>().c_str(), out["threads"].get<int>(), o->reps);
      for (const auto& [k, v] : out["ttft_ms"].items()) {
        std::printf("  %-18s TTFT %10.1f ms  %6.3fx compute\n", k.c_str(), v.get<double>(),
                    out["ttft_ratio"][k].get<double>());
      }
      for (const char* tier : {"disk", "redis"}) {
        const std::string t = tier;
        if (!out.contains(t + "_gb_s")) continue;
        std::printf("%s: %.1f MiB read for %.0f tokens, %.2f GB/s\n", tier,
                    out[t + "_bytes_read"].get<double>() / (1 << 20),
                    out[t + "_tokens_loaded"].get<double>(), out[t + "_gb_s"].get<double>());
      }
      return;
    }
    EngineOptions eo = o->engine;
    const int max_ctx = *std::max_element(o->ctx.begin(), o->ctx.end());
    eo.n_ctx = std::max(eo.n_ctx, max_ctx + o->n_decode);
    auto engine = LoadEngine(eo);
    if (!engine) throw CLI::RuntimeError(1);
    const ModelConfig& c = engine->config();
    if (max_ctx + o->n_decode > c.max_position_embeddings) {
      // Speed is measured all the same (positions past the trained ones cost the same).
      std::fprintf(stderr,
                   "cachet bench: --ctx %d + --n-decode %d passes the model's trained context "
                   "of %d (max_position_embeddings): its outputs there are not meaningful\n",
                   max_ctx, o->n_decode, c.max_position_embeddings);
    }
    // Each point fills its context's cache: one that cannot fit this machine's memory is refused
    // here, not by the kernel's OOM killer hours into the prompt.
    const double kv_bytes = engine->kv_stats().bytes_per_token * (max_ctx + o->n_decode);
    const double ram = PhysicalMemoryBytes();
    if (ram > 0 && kv_bytes > ram) {
      std::fprintf(stderr,
                   "cachet bench: --ctx %d + --n-decode %d needs %.1f GiB of KV cache (%s), more "
                   "than this machine's %.1f GiB of memory\n",
                   max_ctx, o->n_decode, kv_bytes / (1 << 30), engine->kv_stats().codec.c_str(),
                   ram / (1 << 30));
      throw CLI::RuntimeError(1);
    }
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
        std::printf("ctx %d, %d threads, median of %d runs\n", max_ctx, engine->threads(), o->reps);
        std::printf("%8s  %10s  %16s  %8s  %10s\n", "hit", "TTFT ms", "TTFT/TTFT(0)", "r(f)",
                    "ratio/r");
        for (const auto& [k, v] : out["ttft_ms"].items()) {
          const double ratio = out["ttft_ratio"][k].get<double>(), r = out["r"][k].get<double>();
          char per_r[16] = "-";  // all cached: no work left to divide by
          if (r > 0) std::snprintf(per_r, sizeof per_r, "%.3f", ratio / r);
          std::printf("%8s  %10.1f  %16.3f  %8.3f  %10s\n", k.c_str(), v.get<double>(), ratio, r,
                      per_r);
        }
        std::printf("KV bytes/token measured by the pool %.1f, rows alone in f32 %lld, f16 %lld\n",
                    out["kv_bytes_per_token"].get<double>(),
                    static_cast<long long>(c.KvBytesPerToken(4)),
                    static_cast<long long>(c.KvBytesPerToken(2)));
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
    out["threads"] = engine->threads();
    out["reps"] = o->reps;
    out["n_decode"] = o->n_decode;
    ProgressBar progress("bench", int64_t(o->ctx.size()) * o->reps * (1 + others.size()));
    const auto& press = o->gen.press;
    if (press) out["press"] = press::PressSpec(*press);
    struct Rep {
      double prefill = 0, decode = 0;  // tok/s
      double press_ms = 0, kv_before = 0, kv_after = 0, press_peak = 0;
    };
    auto run_rep = [&](Engine& e, int ctx) {
      Rep r;
      // Every rep prefills the whole prompt: the prefix cache would serve an earlier rep's pages
      // (and a longer --ctx a shorter one's), reporting prefill speeds 20x too high.
      e.ClearPrefixCache();
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
        r.kv_before = double(session->kv_bytes());
        auto tp = Clock::now();
        auto pr = session->Compress(*press);
        r.press_ms = std::chrono::duration<double, std::milli>(Clock::now() - tp).count();
        if (!pr.ok()) {
          std::fprintf(stderr, "cachet: %s\n", pr.status().ToString().c_str());
          throw CLI::RuntimeError(1);
        }
        r.kv_after = double(session->kv_bytes());
        r.press_peak = double(pr->peak_bytes);
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
      std::vector<double> prefill, decode, press_ms, kv_before, kv_after, press_peak;
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
        press_peak.push_back(r.press_peak);
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
        out["press_peak_bytes"][key] = Summarize(press_peak).median;
      }
    }
    if (o->roofline) {
      const double bw = MeasureReadBandwidth(engine->threads());
      const int64_t wbytes = engine->weight_bytes_per_token();
      out["read_bandwidth_gb_s"] = bw / 1e9;
      out["weight_bytes_per_token"] = wbytes;
      // KV bytes a decode step reads per context token, as the cache stores them (codes, scales
      // and positions of a full page).
      const double kv_token = engine->kv_stats().bytes_per_token;
      out["kv_bytes_per_context_token"] = kv_token;
      for (int ctx : o->ctx) {
        const double bytes = double(wbytes) + kv_token * ctx;
        out["decode_roofline_tok_s"][std::to_string(ctx)] = bw / bytes;
      }
    }
    out["peak_rss_bytes"] = eval::PeakRssBytes();
    const Engine::WeightResidency weights = engine->weight_residency();
    out["weights_resident_bytes"] = weights.resident_bytes;
    out["weights_huge_page_bytes"] = weights.huge_page_bytes;
    if (o->json) {
      std::printf("%s\n", out.dump().c_str());
      return;
    }
    std::printf("model %s, %d threads, median of %d runs (min-max)\n",
                engine->options().model_dir.c_str(), engine->threads(), o->reps);
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
    PrintWeightPages(weights);
    if (press) {
      std::printf(
          "press %s: KV MiB before -> after (most held while pressing), press ms (fraction of "
          "the prefill)\n",
          out["press"].get<std::string>().c_str());
      for (int ctx : o->ctx) {
        const std::string k = std::to_string(ctx);
        std::printf("%8d  %8.2f -> %8.2f (%8.2f)  %8.1f ms (%.1f%%)\n", ctx,
                    out["kv_bytes_before_press"][k].get<double>() / 1048576.0,
                    out["kv_bytes_after_press"][k].get<double>() / 1048576.0,
                    out["press_peak_bytes"][k].get<double>() / 1048576.0,
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
