// A parsed request (request.h) made into what the Runtime takes: the prompt rendered (chat
// template) and tokenized, checked against the context and the KV pool, defaults resolved, the
// chat template's stop strings added. Needs the served model's tokenizer and template but no
// Runtime, so the unit tests run it on kvtiny's tokenizer.
#pragma once

#include <cstdint>
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
};

// default_seed: the seed of a request that names none.
Result<PreparedRequest> Prepare(const ParsedRequest& parsed, const ServedModel& model,
                                uint64_t default_seed);

// The Runtime request of choice `index` (seed + index: n samples differ unless greedy).
CompletionRequest ChoiceRequest(const PreparedRequest& p, int index);

}  // namespace cachet::server
