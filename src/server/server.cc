#include "cachet/server.h"

#include <httplib.h>
#include <strings.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_set>
#include <vector>

#include "cachet/tokenizer.h"
#include "connection.h"
#include "prepare.h"
#include "reasoning.h"
#include "response.h"

namespace cachet::server {
namespace {

constexpr const char* kJson = "application/json";
// How long a stream may stay silent before a comment line checks that the client is still there.
constexpr auto kStreamHeartbeat = std::chrono::seconds(2);

// Equal strings, in time that does not depend on where they differ.
bool SameSecret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

// Usage of a request of n choices: the prompt counted once (choice 0's), completions summed.
Usage Total(const std::vector<Usage>& per_choice) {
  Usage u = per_choice.empty() ? Usage() : per_choice[0];
  u.completion_tokens = 0;
  for (const Usage& c : per_choice) u.completion_tokens += c.completion_tokens;
  return u;
}

// How often a non-streamed request that is still running checks that its client is there.
constexpr auto kClientCheck = std::chrono::milliseconds(250);

ApiError Stopping() {
  ApiError e;
  e.http_status = 503;
  e.type = "server_error";
  e.message = "the server is shutting down";
  return e;
}

}  // namespace

// The Runtime requests of one HTTP request (one per choice) and the events they produced, in the
// order the scheduler sent them. Shared by the handler and the Runtime's callbacks, which may
// outlive the handler (a cancelled request's last event comes later).
struct Exchange {
  struct Item {
    int index;
    TokenEvent event;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> items;
  std::vector<uint64_t> ids;  // Runtime ids of the choices submitted (written before it is shared)
};

// What preparing requests needs to know of the model the runtime serves.
ServedModel Describe(const Runtime& rt, const ServerOptions& o) {
  ServedModel model;
  model.name = o.model_name;
  model.tokenizer = &rt.tokenizer();
  model.chat_template = o.chat_template;
  UseTokenizerSpecials(rt.tokenizer(), &model.chat_template);
  model.n_ctx = rt.n_ctx();
  model.vocab_size = rt.config().vocab_size;
  const KvStats kv = rt.kv_stats();
  model.pool_pages = kv.pages_total;
  model.page_tokens = kv.page_tokens;
  model.heads_total = int64_t{rt.config().n_layers} * rt.config().n_kv_heads;
  model.on_full = o.on_full;
  model.reasoning_format = o.reasoning_format;
  return model;
}

struct Server::Impl {
  Runtime& runtime;
  ServedModel model;
  ServerOptions opt;
  ParseLimits limits;
  httplib::Server http;
  int bound_port = -1;
  int64_t started = std::time(nullptr);
  std::atomic<bool> stopping{false};

  std::mutex live_mu;  // requests in flight, for Stop
  std::unordered_set<std::shared_ptr<Exchange>> live;

  std::mutex seed_mu;
  std::mt19937_64 seeds{std::random_device{}()};

  Impl(Runtime& r, ServerOptions o) : runtime(r), model(Describe(r, o)), opt(std::move(o)) {
    limits.model_name = model.name;
    limits.vocab_size = model.vocab_size;
  }

  std::string TokenBytes(int32_t id) const { return model.tokenizer->TokenBytes(id); }
  TokenText token_text() const {
    return [this](int32_t id) { return TokenBytes(id); };
  }

  uint64_t NextSeed() {
    std::lock_guard<std::mutex> lock(seed_mu);
    return seeds();
  }

  void SendError(httplib::Response& res, const ApiError& e) {
    res.status = e.http_status;
    if (e.http_status == 503) res.set_header("Retry-After", std::to_string(opt.retry_after_s));
    res.set_content(ErrorJson(e), kJson);
  }
  void SendError(httplib::Response& res, const Status& s) { SendError(res, ApiErrorFromStatus(s)); }

  void CancelAll(Exchange& ex) {
    for (uint64_t id : ex.ids) runtime.Cancel(id);  // finished ids are ignored
  }
  void Register(const std::shared_ptr<Exchange>& ex) {
    std::lock_guard<std::mutex> lock(live_mu);
    live.insert(ex);
  }
  void Unregister(const std::shared_ptr<Exchange>& ex) {
    std::lock_guard<std::mutex> lock(live_mu);
    live.erase(ex);
  }

