// `cachet calibrate -o MODEL.kvcal`: the statistics of a model's K and V rows on calibration text,
// which the calibrated KV codecs (--ctk/--ctv pca4..pca2, kvq4..kvq2, cq4, cq2, gear4) read with
// --kv-calibration.
#include "cachet/calibrate.h"

#include <cstdio>

#include "cachet/eval/tasks.h"
#include "commands.h"

namespace cachet::cli {

void AddCalibrate(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "calibrate",
      "Measure the model's K and V rows on calibration text, per layer and KV head (means, "
      "per-channel scales (keys also before RoPE), outlier channels, principal axes, the queries' "
      "energy along them, Lloyd-Max levels), for the calibrated KV codecs: --ctk/--ctv "
      "pca4|pca3|pca2|kvq4|kvq3|kvq2|cq4|cq2|gear4 --kv-calibration FILE");
  struct Opts {
    EngineOptions engine;
    std::string text_file, out;
    int tokens = 16384;
    CalibrateOptions cal;
  };
  auto o = std::make_shared<Opts>();
  // The model and how to run it; the KV layout is not the user's: rows are measured in f32.
  cmd->add_option("-m,--model", o->engine.model_dir,
                  "HF model directory or GGUF file; default: the embedded kvtiny")
      ->check(CLI::ExistingPath);
  cmd->add_option("-t,--threads", o->engine.threads,
                  "Worker threads (0 = one per CPU this process may run on; at most that many)")
      ->check(NonNegative());
  cmd->add_option("--ubatch", o->engine.ubatch, "Prompt tokens per prefill chunk")
      ->default_val(512)
      ->check(Positive());
  cmd->add_option("-o,--output", o->out, "The .kvcal file to write")->required();
  cmd->add_option("-f,--file", o->text_file,
                  "Calibration text (default: the first quarter of the haystack's pydocs.txt, "
                  "which `cachet eval --kl` never scores: its windows start a quarter in)");
  cmd->add_option("--tokens", o->tokens, "Tokens of the text to evaluate at most")
      ->default_val(16384)
      ->check(CLI::Range(16, 1 << 24));
  cmd->add_option("--window", o->cal.window, "Tokens per pass (each a fresh sequence, BOS first)")
      ->default_val(2048)
      ->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--outliers", o->cal.outliers,
                  "Outlier channels (largest spread) recorded per layer, KV head and role")
      ->default_val(4)
      ->check(CLI::Range(0, 512));
  cmd->add_flag("!--no-progress", o->cal.progress, "No progress bar on stderr");
  cmd->callback([o] {
    o->engine.prefix_cache = false;
    const bool whole = !o->text_file.empty();
    const std::string path = whole ? o->text_file : eval::DefaultHaystackDir() + "/pydocs.txt";
    std::string text = ReadPrompt("", path);
    if (text.empty()) Fail(NotFound(path + ": cannot read, or empty (-f)"));
    if (!whole) text.resize(text.size() / 4);
    auto engine = LoadEngine(o->engine);
    if (!engine) std::exit(1);
    std::vector<int32_t> ids = engine->tokenizer().Encode(text);
    if (ids.size() > size_t(o->tokens)) ids.resize(o->tokens);
    o->cal.source =
        (whole ? path : path + " (first quarter)") + ", " + std::to_string(ids.size()) + " tokens";
    auto r = Calibrate(*engine, ids, o->cal, o->out);
    if (!r.ok()) Fail(r.status());
    std::fprintf(stderr,
                 "cachet calibrate: wrote %s (%.1f KiB, hash %016llx): %lld tokens in %d windows "
                 "of %s, %.1f s; the first eighth of the principal axes holds %.0f%% of the keys' "
                 "variance and %.0f%% of the values'\n",
                 o->out.c_str(), double(r->bytes) / 1024, static_cast<unsigned long long>(r->hash),
                 static_cast<long long>(r->tokens), r->windows, o->cal.source.c_str(), r->seconds,
                 100 * r->key_top_share, 100 * r->value_top_share);
  });
}

}  // namespace cachet::cli
