#include "commands.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "cachet/chat_template.h"
#include "cachet/eval/harness.h"
#include "cachet/kv_codecs.h"
#include "cachet/model_config.h"
#include "cachet/tokenizer.h"

namespace cachet::cli {

CLI::Validator AtLeast(double lo, const char* bound, const char* type) {
  return CLI::Validator(
      [lo, bound](std::string& v) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0') return "value '" + v + "' is not a number";
        if (std::isfinite(x) && x >= lo) return {};
        return "value " + v + " must be " + bound;
      },
      type);
}

namespace {
// A path or address flag given as "" would silently switch its feature off.
const CLI::Validator& NonEmpty() {
  static const CLI::Validator v(
      [](std::string& v) -> std::string { return v.empty() ? "an empty value names nothing" : ""; },
      "TEXT");
  return v;
}
}  // namespace

const CLI::Validator& Positive() {
  static const CLI::Validator v = AtLeast(1e-300, "> 0", "POSITIVE");
  return v;
}
const CLI::Validator& NonNegative() {
  static const CLI::Validator v = AtLeast(0, ">= 0", "NONNEGATIVE");
  return v;
}

void AddEngineFlags(CLI::App& app, EngineOptions& o, const char* default_codec) {
  app.add_option("-m,--model", o.model_dir,
                 "HF model directory (config.json, *.safetensors, tokenizer.json or "
                 "tokenizer.model); default: the embedded kvtiny")
      ->check(CLI::ExistingPath);
  app.add_option("-t,--threads", o.threads,
                 "Worker threads (0 = one per CPU this process may run on; at most that many)")
      ->check(NonNegative());
  app.add_option("--ubatch", o.ubatch, "Prompt tokens per prefill chunk")
      ->default_val(512)
      ->check(Positive());
  app.add_option("-c,--ctx-size", o.n_ctx,
                 "Max tokens per sequence (0 = the model's max_position_embeddings)")
      ->check(NonNegative());
  app.add_option("--kv-mem", o.kv_mem_mib,
                 "KV cache pool capacity in MiB (0 = enough for one full context)")
      ->check(NonNegative());
  app.add_option("--page-tokens", o.page_tokens, "Tokens per KV page (one layer, one KV head)")
      ->default_val(16)
      ->check(CLI::Range(1, 256));
  app.add_option("--cache-type-k,--ctk", o.kv_codec_k, "KV codec of keys: " + codecs::CodecNames())
      ->default_val(default_codec);
  app.add_option("--cache-type-v,--ctv", o.kv_codec_v,
                 "KV codec of values: " + codecs::CodecNames())
      ->default_val(default_codec);
  app.add_option(
      "--kv-calibration", o.kv_calibration,
      "The .kvcal file `cachet calibrate` made for this model: needed by the calibrated codecs "
      "(pca4, pca3, pca2, kvq4, kvq3, kvq2, cq4, cq2, gear4); stored caches coded with it are "
      "only read with it");
  app.add_option("--kv-sinks", o.kv_sinks,
                 "Keep the pages holding the first N tokens in f16 (attention sinks)")
      ->check(NonNegative());
  app.add_option("--kv-window", o.kv_window,
                 "Keep each page in f16 until N newer tokens follow it, then "
                 "store it in the --cache-type codec (the recent window of mixed precision)")
      ->check(NonNegative());
  app.add_option("--kv-cold", o.kv_cold,
                 "Precision by age: move each full page whose tokens are all --kv-cold-after or "
                 "more tokens old to a second pool in this row-wise codec, K[:V] (e.g. kvq2, "
                 "kvq3:kvq2 for 3-bit keys and 2-bit values, cq4:cq2 for calibrated blocks "
                 "attention reads in place, rot3, q4_0), which attention reads whole: recent "
                 "tokens in --kv-window's f16 and the --cache-type codec, older ones in fewer bits "
                 "(not in the plain f32 layout, the reference, which keeps every row as "
                 "computed)");
  app.add_option("--kv-cold-after", o.kv_cold_after,
                 "With --kv-cold: the age in tokens at which a page moves to the cold codec")
      ->default_val(256)
      ->check(Positive());
  app.add_flag("--no-mmap", o.no_mmap,
               "Read the weights into memory (transparent huge pages) instead of mapping the "
               "model file: huge pages even where the page cache holds the file in 4 KiB ones "
               "(`cachet bench` prints the share), slower load, no page cache shared between "
               "processes");
  app.add_flag("!--no-prefix-cache", o.prefix_cache,
               "Do not share or reuse KV pages of common prompt prefixes");
  app.add_option("--disk-cache", o.disk_cache_dir,
                 "Keep cached prompt prefixes in this directory too (created if missing): any "
                 "later run with the same model and KV layout reuses them, after a restart too")
      ->check(NonEmpty());
  app.add_option("--disk-cache-mib", o.disk_cache_mib,
                 "Size cap of --disk-cache in MiB (0 = 4096); least recently used runs go first")
      ->check(NonNegative());
  app.add_flag("--tier-zstd", o.tier_zstd,
               "Compress the runs --disk-cache and --redis store with zstd (level 1): about half "
               "the bytes for f32/f16 pages, little for quantized ones; readers inflate any run");
  app.add_option(
         "--redis", o.redis_url,
         "Keep cached prompt prefixes in Redis too (under --disk-cache, if given), shared "
         "by every process pointed at it: redis://[[user]:password@]host[:port][/db] "
         "(the password percent-encoded, or in $CACHET_REDIS_PASSWORD), or a Redis "
         "Cluster's nodes comma-separated. Runs expire after 24 h; writes are queued in the "
         "background and dropped rather than delaying a request; a failing server is "
         "skipped until it recovers")
      ->check(NonEmpty());
}

