// What `cachet serve` writes: OpenAI's response and stream-chunk shapes for completions and chat
// completions, SSE framing, OpenAI-style errors, /v1/models, llama.cpp's /tokenize and
// /detokenize answers, and /metrics in Prometheus' text format. Pure functions of plain values
// (no Runtime, no sockets), so each shape is unit-tested as it is.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/serving.h"
#include "request.h"

namespace cachet::server {

// --- Errors: {"error": {"message", "type", "param", "code"}}

struct ApiError {
  int http_status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // empty: null
  std::string code;   // empty: null
};

// A Status as the client sees it: InvalidArgument 400; OutOfRange 400 with code
// context_length_exceeded; NotFound 404 model_not_found (cache_not_found when it names cache_id);
// ResourceExhausted 503 (the queue is full: retry later); others 500. A message of the form "field:
// ..." (the parser's and the Runtime's convention) names the field, which becomes `param`.
ApiError ApiErrorFromStatus(const Status& status);
ApiError UnauthorizedError();  // 401, code invalid_api_key
std::string ErrorJson(const ApiError& error);

// --- Completions and chat completions

// The text of a token (its bytes: possibly part of a UTF-8 character).
using TokenText = std::function<std::string(int32_t token)>;

struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  bool logprobs = false;  // the request asked for them: choices carry a logprobs object
};

// One choice of a finished (non-streamed) request.
struct ChoiceOutput {
  std::string text;  // chat: the content
  std::vector<TokenLogprob> logprobs;
  std::string finish_reason;   // "stop" or "length"
  std::string reasoning = {};  // chat: reasoning_content, when reasoned
  bool reasoned = false;
};

// A new id: prefix + 24 random hex digits.
std::string NewResponseId(std::string_view prefix);

// The whole response of a non-streamed request (`object` "text_completion" or
// "chat.completion"); usage always carries prompt_tokens_details.cached_tokens.
std::string CompletionResponse(const ResponseMeta& meta, std::span<const ChoiceOutput> choices,
                               const Usage& usage, const TokenText& token_text);

// Streaming: each chunk is one SSE event, `data: {json}\n\n`; the stream ends with kSseDone.
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";
std::string SseEvent(std::string_view json);

// One stream chunk of choice `index` (`object` "text_completion" or "chat.completion.chunk").
// Chat: role_only gives the opening chunk (delta {"role": "assistant", "content": ""}); a chunk
// with a finish_reason has an empty delta when text is empty; reasoning goes in the delta's
// reasoning_content (DeepSeek's and llama.cpp's stream shape). with_usage_null: every chunk then
// has "usage": null, as OpenAI writes them when stream_options.include_usage is set.
struct ChunkContent {
  int index = 0;
  bool role_only = false;
  std::string_view text;
  std::string_view reasoning;  // chat
  std::span<const TokenLogprob> logprobs;
  std::string_view finish_reason;  // empty: null
};
std::string StreamChunk(const ResponseMeta& meta, const ChunkContent& c,
                        const TokenText& token_text, bool with_usage_null);
// The last chunk when stream_options.include_usage is set: empty choices and the usage.
std::string UsageChunk(const ResponseMeta& meta, const Usage& usage);
// An error in the middle of a stream: the error JSON as one more event (before [DONE]).
std::string StreamError(const ApiError& error);

// --- Other endpoints

// /v1/models: {"object": "list", "data": [ModelJson]}; /v1/models/ID: ModelJson, {"id", "object":
// "model", "created", "owned_by", "max_model_len"} (vLLM's extra field: the context).
std::string ModelsJson(std::string_view model, int64_t created, int n_ctx);
std::string ModelJson(std::string_view model, int64_t created, int n_ctx);
// /tokenize: {"tokens": [ids]}, or with pieces {"tokens": [{"id", "piece"}]} (a piece that is not
// valid UTF-8 is given as its byte values, as llama.cpp does).
std::string TokenizeJson(std::span<const int32_t> ids, bool with_pieces,
                         const TokenText& token_text);
std::string DetokenizeJson(std::string_view content);
// /v1/caches: {"id", "object": "kv_cache", "created", "tokens", "held_rows", "bytes",
// "compression"}; the list {"object": "list", "data": [...]}; a deletion {"id", "object":
// "kv_cache.deleted", "deleted": true} (OpenAI's shape for deleted objects).
std::string CacheJson(const KvCacheInfo& cache);
std::string CacheListJson(std::span<const KvCacheInfo> caches);
std::string CacheDeletedJson(std::string_view id);

// /metrics: Prometheus' text exposition format (version 0.0.4), vLLM's metric names under the
// `cachet:` prefix, each with the label model_name, plus the KV pool's page counts.
std::string MetricsText(const RuntimeMetrics& m, const KvStats& kv, std::string_view model_name);
inline constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace cachet::server
