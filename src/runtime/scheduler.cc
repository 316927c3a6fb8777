// Runtime (include/cachet/serving.h): continuous batching over one engine.
//
// One scheduler thread owns the engine's mutable state (sessions, pool, prefix tree). Each step:
// take in new requests and cancels; admit waiting requests while the pool can hold their prompt
// besides the rest of the prompts already admitted (first come, first served among the next few,
// a longer cached prefix first; one whose prompt shares blocks with a prompt being computed waits
// for it, then reuses its pages: src/runtime/admission.cc); give every decoding request its next
// token and the prefilling ones prompt chunks up to the step's token budget; run them through
// Transformer::ForwardBatch; publish a finished prompt's full pages to the prefix cache; press a
// request that asked for it where its chunk reached the end of its prompt; sample where a chunk
// reached the end of a request's tokens. When the pool runs dry mid-step the newest request is
// preempted: its session (and so its pages) dropped, its tokens kept, and it waits at the front of
// the queue to be recomputed (its published prefix, if any, is reused; a pressed request is pressed
// again at the end of its prompt, then recomputes the tokens it had generated). A request a stop
// string ends drops the stop string's tokens from its session before its pages are offered to the
// prefix cache. Other threads only queue requests and commands and read snapshots the scheduler
// publishes after each step.
#include "runtime/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "cachet/model_config.h"
#include "cachet/serving.h"
#include "cachet/tokenizer.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "model/transformer.h"
#include "runtime/engine_access.h"
#include "runtime/sampler.h"

namespace cachet {

// The scheduler drives sessions token by token through batched steps, below Session's API.
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void Observe(RuntimeMetrics::Histogram& h, double v) {
  constexpr size_t kBounds = std::size(RuntimeMetrics::kLatencyBuckets);
  if (h.buckets.empty()) h.buckets.assign(kBounds + 1, 0);
  for (size_t i = 0; i < kBounds; ++i) {
    if (v <= RuntimeMetrics::kLatencyBuckets[i]) ++h.buckets[i];
  }
  ++h.buckets[kBounds];
  h.sum += v;
  ++h.count;
}

// log-softmax of the chosen token and the n most likely (from the raw logits).
TokenLogprob Logprobs(std::span<const float> logits, int32_t token, int n) {
  const float m = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - m);
  const float lse = m + static_cast<float>(std::log(sum));
  TokenLogprob lp;
  lp.token = token;
  lp.logprob = logits[token] - lse;
  if (n > 0) {
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    n = std::min<int>(n, static_cast<int>(ids.size()));
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int i = 0; i < n; ++i) lp.top.emplace_back(ids[i], logits[ids[i]] - lse);
  }
  return lp;
}

// The length of the longest suffix of text that is a proper prefix of some stop string: text
// that may still turn into a stop string and so is held back.
size_t HeldBack(std::string_view text, const std::vector<std::string>& stops) {
  size_t held = 0;
  for (const std::string& s : stops) {
    for (size_t k = std::min(s.size() - 1, text.size()); k > held; --k) {
      if (text.substr(text.size() - k) == std::string_view(s).substr(0, k)) {
        held = k;
        break;
      }
    }
  }
  return held;
}

// Characters of decoded text (the decoder writes whole characters only): their first bytes.
int Utf8Chars(std::string_view text) {
  int n = 0;
  for (char ch : text) n += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return n;
}

}  // namespace

Runtime::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  if (thread.joinable()) thread.join();
}

// Text goes out with the logprobs of the tokens it starts (all of them when `all`).
void Runtime::Impl::Send(Request& q, std::string_view text, bool all) {
  q.pending.text += text;
  q.sent_chars += Utf8Chars(text);
  size_t n = 0;
  while (n < q.held_logprobs.size() && (all || q.held_logprobs[n].text_offset < q.sent_chars)) ++n;
  if (n == 0) return;
  auto& out = q.pending.logprobs;
  out.insert(out.end(), std::make_move_iterator(q.held_logprobs.begin()),
             std::make_move_iterator(q.held_logprobs.begin() + static_cast<std::ptrdiff_t>(n)));
  q.held_logprobs.erase(q.held_logprobs.begin(), q.held_logprobs.begin() + n);
}