void AddChatTemplateKwargsFlag(CLI::App& app, std::string& kwargs, const std::string& more) {
  app.add_option("--chat-template-kwargs", kwargs,
                 "Jinja variables for the chat template, as a JSON object (llama-server's flag): "
                 "only enable_thinking is read, {\"enable_thinking\": false} making Qwen3's "
                 "templates answer without thinking (an empty <think> block after the generation "
                 "prompt); a template that reads no such variable ignores it, as Jinja would" +
                     more)
      ->type_name("JSON");
}

void AddPressFlags(CLI::App& app, GenerateOptions& o) {
  auto spec = std::make_shared<std::string>();
  auto opts = std::make_shared<press::PressOptions>();
  auto* press_opt =
      app.add_option(
             "--press", *spec,
             "Evict KV entries after the prompt: a scorer (streaming, h2o, snapkv, tova, "
             "knorm, keydiff, expected, random; kvzip, lookahead: scored by probes evaluated "
             "after the prompt and dropped; pyramidkv = snapkv+pyramid) with optional "
             "modifiers +uniform|+pyramid|+ada (per-head budgets), +max|+mean (one token set "
             "for all layers), +merge, +protect, +chunked, +demote:CODEC; or quest (read "
             "only the best pages at each decode step, evict nothing). docs/PRESSES.md")
          ->check(NonEmpty());
  auto* ratio = app.add_option("--ratio", opts->ratio,
                               "Press: fraction of the KV removed (0.75 keeps a quarter)")
                    ->check(CLI::Range(0.0, 0.999999))
                    ->default_val(0.5);
  app.add_option("--budget", opts->budget,
                 "Press: tokens kept per layer and KV head on average, instead of --ratio")
      ->check(Positive())
      ->excludes(ratio);
  app.add_option("--window", opts->window,
                 "Press: observation window, the last prompt tokens whose attention SnapKV and "
                 "expected attention score by (always kept)")
      ->check(Positive())
      ->default_val(opts->window);
  app.add_flag("--compress-during-prefill", opts->during_prefill,
               "Press: compress after every --ubatch chunk of the prompt, so the KV never holds "
               "more than the budget plus one chunk (same as the +chunked press modifier)");
  app.add_option("--demote", opts->demote,
                 "Press: keep the evicted tokens in this row-wise codec (int8, q4_0, rot3, ...) "
                 "in a cold pool instead of freeing them; decode steps fetch back the cold pages "
                 "the query needs (same as the +demote:CODEC press modifier)");
  app.add_option("--demote-fetch", opts->demote_fetch,
                 "Press: fraction of the cold pages each decode step reads (by key bounds)")
      ->check(CLI::Range(0.0, 1.0))
      ->default_val(opts->demote_fetch);
  app.add_option("--decode-every", opts->decode_every,
                 "Press: press again every N decoded tokens, back to the prompt's budget; "
                 "attention scores keep accumulating while decoding (H2O's heavy hitters)")
      ->check(NonNegative())
      ->default_val(0);
  app.add_flag("--merge", opts->merge,
               "Press: fold each evicted token's value into its more similar kept neighbour "
               "(the +merge modifier)");
  app.add_flag("--protect-boundaries", opts->protect_boundaries,
               "Press: reserve 10% of the budget for the first and last tokens of the prompt "
               "(the +protect modifier)");
  app.add_option("--sinks", opts->sinks, "Press: the first N tokens are always kept")
      ->check(NonNegative())
      ->default_val(opts->sinks);
  auto share = std::make_shared<std::string>();
  app.add_option("--share-layers", *share,
                 "Press: keep one token set for every layer and head, from each layer's "
                 "normalized scores combined by max or mean (same as the +max / +mean modifiers)")
      ->check(CLI::IsMember({"none", "max", "mean"}));
  app.add_option("--probe-text", opts->probe_texts,
                 "Press lookahead: a question whose attention scores the cache (repeatable; "
                 "default: three generic questions)")
      ->type_name("TEXT");
  app.add_option("--quest-pages", opts->quest_pages,
                 "Press quest: pages each head reads per decode step (plus the current page), "
                 "instead of the fraction 1 - --ratio of its pages")
      ->check(Positive());
  // The press's flags mean nothing without it: given alone, they were silently ignored.
  for (const char* flag :
       {"--ratio", "--budget", "--window", "--compress-during-prefill", "--demote",
        "--demote-fetch", "--decode-every", "--merge", "--protect-boundaries", "--sinks",
        "--share-layers", "--probe-text", "--quest-pages"}) {
    app.get_option(flag)->needs(press_opt);
  }
  app.parse_complete_callback([spec, opts, share, &o] {
    if (!spec->empty()) {
      press::PressOptions p = *opts;
      if (Status s = press::ParsePressSpec(*spec, &p); !s.ok()) {
        throw CLI::ValidationError("--press", s.message());
      }
      if (!share->empty()) {
        p.share = *share == "max"    ? press::ShareLayers::kMax
                  : *share == "mean" ? press::ShareLayers::kMean
                                     : press::ShareLayers::kNone;
      }
      p.during_prefill |= opts->during_prefill;
      p.protect_boundaries |= opts->protect_boundaries;
      p.merge |= opts->merge;
      if (p.demote.empty()) p.demote = opts->demote;
      if (!p.quest && opts->quest_pages > 0) {
        throw CLI::ValidationError("--quest-pages",
                                   "sets the pages --press quest reads; the press is " + *spec);
      }
      o.press = p;
    }
  });
}

