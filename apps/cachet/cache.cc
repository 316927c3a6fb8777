// `cachet cache save|info`: a long context prefilled and compressed once, saved to a file that
// `cachet run --cache` (and any later process with the same model) continues from.
#include <chrono>
#include <cstdio>

#include "commands.h"

namespace cachet::cli {
namespace {

std::string Describe(const std::optional<press::PressOptions>& p) {
  return p ? press::DescribePress(*p) : "none";
}

void PrintInfo(const std::string& path, const SavedCacheInfo& i) {
  const std::string cold = i.cold_codec.empty() ? ""
                           : i.cold_after > 0
                               ? ", cold " + i.cold_codec + " after " +
                                     std::to_string(i.cold_after) + " tokens (--kv-cold-after)"
                               : ", demoted tokens " + i.cold_codec;
  std::fprintf(stderr,
               "%s: %d tokens, KV %s/%s in %d-token pages (sinks %d, window %d)%s; compression: "
               "%s; %lld token rows held over all layers and KV heads; %.2f MiB of pages; model "
               "hash %016llx%s\n",
               path.c_str(), i.n_tokens, i.codec_k.c_str(), i.codec_v.c_str(), i.page_tokens,
               i.sinks, i.window, cold.c_str(), i.compression.c_str(),
               static_cast<long long>(i.held_rows), double(i.page_bytes) / (1 << 20),
               static_cast<unsigned long long>(i.model_hash),
               i.calibration.empty() ? "" : ("; KV calibration " + i.calibration).c_str());
}

}  // namespace

void ApplySavedLayout(const CLI::App& cmd, const SavedCacheInfo& info, EngineOptions& o) {
  auto unset = [&](const char* name) { return cmd.get_option(name)->count() == 0; };
  if (unset("--ctk")) o.kv_codec_k = info.codec_k;
  if (unset("--ctv")) o.kv_codec_v = info.codec_v;
  if (unset("--page-tokens")) o.page_tokens = info.page_tokens;
  if (unset("--kv-sinks")) o.kv_sinks = info.sinks;
  if (unset("--kv-window")) o.kv_window = info.window;
  if (info.cold_after > 0) {  // it ages its pages: as it did unless the command line says
    if (unset("--kv-cold")) o.kv_cold = info.cold_codec;
    if (unset("--kv-cold-after")) o.kv_cold_after = info.cold_after;
  }
}

void AddCache(CLI::App& app) {
  auto* cache = app.add_subcommand(
      "cache",
      "Save a long context's KV cache, compressed once, for later questions (cachet run "
      "--cache FILE): `cache save`, `cache info`");
  cache->require_subcommand(1);

  auto* save = cache->add_subcommand(
      "save",
      "Prefill a context (text, BOS added), compress it with --press and the KV codecs, and "
      "save the cache to a file: any later process with the same model continues from it "
      "(cachet run --cache FILE -p QUESTION) without computing the context again");
  auto opts = std::make_shared<CommonOptions>();
  auto text = std::make_shared<std::string>();
  auto file = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  AddEngineFlags(*save, opts->engine);
  AddPressFlags(*save, opts->gen);
  auto* p = save->add_option("-p,--prompt", *text, "The context as text");
  save->add_option("-f,--file", *file, "Read the context from a file")
      ->check(CLI::ExistingFile)
      ->excludes(p);
  save->add_option("-o,--output", *out, "The cache file to write (e.g. doc.ckv)")->required();
  save->callback([=] {
    const std::string context = text->empty() && file->empty() ? "" : ReadPrompt(*text, *file);
    if (context.empty()) {
      std::fprintf(stderr, "cachet cache save: %s: give the context with -p TEXT or -f FILE\n",
                   file->empty() ? "the context is empty" : (*file + " is empty").c_str());
      throw CLI::RuntimeError(2);
    }
    EngineOptions eo = opts->engine;
    // The context is computed here; with a disk or Redis tier given, its prefix is looked up
    // there (another process may have computed it) and published to it.
    eo.prefix_cache = !eo.disk_cache_dir.empty() || !eo.redis_url.empty();
    auto engine = LoadEngine(eo);
    if (!engine) throw CLI::RuntimeError(1);
    const std::vector<int32_t> ids = engine->tokenizer().EncodePrompt(context);
    auto session = engine->NewSession();
    const auto t0 = std::chrono::steady_clock::now();
    const auto& press = opts->gen.press;
    Status s = press ? session->EvalPressed(ids, *press, nullptr) : session->Eval(ids, nullptr);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s.ok()) s = session->Save(*out, Describe(press));
    if (!s.ok()) {
      std::fprintf(stderr, "cachet cache save: %s\n", s.ToString().c_str());
      throw CLI::RuntimeError(1);
    }
    std::fprintf(stderr, "cachet: %zu context tokens prefilled%s in %.0f ms\n", ids.size(),
                 press ? " and compressed" : "", ms);
    auto info = ReadSavedCacheInfo(*out);
    if (info.ok()) PrintInfo(*out, *info);
  });

  auto* info = cache->add_subcommand("info", "Check a saved cache file and describe it");
  auto path = std::make_shared<std::string>();
  info->add_option("FILE", *path, "A file `cachet cache save` wrote")
      ->required()
      ->check(CLI::ExistingFile);
  info->callback([=] {
    auto i = ReadSavedCacheInfo(*path);
    if (!i.ok()) {
      std::fprintf(stderr, "cachet cache info: %s\n", i.status().ToString().c_str());
      throw CLI::RuntimeError(1);
    }
    PrintInfo(*path, *i);
  });
}

}  // namespace cachet::cli
