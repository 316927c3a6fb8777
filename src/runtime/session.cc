// Session: one sequence's cache over an Engine's pool: evaluation, truncation and context shifts,
// forks, and the presses (by attention, by probes). The Engine itself: engine.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "cachet/engine.h"
#include "cachet/tokenizer.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "kv/press/press.h"
#include "model/transformer.h"
#include "runtime/sampler.h"
#include "util/clock.h"
#include "util/thread_pool.h"

namespace cachet {

Session::Session(Engine& engine, std::unique_ptr<PagedSequence> seq, uint64_t salt)
    : engine_(engine), salt_(salt), seq_(std::move(seq)) {}

Session::~Session() = default;

int Session::n_tokens() const { return static_cast<int>(tokens_.size()); }

size_t Session::kv_bytes() const { return seq_->bytes_held(); }

void Session::Publish() {
  if (engine_.prefix_) engine_.prefix_->Publish(tokens_, salt_, *seq_);
}

// Kept: every (layer, KV head)'s rows at positions below n, which for a pressed sequence are the
// tokens its presses left there (chosen by scores that may have seen the tokens dropped now); new
// tokens then take positions from n on. An observer's gatherings include the dropped tokens'
// queries and cannot be taken back out, so a session observing for a press stops observing.
Status Session::Truncate(int n) {
  if (n < 0 || n > n_tokens()) {
    return InvalidArgument("Truncate: " + std::to_string(n) + " is outside [0, " +
                           std::to_string(n_tokens()) + "], the tokens the session holds");
  }
  CACHET_RETURN_IF_ERROR(seq_->Truncate(n));
  if (n < n_tokens() && observer_) StopObserving();
  tokens_.resize(n);
  pending_.clear();
  last_logits_.clear();
  return OkStatus();
}

Status Session::Shift(int begin, int end) {
  if (begin < 0 || begin > end || end > n_tokens()) {
    return InvalidArgument("Shift: [" + std::to_string(begin) + ", " + std::to_string(end) +
                           ") is not a range of the " + std::to_string(n_tokens()) +
                           " tokens the session holds");
  }
  if (begin == end) return OkStatus();
  std::vector<int32_t> new_pos(seq_->n_tokens());
  for (int32_t p = 0; p < seq_->n_tokens(); ++p) {
    new_pos[p] = p < begin ? p : p < end ? -1 : p - (end - begin);
  }
  CACHET_RETURN_IF_ERROR(seq_->Renumber(new_pos, engine_.config().RopeInvFreq()));
  // An observer's gatherings include the dropped tokens: they cannot be taken back out.
  if (observer_) StopObserving();
  tokens_.erase(tokens_.begin() + begin, tokens_.begin() + end);
  return OkStatus();
}

Status Session::CompactPositions() {
  const ModelConfig& c = engine_.config();
  std::vector<int32_t> kept, other;
  seq_->Positions(0, 0, &kept);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      seq_->Positions(l, h, &other);
      if (other != kept || seq_->cold_length(l, h) > 0) {
        return FailedPrecondition(
            "CompactPositions: the (layer, KV head) tables hold different tokens (press with a "
            "+max or +mean selection, without demotion)");
      }
    }
  }
  std::vector<int32_t> new_pos(seq_->n_tokens(), -1);
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < kept.size(); ++i) {
    new_pos[kept[i]] = static_cast<int32_t>(i);
    if (kept[i] < static_cast<int32_t>(tokens_.size())) tokens.push_back(tokens_[kept[i]]);
  }
  CACHET_RETURN_IF_ERROR(seq_->Renumber(new_pos, c.RopeInvFreq()));
  if (observer_) StopObserving();
  tokens_ = std::move(tokens);
  return OkStatus();
}

std::unique_ptr<Session> Session::Fork() const {
  std::unique_ptr<Session> s(new Session(engine_, seq_->Fork(), salt_));
  s->pending_ = pending_;
  s->tokens_ = tokens_;
  s->last_logits_ = last_logits_;
  s->observer_ = observer_;  // shared, not attached: the child's tokens are not observed
  return s;
}

