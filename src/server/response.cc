#include "response.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

namespace cachet::server {
namespace {

// Keys in the order OpenAI writes them (id, object, created, model, choices, usage).
using json = nlohmann::ordered_json;

// Generated text may end inside a UTF-8 character (a token's bytes); never throw on it.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// "max_tokens", "messages[2].content[0].type": what a message names before ": ".
bool IsFieldPath(std::string_view s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' ||
          c == ']')) {
      return false;
    }
  }
  return true;
}

json Nullable(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

// -inf (a token the sampler could never pick) as vLLM writes it: JSON has no infinities.
double FiniteLogprob(float lp) { return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0; }

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json UsageJson(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.
json CompletionLogprobs(std::span<const TokenLogprob> lps, const TokenText& token_text) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (const TokenLogprob& lp : lps) {
    const std::string text = token_text(lp.token);
    tokens.push_back(text);
    token_logprobs.push_back(FiniteLogprob(lp.logprob));
    // The most likely tokens and, as OpenAI's legacy API and vLLM give it, always the sampled one
    // (up to logprobs + 1 entries).
    json alternatives = json::object();
    for (const auto& [id, value] : lp.top) {
      const std::string t = token_text(id);
      if (!alternatives.contains(t)) alternatives[t] = FiniteLogprob(value);
    }
    if (!alternatives.contains(text)) alternatives[text] = FiniteLogprob(lp.logprob);
    top.push_back(std::move(alternatives));
    offsets.push_back(lp.text_offset);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}.
json ChatLogprobs(std::span<const TokenLogprob> lps, const TokenText& token_text) {
  json content = json::array();
  for (const TokenLogprob& lp : lps) {
    const std::string text = token_text(lp.token);
    json top = json::array();
    for (const auto& [id, value] : lp.top) {
      const std::string t = token_text(id);
      top.push_back({{"token", t}, {"logprob", FiniteLogprob(value)}, {"bytes", Bytes(t)}});
    }
    content.push_back({{"token", text},
                       {"logprob", FiniteLogprob(lp.logprob)},
                       {"bytes", Bytes(text)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

json Envelope(const ResponseMeta& meta, std::string_view object) {
  return {{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xE  ? 3
                     : (c >> 3) == 0x1E ? 4
                                        : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

ApiError ApiErrorFromStatus(const Status& status) {
  ApiError e;
  e.message = status.message();
  if (const size_t colon = e.message.find(": "); colon != std::string::npos) {
    const std::string_view head = std::string_view(e.message).substr(0, colon);
    if (IsFieldPath(head)) e.param = std::string(head);
  }
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      e.http_status = 400;
      break;
    case StatusCode::kOutOfRange:
      e.http_status = 400;
      e.code = "context_length_exceeded";
      break;
    case StatusCode::kNotFound:
      e.http_status = 404;
      e.code = e.param == "cache_id" ? "cache_not_found" : "model_not_found";
      break;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      e.param.clear();
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      e.param.clear();
      break;
  }
  return e;
}

ApiError UnauthorizedError() {
  ApiError e;
  e.http_status = 401;
  e.message =
      "missing or incorrect API key: send the key given to --api-key as \"Authorization: "
      "Bearer KEY\"";
  e.code = "invalid_api_key";
  return e;
}

std::string ErrorJson(const ApiError& error) {
  return Dump({{"error",
                {{"message", error.message},
                 {"type", error.type},
                 {"param", Nullable(error.param)},
                 {"code", Nullable(error.code)}}}});
}

std::string NewResponseId(std::string_view prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char hex[25];
  const uint64_t a = rng(), b = rng();
  std::snprintf(hex, sizeof(hex), "%016llx%08llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b & 0xffffffffu));
  return std::string(prefix) + hex;
}

std::string CompletionResponse(const ResponseMeta& meta, std::span<const ChoiceOutput> choices,
                               const Usage& usage, const TokenText& token_text) {
  const bool chat = meta.endpoint == Endpoint::kChat;
  json out = Envelope(meta, chat ? "chat.completion" : "text_completion");
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    json choice = {{"index", i}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
      if (c.reasoned) choice["message"]["reasoning_content"] = c.reasoning;
      choice["logprobs"] = meta.logprobs ? ChatLogprobs(c.logprobs, token_text) : json(nullptr);
    } else {
      choice["text"] = c.text;
      choice["logprobs"] =
          meta.logprobs ? CompletionLogprobs(c.logprobs, token_text) : json(nullptr);
    }
    choice["finish_reason"] = Nullable(c.finish_reason);
    list.push_back(std::move(choice));
  }
  out["choices"] = std::move(list);
  out["usage"] = UsageJson(usage);
  return Dump(out);
}

std::string SseEvent(std::string_view json_text) {
  std::string s;
  s.reserve(json_text.size() + 8);
  s.append("data: ").append(json_text).append("\n\n");
  return s;
}

std::string StreamChunk(const ResponseMeta& meta, const ChunkContent& c,
                        const TokenText& token_text, bool with_usage_null) {
  const bool chat = meta.endpoint == Endpoint::kChat;
  json out = Envelope(meta, chat ? "chat.completion.chunk" : "text_completion");
  json choice = {{"index", c.index}};
  const bool with_logprobs = meta.logprobs && !c.role_only;
  if (chat) {
    json delta = json::object();
    if (c.role_only) {
      delta = {{"role", "assistant"}, {"content", ""}};
    } else {
      if (!c.reasoning.empty()) delta["reasoning_content"] = c.reasoning;
      if (!c.text.empty()) delta["content"] = c.text;
    }
    choice["delta"] = std::move(delta);
    choice["logprobs"] =
        with_logprobs && !c.logprobs.empty() ? ChatLogprobs(c.logprobs, token_text) : json(nullptr);
  } else {
    choice["text"] = c.text;
    choice["logprobs"] = with_logprobs && !c.logprobs.empty()
                             ? CompletionLogprobs(c.logprobs, token_text)
                             : json(nullptr);
  }
  choice["finish_reason"] =
      c.finish_reason.empty() ? json(nullptr) : json(std::string(c.finish_reason));
  out["choices"] = json::array({std::move(choice)});
  if (with_usage_null) out["usage"] = nullptr;
  return Dump(out);
}

std::string UsageChunk(const ResponseMeta& meta, const Usage& usage) {
  json out = Envelope(
      meta, meta.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = json::array();
  out["usage"] = UsageJson(usage);
  return Dump(out);
}

std::string StreamError(const ApiError& error) { return SseEvent(ErrorJson(error)); }

namespace {

json ModelObject(std::string_view model, int64_t created, int n_ctx) {
  return {{"id", model},
          {"object", "model"},
          {"created", created},
          {"owned_by", "cachet"},
          {"max_model_len", n_ctx}};
}

}  // namespace

std::string ModelJson(std::string_view model, int64_t created, int n_ctx) {
  return Dump(ModelObject(model, created, n_ctx));
}

std::string ModelsJson(std::string_view model, int64_t created, int n_ctx) {
  return Dump({{"object", "list"}, {"data", json::array({ModelObject(model, created, n_ctx)})}});
}

std::string TokenizeJson(std::span<const int32_t> ids, bool with_pieces,
                         const TokenText& token_text) {
  json tokens = json::array();
  for (int32_t id : ids) {
    if (!with_pieces) {
      tokens.push_back(id);
      continue;
    }
    const std::string piece = token_text(id);
    tokens.push_back({{"id", id}, {"piece", IsValidUtf8(piece) ? json(piece) : Bytes(piece)}});
  }
  return Dump({{"tokens", std::move(tokens)}});
}

std::string DetokenizeJson(std::string_view content) {
  return Dump({{"content", std::string(content)}});
}

namespace {
json CacheObject(const KvCacheInfo& c) {
  return {{"id", c.id},
          {"object", "kv_cache"},
          {"created", c.created},
          {"tokens", c.tokens},
          {"held_rows", c.held_rows},
          {"bytes", c.bytes},
          {"compression", c.compression}};
}
}  // namespace

std::string CacheJson(const KvCacheInfo& cache) { return Dump(CacheObject(cache)); }

std::string CacheListJson(std::span<const KvCacheInfo> caches) {
  json data = json::array();
  for (const KvCacheInfo& c : caches) data.push_back(CacheObject(c));
  return Dump({{"object", "list"}, {"data", std::move(data)}});
}

std::string CacheDeletedJson(std::string_view id) {
  return Dump({{"id", id}, {"object", "kv_cache.deleted"}, {"deleted", true}});
}

namespace {

std::string LabelValue(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// Prometheus sample values: integers as they are, others with enough digits.
std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.9g", v);
  }
  return buf;
}

// Bucket bounds as Python's prometheus_client writes them (vLLM): 0.001, 1.0, 10.0.
std::string Bound(double b) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), b == std::floor(b) ? "%.1f" : "%g", b);
  return buf;
}

class MetricsWriter {
 public:
  explicit MetricsWriter(std::string_view model)
      : labels_("model_name=\"" + LabelValue(model) + "\"") {}

  void Head(std::string_view name, std::string_view type, std::string_view help) {
    out_.append("# HELP cachet:").append(name).append(" ").append(help).append("\n");
    out_.append("# TYPE cachet:").append(name).append(" ").append(type).append("\n");
  }
  void Sample(std::string_view name, double v, std::string_view extra_labels = {}) {
    out_.append("cachet:").append(name).append("{").append(labels_);
    if (!extra_labels.empty()) out_.append(",").append(extra_labels);
    out_.append("} ").append(Number(v)).append("\n");
  }
  void Gauge(std::string_view name, std::string_view help, double v) {
    Head(name, "gauge", help);
    Sample(name, v);
  }
  void Counter(std::string_view name, std::string_view help, double v) {
    Head(name, "counter", help);
    Sample(name, v);
  }
  void Histogram(std::string_view name, std::string_view help, const RuntimeMetrics::Histogram& h) {
    Head(name, "histogram", help);
    const std::string bucket = std::string(name) + "_bucket";
    constexpr size_t kBounds = std::size(RuntimeMetrics::kLatencyBuckets);
    for (size_t i = 0; i <= kBounds; ++i) {
      const uint64_t count = i < h.buckets.size() ? h.buckets[i] : 0;
      const std::string le =
          i < kBounds ? Bound(RuntimeMetrics::kLatencyBuckets[i]) : std::string("+Inf");
      Sample(bucket, static_cast<double>(count), "le=\"" + le + "\"");
    }
    Sample(std::string(name) + "_sum", h.sum);
    Sample(std::string(name) + "_count", static_cast<double>(h.count));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string labels_;
  std::string out_;
};

}  // namespace

std::string MetricsText(const RuntimeMetrics& m, const KvStats& kv, std::string_view model_name) {
  MetricsWriter w(model_name);
  w.Gauge("num_requests_running", "Number of requests running (prefilling or decoding).",
          m.running);
  w.Gauge("num_requests_waiting", "Number of requests waiting to be admitted.", m.waiting);
  w.Gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage);
  w.Counter("prefix_cache_queries_total",
            "Prefix cache queries, in tokens (prompt tokens looked up).",
            static_cast<double>(m.prefix_query_tokens));
  w.Counter("prefix_cache_hits_total", "Prefix cache hits, in tokens (prompt tokens reused).",
            static_cast<double>(m.prefix_hit_tokens));
  w.Counter("num_preemptions_total", "Cumulative number of preemptions.",
            static_cast<double>(m.preemptions));
  w.Counter("prompt_tokens_total", "Number of prefill tokens processed.",
            static_cast<double>(m.prompt_tokens));
  w.Counter("generation_tokens_total", "Number of generation tokens processed.",
            static_cast<double>(m.generation_tokens));
  w.Counter("requests_finished_total",
            "Requests finished (any reason: stop, length, cancelled, error).",
            static_cast<double>(m.requests_finished));
  w.Counter("kv_evicted_tokens_total", "Tokens evicted from the KV cache.",
            static_cast<double>(m.kv_evicted_tokens));
  w.Head("kv_bytes", "gauge", "KV cache bytes in use, by page codec.");
  for (const auto& [codec, bytes] : m.kv_bytes_by_codec) {
    w.Sample("kv_bytes", static_cast<double>(bytes), "codec=\"" + LabelValue(codec) + "\"");
  }
  w.Head("prompt_tokens_by_source_total", "counter",
         "Prompt tokens by where their KV came from: compute, ram (prefix cache), disk, redis.");
  for (const auto& [source, n] : m.prompt_tokens_by_source) {
    w.Sample("prompt_tokens_by_source_total", static_cast<double>(n),
             "source=\"" + LabelValue(source) + "\"");
  }
  const std::pair<const char*, int64_t KvStats::Tier::*> tier_counters[] = {
      {"hits", &KvStats::Tier::hits},
      {"misses", &KvStats::Tier::misses},
      {"corrupt", &KvStats::Tier::corrupt},
      {"errors", &KvStats::Tier::errors},
      {"rejected", &KvStats::Tier::rejected},
      {"bytes_read", &KvStats::Tier::bytes_read},
      {"bytes_written", &KvStats::Tier::bytes_written},
      {"dropped", &KvStats::Tier::dropped}};
  for (const auto& [name, field] : tier_counters) {
    const std::string metric = std::string("kv_tier_") + name + "_total";
    if (m.kv_tiers.empty()) break;
    w.Head(metric, "counter",
           std::string("Prefix-cache tier ") + name + " (runs of up to 256 tokens; bytes).");
    for (const KvStats::Tier& t : m.kv_tiers) {
      w.Sample(metric, static_cast<double>(t.*field), "tier=\"" + LabelValue(t.name) + "\"");
    }
  }
  w.Gauge("kv_pages_total",
          "Pages of the KV pool (one page: page_tokens tokens of one layer "
          "and KV head).",
          kv.pages_total);
  w.Gauge("kv_pages_used", "KV pages referenced by a request or the prefix cache.", kv.pages_used);
  w.Gauge("kv_pages_cached", "KV pages held by the prefix cache.", kv.pages_cached);
  w.Gauge("kv_pages_reclaimable",
          "KV pages held only by the prefix cache (no request uses them): freed on demand.",
          kv.pages_reclaimable);
  w.Gauge("kv_caches", "Kept KV caches (POST /v1/caches) resident in the pool.", m.kv_caches);
  w.Gauge("kv_cache_bytes",
          "Bytes of the KV pages kept caches hold (shared with the requests running on them).",
          static_cast<double>(m.kv_cache_bytes));
  w.Counter("kv_caches_unloaded_total",
            "Kept caches that left RAM for --cache-mem-mib (loaded again from disk or Redis when "
            "asked for).",
            static_cast<double>(m.kv_caches_unloaded));
  w.Counter("chunk_hits_total", "Chunks of prompts (\"chunks\") found in the chunk cache.",
            static_cast<double>(m.chunk_hits));
  w.Counter("chunk_misses_total", "Chunks of prompts computed on their own and cached.",
            static_cast<double>(m.chunk_misses));
  w.Counter("chunk_tokens_total", "Prompt tokens in chunks.", static_cast<double>(m.chunk_tokens));
  w.Counter("chunk_recomputed_tokens_total",
            "Chunk tokens recomputed in place by blending (epic, cacheblend).",
            static_cast<double>(m.chunk_recomputed_tokens));
  w.Counter("fit_requests_total",
            "Chats longer than the context whose history was pressed to fit (--on-full press).",
            static_cast<double>(m.fit_requests));
  w.Counter("fit_pressed_tokens_total", "Prompt tokens those presses took away.",
            static_cast<double>(m.fit_pressed_tokens));
  w.Gauge("kv_chunk_bytes", "Bytes of the KV pages the chunk cache holds (freed on demand).",
          static_cast<double>(kv.chunk_bytes));
  w.Histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              m.ttft);
  w.Histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              m.inter_token);
  w.Histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
              m.e2e);
  return w.Take();
}

}  // namespace cachet::server