  // The endpoints (Routes), each registered with On.
  void Routes();
  void On(std::string_view method, const std::string& path, httplib::Server::Handler handler);
  void Handle(std::string_view method, const std::string& path, httplib::Server::Handler handler);
  void RefuseOtherMethods();
  std::vector<std::pair<std::string, std::string>> methods_of;  // path, "GET, POST": On's record
  void CreateCache(const httplib::Request& req, httplib::Response& res);
  void Generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  // client_fd: the connection's socket, watched so that a client that leaves cancels the request
  // (-1: not watched).
  void Respond(const std::shared_ptr<Exchange>& ex, const PreparedRequest& p, int client_fd,
               const ResponseMeta& meta, httplib::Response& res);
  bool Stream(Exchange& ex, const PreparedRequest& p, const ResponseMeta& meta,
              httplib::DataSink& sink);
};

void Server::Impl::Generate(const httplib::Request& req, httplib::Response& res,
                            Endpoint endpoint) {
  if (stopping) return SendError(res, Stopping());
  Result<ParsedRequest> parsed = ParseRequest(req.body, endpoint, limits);
  if (!parsed.ok()) return SendError(res, parsed.status());
  std::optional<KvCacheInfo> cache;
  if (!parsed->cache_id.empty()) {
    Result<KvCacheInfo> found = runtime.FindCache(parsed->cache_id, parsed->cache_salt);
    if (!found.ok()) return SendError(res, found.status());
    cache = std::move(found).value();
  }
  Result<PreparedRequest> prepared =
      Prepare(parsed.value(), model, NextSeed(), cache ? &*cache : nullptr);
  if (!prepared.ok()) return SendError(res, prepared.status());
  const PreparedRequest& p = prepared.value();
  if (p.n > runtime.max_requests()) {  // its choices are requests: they never would all fit
    return SendError(
        res, InvalidArgument("n: " + std::to_string(p.n) +
                             " choices exceed the requests this server takes at "
                             "once (" +
                             std::to_string(runtime.max_requests()) + ": -np + --max-waiting)"));
  }

  auto ex = std::make_shared<Exchange>();
  for (int i = 0; i < p.n; ++i) {
    Result<uint64_t> id = runtime.Submit(ChoiceRequest(p, i), [ex, i](const TokenEvent& event) {
      {
        std::lock_guard<std::mutex> lock(ex->mu);
        ex->items.push_back({i, event});
      }
      ex->cv.notify_all();
    });
    if (!id.ok()) {
      CancelAll(*ex);
      return SendError(res, id.status());
    }
    ex->ids.push_back(id.value());
  }
  Register(ex);

  ResponseMeta meta;
  meta.endpoint = endpoint;
  meta.id = NewResponseId(endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
  meta.created = std::time(nullptr);
  meta.model = model.name;
  meta.logprobs = p.logprobs >= 0;
  if (p.dropped_messages > 0) {
    res.set_header("X-Cachet-Dropped-Messages", std::to_string(p.dropped_messages));
  }
  if (p.history_pressed) res.set_header("X-Cachet-History-Pressed", "true");
  if (!p.stream) {
    Respond(ex, p, ConnectionSocket(req, bound_port), meta, res);
    Unregister(ex);
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, ex, p, meta](size_t /*offset*/, httplib::DataSink& sink) {
        if (!Stream(*ex, p, meta, sink)) {
          CancelAll(*ex);  // the client went away: free its pages now
          return false;
        }
        sink.done();
        return true;
      },
      [this, ex](bool /*success*/) {
        CancelAll(*ex);  // nothing if every choice finished
        Unregister(ex);
      });
}

// POST /v1/caches: the context is queued like a prompt and the answer waits until it is prefilled
// and pressed. A client that leaves meanwhile cancels it (and a cache made just as it left is
// deleted: nobody has its id).
void Server::Impl::CreateCache(const httplib::Request& req, httplib::Response& res) {
  if (stopping) return SendError(res, Stopping());
  Result<ParsedCacheRequest> parsed = ParseCacheRequest(req.body, limits);
  if (!parsed.ok()) return SendError(res, parsed.status());
  Result<KvCacheRequest> prepared = PrepareCache(*parsed, model);
  if (!prepared.ok()) return SendError(res, prepared.status());
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<Result<KvCacheInfo>> result;
  };
  auto out = std::make_shared<Outcome>();
  Result<uint64_t> id =
      runtime.CreateCache(std::move(prepared).value(), [out](const Result<KvCacheInfo>& r) {
        {
          std::lock_guard<std::mutex> lock(out->mu);
          out->result = r;
        }
        out->cv.notify_all();
      });
  if (!id.ok()) return SendError(res, id.status());
  auto ex = std::make_shared<Exchange>();  // so that Stop cancels it
  ex->ids.push_back(*id);
  Register(ex);
  const int fd = ConnectionSocket(req, bound_port);
  bool client_gone = false;
  std::unique_lock<std::mutex> lock(out->mu);
  while (!out->cv.wait_for(lock, kClientCheck, [&] { return out->result.has_value(); })) {
    if (!client_gone && fd >= 0 && PeerClosed(fd)) {
      client_gone = true;
      runtime.Cancel(*id);
    }
  }
  Result<KvCacheInfo> result = *out->result;
  lock.unlock();
  Unregister(ex);
  if (client_gone) {
    if (result.ok()) (void)runtime.DeleteCache(result.value().id, parsed->cache_salt);
    res.status = 499;
    return;
  }
  if (!result.ok()) return stopping ? SendError(res, Stopping()) : SendError(res, result.status());
  res.set_content(CacheJson(result.value()), kJson);
}

// A non-streamed response: waits for every choice's last event. A client that closes the
// connection meanwhile cancels the request (its pages are freed at once, as a stream's are).
void Server::Impl::Respond(const std::shared_ptr<Exchange>& ex, const PreparedRequest& p,
                           int client_fd, const ResponseMeta& meta, httplib::Response& res) {
  std::vector<ChoiceOutput> out(p.n);
  std::vector<Usage> usage(p.n);
  Status error;
  bool cancelled = false, client_gone = false;
  auto next_check = std::chrono::steady_clock::now() + kClientCheck;
  for (int left = p.n; left > 0;) {
    std::deque<Exchange::Item> batch;
    {
      std::unique_lock<std::mutex> lock(ex->mu);
      ex->cv.wait_until(lock, next_check, [&] { return !ex->items.empty(); });
      batch.swap(ex->items);
    }
    // Every kClientCheck, events streaming in or not.
    if (std::chrono::steady_clock::now() >= next_check) {
      next_check = std::chrono::steady_clock::now() + kClientCheck;
      if (!client_gone && client_fd >= 0 && PeerClosed(client_fd)) {
        client_gone = true;
        CancelAll(*ex);
      }
    }
    for (Exchange::Item& item : batch) {
      TokenEvent& e = item.event;
      ChoiceOutput& c = out[item.index];
      c.text += e.text;
      for (TokenLogprob& lp : e.logprobs) c.logprobs.push_back(std::move(lp));
      if (!e.finished) continue;
      --left;
      c.finish_reason = e.finish_reason;
      usage[item.index] = e.usage;
      if (!e.error.ok() && error.ok()) {
        error = e.error;
        CancelAll(*ex);
      }
      if (e.finish_reason == "cancelled") cancelled = true;
    }
  }
  if (client_gone) {
    res.status = 499;  // nginx's "client closed request": for --log-requests; nobody reads it
    return;
  }
  if (!error.ok()) return SendError(res, error);
  if (cancelled) return SendError(res, Stopping());
  if (p.split_reasoning) {
    for (ChoiceOutput& c : out) {
      ReasoningSplit split(p.reasoning_opened);
      ReasoningSplit::Piece whole = split.Feed(c.text, /*last=*/true);
      c.text = std::move(whole.content);
      c.reasoning = std::move(whole.reasoning);
      c.reasoned = split.reasoned();
    }
  }
  res.set_content(CompletionResponse(meta, out, Total(usage), token_text()), kJson);
}

// Writes the SSE stream of a request; false as soon as a write fails (the client is gone).
bool Server::Impl::Stream(Exchange& ex, const PreparedRequest& p, const ResponseMeta& meta,
                          httplib::DataSink& sink) {
  const TokenText text_of = token_text();
  const bool usage_null = p.include_usage;
  std::string out;
  auto flush = [&] {
    const bool ok = out.empty() || sink.write(out.data(), out.size());
    out.clear();
    return ok;
  };
  if (meta.endpoint == Endpoint::kChat) {
    for (int i = 0; i < p.n; ++i) {
      ChunkContent c;
      c.index = i;
      c.role_only = true;
      out += SseEvent(StreamChunk(meta, c, text_of, usage_null));
    }
    if (!flush()) return false;
  }
  std::vector<Usage> usage(p.n);
  std::vector<ReasoningSplit> splits(p.n, ReasoningSplit(p.reasoning_opened));
  for (int left = p.n; left > 0;) {
    std::deque<Exchange::Item> batch;
    {
      std::unique_lock<std::mutex> lock(ex.mu);
      if (!ex.cv.wait_for(lock, kStreamHeartbeat, [&] { return !ex.items.empty(); })) {
        lock.unlock();
        out = ": keep-alive\n\n";  // an SSE comment: clients skip it
        if (!flush()) return false;
        continue;
      }
      batch.swap(ex.items);
    }
    for (const Exchange::Item& item : batch) {
      const TokenEvent& e = item.event;
      if (e.finished && (!e.error.ok() || e.finish_reason == "cancelled")) {
        // A failed choice ends the whole stream (the others are cancelled): the error as an
        // event, then [DONE]. "cancelled" here means the server is stopping.
        CancelAll(ex);
        out += StreamError(e.error.ok() ? Stopping() : ApiErrorFromStatus(e.error));
        out += kSseDone;
        return flush();
      }
      ChunkContent c;
      c.index = item.index;
      ReasoningSplit::Piece piece;
      if (p.split_reasoning) {
        piece = splits[item.index].Feed(e.text, /*last=*/e.finished);
        c.text = piece.content;
        c.reasoning = piece.reasoning;
      } else {
        c.text = e.text;
      }
      if (!c.text.empty() || !c.reasoning.empty() || !e.logprobs.empty()) {
        c.logprobs = e.logprobs;
        out += SseEvent(StreamChunk(meta, c, text_of, usage_null));
      }
      if (e.finished) {
        --left;
        usage[item.index] = e.usage;
        ChunkContent last;
        last.index = item.index;
        last.finish_reason = e.finish_reason;
        out += SseEvent(StreamChunk(meta, last, text_of, usage_null));
      }
    }
    if (!flush()) return false;
  }
  if (p.include_usage) out += SseEvent(UsageChunk(meta, Total(usage)));
  out += kSseDone;
  return flush();
}

// A route, its method recorded for RefuseOtherMethods.
void Server::Impl::On(std::string_view method, const std::string& path,
                      httplib::Server::Handler handler) {
  Handle(method, path, std::move(handler));
  auto it = std::find_if(methods_of.begin(), methods_of.end(),
                         [&](const auto& m) { return m.first == path; });
  if (it == methods_of.end()) {
    methods_of.emplace_back(path, method);
  } else {
    it->second += ", " + std::string(method);
  }
}

// One method of a path: POST, PUT and PATCH handlers see the body ReadBody read (a POST that
// needs one refuses an empty one).
void Server::Impl::Handle(std::string_view method, const std::string& path,
                          httplib::Server::Handler handler) {
  if (method == "GET") http.Get(path, std::move(handler));
  if (method == "DELETE") http.Delete(path, std::move(handler));
  if (method == "OPTIONS") http.Options(path, std::move(handler));
  if (method != "POST" && method != "PUT" && method != "PATCH") return;
  const bool needs_body = method == "POST" && path != "/v1/cache/reset";
  httplib::Server::HandlerWithContentReader with_body =
      [this, handler = std::move(handler), needs_body](
          const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
        std::string body;
        std::optional<ApiError> e = ReadBody(req, read, opt.max_body_bytes, &body);
        if (!e && needs_body && body.empty()) {
          e = ApiError{};
          e->message = "a POST needs a JSON body; this one came without";
        }
        if (e) {  // httplib closes the connection when the request asks it to
          auto& headers = const_cast<httplib::Headers&>(req.headers);
          headers.erase("Connection");
          headers.emplace("Connection", "close");
          return SendError(res, *e);
        }
        const_cast<std::string&>(req.body) = std::move(body);
        handler(req, res);
      };
  if (method == "POST") http.Post(path, std::move(with_body));
  if (method == "PUT") http.Put(path, std::move(with_body));
  if (method == "PATCH") http.Patch(path, std::move(with_body));
}

// A known path asked with a method it does not take is a 405 naming the ones it takes (not "no
// such endpoint"). Registered after the routes, so that they take their own methods first.
void Server::Impl::RefuseOtherMethods() {
  for (const auto& [path, methods] : methods_of) {
    auto refuse = [this, methods](const httplib::Request& req, httplib::Response& res) {
      ApiError e;
      e.http_status = 405;
      e.message = req.method + " " + req.path + ": this endpoint takes " + methods;
      res.set_header("Allow", methods);
      SendError(res, e);
    };
    for (const char* method : {"GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"}) {
      if (methods.find(method) == std::string::npos) Handle(method, path, refuse);
    }
  }
}

void Server::Impl::Routes() {
  On("POST", "/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Generate(req, res, Endpoint::kCompletions);
  });
  On("POST", "/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Generate(req, res, Endpoint::kChat);
  });
  On("GET", "/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(ModelsJson(model.name, started, model.n_ctx), kJson);
  });
  On("GET", R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (id != model.name) {
      return SendError(res, NotFound("model: the model '" + id +
                                     "' does not exist; this server serves '" + model.name + "'"));
    }
    res.set_content(ModelJson(model.name, started, model.n_ctx), kJson);
  });
  On("GET", "/health", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping) {
      res.status = 503;
      res.set_content(R"({"status":"stopping"})", kJson);
      return;
    }
    res.set_content(R"({"status":"ok"})", kJson);
  });
  On("GET", "/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(runtime.Metrics(), runtime.kv_stats(), model.name),
                    std::string(kMetricsContentType));
  });
  On("POST", "/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    Result<TokenizeRequest> r = ParseTokenizeRequest(req.body);
    if (!r.ok()) return SendError(res, r.status());
    const Tokenizer& tok = *model.tokenizer;
    std::vector<int32_t> ids;
    if (r->add_special && tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    const std::vector<int32_t> text = tok.Encode(r->content, r->parse_special);
    ids.insert(ids.end(), text.begin(), text.end());
    res.set_content(TokenizeJson(ids, r->with_pieces, token_text()), kJson);
  });
  On("POST", "/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::vector<int32_t>> ids = ParseDetokenizeRequest(req.body, model.vocab_size);
    if (!ids.ok()) return SendError(res, ids.status());
    res.set_content(DetokenizeJson(model.tokenizer->Decode(ids.value())), kJson);
  });
  On("POST", "/v1/caches",
     [this](const httplib::Request& req, httplib::Response& res) { CreateCache(req, res); });
  // Tenants name their salt as a query parameter: another salt's caches are not there for them.
  On("GET", "/v1/caches", [this](const httplib::Request& req, httplib::Response& res) {
    res.set_content(CacheListJson(runtime.ListCaches(req.get_param_value("cache_salt"))), kJson);
  });
  On("GET", R"(/v1/caches/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    Result<KvCacheInfo> c = runtime.FindCache(req.matches[1], req.get_param_value("cache_salt"));
    if (!c.ok()) return SendError(res, c.status());
    res.set_content(CacheJson(*c), kJson);
  });
  On("DELETE", R"(/v1/caches/([^/]+))",
     [this](const httplib::Request& req, httplib::Response& res) {
       const std::string id = req.matches[1];
       if (Status s = runtime.DeleteCache(id, req.get_param_value("cache_salt")); !s.ok()) {
         return SendError(res, s);
       }
       res.set_content(CacheDeletedJson(id), kJson);
     });
  On("POST", "/v1/cache/reset", [this](const httplib::Request&, httplib::Response& res) {
    runtime.ClearPrefixCache();
    res.set_content(R"({"status":"ok"})", kJson);
  });
  RefuseOtherMethods();
}