void Session::ObserveForPress(int32_t end, int window, uint32_t gatherings) {
  const ModelConfig& c = engine_.config();
  observer_ = std::make_shared<press::PressObserver>(c.n_layers, c.n_kv_heads, c.head_dim, end,
                                                     window, gatherings);
  observer_->set_rope(c.RopeInvFreq());
  seq_->set_observer(observer_.get());
}

void Session::PrepareForPress(const press::PressOptions& options, int32_t end) {
  ObserveForPress(end, options.window, press::GatheringsFor(options));
  press::PrepareQuest(options, *seq_);
}

void Session::StopObserving() {
  seq_->set_observer(nullptr);
  observer_.reset();
}

namespace {

// lookahead's questions when none are given: generic, about no task in particular.
const std::vector<std::string>& DefaultProbes() {
  static const std::vector<std::string> kProbes = {
      "\n\nQuestion: What is the answer?\nAnswer:",
      "\n\nQuestion: What does the text above say?\nAnswer:",
      "\n\nQuestion: What is the key information in the text?\nAnswer:"};
  return kProbes;
}

}  // namespace

Result<press::PressResult> Session::CompressByProbes(const press::PressOptions& options) {
  const ModelConfig& c = engine_.config();
  const Tokenizer& tok = engine_.tokenizer();
  const int n = seq_->n_tokens();
  if (!pending_.empty()) {
    return FailedPrecondition(std::string("press '") + press::ScorerName(options.scorer) +
                              "' runs on an evaluated cache, not after sampling");
  }
  std::vector<std::vector<int32_t>> probes;
  if (options.scorer == press::Scorer::kKvzip) {
    // KVzip: the context repeated after a prompt to, in chunks, each chunk's queries finding
    // the tokens they copy.
    const std::vector<int32_t> ask = tok.Encode("\n\nRepeat the text above.\n\n");
    const size_t from = !tokens_.empty() && tokens_[0] == tok.bos_id() ? 1 : 0;
    // Chunks as long as the context leaves room for (each is dropped before the next).
    const int room = std::min(options.probe_chunk, engine_.n_ctx() - n) - int(ask.size());
    const size_t chunk = size_t(std::max(16, room));
    for (size_t at = from; at < tokens_.size(); at += chunk) {
      std::vector<int32_t> probe = ask;
      probe.insert(probe.end(), tokens_.begin() + at,
                   tokens_.begin() + std::min(tokens_.size(), at + chunk));
      probes.push_back(std::move(probe));
    }
  } else {
    for (const std::string& t : options.probe_texts.empty() ? DefaultProbes() : options.probe_texts)
      probes.push_back(tok.Encode(t));
    // Pseudo-queries: the context's last window again, after it. Their queries are the model's
    // own for those tokens, placed `window` positions ahead (as expected attention rotates the
    // window's query statistics ahead), and they ask what the context was about to need.
    const size_t w = std::min<size_t>(std::max(options.window, 1), tokens_.size());
    probes.emplace_back(tokens_.end() - static_cast<std::ptrdiff_t>(w), tokens_.end());
  }
  size_t longest = 0;
  for (const auto& p : probes) longest = std::max(longest, p.size());
  if (n + static_cast<int64_t>(longest) > engine_.n_ctx()) {
    return OutOfRange(std::string("press '") + press::ScorerName(options.scorer) +
                      "': a probe of " + std::to_string(longest) + " tokens after the " +
                      std::to_string(n) + " cached ones does not fit in the context of " +
                      std::to_string(engine_.n_ctx()) + " (raise -c, or lower the probe chunk)");
  }
  StopObserving();
  auto observer = std::make_shared<press::PressObserver>(
      c.n_layers, c.n_kv_heads, c.head_dim, static_cast<int32_t>(n + longest),
      static_cast<int>(longest), press::GatheringsFor(options));
  const std::vector<float> logits = last_logits_;
  std::vector<float> scratch;
  Status st;
  const auto t0 = std::chrono::steady_clock::now();
  size_t peak = seq_->bytes_held();
  seq_->set_observer(observer.get());
  for (const auto& probe : probes) {
    st = Eval(probe, &scratch);
    peak = std::max(peak, seq_->bytes_held() + observer->bytes());
    if (st.ok()) st = seq_->Truncate(n);
    tokens_.resize(n);
    if (!st.ok()) break;
  }
  seq_->set_observer(nullptr);
  last_logits_ = logits;
  CACHET_RETURN_IF_ERROR(st);
  // The probes' keys are gone: what they gave the cached tokens stays.
  std::vector<std::vector<int32_t>> keep(size_t(c.n_layers) * c.n_kv_heads);
  for (size_t ti = 0; ti < keep.size(); ++ti) {
    keep[ti].resize(seq_->head_length(int(ti) / c.n_kv_heads, int(ti) % c.n_kv_heads));
    std::iota(keep[ti].begin(), keep[ti].end(), 0);
  }
  observer->Compact(keep);
  const double probe_ms = MsSince(t0);
  auto r = press::Compress(options, *seq_, c.n_layers, c.n_kv_heads, observer.get());
  if (r.ok()) {
    r->probe_ms = probe_ms;
    r->peak_bytes = std::max(r->peak_bytes, peak);
  }
  return r;
}