// A request leaves the runtime: it no longer counts against -np + --max-waiting.
void Runtime::Impl::Retire(const Request& q) {
  std::lock_guard<std::mutex> lock(mu);
  --live;
  ++metrics.requests_finished;
  Observe(metrics.e2e, Seconds(Clock::now() - q.arrival));
}

// Final event, and the request's pages back to the pool (offered to the prefix cache first).
// Text held back for stop strings goes out unless a stop string ended the text.
void Runtime::Impl::Finish(Request& q, std::string reason, Status error, bool flush) {
  if (q.decoder && flush) Send(q, q.held + q.decoder->Flush(), /*all=*/true);
  q.held.clear();
  q.held_logprobs.clear();
  if (q.session) {
    if (Publishes(q)) q.session->Publish();
    q.session.reset();
  }
  Retire(q);
  Publish();         // the snapshot the final event's reader sees
  if (q.on_cache) {  // CreateCache's: no text, only why there is no cache
    q.on_cache(error.ok() ? FailedPrecondition("the cache was cancelled before it was made")
                          : std::move(error));
    return;
  }
  q.pending.finished = true;
  q.pending.finish_reason = std::move(reason);
  q.pending.error = std::move(error);
  q.pending.usage = {q.n_prompt + q.fitted_away, q.cached,
                     static_cast<int>(q.tokens.size()) - q.n_prompt};
  q.on_event(q.pending);
}

void Runtime::Impl::TakeIncoming() {
  std::deque<std::unique_ptr<Request>> fresh;
  {
    std::lock_guard<std::mutex> lock(mu);
    fresh.swap(incoming);
  }
  // Outside the lock: attaching a cache may load it from disk.
  for (auto& q : fresh) {
    q->salt = EngineAccess::SaltOf(q->r.cache_salt);
    if (!q->r.cache_id.empty()) {
      if (Status s = AttachCache(*q); !s.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu);
          --queued;
        }
        Finish(*q, "error", s);
        continue;
      }
    }
    waiting.push_back(std::move(q));
  }
  std::lock_guard<std::mutex> lock(mu);
  for (uint64_t id : cancels) {
    auto is = [id](const auto& q) { return q->id == id; };
    if (auto it = std::find_if(waiting.begin(), waiting.end(), is); it != waiting.end()) {
      cancel_now.push_back(std::move(*it));
      waiting.erase(it);
      --queued;
    } else if (auto r = std::find_if(running.begin(), running.end(), is); r != running.end()) {
      cancel_now.push_back(std::move(*r));
      running.erase(r);
    }
  }
  cancels.clear();
}

Status Runtime::Impl::AttachCache(Request& q) {
  CACHET_ASSIGN_OR_RETURN(std::shared_ptr<Session> base,
                          caches->Get(*engine, q.r.cache_id, q.r.cache_salt));
  const std::vector<int32_t>& context = base->tokens();
  const int64_t total = static_cast<int64_t>(context.size() + q.tokens.size());
  if (total >= engine->n_ctx()) {
    return OutOfRange("prompt: " + std::to_string(q.tokens.size()) + " tokens after the cache's " +
                      std::to_string(context.size()) + " leave no room in the context of " +
                      std::to_string(engine->n_ctx()));
  }
  q.tokens.insert(q.tokens.begin(), context.begin(), context.end());
  q.context = static_cast<int>(context.size());
  q.n_prompt = static_cast<int>(total);
  q.cached = q.context;
  q.base = std::move(base);
  return OkStatus();
}

void Runtime::Impl::KeepAsCache(Request& q) {
  // The last token's logits go with it: a copy loaded elsewhere may continue with no prompt.
  EngineAccess::last_logits(*q.session) = q.logits;
  Result<KvCacheInfo> info =
      caches->Add(std::move(q.session), q.r.cache_salt,
                  q.r.press ? press::DescribePress(*q.r.press) : "none", std::move(q.note));
  if (!info.ok()) return Finish(q, "error", info.status());
  Retire(q);
  Publish();  // the cache counted before its creator hears of it
  q.on_cache(info);
}

