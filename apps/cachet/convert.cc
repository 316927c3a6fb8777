// `cachet convert DIR OUT.gguf [--type f16|bf16|q8_0|...]`: a HF model directory as a GGUF file
// that Cachet (-m OUT.gguf) and llama.cpp both load.
#include <cstdio>

#include "cachet/commands.h"
#include "model/gguf_convert.h"

namespace cachet::cli {

void AddConvert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "Write a HF model directory as a GGUF file");
  struct Opts {
    std::string dir, out, type = "f16";
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("dir", o->dir, "HF model directory (config.json, safetensors, tokenizer)")
      ->required();
  cmd->add_option("out", o->out, "Output .gguf file")->required();
  cmd->add_option("--type", o->type,
                  "Matrix type: f32, f16, bf16, q8_0, q4_0, q4_k, q6_k (norms stay f32)")
      ->default_val("f16");
  cmd->callback([o] {
    static const std::pair<const char*, DType> kTypes[] = {
        {"f32", DType::kF32},   {"f16", DType::kF16},   {"bf16", DType::kBF16},
        {"q8_0", DType::kQ8_0}, {"q4_0", DType::kQ4_0}, {"q4_k", DType::kQ4_K},
        {"q6_k", DType::kQ6_K}};
    const DType* type = nullptr;
    for (const auto& [name, t] : kTypes) {
      if (o->type == name) type = &t;
    }
    if (type == nullptr) {
      std::fprintf(stderr, "cachet convert: unknown --type '%s'\n", o->type.c_str());
      std::exit(2);
    }
    const Status s = ConvertHfToGguf(o->dir, o->out, *type);
    if (!s.ok()) {
      std::fprintf(stderr, "cachet convert: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    std::fprintf(stderr, "cachet convert: wrote %s (%s)\n", o->out.c_str(), o->type.c_str());
  });
}

}  // namespace cachet::cli