Result<press::PressResult> Session::Compress(const press::PressOptions& options,
                                             bool keep_observing) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunPress(options, keep_observing);
  if (r.ok()) {
    r->ms = MsSince(t0);
    r->peak_bytes = std::max({r->peak_bytes, r->bytes_before, r->bytes_after});
  }
  return r;
}

Result<press::PressResult> Session::RunPress(const press::PressOptions& options,
                                             bool keep_observing) {
  const ModelConfig& c = engine_.config();
  if (options.Probes()) {
    if (keep_observing)
      return InvalidArgument("kvzip and lookahead press once, not while decoding");
    return CompressByProbes(options);
  }
  if (keep_observing && !options.demote.empty()) {
    return InvalidArgument("pressing again while decoding does not combine with --demote yet");
  }
  if (!options.demote.empty() && seq_->age_out() > 0) {
    return InvalidArgument(
        "--demote does not combine with --kv-cold (both move tokens to the "
        "cold pool: the press's demoted tokens would be fetched by score, the "
        "aged ones all read)");
  }
  if (!options.demote.empty()) {
    CACHET_ASSIGN_OR_RETURN(PagePool * cold, engine_.ColdPool(options.demote));
    seq_->set_cold_pool(cold, options.demote_fetch);
  }
  seq_->set_observer(nullptr);  // the press reads the observer; nothing is attending now
  // Forks share the prompt's observer: only a session that goes on observing compacts it.
  auto r = press::Compress(options, *seq_, c.n_layers, c.n_kv_heads, observer_.get(),
                           keep_observing ? observer_.get() : nullptr);
  if (keep_observing && r.ok()) {
    seq_->set_observer(observer_.get());
  } else {
    StopObserving();
  }
  return r;
}

Status Session::EvalCompressing(std::span<const int32_t> tokens, const press::PressOptions& options,
                                std::vector<float>* logits, size_t* peak_bytes,
                                press::PressResult* result) {
  press::PressOptions o = options;
  if (o.quest) return InvalidArgument("quest evicts nothing: there is nothing to do per chunk");
  o.budget = o.budget > 0 ? o.budget
                          : static_cast<int>(std::lround((1.0 - o.ratio) * double(tokens.size())));
  o.ratio = 0;
  const int ub = engine_.options().ubatch;
  size_t peak = seq_->bytes_held();
  press::PressResult total;  // each chunk's press added up: before = after + what they removed
  for (size_t start = 0; start < tokens.size(); start += ub) {
    const auto chunk = tokens.subspan(start, std::min<size_t>(ub, tokens.size() - start));
    if (o.NeedsAttention()) {
      ObserveForPress(static_cast<int32_t>(n_tokens() + pending_.size() + chunk.size()), o.window,
                      press::GatheringsFor(o));
    }
    CACHET_RETURN_IF_ERROR(Eval(chunk, logits));
    peak = std::max(peak, seq_->bytes_held());
    if (seq_->longest_head() > o.budget) {
      auto r = Compress(o);
      if (!r.ok()) return r.status();
      total.tokens_before += r->tokens_before - r->tokens_after;
      total.bytes_before += r->bytes_before - r->bytes_after;
      total.ms += r->ms;
      total.probe_ms += r->probe_ms;
      peak = std::max(peak, r->peak_bytes);
    } else {
      StopObserving();
    }
  }
  if (peak_bytes) *peak_bytes = peak;
  if (result) {
    const ModelConfig& c = engine_.config();
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) total.tokens_after += seq_->head_length(l, h);
    total.tokens_before += total.tokens_after;
    total.bytes_after = seq_->bytes_held();
    total.bytes_before += total.bytes_after;
    total.peak_bytes = peak;
    *result = total;
  }
  return OkStatus();
}