void WarnThreadsCapped(const char* command, int asked, int used) {
  if (asked <= used) return;
  std::fprintf(stderr,
               "%s: -t %d is more threads than the CPUs this process may run on (%d): using %d\n",
               command, asked, used, used);
}

void WarnPastTrainedContext(const char* command, int n_ctx, const ModelConfig& c) {
  if (n_ctx <= c.max_position_embeddings) return;
  std::fprintf(stderr,
               "%s: -c %d is past the context the model was trained for (%d tokens): output "
               "past it may degrade\n",
               command, n_ctx, c.max_position_embeddings);
}

std::unique_ptr<Engine> LoadEngine(const EngineOptions& o) {
  auto engine = Engine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "cachet: %s\n", engine.status().ToString().c_str());
    return nullptr;
  }
  if (o.tier_zstd && o.disk_cache_dir.empty() && o.redis_url.empty()) {
    std::fprintf(stderr, "cachet: --tier-zstd is ignored without --disk-cache or --redis\n");
  }
  WarnThreadsCapped("cachet", o.threads, (*engine)->threads());
  WarnPastTrainedContext("cachet", (*engine)->n_ctx(), (*engine)->config());
  for (const std::string& flag : (*engine)->IgnoredKvOptions()) {
    std::fprintf(stderr, "cachet: %s is ignored in the plain f32 layout (--ctk/--ctv f32)\n",
                 flag.c_str());
  }
  return std::move(engine).value();
}

