// cachet eval: accuracy on synthetic long-context tasks and KL/perplexity on text, for each KV
// compression configuration, with memory and speed measured in the same run (docs/EVAL.md).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <tuple>

#include "cachet/eval/harness.h"
#include "cachet/eval/report.h"
#include "cachet/kv_codecs.h"
#include "cachet/model_config.h"
#include "cachet/tokenizer.h"
#include "commands.h"

namespace cachet::cli {
namespace {

using namespace cachet::eval;

struct EvalOpts {
  EngineOptions engine;
  std::vector<std::string> tasks{"passkey"};
  std::vector<int> lengths{1024};
  std::vector<int> needles{1};
  int questions = 4;
  int docs = 8;
  std::vector<std::string> blends{"none", "epic:16", "cacheblend:0.15"};
  std::vector<std::string> depths{"random"};
  int samples = 20;
  uint64_t seed = 1234;
  int max_new = 16;
  std::vector<std::string> presses{"full"};
  std::vector<double> ratios{0.5};
  std::vector<int> budgets;
  std::vector<std::string> codecs{"f32"};
  std::vector<std::string> compress_at{"prompt"};
  int press_window = 32;
  std::vector<std::string> probe_texts;
  int press_sinks = 4;
  double demote_fetch = 0.125;
  bool kl = false, kl_decode = false;
  int windows = 8;
  int window_len = 1024;
  std::string text_file;
  int64_t text_offset = -1;
  std::string kl_ref = "full/f32";
  std::string json, csv, report, dump_prompts, dump_windows, predictions;
  bool prompts_only = false;
  std::string haystack;
  bool progress = true;
  bool reuse_cache = false;
  double test_perturb_logits = 0;
};

// A private directory for --reuse-cache's files, removed with them at the end.
struct TempCacheDir {
  std::string path;
  TempCacheDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "cachet-reuse-XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path = tmpl;
  }
  ~TempCacheDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "cachet eval: %s\n", message.c_str());
  throw CLI::RuntimeError(1);
}

// A failed status ends the command, its message after the flag that led to it.
void Check(const Status& s, const char* flag = nullptr) {
  if (!s.ok()) Fail(flag ? std::string(flag) + ": " + s.message() : s.message());
}

template <class T>
T OrFail(Result<T> r, const char* flag = nullptr) {
  Check(r.status(), flag);
  return std::move(r).value();
}

std::vector<Method> MethodGrid(const EvalOpts& o) {
  for (const std::string& codec : o.codecs) Check(codecs::CheckCodecNames(codec), "--codec");
  std::vector<Method> out;
  for (const std::string& press : o.presses) {
    std::vector<Method> sized;  // this press at each ratio or budget
    if (press == "full") {
      sized.push_back(Method{});
    } else if (!o.budgets.empty()) {
      for (int b : o.budgets) sized.push_back(Method{.press = press, .budget = b});
    } else {
      for (double r : o.ratios) sized.push_back(Method{.press = press, .ratio = r});
    }
    for (Method m : sized) {
      m.window = o.press_window;
      m.probe_texts = o.probe_texts;
      m.sinks = o.press_sinks;
      m.demote_fetch = o.demote_fetch;
      for (const std::string& codec : o.codecs) {
        std::tie(m.codec_k, m.codec_v) = codecs::SplitKv(codec);
        for (const std::string& at : o.compress_at) {
          m.compress_at = OrFail(ParseCompressAt(at), "--compress-at");
          Check(ValidateMethod(m));
          const bool dup = std::any_of(out.begin(), out.end(), [&](const Method& x) {
            return x.Label() == m.Label() && x.compress_at == m.compress_at;
          });
          if (!dup) out.push_back(m);
        }
      }
    }
  }
  return out;
}

void ReportUnavailable(const std::vector<ResultRow>& rows) {
  std::set<std::string> said;
  for (const ResultRow& r : rows) {
    if (r.status != "unavailable" || !said.insert(r.method.Label() + r.reason).second) continue;
    std::fprintf(stderr, "cachet eval: %s unavailable: %s; reported as 'unavailable' rows\n",
                 r.method.Label().c_str(), r.reason.c_str());
  }
}