Status Session::EvalPressed(std::span<const int32_t> tokens, const press::PressOptions& options,
                            std::vector<float>* logits, bool keep_observing,
                            press::PressResult* result) {
  if (options.during_prefill) return EvalCompressing(tokens, options, logits, nullptr, result);
  PrepareForPress(options, static_cast<int32_t>(n_tokens() + pending_.size() + tokens.size()));
  CACHET_RETURN_IF_ERROR(Eval(tokens, logits));
  auto r = Compress(options, keep_observing);
  if (!r.ok()) return r.status();
  if (result) *result = *r;
  return OkStatus();
}

Status Session::Eval(std::span<const int32_t> tokens, std::vector<float>* logits, bool all_logits) {
  const int vocab = engine_.config().vocab_size;
  if (n_tokens() + static_cast<int64_t>(tokens.size() + pending_.size()) > engine_.n_ctx()) {
    return OutOfRange("context full: " + std::to_string(n_tokens()) + " + " +
                      std::to_string(tokens.size()) + " tokens exceed n_ctx " +
                      std::to_string(engine_.n_ctx()));
  }
  if (!pending_.empty()) {  // the last token of a previous Generate goes in first
    std::vector<int32_t> all = pending_;
    all.insert(all.end(), tokens.begin(), tokens.end());
    pending_.clear();
    Status s = Eval(all, logits, all_logits);
    if (!s.ok()) pending_.assign(all.begin(), all.begin() + 1);
    if (s.ok() && all_logits && logits) logits->erase(logits->begin(), logits->begin() + vocab);
    return s;
  }
  if (tokens.empty()) {
    if (logits) *logits = last_logits_;
    return OkStatus();
  }
  // Validate every id up front: a bad id in a later chunk must not leave a half-applied prompt.
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return InvalidArgument("token id " + std::to_string(tokens[i]) + " at index " +
                             std::to_string(i) + " is outside the vocabulary [0, " +
                             std::to_string(vocab) + ")");
    }
  }
  // A fresh session first reuses the longest cached prefix (whole pages, leaving at least one
  // token to compute logits from). Not when every token's logits are wanted.
  int reused = 0;
  const bool prompt = tokens_.empty() && engine_.prefix_ && !all_logits && !seq_->observer();
  if (prompt) {
    reused = engine_.prefix_->Lookup(tokens, salt_, static_cast<int>(tokens.size()) - 1, *seq_);
    tokens_.assign(tokens.begin(), tokens.begin() + reused);
    tokens = tokens.subspan(reused);
  }
  // Reserve the whole span first, so pool exhaustion is reported before any chunk runs.
  if (Status s = seq_->Reserve(static_cast<int>(tokens.size())); !s.ok()) {
    if (reused > 0) {  // back to the empty session we started from
      seq_->Clear();
      tokens_.clear();
    }
    return s;
  }
  const int ub = engine_.options().ubatch;
  if (all_logits && logits) logits->resize(tokens.size() * size_t(vocab));
  last_logits_.resize(vocab);
  for (size_t start = 0; start < tokens.size(); start += ub) {
    const size_t n = std::min<size_t>(ub, tokens.size() - start);
    positions_.resize(n);
    for (size_t i = 0; i < n; ++i) positions_[i] = static_cast<int32_t>(tokens_.size() + i);
    float* out = all_logits && logits ? logits->data() + start * vocab : last_logits_.data();
    // Cannot fail: ids validated and pages reserved above.
    Status s = engine_.model_->Forward(tokens.subspan(start, n), positions_, *seq_, *engine_.pool_,
                                       out, all_logits && logits);
    if (!s.ok()) return s;
    tokens_.insert(tokens_.end(), tokens.begin() + start, tokens.begin() + start + n);
  }
  if (all_logits && logits) {
    std::copy(logits->end() - vocab, logits->end(), last_logits_.begin());
  } else if (logits) {
    *logits = last_logits_;
  }
  // The prompt's full pages are cached now, not only when generation ends: the prefix cache's
  // tiers store runs by their length, and the next request for this prompt asks for this one.
  if (prompt) Publish();
  return OkStatus();
}

