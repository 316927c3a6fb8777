// Requests of `cachet serve`, parsed at the edge. The body of an OpenAI-style request (JSON text)
// becomes a typed ParsedRequest in one pure function, with no model and no Runtime: every field
// is type- and range-checked there, and code past this point never sees JSON again. The errors
// are Status values whose message starts with the offending field ("max_tokens: must be ...",
// "messages[2].role: ..."): ApiErrorFromStatus (response.h) turns that prefix into OpenAI's
// `param`, and the status code into the HTTP status (InvalidArgument 400, NotFound 404 for an
// unknown model, OutOfRange 400 context_length_exceeded).
//
// tests/fuzz/server_request_fuzz.cc fuzzes these parsers; tests/server_request_test.cc checks
// each kind of bad input.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/press.h"
#include "cachet/reuse.h"
#include "cachet/sampling.h"
#include "cachet/server.h"
#include "cachet/status.h"

namespace cachet::server {

enum class Endpoint : uint8_t {
  kCompletions,  // POST /v1/completions: `prompt`
  kChat,         // POST /v1/chat/completions: `messages`
};

// What the parser knows of the server (no model is loaded to parse).
struct ParseLimits {
  std::string model_name;  // a request naming another model is NotFound (an empty name: any)
  int32_t vocab_size = 0;  // token ids must lie in [0, vocab_size) (0: not checked)
  int max_n = 64;          // `n`
  int max_logprobs = 20;   // `logprobs` (completions), `top_logprobs` (chat)
  int max_stop = 16;       // stop strings per request
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  // Completions: the prompt as text (BOS added as the tokenizer says) or as token ids (used as
  // they are); exactly one is set. Chat: the messages, in order.
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  std::vector<ChatMessage> messages;

  std::optional<int> max_tokens;  // unset: the endpoint's default (server.h)
  // OpenAI's defaults, not the CLI's: temperature 1, top_p 1, top_k and min_p off.
  SamplingParams sampling = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
  std::optional<uint64_t> seed;   // unset: the server draws one
  std::vector<std::string> stop;  // never empty strings
  int n = 1;                      // completions of the prompt (choices 0..n-1)
  int logprobs = -1;              // -1: none; k >= 0: each token's logprob and the k most likely
  bool stream = false;
  bool include_usage = false;                // stream_options.include_usage
  bool ignore_eos = false;                   // vLLM's extension: generate past EOS
  bool skip_special_tokens = true;           // vLLM's: special tokens add no text
  std::string cache_salt;                    // prefix-cache namespace; empty: the shared one
  std::optional<press::PressOptions> press;  // kv_press: {name, ratio | budget}
  // Continue from this kept cache (POST /v1/caches); never with press.
  std::string cache_id;
  // Chunk reuse (docs/REUSE.md): texts that appear in the prompt (or the rendered messages),
  // each occurrence's K/V taken from the chunk cache wherever it stands; never with cache_id,
  // kv_press or a prompt of token ids. blend: how they are reconciled (none unless given).
  std::vector<std::string> chunks;
  BlendOptions blend;
  // Or: the prompt cut at this string, every piece between two separators a chunk (the first and
  // last pieces plain text; the separators removed), as `cachet run --chunk-sep` does.
  std::string chunk_separator;
  // Chat: how the reply's thinking is returned; unset: the server's --reasoning-format.
  std::optional<ReasoningFormat> reasoning_format;
  // Chat: chat_template_kwargs.enable_thinking (Qwen3's switch); unset: the server's.
  std::optional<bool> enable_thinking;
};

// The body of POST /v1/completions or /v1/chat/completions. Unknown fields are ignored (as vLLM
// and llama.cpp's server do); known OpenAI fields this server cannot honour (echo, suffix, tools,
// response formats other than text, ...) are errors when set to anything but their neutral
// value, never silently dropped.
Result<ParsedRequest> ParseRequest(std::string_view body, Endpoint endpoint,
                                   const ParseLimits& limits);

// POST /v1/caches: a context to prefill (and press) once and keep. Exactly one of prompt_text,
// prompt_ids (completions' `prompt`) and messages (chat's, rendered without a generation prompt).
struct ParsedCacheRequest {
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  std::vector<ChatMessage> messages;
  std::string cache_salt;
  std::optional<press::PressOptions> press;
};
Result<ParsedCacheRequest> ParseCacheRequest(std::string_view body, const ParseLimits& limits);

// What the server keeps with a cache made from messages (KvCacheInfo::note), so that chat requests
// on it render its conversation and theirs together; "" for a cache made from a prompt.
std::string ChatNote(std::span<const ChatMessage> messages);
// The messages of a note (none for ""); a note that is not one is InvalidArgument.
Result<std::vector<ChatMessage>> ParseChatNote(std::string_view note);

// POST /tokenize (llama.cpp server): {"content": text, "add_special": false,
// "parse_special": true, "with_pieces": false}.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;   // BOS as the tokenizer adds it to a prompt
  bool parse_special = true;  // special tokens written in the text become those tokens
  bool with_pieces = false;   // answer [{"id", "piece"}] instead of ids
};
Result<TokenizeRequest> ParseTokenizeRequest(std::string_view body);

// POST /detokenize (llama.cpp server): {"tokens": [ids]}.
Result<std::vector<int32_t>> ParseDetokenizeRequest(std::string_view body, int32_t vocab_size);

}  // namespace cachet::server
