// `cachet serve`: the OpenAI-compatible HTTP server (src/server/, docs/SERVER.md) over one
// Runtime (continuous batching, include/cachet/serving.h).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <thread>

#include "cachet/chat_template.h"
#include "cachet/server.h"
#include "cachet/serving.h"
#include "commands.h"

namespace cachet::cli {
namespace {

// The id clients name the model by: the directory's name, or the GGUF file's without .gguf.
std::string ModelName(const std::string& path) {
  std::filesystem::path p(path);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();  // a trailing '/'
  return p.extension() == ".gguf" ? p.stem().string() : p.filename().string();
}

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "cachet serve: %s\n", message.c_str());
  throw CLI::RuntimeError(1);
}

struct ServeOptions {
  RuntimeOptions runtime;
  server::ServerOptions server;
  std::string chat_template;
  std::string chat_template_kwargs;
  std::string alias;
  int64_t cache_mem_mib = 0;
};

}  // namespace

void AddServe(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streaming), "
      "/v1/models, /health, /metrics, /tokenize, /detokenize, /v1/cache/reset, /v1/caches (a "
      "context prefilled and pressed once, continued by requests with cache_id); requests are "
      "batched continuously over one KV pool and prefix cache (docs/SERVER.md)");
  auto o = std::make_shared<ServeOptions>();
  AddEngineFlags(*cmd, o->runtime.engine);
  cmd->add_option("--host", o->server.host,
                  "Address to listen on (0.0.0.0: every interface; then set --api-key)")
      ->default_val("127.0.0.1");
  cmd->add_option("--port", o->server.port, "TCP port; 0 picks a free one (printed at startup)")
      ->default_val(8080)
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--np,--parallel", o->runtime.max_sequences,
                  "Requests running at once (prefilling or decoding), batched into each step; "
                  "-np N works too. More wait in a queue")
      ->default_val(8)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--batch-tokens", o->runtime.batch_tokens,
                  "Tokens per batched step: one per decoding request plus chunks of prompts")
      ->default_val(512)
      ->check(Positive());
  cmd->add_option("--max-waiting", o->runtime.max_waiting,
                  "Requests that may wait for a place beyond --np; more are refused with 503 "
                  "and Retry-After")
      ->default_val(256)
      ->check(NonNegative());
  cmd->add_option("--cache-mem-mib", o->cache_mem_mib,
                  "MiB of KV pages that kept caches (POST /v1/caches) may hold in RAM; past it "
                  "the least recently used leave RAM and are loaded again from --disk-cache or "
                  "--redis when asked for (without either, a cache past it is refused). Default "
                  "0: half of --kv-mem")
      ->default_val(0)
      ->check(NonNegative());
  cmd->add_option("--api-key", o->server.api_key,
                  "Require \"Authorization: Bearer KEY\" on every endpoint but /health and "
                  "/metrics (401 otherwise); also read from $CACHET_API_KEY")
      ->envname("CACHET_API_KEY");
  cmd->add_option(std::string(kChatTemplateFlag), o->chat_template,
                  "Chat template of /v1/chat/completions, one of: " + ChatTemplateNames() +
                      ". Default: the model's own (tokenizer_config.json chat_template or the "
                      "GGUF's tokenizer.chat_template) recognised by family; plain for a model "
                      "without one. An unrecognised template stops the server at startup")
      ->type_name("NAME");
  AddChatTemplateKwargsFlag(*cmd, o->chat_template_kwargs,
                            ". A request's chat_template_kwargs field overrides it");
  cmd->add_option("--alias", o->alias,
                  "Model id that /v1/models lists and requests may name (default: the model "
                  "directory's name, or the GGUF file's without .gguf)");
  cmd->add_option("--http-threads", o->server.http_threads,
                  "HTTP connections served at once (each streaming request holds one; default "
                  "0: --np + --max-waiting, at least 16, at most 512)")
      ->default_val(0)
      ->check(NonNegative());
  cmd->add_option_function<std::string>(
         "--on-full",
         [o](const std::string& policy) {
           Result<press::OnFull> parsed = press::ParseOnFull(policy);
           if (!parsed.ok()) throw CLI::ValidationError("--on-full", parsed.status().message());
           o->server.on_full = *parsed;
         },
         "A chat whose messages leave too little room in the context (its max_tokens, or a "
         "quarter of the context): error (a 400, the default), shift (drop the oldest turns "
         "after the system prompt until it fits; the X-Cachet-Dropped-Messages header says how "
         "many), or press:NAME:RATIO (press the turns between the system prompt and the last "
         "message with a press that reads the cache alone, streaming, knorm, keydiff or random, "
         "as often as it takes to fit, at admission; X-Cachet-History-Pressed says so, "
         "usage.prompt_tokens counts every message, and the pressed pages are not cached)")
      ->type_name("POLICY");
  cmd->add_option_function<std::string>(
         "--reasoning-format",
         [o](const std::string& name) {
           Result<server::ReasoningFormat> parsed = server::ParseReasoningFormat(name);
           if (!parsed.ok()) {
             throw CLI::ValidationError("--reasoning-format", parsed.status().message());
           }
           o->server.reasoning_format = *parsed;
         },
         "How a chat reply's thinking is returned, as llama-server does: deepseek (or auto, the "
         "default): a reply that opens with <think>, or whose prompt opened it (DeepSeek-R1's "
         "template), has its thinking in message.reasoning_content (streamed as "
         "delta.reasoning_content) and the rest in content; none: the reply as generated, all "
         "in content. A request's reasoning_format field overrides it")
      ->type_name("FORMAT");
  cmd->add_flag("--log-requests", o->server.log_requests,
                "Print one line per HTTP request (method, path, status) to stderr");
  cmd->callback([o] {
    o->runtime.cache_mem_bytes = o->cache_mem_mib << 20;
    // Everything that can fail does so before the port is opened: the template first (before
    // the model loads), then the model and its tokenizer.
    const std::string path =
        o->runtime.engine.model_dir.empty() ? DefaultModelDir() : o->runtime.engine.model_dir;
    Result<ChatTemplate> tmpl = ResolveChatTemplate(path, o->chat_template);
    if (!tmpl.ok()) Fail(tmpl.status().ToString());
    if (!o->chat_template_kwargs.empty()) {
      if (Status st = ApplyChatTemplateKwargs(o->chat_template_kwargs, &tmpl.value()); !st.ok()) {
        Fail(st.ToString());
      }
    }

    // Signals go to one thread that stops the server; the others (the scheduler's, httplib's)
    // inherit the blocked mask.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    std::signal(SIGPIPE, SIG_IGN);  // a client that left is a failed write, not a signal

    Result<std::unique_ptr<Runtime>> runtime = Runtime::Create(o->runtime);
    if (!runtime.ok()) Fail(runtime.status().ToString());
    Runtime& rt = *runtime.value();
    WarnThreadsCapped("cachet serve", o->runtime.engine.threads, rt.threads());
    WarnPastTrainedContext("cachet serve", rt.n_ctx(), rt.config());

    server::ServerOptions so = o->server;
    so.model_name = o->alias.empty() ? ModelName(path) : o->alias;
    so.chat_template = std::move(tmpl).value();
    if (so.http_threads == 0) {
      so.http_threads = std::clamp(o->runtime.max_sequences + o->runtime.max_waiting, 16, 512);
    }
    const KvStats kv = rt.kv_stats();
    server::Server srv(rt, so);
    if (Status s = srv.Bind(); !s.ok()) Fail(s.message());

    std::atomic<bool> done{false};
    std::thread watcher([&] {
      const timespec tick{0, 200 * 1000 * 1000};
      while (!done) {
        const int sig = sigtimedwait(&signals, nullptr, &tick);
        if (sig == SIGINT || sig == SIGTERM) {
          std::fprintf(stderr, "cachet serve: %s, stopping\n",
                       sig == SIGINT ? "SIGINT" : "SIGTERM");
          srv.Stop();
          break;
        }
      }
    });
    std::fprintf(stderr,
                 "cachet serve: model %s (%s template, context %d, KV %s, %d pages of %d tokens), "
                 "-np %d, --batch-tokens %d, %d threads\n",
                 so.model_name.c_str(),
                 std::string(ChatFamilyName(so.chat_template.family)).c_str(), rt.n_ctx(),
                 kv.codec.c_str(), kv.pages_total, kv.page_tokens, o->runtime.max_sequences,
                 o->runtime.batch_tokens, rt.threads());
    std::fprintf(stderr, "cachet serve: listening on http://%s:%d\n", so.host.c_str(), srv.port());
    std::fflush(stderr);
    const bool ok = srv.Run();
    done = true;
    watcher.join();
    srv.Stop();
    if (!ok) Fail("the HTTP listen loop failed");
    std::fprintf(stderr, "cachet serve: stopped\n");
  });
}

}  // namespace cachet::cli
