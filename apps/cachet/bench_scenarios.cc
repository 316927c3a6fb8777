// cachet bench's scenarios beside the speed table: --prefix-hit (time to first token with a
// cached prefix), --serve-capacity (how many sequences of a context length one KV pool serves at
// once through the Runtime) and --tier-ttft (time to first token by where the K/V comes from).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>

#include "cachet/eval/harness.h"
#include "cachet/model_config.h"
#include "cachet/press.h"
#include "cachet/progress.h"
#include "cachet/sampling.h"
#include "cachet/serving.h"
#include "commands.h"

namespace cachet::cli {

Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Summary s;
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

nlohmann::json PrefixHitBench(Engine& engine, const std::vector<int32_t>& tokens,
                              const std::vector<double>& fractions, int reps) {
  const ModelConfig& c = engine.config();
  const int n = static_cast<int>(tokens.size());
  const int page = engine.options().page_tokens;
  nlohmann::json out;
  out["model"] = engine.options().model_dir;
  out["threads"] = engine.threads();
  out["ctx"] = n;
  out["reps"] = reps;
  // The ratios are to a run with nothing cached: measured first, whether asked for or not.
  std::vector<double> fr = fractions;
  if (std::find(fr.begin(), fr.end(), 0.0) == fr.end()) fr.push_back(0.0);
  std::sort(fr.begin(), fr.end());
  fr.erase(std::unique(fr.begin(), fr.end()), fr.end());
  ProgressBar progress("bench --prefix-hit", int64_t(fr.size()) * reps);
  double ttft0 = 0;
  for (double f : fr) {
    // The last token is computed whatever is cached: it gives the logits.
    const int cached = std::min(static_cast<int>(f * n), n - 1) / page * page;
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
      const int32_t first =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (!s.ok() || first < 0) {
        std::fprintf(stderr, "cachet: %s\n", s.ToString().c_str());
        throw CLI::RuntimeError(1);
      }
      if (f == fr.front() && rep == 0) {
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

// --serve-capacity: n requests, each a prompt of ctx - n_decode distinct random tokens that
// then decodes n_decode tokens (a sequence of ctx tokens at its end), submitted at once to a
// Runtime over the engine's pool with the prefix cache off, each pressed after its prompt when
// `press` is set. Measures how many of them decode at once before any preemption: the pool's
// capacity in sequences, when every request outlives the admission of the others (a step prefills
// one whole prompt by default, so with n_decode >= n the first admitted is still decoding when
// the n-th is admitted). One request served alone first measures a sequence's KV at its largest.
nlohmann::json ServeCapacityBench(EngineOptions eo, int ctx, int n, int n_decode, int batch_tokens,
                                  const std::optional<press::PressOptions>& press) {
  // What every request's events tell (on the scheduler thread); declared before the runtime,
  // whose destructor sends the final events of requests still in flight.
  struct Tally {
    std::mutex mu;
    std::condition_variable cv;
    int finished = 0, errors = 0, decoding = 0, most_decoding = 0;
    std::string first_error;
    int64_t most_pages = 0, most_bytes = 0;  // of the pool, at the events of the lone request
  };
  Tally tally;
  eo.n_ctx = ctx;
  eo.prefix_cache = false;
  RuntimeOptions ro;
  ro.engine = eo;
  ro.max_sequences = n;
  ro.max_waiting = n + 1;
  ro.batch_tokens = batch_tokens > 0 ? batch_tokens : ctx + n;  // a whole prompt and every decode
  ro.publish_prefixes = false;
  auto created = Runtime::Create(ro);
  if (!created.ok()) {
    std::fprintf(stderr, "cachet: %s\n", created.status().ToString().c_str());
    throw CLI::RuntimeError(1);
  }
  Runtime& rt = **created;
  const int prompt_len = ctx - n_decode;
  std::mt19937 rng(4321);
  std::uniform_int_distribution<int32_t> dist(3, rt.config().vocab_size - 1);
  auto request = [&](int i) {
    CompletionRequest r;
    r.prompt.resize(prompt_len);
    for (int32_t& t : r.prompt) t = dist(rng);
    r.prompt[0] = 3 + i % (rt.config().vocab_size - 3);  // no two share a first token
    r.max_tokens = n_decode;
    r.sampling.temperature = 0;
    r.stop_at_eos = false;
    r.press = press;
    return r;
  };

  auto on_event = [&](bool lone) {
    return [&rt, &tally, lone, started = false](const TokenEvent& e) mutable {
      // The snapshot of the step before (the lone request's pressed prompt and tokens so far).
      const KvStats kv = lone && started && !e.finished ? rt.kv_stats() : KvStats();
      const int64_t preemptions = rt.Metrics().preemptions;
      std::lock_guard<std::mutex> lock(tally.mu);
      tally.most_pages = std::max<int64_t>(tally.most_pages, kv.pages_used);
      tally.most_bytes = std::max(tally.most_bytes, kv.bytes_used);
      if (!started && !e.finished) {
        started = true;
        ++tally.decoding;
        if (preemptions == 0) tally.most_decoding = std::max(tally.most_decoding, tally.decoding);
      }
      if (e.finished) {
        if (started) --tally.decoding;
        ++tally.finished;
        if (!e.error.ok() || e.finish_reason != "length") {
          if (tally.errors++ == 0) {
            tally.first_error =
                e.error.ok() ? "finish_reason " + e.finish_reason : e.error.ToString();
          }
        }
        tally.cv.notify_all();
      }
    };
  };
  auto wait_for = [&](int finished) {
    std::unique_lock<std::mutex> lock(tally.mu);
    tally.cv.wait(lock, [&] { return tally.finished >= finished; });
  };

  // One request alone: a sequence's KV at its largest.
  ProgressBar progress("bench --serve-capacity", n + 1);
  if (auto id = rt.Submit(request(n), on_event(true)); !id.ok()) {
    std::fprintf(stderr, "cachet: %s\n", id.status().ToString().c_str());
    throw CLI::RuntimeError(1);
  }
  wait_for(1);
  progress.Add();
  const RuntimeMetrics base = rt.Metrics();
  {
    std::lock_guard<std::mutex> lock(tally.mu);
    tally.most_decoding = 0;
  }

  // n at once.
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    if (auto id = rt.Submit(request(i), on_event(false)); !id.ok()) {
      std::fprintf(stderr, "cachet: %s\n", id.status().ToString().c_str());
      throw CLI::RuntimeError(1);
    }
  }
  int peak_running = 0, done = 1;
  int64_t peak_pages = 0;
  for (;;) {  // the gauges, sampled far more often than steps end
    const RuntimeMetrics m = rt.Metrics();
    peak_running = std::max(peak_running, m.running);
    peak_pages = std::max<int64_t>(peak_pages, rt.kv_stats().pages_used);
    std::unique_lock<std::mutex> lock(tally.mu);
    for (; done < tally.finished; ++done) progress.Add();
    if (tally.cv.wait_for(lock, std::chrono::milliseconds(2),
                          [&] { return tally.finished >= n + 1; })) {
      break;
    }
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  for (; done < n + 1; ++done) progress.Add();
  const RuntimeMetrics m = rt.Metrics();
  const KvStats kv = rt.kv_stats();

  nlohmann::json out;
  out["model"] = eo.model_dir.empty() ? DefaultModelDir() : eo.model_dir;
  out["threads"] = rt.threads();
  out["ctx"] = ctx;
  out["prompt_tokens"] = prompt_len;
  out["n_decode"] = n_decode;
  out["requests"] = n;
  out["batch_tokens"] = ro.batch_tokens;
  out["codec"] = kv.codec;
  out["press"] = press ? nlohmann::json(press::PressSpec(*press)) : nlohmann::json(nullptr);
  if (press) out["ratio"] = press->ratio;
  out["pool_bytes"] = kv.bytes_total;
  out["pool_pages"] = kv.pages_total;
  out["kv_bytes_per_token"] = kv.bytes_per_token;
  out["seq_kv_bytes"] = tally.most_bytes;
  out["seq_kv_pages"] = tally.most_pages;
  out["seq_kv_bytes_unpressed"] = kv.bytes_per_token * (ctx - 1);
  out["fits"] = tally.most_bytes > 0 ? kv.bytes_total / tally.most_bytes : 0;
  out["concurrent"] = tally.most_decoding;
  out["peak_running"] = peak_running;
  out["peak_pages_used"] = peak_pages;
  out["preemptions"] = m.preemptions - base.preemptions;
  out["finished"] = m.requests_finished - base.requests_finished;
  out["errors"] = tally.errors;
  if (tally.errors > 0) out["first_error"] = tally.first_error;
  out["prompt_tokens_total"] = m.prompt_tokens - base.prompt_tokens;
  out["generated_tokens"] = m.generation_tokens - base.generation_tokens;
  out["wall_s"] = wall;
  out["tok_s"] =
      double(m.prompt_tokens - base.prompt_tokens + m.generation_tokens - base.generation_tokens) /
      wall;
  out["peak_rss_bytes"] = eval::PeakRssBytes();
  return out;
}

// Time to first token of a ctx-token prompt by where its K/V comes from: computed (an engine
// without tiers), the prefix cache in RAM (a second session of the engine that computed it), the
// disk tier (a new engine on the same directory: a restarted process) and Redis (a new engine with
// only --redis: another process or machine). Each rep uses a prompt of its own, new to every
// cache; the engine that computes it is destroyed before the tiers are read, which waits for its
// background Redis writes.
nlohmann::json TierTtftBench(const EngineOptions& eo, int ctx, int reps) {
  EngineOptions plain = eo;
  plain.disk_cache_dir.clear();
  plain.redis_url.clear();
  plain.n_ctx = std::max(plain.n_ctx, ctx + 8);
  EngineOptions tiered = eo, disk_only = eo, redis_only = eo;
  tiered.n_ctx = disk_only.n_ctx = redis_only.n_ctx = plain.n_ctx;
  disk_only.redis_url.clear();
  redis_only.disk_cache_dir.clear();
  auto cold = LoadEngine(plain);
  if (!cold) throw CLI::RuntimeError(1);
  const ModelConfig& c = cold->config();
  auto ms_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto ttft = [&](Engine& e, const std::vector<int32_t>& prompt) {
    auto session = e.NewSession();
    std::vector<float> logits;
    const auto t0 = Clock::now();
    if (Status s = session->Eval(prompt, &logits); !s.ok()) {
      std::fprintf(stderr, "cachet: %s\n", s.ToString().c_str());
      throw CLI::RuntimeError(1);
    }
    return ms_since(t0);
  };
  struct Source {
    const char* name;
    const EngineOptions* options;
    std::vector<double> ttft, bytes, tokens;
  };
  std::vector<Source> sources;
  if (!eo.disk_cache_dir.empty()) sources.push_back({"disk", &disk_only, {}, {}, {}});
  if (!eo.redis_url.empty()) sources.push_back({"redis", &redis_only, {}, {}, {}});
  std::vector<double> compute, store, ram;
  std::string codec;
  ProgressBar progress("bench --tier-ttft", reps);
  for (int rep = 0; rep < reps; ++rep) {
    std::mt19937 rng(4242 + rep);
    std::uniform_int_distribution<int32_t> dist(3, c.vocab_size - 1);
    std::vector<int32_t> prompt(ctx);
    for (int32_t& t : prompt) t = dist(rng);
    compute.push_back(ttft(*cold, prompt));
    {
      auto writer = LoadEngine(tiered);
      if (!writer) throw CLI::RuntimeError(1);
      store.push_back(ttft(*writer, prompt));  // computed, then written through to the tiers
      ram.push_back(ttft(*writer, prompt));
      codec = writer->kv_stats().codec;
    }
    for (Source& src : sources) {
      auto reader = LoadEngine(*src.options);
      if (!reader) throw CLI::RuntimeError(1);
      src.ttft.push_back(ttft(*reader, prompt));
      const KvStats kv = reader->kv_stats();
      src.bytes.push_back(double(kv.tiers.at(0).bytes_read));
      src.tokens.push_back(double(kv.tiers.at(0).loaded_tokens));
    }
    progress.Add();
  }
  nlohmann::json out;
  out["ctx"] = ctx;
  out["threads"] = cold->threads();
  out["codec"] = codec;
  const double base = Summarize(compute).median;
  auto put = [&](const std::string& name, const std::vector<double>& v) {
    out["ttft_ms"][name] = Summarize(v).median;
    out["ttft_ratio"][name] = Summarize(v).median / base;
  };
  put("compute", compute);
  put("compute_and_store", store);
  put("ram", ram);
  for (const Source& src : sources) {
    put(src.name, src.ttft);
    const std::string n = src.name;
    out[n + "_bytes_read"] = Summarize(src.bytes).median;
    out[n + "_tokens_loaded"] = Summarize(src.tokens).median;
    out[n + "_gb_s"] = Summarize(src.bytes).median / 1e9 / (Summarize(src.ttft).median / 1e3);
  }
  return out;
}

}  // namespace cachet::cli
