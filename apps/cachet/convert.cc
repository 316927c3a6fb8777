// `cachet convert DIR OUT.gguf [--type f16|bf16|q8_0|...]`: a HF model directory as a GGUF file
// that Cachet (-m OUT.gguf) and llama.cpp both load; `cachet convert --synthetic SHAPE OUT.gguf`:
// a model of a real shape with seeded random weights (src/model/gguf_synthetic.cc).
#include "cachet/convert.h"

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "commands.h"

namespace cachet::cli {

void AddConvert(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert",
      "Write a HF model directory, or a synthetic model of a real shape (--synthetic), as a GGUF "
      "file");
  struct Opts {
    std::string dir, out, type = "f16", synthetic;
    uint64_t seed = 1;
    int threads = 0;
    bool progress = true;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("dir", o->dir,
                  "HF model directory (config.json, safetensors, tokenizer); left out with "
                  "--synthetic");
  cmd->add_option("out", o->out, "Output .gguf file");
  cmd->add_option(
      "--synthetic", o->synthetic,
      "Instead of a HF directory: a model of this shape with random weights (normal, std 0.02; "
      "norms 1) and a generated tokenizer of the shape's vocab size, for measuring speed. SHAPE "
      "is a shipped shape (tinyllama-1.1b, qwen2.5-0.5b, llama-3.2-1b, mha-85m: "
      "models/shapes/NAME.json) or the path of a config.json-style file. Usage: cachet convert "
      "--synthetic SHAPE OUT.gguf --type q4_0");
  cmd->add_option("--seed", o->seed,
                  "--synthetic: seed of the weights (the file depends on it alone, not on -t)")
      ->default_val(1);
  cmd->add_option(
         "--type", o->type,
         "Matrix type: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q4_k, q5_k, q6_k, or one of "
         "llama.cpp's mixes, matrix for matrix as its quantizer makes them: q4_k_m / q5_k_m "
         "(q4_k / q5_k, with q6_k for attn_v and ffn_down in about a third of the layers), "
         "q3_k_m (q3_k, with q4_k / q5_k for attn_output, attn_v and ffn_down), q2_k (q2_k, with "
         "q3_k / q4_k for attn_output, attn_v and ffn_down); every mix keeps the LM head in "
         "q6_k. Norms stay f32. A matrix whose rows do not split into the type's blocks (256 "
         "values for the k types) falls back as llama.cpp's does: q4_k to q5_0, q5_k to q5_1, "
         "q6_k to q8_0, q3_k and q2_k to q4_0, then f16")
      ->default_val("f16");
  cmd->add_option("-t,--threads", o->threads,
                  "Threads converting rows (0 = one per CPU this process may run on)")
      ->default_val(0)
      ->check(NonNegative());
  cmd->add_flag("!--no-progress", o->progress, "No progress bar on stderr");
  cmd->callback([o] {
    auto usage = [](const char* what) {
      std::fprintf(stderr, "cachet convert: %s\n", what);
      std::exit(2);
    };
    if (!o->synthetic.empty()) {
      // One positional: it is OUT (CLI11 fills positionals in order, so it landed in dir).
      if (!o->out.empty()) usage("--synthetic takes OUT.gguf only, not a model directory");
      o->out = o->dir;
      o->dir.clear();
      if (o->out.empty()) usage("--synthetic SHAPE needs an output file: OUT.gguf");
    } else if (o->dir.empty() || o->out.empty()) {
      usage("needs DIR OUT.gguf (or --synthetic SHAPE OUT.gguf); see --help");
    }
    static const std::pair<const char*, WeightFormat> kTypes[] = {
        {"f32", DType::kF32},
        {"f16", DType::kF16},
        {"bf16", DType::kBF16},
        {"q8_0", DType::kQ8_0},
        {"q5_0", DType::kQ5_0},
        {"q5_1", DType::kQ5_1},
        {"q4_0", DType::kQ4_0},
        {"q4_1", DType::kQ4_1},
        {"q4_k", DType::kQ4_K},
        {"q5_k", DType::kQ5_K},
        {"q6_k", DType::kQ6_K},
        {"q4_k_m", WeightFormat::MixM(DType::kQ4_K)},
        {"q5_k_m", WeightFormat::MixM(DType::kQ5_K)},
        {"q3_k_m", WeightFormat::MixM(DType::kQ3_K)},
        {"q2_k", WeightFormat::MixM(DType::kQ2_K)}};
    const WeightFormat* type = nullptr;
    for (const auto& [name, t] : kTypes) {
      if (o->type == name) type = &t;
    }
    if (type == nullptr) {
      std::string names;
      for (const auto& [name, t] : kTypes) names += std::string(names.empty() ? "" : ", ") + name;
      std::fprintf(stderr, "cachet convert: unknown --type '%s' (one of: %s)\n", o->type.c_str(),
                   names.c_str());
      std::exit(2);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const Status s =
        o->synthetic.empty()
            ? ConvertHfToGguf(o->dir, o->out, *type, o->threads, o->progress)
            : WriteSyntheticGguf(o->synthetic, o->out, *type, o->seed, o->threads, o->progress);
    if (!s.ok()) {
      std::fprintf(stderr, "cachet convert: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    std::error_code ec;
    const double mib = double(std::filesystem::file_size(o->out, ec)) / (1 << 20);
    std::fprintf(stderr, "cachet convert: wrote %s (%s, %.1f MiB) in %.1f s\n", o->out.c_str(),
                 o->type.c_str(), ec ? 0.0 : mib,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  });
}

}  // namespace cachet::cli