std::string ModelName(const std::string& dir) {
  std::filesystem::path p(dir);
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

void Run(const EvalOpts& o) {
  const bool run_tasks = !o.kl || o.prompts_only;
  std::vector<TaskKind> tasks;
  if (!o.report.empty()) {  // before the evaluation, not after it
    std::error_code ec;
    std::filesystem::create_directories(o.report, ec);
    if (ec || !std::filesystem::is_directory(o.report)) {
      Fail("--report " + o.report + ": cannot create the directory" +
           (ec ? ": " + ec.message() : std::string(": a file is in the way")));
    }
  }
  for (const std::string& t : o.tasks) tasks.push_back(OrFail(ParseTaskKind(t), "--task"));
  std::vector<double> depths;
  for (const std::string& d : o.depths) {
    if (d == "random") {
      depths.push_back(-1);
      continue;
    }
    double v = -1;
    try {
      size_t used = 0;
      v = std::stod(d, &used);
      if (used != d.size()) v = -1;
    } catch (const std::exception&) {
    }
    if (!(v >= 0 && v <= 1)) Fail("--depth takes numbers in [0, 1] or 'random', got '" + d + "'");
    depths.push_back(v);
  }
  for (int n : o.needles) {
    if (n < 0 || n > 64) Fail("--needles must be in [0, 64] (0: the training mix)");
  }
  const std::vector<Method> methods = MethodGrid(o);

  // Room for the longest prompt (lengths are met within 2%) plus the answer; the pool holds two
  // such sequences, since a press that compresses after prefill keeps the prefill while its fork
  // is built. Reserved address space only: pages are touched when written.
  EngineOptions eo = o.engine;
  if (eo.model_dir.empty()) eo.model_dir = DefaultModelDir();
  eo.prefix_cache = false;  // every prefill is measured in full, never served from another's pages
  const int max_len = *std::max_element(o.lengths.begin(), o.lengths.end());
  const ModelConfig config = OrFail(ModelConfig::Load(eo.model_dir));
  if (eo.n_ctx == 0) {
    // multiturn keeps every question (about 20 tokens) and answer in the context.
    const bool turns = std::find(o.tasks.begin(), o.tasks.end(), "multiturn") != o.tasks.end();
    const int answers = turns ? o.questions * (o.max_new + 32) : o.max_new + 8;
    // kvzip repeats the context after it in chunks: room for 256-token chunks.
    const bool probes = std::find(o.presses.begin(), o.presses.end(), "kvzip") != o.presses.end();
    eo.n_ctx = std::max(o.kl ? o.window_len : 0,
                        run_tasks ? max_len + max_len / 50 + answers + (probes ? 256 : 0) : 0);
    // Past the trained positions the model's outputs mean nothing: measured only when asked.
    const int trained = config.max_position_embeddings;
    const int asked = std::max(o.kl ? o.window_len : 0, run_tasks ? max_len : 0);
    if (asked > trained) {
      std::fprintf(stderr,
                   "cachet eval: %s %d passes the model's trained context of %d "
                   "(max_position_embeddings), where its outputs mean nothing; give -c %d to "
                   "evaluate there anyway\n",
                   asked == max_len && run_tasks ? "--len" : "--window-len", asked, trained,
                   eo.n_ctx);
      throw CLI::RuntimeError(1);
    }
  }
  // multidoc keeps the cached documents beside the prompt (and the prompt it blends).
  const bool multidoc = std::find(tasks.begin(), tasks.end(), TaskKind::kMultidoc) != tasks.end();
  std::vector<BlendOptions> blends;
  for (const std::string& b : o.blends) blends.push_back(OrFail(ParseBlend(b), "--blend"));
  if (eo.kv_mem_mib == 0) {
    eo.kv_mem_mib = KvPoolMibFor(config, eo.page_tokens, eo.n_ctx,
                                 /*sequences=*/multidoc ? 3 : 2);
  }
  auto engine = LoadEngine(eo);
  if (!engine) throw CLI::RuntimeError(1);
  const std::string model = ModelName(engine->options().model_dir);

  std::vector<ResultRow> rows;
  if (run_tasks) {
    const std::string dir = o.haystack.empty() ? DefaultHaystackDir() : o.haystack;
    TaskGenerator gen(engine->tokenizer(), OrFail(Haystack::Load(dir)));
    SweepOptions so;
    so.tasks = tasks;
    so.lengths = o.lengths;
    so.needles = o.needles;
    so.questions = o.questions;
    so.docs = o.docs;
    so.blends = blends;
    so.depths = depths;
    so.samples = o.samples;
    so.seed = o.seed;
    so.max_new = o.max_new;
    so.methods = methods;
    so.model_name = model;
    so.dump_prompts = o.dump_prompts;
    so.predictions = o.predictions;
    so.progress = o.progress;
    if (o.prompts_only) {
      if (o.dump_prompts.empty()) Fail("--prompts-only needs --dump-prompts FILE");
      std::ofstream out(o.dump_prompts, std::ios::binary | std::ios::trunc);
      if (!out) Fail(o.dump_prompts + ": cannot open for writing");
      int64_t n = 0;
      for (const TaskSpec& spec : TaskCells(so)) {
        for (int i = 0; i < o.samples; ++i, ++n) {
          out << PromptJsonLine(OrFail(gen.Generate(spec, o.seed, i)), spec, o.seed, i);
        }
      }
      std::fprintf(stderr, "cachet eval: wrote %lld prompts to %s\n", static_cast<long long>(n),
                   o.dump_prompts.c_str());
      return;
    }
    std::unique_ptr<TempCacheDir> reuse_dir;
    if (o.reuse_cache) {
      if (std::find(o.compress_at.begin(), o.compress_at.end(), "context") == o.compress_at.end()) {
        Fail(
            "--reuse-cache scores a compressed context saved and loaded again: it needs "
            "--compress-at context");
      }
      reuse_dir = std::make_unique<TempCacheDir>();
      so.reuse_cache_dir = reuse_dir->path;
    }
    rows = OrFail(RunTaskSweep(*engine, gen, so));
  }
  if (o.kl) {
    KlOptions ko;
    ko.text_file = o.text_file;
    ko.offset = o.text_offset;
    ko.windows = o.windows;
    ko.window_len = o.window_len;
    ko.methods = methods;
    ko.reference = OrFail(ParseMethod(o.kl_ref), "--kl-ref");
    ko.seed = o.seed;
    ko.model_name = model;
    ko.progress = o.progress;
    ko.dump_windows = o.dump_windows;
    ko.decode = o.kl_decode;
    ko.test_perturb_logits = o.test_perturb_logits;
    std::vector<ResultRow> kl = OrFail(RunKlSweep(*engine, ko));
    rows.insert(rows.end(), kl.begin(), kl.end());
  }

  ReportUnavailable(rows);
  if (!o.json.empty()) Check(WriteJsonl(rows, o.json));
  if (!o.csv.empty()) Check(WriteCsv(rows, o.csv));
  std::vector<std::string> notes;
  if (!o.report.empty()) {
    Check(WriteReport(rows, o.report, CurrentMeta(), &notes));
    for (const std::string& n : notes) std::fprintf(stderr, "cachet eval: %s\n", n.c_str());
    std::fprintf(stderr, "cachet eval: report in %s/index.html\n", o.report.c_str());
  }
  std::printf("%s", MarkdownTable(rows).c_str());
}

}  // namespace

