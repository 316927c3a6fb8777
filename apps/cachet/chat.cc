// `cachet chat`: an interactive conversation whose KV stays cached between turns, and what to do
// when the next turn would not fit in the context (--on-full): stop (error), drop the oldest turns
// after the system prompt and move the rest back (shift), or compress the history (press).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cachet/chat_template.h"
#include "cachet/press.h"
#include "commands.h"

namespace cachet::cli {
namespace {

using press::OnFull;

// The conversation and the session that holds it. A turn is a user message, the template text
// around it and the reply; turns_ says where each starts in the cached text and tokens. The
// system prompt, prefilled on its own, is never dropped or pressed.
class Chat {
 public:
  Chat(Engine& engine, ChatTemplate tmpl, const GenerateOptions& gen, OnFull on_full)
      : engine_(engine),
        tok_(engine.tokenizer()),
        tmpl_(std::move(tmpl)),
        stops_(StopStrings(tmpl_)),
        gen_(gen),
        on_full_(std::move(on_full)),
        session_(engine.NewSession()) {}

  void System(const std::string& text) { messages_.push_back({ChatRole::kSystem, text}); }
  void Turn(const std::string& user, bool verbose_prompt);

 private:
  struct TurnStart {
    size_t text = 0;   // offset in in_cache_
    int token = 0;     // position in the session
    int messages = 2;  // messages it holds (a pressed history: several turns)
  };
  // The text the next turn prefills (what the rendering adds to in_cache_); a session that
  // cannot append (the template rewrote earlier text) starts over.
  std::string NextText();
  // Makes room for `need` more tokens by the --on-full policy; false when it cannot.
  bool MakeRoom(int need);
  bool DropOldestTurn();
  bool PressHistory();
  std::string Generate(const std::vector<int32_t>& ids);
  // Prefills what the template writes after a reply (chatml's "<|im_end|>\n"): the reply ends at
  // the stop string, which the session does not hold, and the next turn follows the closed one.
  // Returns the text prefilled.
  std::string CloseTurn();
  int CloseTokens() const;  // room CloseTurn needs