// A chunked request's prompt but its last token, through Session::EvalChunked: the step that
// follows computes that token (and any a preempted request had generated) as for any request.
Status Runtime::Impl::EvalChunks(Request& q) {
  const std::span<const int32_t> prompt(q.tokens.data(), q.n_prompt - 1);
  std::vector<PromptPart> parts;
  int32_t at = 0;
  for (const auto& [begin, end] : q.r.chunks) {
    const int32_t b = std::min<int32_t>(begin, prompt.size());
    const int32_t e = std::min<int32_t>(end, prompt.size());
    if (b > at) parts.push_back({prompt.subspan(at, b - at), false});
    if (e > b) parts.push_back({prompt.subspan(b, e - b), true});
    at = std::max(at, e);
  }
  if (at < static_cast<int32_t>(prompt.size())) parts.push_back({prompt.subspan(at), false});
  ChunkReuseStats stats;
  CACHET_RETURN_IF_ERROR(q.session->EvalChunked(parts, q.r.blend, nullptr, &stats));
  q.evaluated = q.session->n_tokens();
  if (!q.ever_admitted) q.cached = stats.hit_tokens;
  std::lock_guard<std::mutex> lock(mu);
  // Computed here: the prompt but its last token, less what the chunk cache and the prefix
  // cache's tiers gave, plus the cached chunks' tokens blending computed again.
  metrics.prompt_tokens +=
      std::max<int64_t>(0, static_cast<int64_t>(prompt.size()) - stats.hit_tokens -
                               stats.prefix_tokens + stats.recomputed_tokens);
  metrics.chunk_hits += stats.chunk_hits;
  metrics.chunk_misses += stats.chunk_misses;
  metrics.chunk_tokens += stats.chunk_tokens;
  metrics.chunk_recomputed_tokens += stats.recomputed_tokens;
  return OkStatus();
}

// A fit request's prompt but its last token, pressed to fit (Session::EvalFitting); its tokens
// become those the session kept, the prompt's last and what it had generated, so the steps that
// follow run it as any request. A preempted one starts again from the whole prompt.
Status Runtime::Impl::EvalFitted(Request& q) {
  const std::span<const int32_t> prompt(q.r.prompt);
  FitOptions fit = *q.r.fit;
  fit.reserve += 1;  // the prompt's last token, which the next step computes
  CACHET_ASSIGN_OR_RETURN(const int away,
                          q.session->EvalFitting(prompt.first(prompt.size() - 1), fit, nullptr));
  std::vector<int32_t> tokens = q.session->tokens();
  tokens.push_back(prompt.back());
  tokens.insert(tokens.end(), q.tokens.begin() + q.n_prompt, q.tokens.end());  // generated
  q.fitted_away = away;  // the prompt's tokens but those the session kept and its last
  q.n_prompt = q.session->n_tokens() + 1;
  q.tokens = std::move(tokens);
  q.evaluated = q.session->n_tokens();
  std::lock_guard<std::mutex> lock(mu);
  metrics.prompt_tokens += static_cast<int64_t>(prompt.size()) - 1;  // all computed, then pressed
  metrics.fit_requests += 1;
  metrics.fit_pressed_tokens += away;
  return OkStatus();
}

// Drops the newest running request's session and queues it again (front) for recompute.
void Runtime::Impl::Preempt() {
  auto newest = std::max_element(running.begin(), running.end(), [](const auto& a, const auto& b) {
    return a->admitted_order < b->admitted_order;
  });
  std::unique_ptr<Request> q = std::move(*newest);
  running.erase(newest);
  q->session.reset();
  q->evaluated = 0;
  waiting.push_front(std::move(q));
  std::lock_guard<std::mutex> lock(mu);
  ++metrics.preemptions;
  ++queued;
}

// A request that a stop string ended, before Finish publishes its pages: its session keeps only
// the tokens whose text lies wholly before the stop string (text_end bytes of generated text),
// so the prefix cache gets the conversation up to the stop, which a follow-up prompt repeats,
// and not blocks holding the stop string's tokens, which it would not.
void Runtime::Impl::TruncateAtStop(Request& q, size_t text_end) {
  if (!q.session || !Publishes(q)) return;  // nothing will be published
  StreamDecoder replay(engine->tokenizer());
  size_t len = 0;
  int kept = 0;
  for (size_t i = q.n_prompt; i < q.tokens.size(); ++i) {
    if (Silent(q, q.tokens[i])) continue;
    len += replay.Push(q.tokens[i]).size();
    if (len > text_end) break;
    if (!replay.holding()) kept = static_cast<int>(i) + 1 - q.n_prompt;  // its bytes all out
  }
  Session& s = *q.session;
  if (q.n_prompt + kept < s.n_tokens()) {
    // Can only fail for want of a raw page to unseal a page into (staged layouts): the pages
    // are then published as they are.
    (void)s.Truncate(q.n_prompt + kept);
  }
}

