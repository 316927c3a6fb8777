#include "prepare.h"

#include <algorithm>
#include <optional>

#include "cachet/tokenizer.h"

namespace cachet::server {

namespace {

// A context of n tokens (after `before` already held) against the model's window and its pool.
Status CheckLength(const std::string& field, int64_t before, int64_t n, const ServedModel& model) {
  const std::string after = before > 0 ? " after the cache's " + std::to_string(before) : "";
  if (before + n >= model.n_ctx) {
    return OutOfRange(field + ": the prompt is " + std::to_string(n) + " tokens" + after +
                      "; this model's context holds " + std::to_string(model.n_ctx) +
                      " and at least one must be left to generate");
  }
  if (model.pool_pages > 0 && model.page_tokens > 0) {
    const int64_t pages = (n + model.page_tokens) / model.page_tokens * model.heads_total;
    if (pages > model.pool_pages) {
      return InvalidArgument(field + ": the prompt is " + std::to_string(n) +
                             " tokens, which need " + std::to_string(pages) +
                             " KV pages; the server's pool has " +
                             std::to_string(model.pool_pages) + " (--kv-mem)");
    }
  }
  return OkStatus();
}

// The prompt text cut at every occurrence of a chunk (the earliest first, the longest of those
// starting at one place), each piece tokenized on its own so that a chunk's tokens are the same
// wherever it stands: the first piece as the start of a prompt (BOS), the rest without.
Status SplitChunks(const std::string& text, std::span<const std::string> chunks, bool chat,
                   const ServedModel& model, CompletionRequest* r) {
  const Tokenizer& tok = *model.tokenizer;
  std::vector<char> found(chunks.size(), 0);
  r->prompt.clear();
  auto encode = [&](std::string_view piece) {
    const bool first = r->prompt.empty();
    const std::vector<int32_t> ids = chat    ? EncodeChatPrompt(tok, piece, first)
                                     : first ? tok.EncodePrompt(piece)
                                             : tok.Encode(piece);
    r->prompt.insert(r->prompt.end(), ids.begin(), ids.end());
  };
  for (size_t at = 0; at < text.size();) {
    size_t best = std::string::npos, which = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const size_t p = text.find(chunks[c], at);
      if (p < best ||
          (p == best && p != std::string::npos && chunks[c].size() > chunks[which].size())) {
        best = p;
        which = c;
      }
    }
    encode(std::string_view(text).substr(at, best == std::string::npos ? best : best - at));
    if (best == std::string::npos) break;
    if (r->prompt.empty()) encode("");  // a prompt that opens with a chunk: BOS first
    const int32_t begin = static_cast<int32_t>(r->prompt.size());
    const std::vector<int32_t> ids = tok.Encode(chunks[which]);
    r->prompt.insert(r->prompt.end(), ids.begin(), ids.end());
    if (!ids.empty()) r->chunks.emplace_back(begin, static_cast<int32_t>(r->prompt.size()));
    found[which] = 1;
    at = best + chunks[which].size();
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (!found[c]) {
      return InvalidArgument("chunks[" + std::to_string(c) + "]: not found in the " +
                             (chat ? "rendered messages" : "prompt"));
    }
  }
  return OkStatus();
}

// The room a chat that --on-full shifts or presses keeps for its reply: its max_tokens, or a
// quarter of the context.
int ReplyRoom(const ParsedRequest& parsed, const ServedModel& model) {
  return std::max(1, parsed.max_tokens.value_or(model.n_ctx / 4));
}

// on_full shift: the messages without their oldest turns after the system prompt, as few dropped
// as leave `room` tokens of the context free (a turn opens with a user message, which the
// templates that alternate roles need first). Returns how many were dropped; the rendering fails
// as RenderChat does, or is left too long when only the last message is left.
Result<int> ShiftChat(const ServedModel& model, std::vector<ChatMessage>* messages, int room,
                      std::vector<int32_t>* prompt) {
  int dropped = 0;
  const size_t first = !messages->empty() && (*messages)[0].role == ChatRole::kSystem ? 1 : 0;
  for (;;) {
    Result<std::string> text =
        RenderChat(model.chat_template, *messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
    *prompt = EncodeChatPrompt(*model.tokenizer, *text, /*first=*/true);
    if (static_cast<int64_t>(prompt->size()) + room <= model.n_ctx ||
        messages->size() <= first + 1) {
      return dropped;
    }
    messages->erase(messages->begin() + static_cast<std::ptrdiff_t>(first));
    ++dropped;
    while (messages->size() > first + 1 && (*messages)[first].role != ChatRole::kUser) {
      messages->erase(messages->begin() + static_cast<std::ptrdiff_t>(first));
      ++dropped;
    }
  }
}

// on_full press: a chat that leaves less than `room` tokens of the context free gets its history
// pressed at admission (CompletionRequest::fit), between the system prompt and the last message,
// which stay whole.
Status FitChat(const ServedModel& model, std::span<const ChatMessage> messages, int room,
               CompletionRequest* r) {
  const ChatTemplate& t = model.chat_template;
  Result<std::string> text = RenderChat(t, messages, /*add_generation_prompt=*/true);
  if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
  r->prompt = EncodeChatPrompt(*model.tokenizer, *text, /*first=*/true);
  const int n = static_cast<int>(r->prompt.size());
  if (int64_t{n} + room <= model.n_ctx) return OkStatus();
  // Where the first m messages end in the prompt's tokens (-1: the whole rendering does not
  // start with theirs).
  auto end_of = [&](size_t m) -> int {
    if (m == 0) return 0;
    Result<std::string> head = RenderChat(t, messages.first(m), /*add_generation_prompt=*/false);
    if (!head.ok() || !text->starts_with(*head)) return -1;
    return static_cast<int>(EncodeChatPrompt(*model.tokenizer, *head, /*first=*/true).size());
  };
  const bool system = messages[0].role == ChatRole::kSystem;
  const int bos = r->prompt[0] == model.tokenizer->bos_id() ? 1 : 0;
  const int protect = std::max(bos, system ? end_of(1) : 0);
  const int tail = std::min(end_of(messages.size() - 1), n - 1);
  if (tail <= protect) {
    return OutOfRange("messages: the prompt is " + std::to_string(n) +
                      " tokens and leaves less than " + std::to_string(room) +
                      " of the context of " + std::to_string(model.n_ctx) +
                      " for the reply; there is no history between the system prompt and the " +
                      "last message to press" +
                      (tail < 0 ? " (the template renders the earlier messages differently)" : ""));
  }
  if (int64_t{protect} + (n - tail) + room >= model.n_ctx) {
    return OutOfRange("messages: the system prompt (" + std::to_string(protect) +
                      " tokens) and the last message (" + std::to_string(n - tail) +
                      ") leave less than " + std::to_string(room) + " tokens of the context of " +
                      std::to_string(model.n_ctx) +
                      " for the reply, however much the history between them is pressed");
  }
  r->fit = FitOptions{model.on_full.press, protect, tail, room};
  return OkStatus();
}

}  // namespace

Result<std::vector<int32_t>> ChatAfterCache(const ServedModel& model, const KvCacheInfo& cache,
                                            std::span<const ChatMessage> messages) {
  auto context = ParseChatNote(cache.note);
  if (!context.ok()) return InvalidArgument("cache_id: " + context.status().message());
  const ChatTemplate& t = model.chat_template;
  if (context->empty()) {
    Result<std::string> text = RenderChat(t, messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
    std::string_view rest = *text;
    if (!t.bos_token.empty() && rest.starts_with(t.bos_token))
      rest.remove_prefix(t.bos_token.size());
    return EncodeChatPrompt(*model.tokenizer, rest, /*first=*/false);
  }
  Result<std::string> before = RenderChat(t, *context, /*add_generation_prompt=*/false);
  if (!before.ok()) return InvalidArgument("cache_id: " + before.status().message());
  std::vector<ChatMessage> all = *context;
  all.insert(all.end(), messages.begin(), messages.end());
  Result<std::string> text = RenderChat(t, all, /*add_generation_prompt=*/true);
  if (!text.ok()) {
    return InvalidArgument("messages: after the cache's " + std::to_string(context->size()) +
                           " messages: " + text.status().message());
  }
  if (!std::string_view(*text).starts_with(*before)) {
    return InvalidArgument("messages: the " + std::string(ChatFamilyName(t.family)) +
                           " chat template renders the cache's messages differently when these "
                           "follow them, so they cannot continue from it");
  }
  return EncodeChatPrompt(*model.tokenizer, std::string_view(*text).substr(before->size()),
                          /*first=*/false);
}

Result<KvCacheRequest> PrepareCache(const ParsedCacheRequest& parsed, const ServedModel& model) {
  KvCacheRequest r;
  const bool chat = !parsed.messages.empty();
  const std::string field = chat ? "messages" : "prompt";
  if (chat) {
    Result<std::string> text =
        RenderChat(model.chat_template, parsed.messages, /*add_generation_prompt=*/false);
    if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
    r.prompt = EncodeChatPrompt(*model.tokenizer, *text, /*first=*/true);
    r.note = ChatNote(parsed.messages);
  } else if (parsed.prompt_text) {
    r.prompt = model.tokenizer->EncodePrompt(*parsed.prompt_text);
  } else {
    r.prompt = parsed.prompt_ids;
  }
  if (r.prompt.empty()) return InvalidArgument(field + ": empty (no tokens)");
  CACHET_RETURN_IF_ERROR(CheckLength(field, 0, static_cast<int64_t>(r.prompt.size()), model));
  r.cache_salt = parsed.cache_salt;
  r.press = parsed.press;
  return r;
}

Result<PreparedRequest> Prepare(const ParsedRequest& parsed, const ServedModel& served,
                                uint64_t default_seed, const KvCacheInfo* cache) {
  // A request's chat_template_kwargs render its messages with a template of its own.
  std::optional<ServedModel> own;
  if (parsed.enable_thinking && *parsed.enable_thinking != served.chat_template.enable_thinking) {
    own = served;
    own->chat_template.enable_thinking = *parsed.enable_thinking;
  }
  const ServedModel& model = own ? *own : served;
  PreparedRequest p;
  p.endpoint = parsed.endpoint;
  p.n = parsed.n;
  p.logprobs = parsed.logprobs;
  p.stream = parsed.stream;
  p.include_usage = parsed.include_usage;
  CompletionRequest& r = p.request;

  const bool chat = parsed.endpoint == Endpoint::kChat;
  const std::string prompt_field = chat ? "messages" : "prompt";
  // A JSON-mode reply is the object from its first byte: nothing of it is thinking.
  p.split_reasoning =
      chat && parsed.sampling.format == OutputFormat::kText &&
      parsed.reasoning_format.value_or(model.reasoning_format) == ReasoningFormat::kDeepSeek;
  p.reasoning_opened = p.split_reasoning && model.chat_template.open_think;
  if (chat && cache != nullptr) {
    CACHET_ASSIGN_OR_RETURN(r.prompt, ChatAfterCache(model, *cache, parsed.messages));
  } else if (chat && model.on_full.kind == press::OnFull::Kind::kShift && parsed.chunks.empty()) {
    std::vector<ChatMessage> messages = parsed.messages;
    CACHET_ASSIGN_OR_RETURN(p.dropped_messages,
                            ShiftChat(model, &messages, ReplyRoom(parsed, model), &r.prompt));
  } else if (chat && model.on_full.kind == press::OnFull::Kind::kPress && parsed.chunks.empty() &&
             !parsed.press) {
    CACHET_RETURN_IF_ERROR(FitChat(model, parsed.messages, ReplyRoom(parsed, model), &r));
    p.history_pressed = r.fit.has_value();
  } else if (chat) {
    Result<std::string> text =
        RenderChat(model.chat_template, parsed.messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return InvalidArgument("messages: " + text.status().message());
    if (parsed.chunks.empty()) {
      r.prompt = EncodeChatPrompt(*model.tokenizer, *text, /*first=*/true);
    } else {
      CACHET_RETURN_IF_ERROR(SplitChunks(*text, parsed.chunks, true, model, &r));
    }
  } else if (!parsed.chunks.empty()) {
    CACHET_RETURN_IF_ERROR(SplitChunks(*parsed.prompt_text, parsed.chunks, false, model, &r));
  } else if (parsed.prompt_text) {
    // After a cache the prompt follows its context: no BOS.
    r.prompt = cache != nullptr ? model.tokenizer->Encode(*parsed.prompt_text)
                                : model.tokenizer->EncodePrompt(*parsed.prompt_text);
  } else {
    r.prompt = parsed.prompt_ids;
  }
  if (r.prompt.empty()) return InvalidArgument(prompt_field + ": empty (no tokens)");
  const int64_t n_prompt = static_cast<int64_t>(r.prompt.size());
  const int context = cache != nullptr ? cache->tokens : 0;
  if (!r.fit) CACHET_RETURN_IF_ERROR(CheckLength(prompt_field, context, n_prompt, model));
  // A chat whose reply of max_tokens would not fit is refused, as OpenAI's API does: under
  // --on-full error, and under shift when even the last message alone leaves too little room
  // (press refused it above, or pressed the history to make the room).
  if (chat && !r.fit && parsed.max_tokens &&
      context + n_prompt + *parsed.max_tokens > model.n_ctx) {
    const bool error_policy = model.on_full.kind == press::OnFull::Kind::kError;
    return OutOfRange("messages: the prompt is " + std::to_string(n_prompt) + " tokens" +
                      (context > 0 ? " after the cache's " + std::to_string(context) : "") +
                      (error_policy ? "" : " with every turn it could drop dropped") +
                      " and max_tokens " + std::to_string(*parsed.max_tokens) +
                      " more; this model's context holds " + std::to_string(model.n_ctx) +
                      (error_policy ? " (lower max_tokens, or start the server with --on-full "
                                      "shift or press)"
                                    : " (lower max_tokens)"));
  }

  const int room = r.fit ? r.fit->reserve : model.n_ctx - context - static_cast<int>(n_prompt);
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
  r.skip_special_tokens = parsed.skip_special_tokens;
  r.top_logprobs = parsed.logprobs;
  r.cache_salt = parsed.cache_salt;
  r.press = parsed.press;
  r.cache_id = parsed.cache_id;
  r.blend = parsed.blend;
  return p;
}

CompletionRequest ChoiceRequest(const PreparedRequest& p, int index) {
  CompletionRequest r = p.request;
  r.sampling.seed += static_cast<uint64_t>(index);
  return r;
}

}  // namespace cachet::server