namespace {

double PeakRssMib() { return double(eval::PeakRssBytes()) / (1 << 20); }

void PrintStats(const GenerateResult& r) {
  const double pf = r.prefill_ms > 0 ? r.prompt_tokens / (r.prefill_ms / 1e3) : 0;
  const double dc = r.decode_ms > 0 ? r.tokens.size() / (r.decode_ms / 1e3) : 0;
  std::fprintf(stderr,
               "\n[cachet] prompt %d tokens in %.1f ms (%.1f tok/s) | generated %zu tokens in "
               "%.1f ms (%.1f tok/s) | finish: %s | peak RSS %.1f MiB\n",
               r.prompt_tokens, r.prefill_ms, pf, r.tokens.size(), r.decode_ms, dc,
               r.finish_reason.c_str(), PeakRssMib());
  if (r.press) {
    const press::PressResult& p = *r.press;
    std::fprintf(stderr, "[cachet] press: KV %.2f -> %.2f MiB (%lld -> %lld token rows) in %.1f ms",
                 p.bytes_before / 1048576.0, p.bytes_after / 1048576.0,
                 static_cast<long long>(p.tokens_before), static_cast<long long>(p.tokens_after),
                 p.ms);
    if (p.probe_ms > 0) std::fprintf(stderr, " (probe pass %.1f ms)", p.probe_ms);
    std::fprintf(stderr, ", at most %.2f MiB held while pressing\n", p.peak_bytes / 1048576.0);
  }
}

bool PrintPiece(std::string_view piece) {
  std::fwrite(piece.data(), 1, piece.size(), stdout);
  std::fflush(stdout);
  return true;
}

// `cachet run --logits-of IDS.json`: per-position argmax and top-2 margin of a token sequence.
void PrintLogitsOf(const EngineOptions& eo, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  std::vector<int32_t> ids;
  bool ok = j.is_array() && !j.empty();
  for (size_t i = 0; ok && i < j.size(); ++i) {
    ok = j[i].is_number_integer();
    if (ok)
      ids.push_back(static_cast<int32_t>(std::clamp<int64_t>(j[i].get<int64_t>(), -1, INT32_MAX)));
  }
  if (!ok) {
    std::fprintf(stderr, "cachet: %s: not a non-empty JSON array of token ids\n", path.c_str());
    throw CLI::RuntimeError(1);
  }
  auto engine = LoadEngine(eo);  // -c as given: 0 is the model's context
  if (!engine) throw CLI::RuntimeError(1);
  const int vocab_size = engine->config().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      std::fprintf(stderr, "cachet: %s: [%zu] = %s is not a token id (0 to %d)\n", path.c_str(), i,
                   j[i].dump().c_str(), vocab_size - 1);
      throw CLI::RuntimeError(1);
    }
  }
  if (static_cast<int64_t>(ids.size()) > engine->n_ctx()) {
    std::fprintf(stderr, "cachet: %s: %zu tokens do not fit in the context of %d (-c)\n",
                 path.c_str(), ids.size(), engine->n_ctx());
    throw CLI::RuntimeError(1);
  }
  std::vector<float> logits;
  const Status s = engine->NewSession()->Eval(ids, &logits, /*all_logits=*/true);
  if (!s.ok()) {
    std::fprintf(stderr, "cachet: %s: %s\n", path.c_str(), s.ToString().c_str());
    throw CLI::RuntimeError(1);
  }
  const size_t vocab = logits.size() / ids.size();
  nlohmann::json argmax = nlohmann::json::array(), margin = nlohmann::json::array();
  for (size_t p = 0; p < ids.size(); ++p) {
    const float* row = logits.data() + p * vocab;
    size_t best = 0;
    for (size_t i = 1; i < vocab; ++i) best = row[i] > row[best] ? i : best;
    float second = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < vocab; ++i) second = i != best ? std::max(second, row[i]) : second;
    argmax.push_back(best);
    margin.push_back(row[best] - second);
  }
  std::printf(
      "%s\n",
      nlohmann::json{{"n", ids.size()}, {"argmax", argmax}, {"margin", margin}}.dump().c_str());
}

}  // namespace