bool Runtime::Impl::Silent(const Request& q, int32_t id) const {
  return q.r.skip_special_tokens && engine->tokenizer().IsSpecial(id);
}

// Samples request q's next token from its logits; returns false when the request is done.
bool Runtime::Impl::Sample(Request& q) {
  const Tokenizer& tok = engine->tokenizer();
  // Logprobs come from the logits as the model gave them: the sampler's repetition penalty
  // rewrites its input in place.
  const bool logprobs = q.r.top_logprobs >= 0;
  if (logprobs) q.raw_logits.assign(q.logits.begin(), q.logits.end());
  const int32_t next = q.sampler->Sample(q.logits, q.tokens);
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!q.first_token_seen) {
      Observe(metrics.ttft, Seconds(now - q.arrival));
    } else {
      Observe(metrics.inter_token, Seconds(now - q.last_token));
    }
  }
  q.first_token_seen = true;
  q.last_token = now;
  if (q.r.stop_at_eos && next == tok.eos_id()) {
    Finish(q, "stop");
    return false;
  }
  const bool silent = Silent(q, next);
  if (silent &&
      std::find(q.r.stop.begin(), q.r.stop.end(), tok.TokenBytes(next)) != q.r.stop.end()) {
    Finish(q, "stop");  // a chat template's end of turn, as a token: as EOS
    return false;
  }
  q.tokens.push_back(next);
  q.pending.tokens.push_back(next);
  {
    std::lock_guard<std::mutex> lock(mu);
    ++metrics.generation_tokens;
  }
  // Bytes earlier tokens left in the decoder that do not complete a character come out first as
  // U+FFFD: those characters are theirs, and this token's text starts after them.
  std::string earlier;
  if (!silent && q.decoder->holding()) earlier = StreamDecoder(*q.decoder).Flush();
  const std::string piece = silent ? std::string() : q.decoder->Push(next);
  if (logprobs) {
    q.held_logprobs.push_back(Logprobs(q.raw_logits, next, q.r.top_logprobs));
    q.held_logprobs.back().text_offset =
        q.decoded_chars + (piece.starts_with(earlier) ? Utf8Chars(earlier) : 0);
  }
  q.decoded += piece.size();
  q.decoded_chars += Utf8Chars(piece);
  q.held += piece;
  // The earliest stop string ends the text before it.
  size_t cut = std::string::npos;
  for (const std::string& s : q.r.stop) {
    if (!s.empty()) cut = std::min(cut, q.held.find(s));
  }
  if (cut != std::string::npos) {
    Send(q, q.held.substr(0, cut));
    TruncateAtStop(q, q.decoded - q.held.size() + cut);
    Finish(q, "stop", OkStatus(), /*flush=*/false);
    return false;
  }
  const size_t keep = HeldBack(q.held, q.r.stop);
  Send(q, q.held.substr(0, q.held.size() - keep), /*all=*/q.held.empty() && !q.decoder->holding());
  q.held.erase(0, q.held.size() - keep);
  const int generated = static_cast<int>(q.tokens.size()) - q.n_prompt;
  if (generated >= q.r.max_tokens || static_cast<int>(q.tokens.size()) >= engine->n_ctx()) {
    Finish(q, "length");
    return false;
  }
  q.on_event(q.pending);
  q.pending = TokenEvent();
  return true;
}

