// Subcommands of the cachet CLI and the options they share.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cachet/engine.h"

namespace cachet::cli {

struct CommonOptions {
  EngineOptions engine;
  GenerateOptions gen;
};

// -m, -t, --ubatch, --ctx, --kv-mem, --page-tokens.
// Checks of integer flags whose failures name the value and the bound (CLI11's own print the
// range up to DBL_MAX in full).
const CLI::Validator& Positive();     // > 0
const CLI::Validator& NonNegative();  // >= 0
// A finite number >= lo; a failure says the value "must be <bound>"; type: the help's type name.
CLI::Validator AtLeast(double lo, const char* bound, const char* type);

// The KV codec defaults to f16, llama.cpp's default and half the bytes of f32; eval defaults to
// f32, the golden-exact reference its KL and accuracy are measured against.
void AddEngineFlags(CLI::App& app, EngineOptions& o, const char* default_codec = "f16");
// -n, --temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty,
// --frequency-penalty, --logit-bias, --seed, --ignore-eos (sampling_flags.cc).
void AddSamplingFlags(CLI::App& app, GenerateOptions& o);
// A --logit-bias token past the engine's vocabulary fails the command, naming the first.
void RequireLogitBiasInVocab(const SamplingParams& s, const Engine& engine);
// --press, --ratio, --budget, --window, --sinks: evict after the prompt (kv/press).
void AddPressFlags(CLI::App& app, GenerateOptions& o);
// --chat-template-kwargs (chat, serve), its help followed by `more`.
void AddChatTemplateKwargsFlag(CLI::App& app, std::string& kwargs, const std::string& more = "");
// The text of -p, or of the -f file when one is given.
std::string ReadPrompt(const std::string& text, const std::string& file);
// Prints "cachet: <status>" to stderr and exits the command with status 1.
[[noreturn]] void Fail(const Status& s);
// Loads the engine or prints the error and returns null.
std::unique_ptr<Engine> LoadEngine(const EngineOptions& o);
// "<command>: -t <asked> is more threads than the CPUs ..." on stderr when the engine uses fewer.
void WarnThreadsCapped(const char* command, int asked, int used);
// "<command>: -c <n_ctx> is past the context the model was trained for ..." when it is.
void WarnPastTrainedContext(const char* command, int n_ctx, const ModelConfig& c);

void AddRun(CLI::App& app);
void AddChat(CLI::App& app);
void AddInspect(CLI::App& app);
void AddBench(CLI::App& app);
void AddEval(CLI::App& app);
void AddConvert(CLI::App& app);
void AddCalibrate(CLI::App& app);  // calibrate.cc
void AddServe(CLI::App& app);      // serve.cc
void AddCache(CLI::App& app);      // cache.cc
// bench --agents (bench_agents.cc): n agents on one context of ctx tokens, independent copies
// against forks of it (pressed too with press), as JSON; and its table.
nlohmann::json AgentsBench(const EngineOptions& base, int ctx, int n, int n_decode,
                           const std::optional<press::PressOptions>& press);
void PrintAgents(const nlohmann::json& out);
// The median and range of a measurement's reps.
struct Summary {
  double median = 0, min = 0, max = 0;
};
Summary Summarize(std::vector<double> v);
// bench --prefix-hit, --serve-capacity, --tier-ttft (bench_scenarios.cc), as JSON.
nlohmann::json PrefixHitBench(Engine& engine, const std::vector<int32_t>& tokens,
                              const std::vector<double>& fractions, int reps);
nlohmann::json ServeCapacityBench(EngineOptions eo, int ctx, int n, int n_decode, int batch_tokens,
                                  const std::optional<press::PressOptions>& press);
nlohmann::json TierTtftBench(const EngineOptions& eo, int ctx, int reps);

// The KV layout options a saved cache needs (codecs, page size, sinks, window), where cmd's
// flags did not set them.
void ApplySavedLayout(const CLI::App& cmd, const SavedCacheInfo& info, EngineOptions& o);

}  // namespace cachet::cli
