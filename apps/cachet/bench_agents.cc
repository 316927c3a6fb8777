// cachet bench --agents N: N agents that share one long context and differ in their instructions
// and continuations, as independent copies and as forks of one prefilled (optionally pressed)
// context: KV bytes held by all of them and the time until every agent has its first token.
#include <chrono>
#include <cstdio>
#include <random>

#include "commands.h"

namespace cachet::cli {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Agents {
  std::vector<std::unique_ptr<Session>> sessions;
  double ttft_ms = 0;  // until the last agent's first token
  int64_t bytes = 0;   // KV pool bytes in use with every agent done
};

// Each agent: its instruction evaluated, then n_decode greedy tokens.
Status RunAgent(Session& s, std::span<const int32_t> instruction, int n_decode,
                std::chrono::steady_clock::time_point t0, double* ttft_ms) {
  GenerateOptions g;
  g.max_tokens = n_decode;
  g.sampling.temperature = 0;
  g.stop_at_eos = false;
  std::vector<float> logits;
  CACHET_RETURN_IF_ERROR(s.Eval(instruction, &logits));
  *ttft_ms = MsSince(t0);
  auto r = s.Generate({}, g);
  return r.ok() ? OkStatus() : r.status();
}

}  // namespace

nlohmann::json AgentsBench(const EngineOptions& base, int ctx, int n, int n_decode,
                           const std::optional<press::PressOptions>& press) {
  constexpr int kInstruction = 32;
  EngineOptions eo = base;
  eo.prefix_cache = false;  // sharing comes from forks only, never from the prefix cache
  eo.n_ctx = std::max(eo.n_ctx, ctx + kInstruction + n_decode + 8);
  if (eo.kv_mem_mib == 0) {
    auto config = ModelConfig::Load(eo.model_dir.empty() ? DefaultModelDir() : eo.model_dir);
    if (!config.ok()) Fail(config.status());
    eo.kv_mem_mib = KvPoolMibFor(*config, eo.page_tokens, eo.n_ctx, n + 1);
  }
  auto engine = LoadEngine(eo);
  if (!engine) throw CLI::RuntimeError(1);
  std::mt19937 rng(7);
  const int vocab = engine->config().vocab_size;
  std::uniform_int_distribution<int32_t> id(4, vocab - 1);
  std::vector<int32_t> context(ctx);
  for (int32_t& t : context) t = id(rng);
  std::vector<std::vector<int32_t>> instructions(n, std::vector<int32_t>(kInstruction));
  for (auto& ins : instructions) {
    for (int32_t& t : ins) t = id(rng);
  }
  auto used = [&] { return engine->kv_stats().bytes_used; };
  const int64_t idle = used();

  // Independent: every agent prefills the context with its own instruction.
  auto independent = [&](int agents) {
    Agents a;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < agents; ++i) {
      a.sessions.push_back(engine->NewSession());
      std::vector<int32_t> prompt = context;
      prompt.insert(prompt.end(), instructions[i].begin(), instructions[i].end());
      if (Status s = RunAgent(*a.sessions.back(), prompt, n_decode, t0, &a.ttft_ms); !s.ok()) {
        Fail(s);
      }
    }
    a.bytes = used() - idle;
    return a;
  };
  // Shared: the context once (pressed when asked), every agent a fork of it.
  auto shared = [&](const std::optional<press::PressOptions>& p) {
    Agents a;
    const auto t0 = std::chrono::steady_clock::now();
    auto root = engine->NewSession();
    Status s = p ? root->EvalPressed(context, *p, nullptr) : root->Eval(context, nullptr);
    if (!s.ok()) Fail(s);
    for (int i = 0; i < n; ++i) {
      a.sessions.push_back(root->Fork());
      if (s = RunAgent(*a.sessions.back(), instructions[i], n_decode, t0, &a.ttft_ms); !s.ok()) {
        Fail(s);
      }
    }
    a.bytes = used() - idle;
    return a;
  };

  nlohmann::json out;
  out["agents"] = n;
  out["ctx"] = ctx;
  out["instruction_tokens"] = kInstruction;
  out["n_decode"] = n_decode;
  out["codec"] = engine->kv_stats().codec;
  int64_t one_bytes = 0;
  {
    Agents one = independent(1);
    one_bytes = one.bytes;
    out["one_agent"] = {{"kv_bytes", one.bytes}, {"ttft_ms", one.ttft_ms}};
  }
  auto row = [&](const char* name, const Agents& a) {
    out[name] = {{"kv_bytes", a.bytes},
                 {"kv_bytes_vs_one_agent", double(a.bytes) / double(one_bytes)},
                 {"ttft_all_ms", a.ttft_ms}};
  };
  row("independent", independent(n));
  row("shared", shared(std::nullopt));
  if (press) {
    row("shared_pressed", shared(press));
    out["press"] = press::DescribePress(*press);
  }
  return out;
}

void PrintAgents(const nlohmann::json& out) {
  const double mib = 1.0 / (1 << 20);
  std::printf(
      "%d agents on one context of %d tokens (+%d instruction tokens and %d decoded each), "
      "KV %s\n",
      out["agents"].get<int>(), out["ctx"].get<int>(), out["instruction_tokens"].get<int>(),
      out["n_decode"].get<int>(), out["codec"].get<std::string>().c_str());
  std::printf("%-16s %12s %14s %18s\n", "", "KV MiB", "vs one agent", "TTFT of all, ms");
  std::printf("%-16s %12.2f %14.2f %18.1f\n", "one agent",
              out["one_agent"]["kv_bytes"].get<double>() * mib, 1.0,
              out["one_agent"]["ttft_ms"].get<double>());
  for (const char* name : {"independent", "shared", "shared_pressed"}) {
    if (!out.contains(name)) continue;
    const auto& r = out[name];
    std::string label = name;
    if (label == "shared_pressed") label = "shared, pressed";
    std::printf("%-16s %12.2f %14.2f %18.1f\n", label.c_str(), r["kv_bytes"].get<double>() * mib,
                r["kv_bytes_vs_one_agent"].get<double>(), r["ttft_all_ms"].get<double>());
  }
  if (out.contains("press")) {
    std::printf("(pressed: %s on the shared context)\n", out["press"].get<std::string>().c_str());
  }
}

}  // namespace cachet::cli
