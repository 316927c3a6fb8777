// `cachet serve`'s HTTP side (cpp-httplib): OpenAI's /v1/completions, /v1/chat/completions (SSE
// streaming) and /v1/models, plus /health, /metrics (Prometheus), llama.cpp's /tokenize and
// /detokenize, /v1/cache/reset, and saved caches (/v1/caches: a context prefilled and pressed once
// that requests continue with `cache_id`), over one Runtime (include/cachet/serving.h).
//
// Threads: cpp-httplib's handler threads parse a body into a typed request (request.h), prepare
// it (prepare.h) and Submit it to the Runtime, one Runtime request per choice (`n`). Each HTTP
// request then waits on its own queue (a mutex and a condition variable) that the Runtime's event
// callbacks fill on the scheduler thread; the callbacks only copy the event in and notify. A
// streaming response writes each event as SSE chunks as it arrives; a write that fails (the
// client went away) cancels the request's Runtime requests, which frees their pages. While
// nothing arrives for a while (a request still queued), an SSE comment line is written so that a
// client that left is noticed then too. (src/server/ implements it.)
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "cachet/chat_template.h"
#include "cachet/serving.h"

namespace cachet::server {

// What a chat reply is split by (--reasoning-format, a request's `reasoning_format`): "none", the
// reply as generated, all in `content`; "deepseek" (and "auto", llama.cpp's default name for it),
// its <think> part in `reasoning_content` (DeepSeek's API shape).
enum class ReasoningFormat : uint8_t { kNone, kDeepSeek };
// "none", "deepseek" or "auto"; anything else is InvalidArgument naming the three.
Result<ReasoningFormat> ParseReasoningFormat(std::string_view name);

struct ServerOptions {
  std::string model_name;  // the id /v1/models lists and requests may name
  // The template of /v1/chat/completions (ResolveChatTemplate); the server gives it the
  // tokenizer's BOS and EOS texts.
  ChatTemplate chat_template;
  std::string host = "127.0.0.1";
  int port = 8080;        // 0: any free port (port() says which)
  std::string api_key;    // non-empty: every endpoint but /health and /metrics needs it
  int http_threads = 32;  // connections served at once (a streaming request holds one)
  size_t max_body_bytes = 16u << 20;
  int retry_after_s = 1;      // Retry-After of a 503 (the Runtime's queue is full)
  bool log_requests = false;  // one line per request on stderr
  // --on-full: what a chat that leaves too little room in the context gets: a 400 (error), its
  // oldest turns after the system prompt dropped (shift), or its history pressed (press).
  press::OnFull on_full;
  ReasoningFormat reasoning_format = ReasoningFormat::kDeepSeek;
};

class Server {
 public:
  // runtime must outlive the server.
  Server(Runtime& runtime, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket (errors: the address is taken or not local).
  Status Bind();
  int port() const;
  // Serves until Stop(); returns false if the listen loop failed.
  bool Run();
  // From any thread: refuses new requests (503), cancels those in flight and ends Run().
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cachet::server