// One batched step; false when there was nothing to do.
bool Runtime::Impl::Step() {
  TakeIncoming();
  for (auto& q : cancel_now) Finish(*q, "cancelled");
  cancel_now.clear();
  Admit();
  if (running.empty()) return false;

  struct Entry {
    Request* q;
    int n;
  };
  std::vector<Entry> entries;
  std::vector<SeqChunk> chunks;
  std::vector<std::vector<int32_t>> positions;
  for (;;) {
    // Decoding requests first (one token each), then prompt chunks, oldest first.
    std::vector<Request*> order;
    for (auto& q : running) order.push_back(q.get());
    std::stable_sort(order.begin(), order.end(), [](Request* a, Request* b) {
      const bool da = a->evaluated + 1 == static_cast<int>(a->tokens.size());
      const bool db = b->evaluated + 1 == static_cast<int>(b->tokens.size());
      return da != db ? da : a->admitted_order < b->admitted_order;
    });
    int budget = std::min(opt.batch_tokens, EngineAccess::model(*engine).max_batch());
    entries.clear();
    chunks.clear();
    positions.assign(order.size(), {});
    for (size_t i = 0; i < order.size() && budget > 0; ++i) {
      Request& q = *order[i];
      const int left = static_cast<int>(q.tokens.size()) - q.evaluated;
      int n = std::min(left, budget);
      // A pressed request's chunk stops at the end of its prompt, where the press runs.
      if (q.r.press && q.evaluated < q.n_prompt) n = std::min(n, q.n_prompt - q.evaluated);
      if (n <= 0) continue;
      budget -= n;
      auto& pos = positions[i];
      pos.resize(n);
      for (int j = 0; j < n; ++j) pos[j] = q.evaluated + j;
      SeqChunk c;
      c.kv = &EngineAccess::kv(*q.session);
      c.tokens = std::span<const int32_t>(q.tokens).subspan(q.evaluated, n);
      c.positions = pos;
      c.logits = n == left ? q.logits.data() : nullptr;
      chunks.push_back(c);
      entries.push_back({&q, n});
    }
    Status s = EngineAccess::model(*engine).ForwardBatch(chunks, EngineAccess::threads(*engine));
    if (s.ok()) break;
    if (s.code() == StatusCode::kResourceExhausted && running.size() > 1) {
      Preempt();
      continue;
    }
    // Nothing else to free: the request alone does not fit (or the step is broken). One that
    // has generated ends as a context limit would (its text so far stands; trying again would
    // fail the same way); one still in its prompt is an error.
    std::unique_ptr<Request> q = std::move(running.front());
    running.erase(running.begin());
    const bool generating = static_cast<int>(q->tokens.size()) > q->n_prompt;
    if (s.code() == StatusCode::kResourceExhausted && generating) {
      Finish(*q, "length");
    } else if (s.code() == StatusCode::kResourceExhausted && caches->count() > 0) {
      // What holds the pool is the kept caches, which only their owners' DELETE frees.
      Finish(*q, "error",
             ResourceExhausted("the KV pool (--kv-mem) cannot hold this prompt beside the " +
                               std::to_string(caches->count()) + " kept caches (" +
                               std::to_string(caches->bytes() >> 20) +
                               " MiB): delete one (DELETE /v1/caches/ID), or raise --kv-mem"));
    } else {
      Finish(*q, "error", s);
    }
    return true;
  }
  int64_t prompt_tokens = 0;
  for (const Entry& e : entries) {
    Request& q = *e.q;
    auto& held = EngineAccess::tokens(*q.session);
    held.insert(held.end(), q.tokens.begin() + q.evaluated, q.tokens.begin() + q.evaluated + e.n);
    const bool prompt_done = q.evaluated < q.n_prompt && q.evaluated + e.n >= q.n_prompt;
    if (q.evaluated < q.n_prompt) prompt_tokens += std::min(e.n, q.n_prompt - q.evaluated);
    q.evaluated += e.n;
    // The prompt's full pages go to the prefix cache now, not when the request ends, so that
    // requests waiting on it (AwaitsSharedPrefill) and any that share it reuse them at once.
    if (prompt_done && Publishes(q)) q.session->Publish();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    metrics.prompt_tokens += prompt_tokens;
  }
  std::vector<Request*> done;
  for (const Entry& e : entries) {
    Request& q = *e.q;
    if (q.r.press && q.evaluated == q.n_prompt) {  // the step reached the end of the prompt
      auto pr = q.session->Compress(*q.r.press);
      if (!pr.ok()) {
        Finish(q, "error", pr.status());
        done.push_back(&q);
        continue;
      }
      // Tokens per (layer, KV head) the press evicted, on average (per-head budgets differ).
      press_evicted_tokens += (pr->tokens_before - pr->tokens_after) / heads_total;
    }
    if (q.evaluated != static_cast<int>(q.tokens.size())) continue;  // mid-prompt
    if (q.on_cache) {
      KeepAsCache(q);
      done.push_back(&q);
    } else if (!Sample(q)) {
      done.push_back(&q);
    }
  }
  std::erase_if(running, [&](const auto& q) {
    return std::find(done.begin(), done.end(), q.get()) != done.end();
  });
  return true;
}