void AddEval(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Evaluate KV compression: accuracy on synthetic long-context tasks (passkey, niah, kv, vt) "
      "or KL divergence / perplexity on text (--kl), with KV bytes, peak RSS, tok/s and TTFT of "
      "each configuration. Methods the build cannot run give 'unavailable' rows");
  auto o = std::make_shared<EvalOpts>();
  AddEngineFlags(*cmd, o->engine, "f32");
  cmd->add_option("--task", o->tasks,
                  "Tasks: passkey, niah, kv, vt, multiq (--questions against one cache, each "
                  "dropped before the next), multiturn (each question and answer kept, as a "
                  "chat), multidoc (a niah context cut into --docs documents in a random order, "
                  "each reused as a chunk with every --blend, beside the full prefill); comma "
                  "separated")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--len", o->lengths, "Prompt lengths in tokens, BOS included (e.g. 1024,4096)")
      ->delimiter(',')
      ->check(CLI::Range(16, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--samples", o->samples, "Samples per task, length, needles and depth")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--needles", o->needles,
                  "niah: needles in the haystack (1, 2, 4, 8; a list sweeps; 0 = the mix kvtiny "
                  "was trained and baselined on: 1, 1, 2, 4, 8 needles by sample)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--questions", o->questions,
                  "multiq, multiturn: questions per context, each about its own niah needle, "
                  "asked in a random order")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--docs", o->docs, "multidoc: documents the context is cut into")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--blend", o->blends,
                  "multidoc: ways of reusing the documents as chunks, each beside the full "
                  "prefill: none (plain concatenation), epic:K (recompute each chunk's first K "
                  "tokens), cacheblend:R (recompute the R fraction of tokens whose K/V deviate "
                  "most); docs/REUSE.md")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--depth", o->depths,
                  "Needle depth, 0 (start) .. 1 (end), or 'random' (a list sweeps)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("-s,--seed", o->seed, "Seed of the task prompts (same seed, same prompts)")
      ->capture_default_str();
  cmd->add_option("--max-new", o->max_new,
                  "Max tokens decoded per answer (decoding also stops at a newline or EOS)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--press", o->presses,
                  "Presses: full, or a scorer (streaming, h2o, snapkv, tova, knorm, keydiff, "
                  "expected, random; kvzip, lookahead: scored by probes evaluated after the "
                  "cache and dropped; pyramidkv = snapkv+pyramid) with optional modifiers: "
                  "+uniform|+pyramid|+ada (per-head budget allocator) or +max|+mean (one token "
                  "set for all layers, scores combined over layers and heads), e.g. snapkv+max")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--probe-text", o->probe_texts,
                  "Press lookahead: a question whose attention scores the cache (repeatable; "
                  "default: three generic questions, none about the tasks)")
      ->type_name("TEXT");
  cmd->add_option("--window", o->press_window,
                  "Presses: observation window (last prompt tokens whose attention SnapKV and "
                  "expected attention score by; always kept)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--demote-fetch", o->demote_fetch,
                  "Presses with +demote:CODEC: fraction of the cold pages each decode step reads")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--sinks", o->press_sinks, "Presses: the first N tokens are always kept")
      ->check(NonNegative())
      ->capture_default_str();
  auto* ratio = cmd->add_option("--ratio", o->ratios,
                                "Fraction of the KV removed by each press (0.5 = half the "
                                "entries kept)")
                    ->delimiter(',')
                    ->check(CLI::Range(0.0, 0.999999))
                    ->capture_default_str();
  cmd->add_option("--budget", o->budgets, "Tokens kept by each press, instead of --ratio")
      ->delimiter(',')
      ->check(Positive())
      ->excludes(ratio);
  cmd->add_option("--codec", o->codecs,
                  "KV codecs: " + codecs::CodecNames() +
                      ", or K:V for different K and V codecs (each codec pair runs on its own "
                      "engine)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--compress-at", o->compress_at,
                  "When a press acts: 'prompt' (after the whole prompt) or 'context' (before "
                  "the question is appended)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_flag("--reuse-cache", o->reuse_cache,
                "With --compress-at context: save each compressed context to a file and answer "
                "the question from a session loaded from it, as a later request reusing the cache "
                "would (TTFT then counts the load and the question; rows record the file size)");
  cmd->add_flag("--kl", o->kl,
                "Measure KL divergence, top-1 agreement and perplexity on text against --kl-ref "
                "instead of task accuracy");
  cmd->add_option("--windows", o->windows, "KL: text windows")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--window-len", o->window_len,
                  "KL: tokens per window, BOS included; the first half is context, the second "
                  "half is scored")
      ->check(CLI::Range(8, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--text", o->text_file, "KL: text file (default: the haystack's pydocs.txt)")
      ->check(CLI::ExistingFile);
  cmd->add_option(
         "--text-offset", o->text_offset,
         "KL: byte offset in the text (next paragraph start; default: a quarter into the file)")
      ->check(NonNegative());
  cmd->add_option("--kl-ref", o->kl_ref, "KL: reference configuration, e.g. full/f32")
      ->capture_default_str();
  cmd->add_flag("--kl-decode", o->kl_decode,
                "KL: score the second half one token at a time, as generation sees the cache "
                "(KIVI's full-precision residual and --kv-window act as in decoding); by default "
                "it runs in --ubatch chunks: row-wise codecs store a chunk's K/V before it "
                "attends, as llama.cpp's perplexity tool does; staged ones (KIVI keys, "
                "--kv-window) seal its pages after");
  cmd->add_option("--dump-windows", o->dump_windows,
                  "KL: write each text window's token ids as a JSON line (window, score_from, "
                  "ids) to score another engine on the same tokens");
  cmd->add_option("--json", o->json, "Write the result rows as JSON lines");
  cmd->add_option("--csv", o->csv, "Write the result rows as CSV");
  cmd->add_option("--report", o->report,
                  "Write DIR/index.html (plots embedded), DIR/summary.md and the plots (gnuplot)");
  cmd->add_option("--dump-prompts", o->dump_prompts,
                  "Write the task prompts as JSON lines (id, task, length, text, answer, ...) to "
                  "score another engine on the same prompts");
  cmd->add_flag("--prompts-only", o->prompts_only,
                "With --dump-prompts: write the prompts and stop (no model runs)");
  cmd->add_option("--predictions", o->predictions,
                  "Write each sample's prediction per configuration as JSON lines");
  cmd->add_option("--haystack", o->haystack,
                  "Directory with bible.txt, pydocs.txt, fortunes.txt, words.txt (default: the "
                  "source tree's data/haystack)")
      ->check(CLI::ExistingPath);
  cmd->add_flag("!--no-progress", o->progress, "No progress bar on stderr");
  cmd->add_option("--test-perturb-logits", o->test_perturb_logits,
                  "Test only: add Gaussian noise of this stddev to the tested logits (KL)")
      ->group("");  // hidden: it exists to show the KL metric can fail
  cmd->callback([o, cmd] {
    // --kl scores text windows instead of the tasks: their flags would be ignored without a word.
    if (o->kl && !o->prompts_only) {
      for (const char* flag : {"--task", "--len", "--samples", "--needles", "--depth"}) {
        if (cmd->count(flag) > 0) {
          Fail(std::string(flag) +
               " sets the tasks, which --kl does not run (it scores --windows text windows of "
               "--window-len tokens): run the tasks in an eval of their own");
        }
      }
    }
    Run(*o);
  });
}

}  // namespace cachet::cli
