#include "prepare.h"

#include <algorithm>

#include "cachet/tokenizer.h"

namespace cachet::server {

Result<PreparedRequest> Prepare(const ParsedRequest& parsed, const ServedModel& model,
                                uint64_t default_seed) {
  PreparedRequest p;
  p.endpoint = parsed.endpoint;
  p.n = parsed.n;
  p.logprobs = parsed.logprobs;
  p.stream = parsed.stream;
  p.include_usage = parsed.include_usage;
  CompletionRequest& r = p.request;

  const bool chat = parsed.endpoint == Endpoint::kChat;
  const std::string prompt_field = chat ? "messages" : "prompt";
  if (chat) {
    Result<std::string> text =
        RenderChat(model.chat_template, parsed.messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
    r.prompt = EncodeChatPrompt(*model.tokenizer, *text, /*first=*/true);
  } else if (parsed.prompt_text) {
    r.prompt = model.tokenizer->EncodePrompt(*parsed.prompt_text);
  } else {
    r.prompt = parsed.prompt_ids;
  }
  if (r.prompt.empty()) return InvalidArgument(prompt_field + ": empty (no tokens)");
  const int64_t n_prompt = static_cast<int64_t>(r.prompt.size());
  if (n_prompt >= model.n_ctx) {
    return OutOfRange(prompt_field + ": the prompt is " + std::to_string(n_prompt) +
                      " tokens; this model's context holds " + std::to_string(model.n_ctx) +
                      " and at least one must be left to generate");
  }
  if (model.pool_pages > 0 && model.page_tokens > 0) {
    const int64_t pages = (n_prompt + model.page_tokens) / model.page_tokens * model.heads_total;
    if (pages > model.pool_pages) {
      return InvalidArgument(prompt_field + ": the prompt is " + std::to_string(n_prompt) +
                             " tokens, which need " + std::to_string(pages) +
                             " KV pages; the server's pool has " +
                             std::to_string(model.pool_pages) + " (--kv-mem)");
    }
  }

  const int room = model.n_ctx - static_cast<int>(n_prompt);
  r.max_tokens = parsed.max_tokens.value_or(chat ? room : kDefaultCompletionTokens);
  r.sampling = parsed.sampling;
  r.sampling.seed = parsed.seed.value_or(default_seed);
  r.stop = parsed.stop;
  if (chat) {
    for (std::string& s : StopStrings(model.chat_template)) {
      if (!s.empty() && std::find(r.stop.begin(), r.stop.end(), s) == r.stop.end()) {
        r.stop.push_back(std::move(s));
      }
    }
  }
  r.stop_at_eos = !parsed.ignore_eos;
  r.top_logprobs = parsed.logprobs;
  r.cache_salt = parsed.cache_salt;
  r.press = parsed.press;
  return p;
}

CompletionRequest ChoiceRequest(const PreparedRequest& p, int index) {
  CompletionRequest r = p.request;
  r.sampling.seed += static_cast<uint64_t>(index);
  return r;
}

}  // namespace cachet::server
