// Runtime::Impl, the scheduler behind Runtime (include/cachet/serving.h): its state and steps.
// scheduler.cc implements the steps; runtime.cc, Runtime's methods on other threads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "cachet/serving.h"
#include "cachet/tokenizer.h"
#include "runtime/cache_registry.h"
#include "runtime/sampler.h"

namespace cachet {

using Clock = std::chrono::steady_clock;

struct Runtime::Impl {
  struct Request {
    uint64_t id = 0;
    uint64_t salt = 0;  // the cache salt's key, as sessions hash it
    CompletionRequest r;
    EventCallback on_event;
    std::unique_ptr<Session> session;  // null while waiting
    std::vector<int32_t> tokens;       // prompt, then every sampled token
    int n_prompt = 0;
    int evaluated = 0;    // tokens whose K/V the session holds
    int cached = 0;       // prompt tokens reused from the prefix cache (first admission)
    int fitted_away = 0;  // prompt tokens a fit request's press took away (not in `tokens`)
    bool ever_admitted = false;
    std::unique_ptr<Sampler> sampler;
    std::unique_ptr<StreamDecoder> decoder;
    std::string held;       // decoded text not yet sent (a stop string may be starting)
    size_t decoded = 0;     // bytes of text the decoder gave so far (sent or held)
    int decoded_chars = 0;  // and its characters
    int sent_chars = 0;     // characters of the text sent (or in pending)
    // Logprobs of tokens whose text is not sent yet: they go out with it (Send), and those of a
    // stop string's tokens never do.
    std::vector<TokenLogprob> held_logprobs;
    std::vector<float> logits;
    std::vector<float> raw_logits;  // a copy for logprobs, reused
    TokenEvent pending;             // what the next event carries
    Clock::time_point arrival, last_token;
    bool first_token_seen = false;
    int64_t admitted_order = 0;
    // A cache_id request: the kept cache it forks at each admission, and its tokens (the first
    // `context` of `tokens`).
    std::shared_ptr<Session> base;
    int context = 0;
    // Set for CreateCache: the session is kept once its prompt is prefilled (and pressed); no text.
    CacheCallback on_cache;
    std::string note;  // KvCacheRequest::note
  };

  RuntimeOptions opt;
  std::unique_ptr<Engine> engine;
  int vocab = 0;
  int64_t heads_total = 1;           // layers x KV heads
  int64_t press_evicted_tokens = 0;  // scheduler thread only; Publish snapshots it

  std::mutex mu;  // guards the fields below up to `metrics`
  std::condition_variable cv;
  std::deque<std::unique_ptr<Request>> incoming;
  std::unordered_set<uint64_t> cancels;
  std::vector<std::function<void()>> commands;  // run on the scheduler thread
  bool stop = false;
  uint64_t next_id = 1;
  int queued = 0;  // incoming + waiting
  int live = 0;    // queued + running, for max_sequences + max_waiting
  RuntimeMetrics metrics;
  KvStats kv;
  std::vector<int64_t> tier_tokens;  // prompt tokens each tier served
  std::unique_ptr<CacheRegistry> caches;

  // Scheduler thread only.
  std::deque<std::unique_ptr<Request>> waiting;
  std::vector<std::unique_ptr<Request>> running;
  int64_t admissions = 0;
  std::vector<std::unique_ptr<Request>> cancel_now;  // taken from `cancels`
  std::thread thread;

  ~Impl();

  // Other threads (runtime.cc). Check: what Submit and CreateCache refuse before anything is
  // queued. Queue: sets the request's arrival and id and queues it (ResourceExhausted when the
  // queue is full). OnScheduler: runs fn on the scheduler thread before its next step, and waits.
  Status Check(const CompletionRequest& request) const;
  Result<uint64_t> Queue(std::unique_ptr<Request> q);
  void OnScheduler(const std::function<void()>& fn);

  // Final event, and the request's pages back to the pool (offered to the prefix cache first).
  // Text held back for stop strings goes out unless a stop string ended the text.
  void Finish(Request& q, std::string reason, Status error = OkStatus(), bool flush = true);

  void TakeIncoming();
  // A cache_id request's cache, and its tokens before the prompt (an error: nothing changes).
  Status AttachCache(Request& q);
  // A CreateCache request whose context is done: its session becomes the cache.
  void KeepAsCache(Request& q);
  // Whether q's pages go to the prefix cache. Not a pressed request's (its pages lack tokens, as a
  // fit request's do) nor
  // a cache_id request's (the cache may be pressed; its forks share its pages anyway).
  bool Publishes(const Request& q) const {
    return opt.publish_prefixes && !q.r.press && !q.r.fit && q.base == nullptr;
  }

  // Pages (every layer and KV head) that `tokens` tokens fill.
  int64_t Pages(int64_t tokens) const;

  // Tokens per (layer, KV head) that a pressed request keeps of its prompt (Quest keeps them all).
  static int64_t Kept(const Request& q);

  // The most pages request q holds while its tokens are (re)computed, the first sampled one
  // included, with `cached` of them already held from the prefix cache. A pressed request holds
  // its whole prompt until the press, then what the press kept plus the tokens after the prompt
  // (plus a partial page per table: per-head budgets differ); after_press: only the latter.
  int64_t PeakPages(const Request& q, int cached, bool after_press = false) const;

  // Pages a running request has yet to take before it decodes (the rest of its prompt, or of what
  // a preempted request recomputes). Admission keeps them free: a request admitted while others
  // are still prefilling must not take the pages their prompts were admitted with.
  int64_t Outstanding(const Request& q) const;

  int Cached(const Request& q) const;

  // Whether q should wait for a running request that is computing a prompt sharing at least one
  // more block with q's than the prefix cache holds now (requests on one system prompt, the `n`
  // choices of one request): that prompt is published when it is done, and q then reuses it
  // instead of computing the same blocks beside it.
  bool AwaitsSharedPrefill(const Request& q, int cached) const;

  void Admit();
  Status EvalChunks(Request& q);  // a chunked request's prompt, at admission
  Status EvalFitted(Request& q);  // a fit request's prompt, pressed to fit, at admission

  // Drops the newest running request's session and queues it again (front) for recompute.
  void Preempt();

  // A request that a stop string ended, before Finish publishes its pages: its session keeps only
  // the tokens whose text lies wholly before the stop string (text_end bytes of generated text),
  // so the prefix cache gets the conversation up to the stop, which a follow-up prompt repeats,
  // and not blocks holding the stop string's tokens, which it would not.
  void TruncateAtStop(Request& q, size_t text_end);
  // Counts q finished (metrics, its place among the live requests).
  void Retire(const Request& q);
  // Appends text to the pending event with the logprobs of the tokens it starts (all held ones
  // when `all`).
  static void Send(Request& q, std::string_view text, bool all = false);
  // Whether token id adds none of q's reply text (a special token, unless q asks for them).
  bool Silent(const Request& q, int32_t id) const;

  // Samples request q's next token from its logits; returns false when the request is done.
  bool Sample(Request& q);

  // One batched step; false when there was nothing to do.
  bool Step();

  // Snapshots for other threads.
  void Publish();

  void Loop();
};

}  // namespace cachet