Server::Server(Runtime& runtime, ServerOptions options)
    : impl_(std::make_unique<Impl>(runtime, std::move(options))) {
  Impl& m = *impl_;
  const int threads = std::max(1, m.opt.http_threads);
  m.http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // ReadBody enforces max_body_bytes; httplib's own cap only stops what it would not drain.
  m.http.set_payload_max_length(kDrainFactor * m.opt.max_body_bytes);
  m.http.set_tcp_nodelay(true);  // stream chunks go out as they are written
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second server on the same
  // port would start and silently share the connections instead of failing.
  m.http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const char*>(&yes), sizeof(yes));
  });
  m.http.set_pre_routing_handler([&m](const httplib::Request& req, httplib::Response& res) {
    // Bodies are JSON whatever their Content-Type. `curl -d` sends form-urlencoded, whose bodies
    // httplib (the Debian library, built with an 8 KiB cap) refuses past 8 KiB with a 413: such a
    // request is relabelled before its body is read (the handler runs first), so that
    // --max-body is the one limit. (The request is httplib's own, non-const object.)
    if (req.get_header_value("Content-Type") == "application/x-www-form-urlencoded") {
      auto& headers = const_cast<httplib::Headers&>(req.headers);
      headers.erase("Content-Type");
      headers.emplace("Content-Type", "application/json");
    }
    if (m.opt.api_key.empty() || req.path == "/health" || req.path == "/metrics") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    // The scheme is case-insensitive (RFC 7235): "bearer KEY" too.
    std::string auth = req.get_header_value("Authorization");
    if (auth.size() >= 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0)
      auth.replace(0, 7, "Bearer ");
    if (SameSecret(auth, "Bearer " + m.opt.api_key)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    m.SendError(res, UnauthorizedError());
    return httplib::Server::HandlerResponse::Handled;
  });
  // httplib's own errors (no route, a body over the limit, ...) in the same JSON shape.
  m.http.set_error_handler(httplib::Server::HandlerWithResponse(
      [&m](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        ApiError e;
        e.http_status = res.status;
        if (res.status == 404) {
          e.message = "no such endpoint: " + req.method + " " + req.path;
          e.code = "unknown_url";
        } else if (res.status == 413) {
          e = TooLarge(m.opt.max_body_bytes);
        } else {
          e.message = "HTTP error " + std::to_string(res.status);
          if (res.status >= 500) e.type = "server_error";
        }
        res.set_content(ErrorJson(e), kJson);
        return httplib::Server::HandlerResponse::Handled;
      }));
  m.http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        ApiError e;
        e.http_status = 500;
        e.type = "server_error";
        e.message = "internal error: " + what;
        res.status = 500;
        res.set_content(ErrorJson(e), kJson);
      });
  if (m.opt.log_requests) {
    m.http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "cachet serve: %s %s %d\n", req.method.c_str(), req.path.c_str(),
                   res.status);
    });
  }
  m.Routes();
}

Server::~Server() { Stop(); }

Status Server::Bind() {
  Impl& m = *impl_;
  if (m.opt.port == 0) {
    m.bound_port = m.http.bind_to_any_port(m.opt.host);
  } else if (m.http.bind_to_port(m.opt.host, m.opt.port)) {
    m.bound_port = m.opt.port;
  }
  if (m.bound_port <= 0) {
    return FailedPrecondition("cannot listen on " + m.opt.host + ":" + std::to_string(m.opt.port) +
                              " (the port is taken, or the host is not an address of this "
                              "machine)");
  }
  return OkStatus();
}

int Server::port() const { return impl_->bound_port; }

bool Server::Run() {
  if (impl_->stopping) return true;  // Stop() came first
  return impl_->http.listen_after_bind();
}

void Server::Stop() {
  Impl& m = *impl_;
  m.stopping = true;
  {
    std::lock_guard<std::mutex> lock(m.live_mu);
    for (const auto& ex : m.live) m.CancelAll(*ex);
  }
  if (m.http.is_running()) m.http.stop();
}

}  // namespace cachet::server
