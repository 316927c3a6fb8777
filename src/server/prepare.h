// A parsed request (request.h) made into what the Runtime takes: the prompt rendered (chat
// template) and tokenized, checked against the context and the KV pool, defaults resolved, the
// chat template's stop strings added. Needs the served model's tokenizer and template but no
// Runtime, so the unit tests run it on kvtiny's tokenizer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/serving.h"
#include "request.h"

namespace cachet {
class Tokenizer;
}

namespace cachet::server {

// What preparing a request knows of the served model.
struct ServedModel {
  std::string name;  // the id /v1/models lists and requests may name
  const Tokenizer* tokenizer = nullptr;
  ChatTemplate chat_template;  // with the tokenizer's BOS/EOS texts
  int n_ctx = 0;               // tokens a sequence may hold
  int32_t vocab_size = 0;
  // The KV pool: a prompt that needs more pages than it has can never run (0: not checked).
  int64_t pool_pages = 0;
  int page_tokens = 16;
  int64_t heads_total = 0;  // layers x KV heads: pages per page_tokens tokens
  // A chat whose messages leave too little room in the context (less than its max_tokens, or a
  // quarter of the context when it names none), by `cachet serve --on-full`: an error
  // (OutOfRange); shift: the oldest messages after the system prompt are dropped until it fits;
  // press: the history between the system prompt and the last message is pressed until it fits
  // (CompletionRequest::fit), when the request is admitted.
  press::OnFull on_full;
  ReasoningFormat reasoning_format = ReasoningFormat::kDeepSeek;  // unless a request names one
};

// Completions' default max_tokens (OpenAI's); chat's is the rest of the context.
inline constexpr int kDefaultCompletionTokens = 16;

struct PreparedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  CompletionRequest request;  // choice 0's; choice i samples with seed + i
  int n = 1;
  int logprobs = -1;  // -1: none; else the top alternatives per token (request.top_logprobs)
  bool stream = false;
  bool include_usage = false;
  int dropped_messages = 0;      // by on_full shift (the X-Cachet-Dropped-Messages header)
  bool history_pressed = false;  // by on_full press (the X-Cachet-History-Pressed header)
  // Chat replies split into reasoning_content and content (server/reasoning.h); opened: the
  // generation prompt ended inside <think> (ChatTemplate::open_think).
  bool split_reasoning = false;
  bool reasoning_opened = false;
};

// default_seed: the seed of a request that names none. cache: the kept cache parsed.cache_id
// names (FindCache), whose context the prompt follows: a text prompt is then tokenized without
// BOS, and chat messages are rendered after the cache's own (ChatAfterCache); the context and
// the prompt together must leave room in the context window.
Result<PreparedRequest> Prepare(const ParsedRequest& parsed, const ServedModel& model,
                                uint64_t default_seed, const KvCacheInfo* cache = nullptr);

// The tokens of chat messages that follow a cache's context. For a cache made from messages, the
// conversation (the cache's messages, then these) is rendered with the generation prompt and
// must begin with the cache's own rendering, which is dropped: the template's BOS and system
// preamble are in the cache once. A template that renders the cache's messages otherwise once
// more follow (llama2 folds the system message into the first user turn; turns must alternate)
// is an InvalidArgument naming `messages`. For a cache made from a prompt, the messages are
// rendered alone, without the BOS text the template opens with.
Result<std::vector<int32_t>> ChatAfterCache(const ServedModel& model, const KvCacheInfo& cache,
                                            std::span<const ChatMessage> messages);

// POST /v1/caches: the context tokenized (a prompt with BOS as completions get it; messages
// rendered without a generation prompt) and checked against the context window and the pool.
Result<KvCacheRequest> PrepareCache(const ParsedCacheRequest& parsed, const ServedModel& model);

// The Runtime request of choice `index` (seed + index: n samples differ unless greedy).
CompletionRequest ChoiceRequest(const PreparedRequest& p, int index);

}  // namespace cachet::server