void Fail(const Status& s) {
  std::fprintf(stderr, "\ncachet: %s\n", s.ToString().c_str());
  throw CLI::RuntimeError(1);
}

std::string ReadPrompt(const std::string& text, const std::string& file) {
  if (file.empty()) return text;
  std::ifstream in(file, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// run --chunk-file / --chunk-sep: BOS, the prompt's first piece, the chunk files, the prompt's
// pieces between separators (chunks), then its last piece; each piece tokenized on its own.
struct ChunkedPrompt {
  std::vector<std::vector<int32_t>> ids;
  std::vector<PromptPart> parts;  // views of ids
};
ChunkedPrompt BuildChunkedPrompt(const Tokenizer& tok, const std::string& text,
                                 const std::vector<std::string>& files, const std::string& sep) {
  std::vector<std::string> pieces;
  if (sep.empty()) {
    pieces = {"", text};
  } else {
    for (size_t at = 0;;) {
      const size_t next = text.find(sep, at);
      pieces.push_back(text.substr(at, next == std::string::npos ? std::string::npos : next - at));
      if (next == std::string::npos) break;
      at = next + sep.size();
    }
    if (pieces.size() == 1) pieces.insert(pieces.begin(), "");  // no separator: all question
  }
  ChunkedPrompt p;
  std::vector<bool> chunk;
  if (tok.add_bos() && tok.bos_id() >= 0) {
    p.ids.push_back({tok.bos_id()});
    chunk.push_back(false);
  }
  p.ids.push_back(tok.Encode(pieces.front()));
  chunk.push_back(false);
  for (const std::string& f : files) {
    p.ids.push_back(tok.Encode(ReadPrompt("", f)));
    chunk.push_back(true);
  }
  for (size_t i = 1; i + 1 < pieces.size(); ++i) {
    p.ids.push_back(tok.Encode(pieces[i]));
    chunk.push_back(true);
  }
  p.ids.push_back(tok.Encode(pieces.back()));
  chunk.push_back(false);
  for (size_t i = 0; i < p.ids.size(); ++i) p.parts.push_back({p.ids[i], bool(chunk[i])});
  return p;
}

// run --cache: the saved context's session, then the prompt (no BOS) and the completion.
void RunFromCache(const CLI::App& cmd, const std::string& path, const CommonOptions& opts,
                  const std::string& prompt, const std::string& prompt_file, bool quiet,
                  bool kv_stats, const std::string& salt, bool print_ids) {
  auto info = ReadSavedCacheInfo(path);
  if (!info.ok()) Fail(info.status());
  EngineOptions eo = opts.engine;
  ApplySavedLayout(cmd, *info, eo);
  auto engine = LoadEngine(eo);
  if (!engine) throw CLI::RuntimeError(1);
  RequireLogitBiasInVocab(opts.gen.sampling, *engine);
  auto session = engine->LoadSession(path, salt);
  if (!session.ok()) Fail(session.status());
  const std::vector<int32_t> ids = engine->tokenizer().Encode(ReadPrompt(prompt, prompt_file));
  auto r = (*session)->Generate(ids, opts.gen, print_ids ? nullptr : PrintPiece);
  if (!r.ok()) Fail(r.status());
  if (print_ids) {  // the prompt after the cached context
    std::printf("%s", nlohmann::json{{"prompt", ids}, {"completion", r->tokens}}.dump().c_str());
  }
  std::fputc('\n', stdout);
  if (!quiet) {
    std::fprintf(stderr, "[cachet] context: %d cached tokens from %s (%s)\n", info->n_tokens,
                 path.c_str(), info->compression.c_str());
    PrintStats(*r);
  }
  if (kv_stats) std::fputs(engine->kv_stats().ToString().c_str(), stderr);
}

void AddRun(CLI::App& app) {
  auto* cmd = app.add_subcommand("run",
                                 "Generate a completion of a prompt; only the completion "
                                 "goes to stdout, stats to stderr");
  auto opts = std::make_shared<CommonOptions>();
  auto prompt = std::make_shared<std::string>();
  auto prompt_file = std::make_shared<std::string>();
  auto quiet = std::make_shared<bool>(false);
  auto kv_stats = std::make_shared<bool>(false);
  auto n_parallel = std::make_shared<int>(1);
  auto salt = std::make_shared<std::string>();
  auto ids = std::make_shared<bool>(false);
  auto logits_of = std::make_shared<std::string>();
  AddEngineFlags(*cmd, opts->engine);
  AddSamplingFlags(*cmd, opts->gen);
  AddPressFlags(*cmd, opts->gen);
  auto* p = cmd->add_option("-p,--prompt", *prompt,
                            "Prompt text (BOS is added as the tokenizer "
                            "config says)");
  cmd->add_option("-f,--file", *prompt_file, "Read the prompt from a file")
      ->check(CLI::ExistingFile)
      ->excludes(p);
  cmd->add_flag("-q,--quiet", *quiet, "Do not print timing stats to stderr");
  cmd->add_flag("--kv-stats", *kv_stats,
                "Print KV cache statistics (pages, bytes, prefix hits) "
                "to stderr at the end");
  cmd->add_option("--np", *n_parallel,
                  "Parallel sampling: N completions of one prompt, sharing "
                  "its KV pages (fork + copy-on-write); seeds seed..seed+N-1")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--ids", *ids,
                "Print token ids instead of text: one JSON line {\"prompt\": [...], "
                "\"completion\": [...]} per completion (to compare with another engine)");
  cmd->add_option("--cache-salt", *salt,
                  "Prefix-cache namespace: requests with different salts "
                  "never share cached pages");
  cmd->add_option("--logits-of", *logits_of,
                  "Instead of generating: evaluate the token ids in this file (a JSON array, no "
                  "BOS added) as one sequence and print one JSON line {\"n\": N, \"argmax\": "
                  "[...], \"margin\": [...]}: each position's argmax and top-2 logit margin (to "
                  "compare with another engine: bench/peers/llama_peer logits)")
      ->check(CLI::ExistingFile)
      ->excludes(p);
  auto cache = std::make_shared<std::string>();
  cmd->add_option("--cache", *cache,
                  "Continue from a saved cache (cachet cache save): the prompt follows its "
                  "context (no BOS), which is not computed again. Its KV layout (--ctk, --ctv, "
                  "--page-tokens, --kv-sinks, --kv-window) is taken from the file unless given")
      ->check(CLI::ExistingFile)
      ->excludes("--logits-of")
      ->excludes("--np")
      ->excludes("--press")
      ->excludes("--disk-cache")
      ->excludes("--redis");
  auto chunk_files = std::make_shared<std::vector<std::string>>();
  auto chunk_sep = std::make_shared<std::string>();
  auto blend = std::make_shared<BlendOptions>();
  auto* chunk_file_opt =
      cmd->add_option("--chunk-file", *chunk_files,
                      "A document reused as a chunk (repeatable, in order): its K/V is computed "
                      "on its own, cached, and moved to wherever it appears in a prompt, keys "
                      "re-rotated; the prompt follows the chunk files. docs/REUSE.md")
          ->check(CLI::ExistingFile);
  auto* chunk_sep_opt = cmd->add_option(
      "--chunk-sep", *chunk_sep,
      "Split the prompt at this string: its first piece is plain text, every piece between two "
      "separators a chunk (after any --chunk-file), its last piece plain text (the question)");
  cmd->add_option_function<std::string>(
         "--blend",
         [blend](const std::string& spec) {
           auto b = ParseBlend(spec);
           if (!b.ok()) throw CLI::ValidationError("--blend", b.status().message());
           *blend = *b;
         },
         "With chunks: how they are reconciled with what precedes them: none (plain "
         "concatenation, the default), epic:K (recompute each chunk's first K tokens, 16 by "
         "default), cacheblend:R (recompute the R fraction of tokens whose K/V deviate most, "
         "0.15 by default)")
      ->type_name("SPEC");
  for (auto* o : {chunk_file_opt, chunk_sep_opt}) {
    o->excludes("--press")->excludes("--cache")->excludes("--logits-of");
  }
  cmd->callback([=] {
    if (!logits_of->empty()) return PrintLogitsOf(opts->engine, *logits_of);
    if (!cache->empty())
      return RunFromCache(*cmd, *cache, *opts, *prompt, *prompt_file, *quiet, *kv_stats, *salt,
                          *ids);
    const std::string text = ReadPrompt(*prompt, *prompt_file);
    auto engine = LoadEngine(opts->engine);
    if (!engine) throw CLI::RuntimeError(1);
    RequireLogitBiasInVocab(opts->gen.sampling, *engine);
    const bool chunked = !chunk_files->empty() || !chunk_sep->empty();
    ChunkedPrompt cp;
    std::vector<int32_t> prompt_ids;
    if (chunked) {
      cp = BuildChunkedPrompt(engine->tokenizer(), text, *chunk_files, *chunk_sep);
      for (const auto& ids_of : cp.ids)
        prompt_ids.insert(prompt_ids.end(), ids_of.begin(), ids_of.end());
    } else {
      prompt_ids = engine->tokenizer().EncodePrompt(text);
    }
    const std::function<bool(std::string_view)> on_piece = *ids ? nullptr : PrintPiece;
    auto done = [&](const GenerateResult& r) {
      if (*ids) {
        std::printf(
            "%s", nlohmann::json{{"prompt", prompt_ids}, {"completion", r.tokens}}.dump().c_str());
      }
      std::fputc('\n', stdout);
      if (!*quiet) PrintStats(r);
    };
    if (*n_parallel == 1 && !chunked) {
      auto r = engine->Generate(text, opts->gen, on_piece, *salt);
      if (!r.ok()) Fail(r.status());
      done(*r);
    } else {
      // Prefill once; each completion forks the prompt's pages and diverges copy-on-write.
      auto prompt_session = engine->NewSession(*salt);
      const auto& press = opts->gen.press;
      ChunkReuseStats cs;
      press::PressResult pressed;
      const auto t0 = std::chrono::steady_clock::now();
      const Status s =
          chunked ? prompt_session->EvalChunked(cp.parts, *blend, nullptr, &cs)
          : press ? prompt_session->EvalPressed(prompt_ids, *press, nullptr, false, &pressed)
                  : prompt_session->Eval(prompt_ids, nullptr);
      if (!s.ok()) Fail(s);
      const double prompt_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (chunked && !*quiet) {
        std::fprintf(stderr,
                     "[chunks] %d prompt tokens, %d in chunks (%d found cached, %d computed on "
                     "their own in %.1f ms, %d of their tokens from the prefix cache or its "
                     "tiers), %d recomputed in place (%s)\n",
                     cs.prompt_tokens, cs.chunk_tokens, cs.chunk_hits, cs.chunk_misses,
                     cs.chunk_compute_ms, cs.prefix_tokens, cs.recomputed_tokens,
                     BlendName(*blend).c_str());
      }
      for (int i = 0; i < *n_parallel; ++i) {
        auto fork = prompt_session->Fork();
        GenerateOptions g = opts->gen;
        g.press.reset();  // the shared prompt is already compressed
        g.sampling.seed += i;
        if (!*quiet && *n_parallel > 1) {
          std::fprintf(stderr, "--- completion %d of %d\n", i + 1, *n_parallel);
        }
        auto r = fork->Generate({}, g, on_piece);
        if (!r.ok()) Fail(r.status());
        r->prompt_tokens = static_cast<int>(prompt_ids.size());  // evaluated once for all
        r->prefill_ms = prompt_ms;
        if (press) r->press = pressed;
        done(*r);
      }
    }
    if (*kv_stats) std::fputs(engine->kv_stats().ToString().c_str(), stderr);
  });
}

void AddInspect(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect",
                                 "Print a model's architecture, parameter count, weight types "
                                 "and KV cache bytes per token");
  auto dir = std::make_shared<std::string>();
  auto tensors = std::make_shared<bool>(false);
  cmd->add_option("-m,--model", *dir,
                  "HF model directory or .gguf file (default: the embedded kvtiny)")
      ->check(CLI::ExistingPath);
  cmd->add_flag("--tensors", *tensors,
                "Also list every weight matrix: GGUF name, type, rows x columns, MiB");
  cmd->callback([=] {
    EngineOptions o;
    o.model_dir = *dir;
    o.threads = 1;
    o.kv_mem_mib = 1;
    auto engine = LoadEngine(o);
    if (!engine) throw CLI::RuntimeError(1);
    const ModelConfig& c = engine->config();
    const Tokenizer& tok = engine->tokenizer();
    std::printf("model            %s\n", engine->options().model_dir.c_str());
    std::printf("architecture     %s\n", ArchName(c.arch));
    std::printf("parameters       %lld (%.2f M)\n", static_cast<long long>(c.ParamCount()),
                c.ParamCount() / 1e6);
    std::printf("layers           %d\n", c.n_layers);
    std::printf("hidden / ffn     %d / %d\n", c.hidden_size, c.intermediate_size);
    std::printf("heads (q / kv)   %d / %d, head_dim %d\n", c.n_heads, c.n_kv_heads, c.head_dim);
    std::printf("vocab            %d (tokenizer: %s, %d tokens)\n", c.vocab_size,
                std::string(tok.kind()).c_str(), tok.vocab_size());
    std::printf("context          %d, rope_theta %g\n", c.max_position_embeddings, c.rope_theta);
    std::printf("tied embeddings  %s\n", c.tie_word_embeddings ? "yes" : "no");
    std::printf(
        "KV bytes/token   f32 %lld, f16/bf16 %lld, int8 %lld (+scales); pages add each row's "
        "position: %d more\n",
        static_cast<long long>(c.KvBytesPerToken(4)), static_cast<long long>(c.KvBytesPerToken(2)),
        static_cast<long long>(c.KvBytesPerToken(1)), 4 * c.n_layers * c.n_kv_heads);
    std::printf("KV at context    f32 %.1f MiB for %d tokens\n",
                c.KvBytesPerToken(4) * double(c.max_position_embeddings) / (1 << 20),
                c.max_position_embeddings);
    // Weight types as llama.cpp's loader prints them: matrices per type and their MiB.
    const auto matrices = engine->weight_matrices();
    struct TypeTotal {
      DType type;
      int matrices = 0;
      int64_t bytes = 0;
    };
    std::vector<TypeTotal> by_type;  // in the order the types first appear
    for (const auto& m : matrices) {
      auto it = std::find_if(by_type.begin(), by_type.end(),
                             [&](const TypeTotal& e) { return e.type == m.type; });
      if (it == by_type.end()) it = by_type.insert(by_type.end(), TypeTotal{m.type});
      ++it->matrices;
      it->bytes += m.bytes;
    }
    std::string types;
    for (const TypeTotal& t : by_type) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s%s x %d (%.1f MiB)", types.empty() ? "" : ", ",
                    DTypeName(t.type), t.matrices, t.bytes / double(1 << 20));
      types += buf;
    }
    std::printf("weights          %s\n", types.c_str());
    if (*tensors) {
      for (const auto& m : matrices) {
        std::printf("  %-18s %-5s %6lld x %-6lld %9.2f MiB\n", m.name.c_str(), DTypeName(m.type),
                    static_cast<long long>(m.rows), static_cast<long long>(m.cols),
                    m.bytes / double(1 << 20));
      }
    }
  });
}

}  // namespace cachet::cli