Result<GenerateResult> Session::Generate(std::span<const int32_t> prompt,
                                         const GenerateOptions& options,
                                         const TextCallback& on_text) {
  GenerateResult r;
  r.prompt_tokens = static_cast<int>(prompt.size());
  auto t0 = std::chrono::steady_clock::now();
  if (prompt.empty() && last_logits_.empty() && pending_.empty()) {
    return InvalidArgument("Generate: empty prompt and nothing evaluated yet");
  }
  const bool repress = options.press && options.press->decode_every > 0;
  if (options.press) {
    r.press.emplace();
    CACHET_RETURN_IF_ERROR(EvalPressed(prompt, *options.press, nullptr, repress, &*r.press));
  } else {
    CACHET_RETURN_IF_ERROR(Eval(prompt, nullptr));
  }
  // Presses repeated while decoding go back to the budget the prompt's press left.
  std::optional<press::PressOptions> again;
  if (repress) {
    again = *options.press;
    if (again->during_prefill) {
      again->budget = seq_->longest_head();  // what the chunked prefill left
    } else if (again->budget <= 0) {
      again->budget = static_cast<int>(std::lround((1.0 - again->ratio) * n_tokens()));
    }
    again->ratio = 0;
    again->during_prefill = false;
  }
  if (again && !observer_ && again->NeedsAttention()) {  // a chunked prompt dropped its observer
    ObserveForPress(n_tokens(), again->window, press::GatheringsFor(*again));
  }
  r.prefill_ms = MsSince(t0);
  auto t1 = std::chrono::steady_clock::now();

  const Tokenizer& tok = engine_.tokenizer();
  Sampler sampler(options.sampling, engine_.config().vocab_size, &tok);
  StreamDecoder decoder(tok);
  std::vector<float> logits = last_logits_;
  r.finish_reason = "length";
  for (int i = 0; i < options.max_tokens; ++i) {
    const int32_t next = sampler.Sample(logits, tokens_);
    if (options.stop_at_eos && next == tok.eos_id()) {
      r.finish_reason = "stop";
      break;
    }
    r.tokens.push_back(next);
    std::string piece = decoder.Push(next);
    r.text += piece;
    if (on_text && !piece.empty() && !on_text(piece)) break;
    if (i + 1 == options.max_tokens || n_tokens() + 1 > engine_.n_ctx()) {
      pending_.push_back(next);  // evaluated lazily, if the conversation goes on
      break;
    }
    const int32_t one[1] = {next};
    CACHET_RETURN_IF_ERROR(Eval(one, &logits));
    if (again && (i + 1) % again->decode_every == 0) {
      auto pr = Compress(*again, /*keep_observing=*/true);
      if (!pr.ok()) return pr.status();
    }
  }
  if (again) StopObserving();
  std::string rest = decoder.Flush();
  r.text += rest;
  if (on_text && !rest.empty()) on_text(rest);
  r.decode_ms = MsSince(t1);
  Publish();
  return r;
}

}  // namespace cachet