  Engine& engine_;
  const Tokenizer& tok_;
  const ChatTemplate tmpl_;
  const std::vector<std::string> stops_;
  const GenerateOptions gen_;
  const OnFull on_full_;
  std::unique_ptr<Session> session_;
  std::vector<ChatMessage> messages_;
  std::string in_cache_;  // the rendered conversation whose tokens the session holds
  int system_tokens_ = 0;
  std::string prefilled_this_turn_;  // a system prompt NextText prefilled, for --verbose-prompt
  std::vector<TurnStart> turns_;
};

std::string Chat::NextText() {
  auto prompt = RenderChat(tmpl_, messages_, /*add_generation_prompt=*/true);
  if (!prompt.ok()) Fail(prompt.status());
  // What the new message adds to the rendering of the conversation before it. The cached text
  // may differ from that rendering where the template normalises a reply (plain adds a space
  // after "Assistant:"); only the added text must follow it.
  if (!in_cache_.empty()) {
    // As the earlier turns render with a user message after them: Qwen3's templates keep a
    // reply's reasoning only while it is the last turn.
    ChatTemplate followed = tmpl_;
    followed.recent_reasoning = false;
    auto before = RenderChat(followed, std::span(messages_.data(), messages_.size() - 1),
                             /*add_generation_prompt=*/false);
    if (before.ok() && prompt->starts_with(*before)) return prompt->substr(before->size());
  }
  // The first turn, or a template that rewrites earlier text: start over. The system prompt goes
  // in on its own, so that it can be protected.
  session_ = engine_.NewSession();
  in_cache_.clear();
  turns_.clear();
  system_tokens_ = 0;
  if (!messages_.empty() && messages_[0].role == ChatRole::kSystem) {
    auto system =
        RenderChat(tmpl_, std::span(messages_.data(), 1), /*add_generation_prompt=*/false);
    if (system.ok() && !system->empty() && prompt->starts_with(*system)) {
      std::vector<float> logits;
      if (Status s = session_->Eval(EncodeChatPrompt(tok_, *system, /*first=*/true), &logits);
          !s.ok()) {
        Fail(s);
      }
      in_cache_ = *system;
      prefilled_this_turn_ = *system;
      system_tokens_ = session_->n_tokens();
    }
  }
  return prompt->substr(in_cache_.size());
}

bool Chat::DropOldestTurn() {
  if (turns_.empty()) return false;
  const TurnStart first = turns_[0];
  const int end = turns_.size() > 1 ? turns_[1].token : session_->n_tokens();
  const size_t text_end = turns_.size() > 1 ? turns_[1].text : in_cache_.size();
  if (Status s = session_->Shift(first.token, end); !s.ok()) Fail(s);
  in_cache_.erase(first.text, text_end - first.text);
  const size_t at = system_tokens_ > 0 ? 1 : 0;
  messages_.erase(messages_.begin() + at, messages_.begin() + at + first.messages);
  turns_.erase(turns_.begin());
  for (TurnStart& t : turns_) {
    t.token -= end - first.token;
    t.text -= text_end - first.text;
  }
  std::fprintf(stderr, "[context full: dropped %d tokens of the oldest turn]\n", end - first.token);
  return true;
}

// Presses every turn but the last (the system prompt is the press's sinks, the last turn its
// window), then gives the freed positions back: the pressed turns become one.
bool Chat::PressHistory() {
  if (turns_.size() < 2) return false;
  press::PressOptions o = on_full_.press;
  o.sinks = system_tokens_;
  o.window = session_->n_tokens() - turns_.back().token;
  const int before = session_->n_tokens();
  auto r = session_->Compress(o);
  if (!r.ok()) Fail(r.status());
  if (Status s = session_->CompactPositions(); !s.ok()) Fail(s);
  const int freed = before - session_->n_tokens();
  if (freed <= 0) return false;
  TurnStart history{turns_[0].text, system_tokens_, 0};
  for (size_t i = 0; i + 1 < turns_.size(); ++i) history.messages += turns_[i].messages;
  TurnStart last = turns_.back();
  last.token -= freed;
  turns_ = {history, last};
  std::fprintf(stderr, "[context full: pressed the history, %d tokens freed]\n", freed);
  return true;
}

bool Chat::MakeRoom(int need) {
  const int n_ctx = engine_.n_ctx();
  if (session_->n_tokens() + need > n_ctx && on_full_.kind != OnFull::Kind::kError) {
    // The prefix cache holds the conversation's full pages too: shared, they would be copied
    // before the shift or press writes them (the pool holds one conversation, not two).
    engine_.ClearPrefixCache();
  }
  while (session_->n_tokens() + need > n_ctx) {
    switch (on_full_.kind) {
      case OnFull::Kind::kError:
        return false;
      case OnFull::Kind::kShift:
        if (!DropOldestTurn()) return false;
        break;
      case OnFull::Kind::kPress:
        // A history pressed before is pressed again with the turns since; when pressing frees
        // too little, the oldest turns go.
        if (!PressHistory() && !DropOldestTurn()) return false;
        break;
    }
  }
  return true;
}

std::string Chat::Generate(const std::vector<int32_t>& ids) {
  std::string reply;
  bool at_stop = false;
  size_t printed = 0;  // of reply
  auto print_to = [&](size_t end) {
    if (end <= printed) return;
    std::fwrite(reply.data() + printed, 1, end - printed, stdout);
    std::fflush(stdout);
    printed = end;
  };
  auto r = session_->Generate(ids, gen_, [&](std::string_view piece) {
    reply += piece;
    // End the turn at the template's end of turn (the model would otherwise write the user's
    // turn too): the text before the stop string is the reply.
    size_t stop_at = std::string::npos;
    for (const std::string& stop : stops_) stop_at = std::min(stop_at, reply.find(stop));
    if (stop_at != std::string::npos) {
      at_stop = true;
      print_to(stop_at);
      return false;
    }
    // Text that may be the start of a stop string waits until the next pieces tell.
    size_t held = 0;
    for (const std::string& stop : stops_) {
      if (stop.empty()) continue;
      for (size_t k = std::min(stop.size() - 1, reply.size()); k > held; --k) {
        if (reply.compare(reply.size() - k, k, stop, 0, k) == 0) {
          held = k;
          break;
        }
      }
    }
    print_to(reply.size() - held);
    return true;
  });
  if (!r.ok()) Fail(r.status());
  if (!at_stop) print_to(reply.size());
  // The reply as the session holds it. At a stop string, only the tokens whose text comes before
  // it: the session drops the rest (those the stop string began in were evaluated; the one that
  // completed it was not), so the next turn's template text follows the reply.
  std::string content;
  if (at_stop) {
    size_t stop_at = reply.size();
    for (const std::string& stop : stops_) stop_at = std::min(stop_at, reply.find(stop));
    size_t kept = 0;
    for (; kept < r->tokens.size(); ++kept) {
      const std::string bytes = tok_.TokenBytes(r->tokens[kept]);
      if (content.size() + bytes.size() > stop_at ||
          reply.compare(content.size(), bytes.size(), bytes) != 0) {
        break;
      }
      content += bytes;
    }
    const int dropped = static_cast<int>(r->tokens.size() - 1 - kept);  // evaluated ones
    if (dropped > 0) {
      if (Status s = session_->Truncate(session_->n_tokens() - dropped); !s.ok()) Fail(s);
    }
  } else {
    for (int32_t id : r->tokens) content += tok_.TokenBytes(id);
  }
  std::fputc('\n', stdout);
  std::fprintf(stderr, "[%d tokens in context, %d new this turn, prefill %.1f ms]\n",
               session_->n_tokens(), r->prompt_tokens, r->prefill_ms);
  return content;
}

int Chat::CloseTokens() const {
  return static_cast<int>(tok_.Encode(EndOfTurn(tmpl_) + "\n", /*parse_special=*/true).size()) + 1;
}

std::string Chat::CloseTurn() {
  auto closed = RenderChat(tmpl_, messages_, /*add_generation_prompt=*/false);
  auto prior = RenderChat(tmpl_, std::span(messages_.data(), messages_.size() - 1),
                          /*add_generation_prompt=*/false);
  const std::string eot = EndOfTurn(tmpl_);
  if (!closed.ok() || !prior.ok() || eot.empty() || !closed->starts_with(*prior)) return {};
  // The rendering from the reply's end-of-turn text on (the reply holds none: generation stops at
  // it), looked for past the conversation before the reply rather than past the generation
  // prompt: DeepSeek-R1's opens "<think>", which its rendering of a past reply drops. An end of
  // turn before that belongs to an earlier turn (plain's "\nUser:"): nothing to close then.
  const size_t at = closed->rfind(eot);
  if (at == std::string::npos || at < prior->size()) return {};
  const std::string tail = closed->substr(at);
  const std::vector<int32_t> ids = EncodeChatPrompt(tok_, tail, /*first=*/false);
  if (ids.empty() || session_->n_tokens() + static_cast<int>(ids.size()) > engine_.n_ctx()) {
    return {};
  }
  if (Status s = session_->Eval(ids, nullptr); !s.ok()) Fail(s);
  in_cache_ += tail;
  return tail;
}

void Chat::Turn(const std::string& user, bool verbose_prompt) {
  messages_.push_back({ChatRole::kUser, user});
  prefilled_this_turn_.clear();
  std::string text = NextText();
  std::vector<int32_t> ids = EncodeChatPrompt(tok_, text, /*first=*/in_cache_.empty());
  // Room for the prompt, a reply of -n tokens (at most a quarter of the context) and the turn's
  // end.
  const int reply = std::min(gen_.max_tokens, engine_.n_ctx() / 4) + CloseTokens();
  if (!MakeRoom(static_cast<int>(ids.size()) + reply)) {
    if (on_full_.kind == OnFull::Kind::kError) {
      Fail(FailedPrecondition("context full: " + std::to_string(session_->n_tokens()) +
                              " tokens in context + " + std::to_string(ids.size()) +
                              " of this message + " + std::to_string(reply) +
                              " for the reply exceed -c " + std::to_string(engine_.n_ctx()) +
                              " (--on-full shift or press:NAME:RATIO make room instead)"));
    }
    // That message alone is too long: it is not sent, and the chat goes on without it.
    std::fprintf(stderr,
                 "cachet chat: the message (%zu tokens with its template) does not fit in the "
                 "context of %d even with every earlier turn gone: not sent\n",
                 ids.size(), engine_.n_ctx());
    messages_.pop_back();
    return;
  } else if (on_full_.kind != OnFull::Kind::kError) {
    text = NextText();  // what dropping turns left to add (the same text for append templates)
    ids = EncodeChatPrompt(tok_, text, /*first=*/in_cache_.empty());
  }
  if (verbose_prompt) {
    const std::string shown = prefilled_this_turn_ + text;
    std::fprintf(stderr, "--- prompt\n%s\n---\n", shown.c_str());
  }
  turns_.push_back({in_cache_.size(), session_->n_tokens(), 2});
  in_cache_ += text;
  std::string content = Generate(ids);
  in_cache_ += content;
  messages_.push_back({ChatRole::kAssistant, std::move(content)});
  const std::string closed = CloseTurn();
  if (verbose_prompt && !closed.empty()) {
    std::fprintf(stderr, "--- end of turn\n%s\n---\n", closed.c_str());
  }
}

}  // namespace

void AddChat(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "chat",
      "Interactive multi-turn chat on stdin/stdout in the model's chat template; the "
      "conversation's KV stays cached between turns, so each turn only prefills the new text");
  auto opts = std::make_shared<CommonOptions>();
  auto system = std::make_shared<std::string>();
  auto template_name = std::make_shared<std::string>();
  auto on_full = std::make_shared<std::string>("error");
  auto verbose_prompt = std::make_shared<bool>(false);
  AddEngineFlags(*cmd, opts->engine);
  AddSamplingFlags(*cmd, opts->gen);
  cmd->add_option("--system", *system, "System message that opens the conversation");
  cmd->add_option(std::string(kChatTemplateFlag), *template_name,
                  "Prompt format, one of: " + ChatTemplateNames() +
                      ". Default: the model's own chat template (tokenizer_config.json "
                      "chat_template or the GGUF's tokenizer.chat_template) recognised by "
                      "family; plain (\"User: ...\\nAssistant:\" lines) for a model without one")
      ->type_name("NAME");
  auto kwargs = std::make_shared<std::string>();
  AddChatTemplateKwargsFlag(*cmd, *kwargs);
  cmd->add_option("--on-full", *on_full,
                  "When the next turn (its prompt and -n reply tokens, at most a quarter of -c) "
                  "would not fit in the context: error (stop, as before), shift (drop the oldest "
                  "turns after the system prompt, the later tokens' keys re-rotated to close the "
                  "gap, as llama.cpp's context shift), or press:NAME:RATIO (compress the turns "
                  "before the last with a press that reads the cache alone: streaming, knorm, "
                  "keydiff or random; the system prompt and the last turn are kept, the freed "
                  "positions given back; turns go when pressing frees too little)")
      ->capture_default_str();
  cmd->add_flag("--verbose-prompt", *verbose_prompt,
                "Print the prompt text each turn prefills to stderr");
  cmd->callback([=] {
    // Flags and the template first: a bad value fails before the model loads.
    Result<OnFull> policy = press::ParseOnFull(*on_full);
    if (!policy.ok()) Fail(policy.status());
    const std::string& dir = opts->engine.model_dir;
    auto chat_template = ResolveChatTemplate(dir.empty() ? DefaultModelDir() : dir, *template_name);
    if (!chat_template.ok()) Fail(chat_template.status());
    if (!kwargs->empty()) {
      if (Status s = ApplyChatTemplateKwargs(*kwargs, &chat_template.value()); !s.ok()) Fail(s);
    }
    auto engine = LoadEngine(opts->engine);
    if (!engine) throw CLI::RuntimeError(1);
    RequireLogitBiasInVocab(opts->gen.sampling, *engine);
    if (policy->kind == OnFull::Kind::kPress && engine->ages()) {
      // The history's oldest pages sit in the cold pool by then, which a press (one token set
      // over the hot tables) cannot take in.
      Fail(InvalidArgument("--on-full press does not combine with --kv-cold: use --on-full shift"));
    }
    ChatTemplate tmpl = std::move(chat_template).value();
    UseTokenizerSpecials(engine->tokenizer(), &tmpl);
    const std::string family(ChatFamilyName(tmpl.family));
    Chat chat(*engine, std::move(tmpl), opts->gen, *policy);
    if (!system->empty()) chat.System(*system);
    std::fprintf(stderr,
                 "cachet chat (%s template): type a message and press Enter; Ctrl-D to quit.\n",
                 family.c_str());
    for (std::string line;;) {
      std::fprintf(stderr, "> ");
      if (!std::getline(std::cin, line)) break;
      if (line.ends_with('\r')) line.pop_back();  // a CRLF script or terminal
      if (!line.empty()) chat.Turn(line, *verbose_prompt);
    }
  });
}

}  // namespace cachet::cli