// Snapshots for other threads.
void Runtime::Impl::Publish() {
  const KvStats s = engine->kv_stats();
  const int n_caches = caches->count();
  const int64_t cache_bytes = caches->bytes();
  const int64_t unloaded = caches->unloaded();
  std::lock_guard<std::mutex> lock(mu);
  kv = s;
  metrics.kv_caches = n_caches;
  metrics.kv_cache_bytes = cache_bytes;
  metrics.kv_caches_unloaded = unloaded;
  // Finished requests (no session) may still be in `running` until the step ends.
  metrics.running = static_cast<int>(std::count_if(
      running.begin(), running.end(), [](const auto& q) { return q->session != nullptr; }));
  metrics.waiting = queued;
  // Cached pages no request uses are free for the taking (evicted on demand), as vLLM counts.
  metrics.kv_usage =
      s.pages_total > 0 ? double(s.pages_used - s.pages_reclaimable) / s.pages_total : 0;
  metrics.kv_bytes_by_codec = s.bytes_by_codec;
  // Pressed out of requests' caches, and dropped from the prefix cache under pressure.
  metrics.kv_evicted_tokens = press_evicted_tokens + s.evicted_blocks * s.page_tokens;
  // Prompt tokens by where their K/V came from: computed, the prefix cache in RAM, its tiers.
  int64_t from_tiers = 0;
  metrics.prompt_tokens_by_source = {{"compute", metrics.prompt_tokens}, {"ram", 0}};
  for (size_t t = 0; t < s.tiers.size(); ++t) {
    const int64_t n = t < tier_tokens.size() ? tier_tokens[t] : 0;
    metrics.prompt_tokens_by_source.emplace_back(s.tiers[t].name, n);
    from_tiers += n;
  }
  metrics.prompt_tokens_by_source[1].second = metrics.prefix_hit_tokens - from_tiers;
  metrics.kv_tiers = s.tiers;
}

void Runtime::Impl::Loop() {
  for (;;) {
    std::vector<std::function<void()>> cmds;
    {
      std::unique_lock<std::mutex> lock(mu);
      const bool ready = cv.wait_for(lock, std::chrono::seconds(1), [&] {
        return stop || !incoming.empty() || !cancels.empty() || !commands.empty() ||
               !running.empty() || (!waiting.empty());
      });
      if (stop) break;
      if (!ready) {
        // Idle: refresh the snapshot once a second anyway, since the tiers' background writes
        // (Redis) finish after the last step and their counters would otherwise stay stale.
        lock.unlock();
        Publish();
        continue;
      }
      cmds.swap(commands);
    }
    for (auto& c : cmds) c();
    const bool worked = Step();
    Publish();
    if (!worked && running.empty() && !waiting.empty()) {
      // Waiting requests that cannot be admitted with nothing running: fail the first.
      std::unique_ptr<Request> q = std::move(waiting.front());
      waiting.pop_front();
      {
        std::lock_guard<std::mutex> lock(mu);
        --queued;
      }
      Finish(*q, "error",
             ResourceExhausted("the KV pool cannot hold the prompt beside the "
                               "prefix cache's pages in use"));
    }
  }
  for (auto& q : running) Finish(*q, "cancelled");
  for (auto& q : waiting) Finish(*q, "cancelled");
  std::lock_guard<std::mutex> lock(mu);
  for (auto& q : incoming) {
    q->pending.finished = true;
    q->pending.finish_reason = "cancelled";
    q->on_event(q->pending);
  }
}

}  // namespace cachet
