// Serving many requests from one engine: a Runtime runs one scheduler thread that, step after
// step, batches the next token of every decoding request with prompt chunks of requests still
// prefilling (continuous batching) through Transformer::ForwardBatch, over one KV pool and one
// prefix cache. Requests are admitted first come, first served (a longer cached prefix first),
// only when the pool can hold their prompt. A prompt's full pages are published to the prefix
// cache as soon as it is computed, and a request whose prompt shares blocks with one being
// computed waits for it and reuses them (many requests on one system prompt, the `n` choices of
// one request). When the pool runs dry mid-decode the newest request is preempted (its pages
// freed, its published prefix kept) and later resumed by recompute.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/engine.h"

namespace cachet {

struct RuntimeOptions {
  EngineOptions engine;
  int max_sequences = 8;         // -np: requests running (prefilling or decoding) at once
  int batch_tokens = 512;        // --batch-tokens: tokens per step (decode tokens + prompt chunks)
  int max_waiting = 256;         // requests that may wait beyond max_sequences; Submit refuses more
  bool publish_prefixes = true;  // offer finished requests' pages to the prefix cache
  // Where kept caches (CreateCache) are also saved, <cache_dir>/<id>.ckv with <id>.json beside
  // it, and looked up when not resident, so that a restarted runtime with the same model and KV
  // layout finds them. Empty: <engine.disk_cache_dir>/caches when that is set, else none. With
  // engine.redis_url they are stored in Redis too, where other runtimes on it find them.
  std::string cache_dir;
  // --cache-mem-mib: bytes of pages kept caches may hold in RAM (0: half the KV pool). Past it
  // the least recently used leave RAM, to be loaded again from cache_dir or Redis on their next
  // request; with neither, a cache that would pass it is refused.
  int64_t cache_mem_bytes = 0;
};

struct CompletionRequest {
  std::vector<int32_t> prompt;  // token ids, BOS included as the caller wants
  int max_tokens = 16;
  SamplingParams sampling;        // temperature <= 0: greedy
  std::vector<std::string> stop;  // stop strings: the text ends before the first match
  bool stop_at_eos = true;
  // Special tokens (BOS, a chat template's markers) are tokens of the reply but add none of its
  // text, as vLLM's skip_special_tokens and llama-server; one whose text is a stop string ends
  // the reply there, as EOS does.
  bool skip_special_tokens = true;
  int top_logprobs = -1;                     // -1: no logprobs; n >= 0: the token's and the top n
  std::string cache_salt;                    // tenant isolation in the prefix cache
  std::optional<press::PressOptions> press;  // applied after the prompt, before the first token
  // Continue from this kept cache (CreateCache's id; empty: none): the prompt follows its context,
  // in a fork of its session (its pages shared, never copied). Its salt must be cache_salt, and
  // press unset (the cache was compressed when it was made).
  std::string cache_id;
  // Chunk reuse (Session::EvalChunked): [begin, end) token ranges of the prompt, ascending and
  // apart, whose K/V the chunk cache supplies wherever they stand, reconciled by blend. Not with
  // press or cache_id. The prompt is computed when the request is admitted, on the scheduler
  // thread, before the next step.
  std::vector<std::pair<int32_t, int32_t>> chunks;
  BlendOptions blend;
  // A prompt longer than the context (`cachet serve --on-full press:...`): computed at admission
  // by Session::EvalFitting, its history pressed until it fits; the reply then has the context's
  // room. Not with press, cache_id or chunks; its pages are not published to the prefix cache.
  std::optional<FitOptions> fit;
};

// A context prefilled (and pressed) once and kept by the Runtime for requests to continue from.
struct KvCacheRequest {
  std::vector<int32_t> prompt;               // the context, BOS included as the caller wants
  std::string cache_salt;                    // the cache answers to this salt only
  std::optional<press::PressOptions> press;  // applied once the context is prefilled
  std::string note;                          // the caller's, kept with the cache and its file
};

struct KvCacheInfo {
  std::string id;           // "kvc-" and 32 random hex digits (nothing of the content)
  int64_t created = 0;      // Unix time
  int tokens = 0;           // of the context
  int64_t held_rows = 0;    // token rows kept over every (layer, KV head) table
  int64_t bytes = 0;        // of the KV pages it holds
  std::string compression;  // "snapkv ratio 0.750", or "none"
  std::string note;
};

// Called on the scheduler thread with the new cache, or why it was not made.
using CacheCallback = std::function<void(const Result<KvCacheInfo>&)>;

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // the top_logprobs most likely, best first
  // Characters (code points) of the reply's text before this token's: where its text starts
  // (completions' logprobs.text_offset). A special token's text is none of the reply's.
  int text_offset = 0;
};

struct Usage {
  int prompt_tokens = 0;
  int cached_tokens = 0;  // prompt tokens served by the prefix cache
  int completion_tokens = 0;
};

// What a request produces, in order: events with new text, then one final event.
struct TokenEvent {
  std::string text;             // new text (held back while it may be the start of a stop string)
  std::vector<int32_t> tokens;  // the tokens generated since the previous event
  std::vector<TokenLogprob> logprobs;  // one per token when requested
  bool finished = false;
  std::string finish_reason;  // final event: "stop" (EOS or a stop string), "length", "cancelled"
  Status error;               // final event: why the request failed, when it did
  Usage usage;                // final event
};

// Called on the scheduler thread: copy what is needed and return quickly.
using EventCallback = std::function<void(const TokenEvent&)>;

// Counters since start, gauges now, and latency histograms (seconds; cumulative bucket counts
// with upper bounds kLatencyBuckets, then +Inf), as Prometheus exposes them.
struct RuntimeMetrics {
  static constexpr double kLatencyBuckets[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                               0.5,   1.0,   2.5,  5.0,   10.0, 30.0, 60.0};
  struct Histogram {
    std::vector<uint64_t> buckets;  // cumulative, one per bound plus +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  int running = 0;
  int waiting = 0;
  double kv_usage = 0;  // fraction of the KV pool's pages in use
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t preemptions = 0;
  int64_t requests_finished = 0;
  int64_t kv_evicted_tokens = 0;
  std::vector<std::pair<std::string, int64_t>> kv_bytes_by_codec;
  // Prompt tokens by where their K/V came from: "compute", "ram" (the prefix cache), then each
  // tier below it ("disk").
  std::vector<std::pair<std::string, int64_t>> prompt_tokens_by_source;
  std::vector<KvStats::Tier> kv_tiers;  // each tier's own counters
  int kv_caches = 0;                    // kept caches resident
  int64_t kv_cache_bytes = 0;           // bytes of their pages (shared with requests on them)
  int64_t kv_caches_unloaded = 0;       // times a cache left RAM for cache_mem_bytes
  // Chunk reuse: chunks found in the chunk cache or computed on their own, their prompt tokens,
  // and the chunk tokens recomputed in place by blending.
  int64_t chunk_hits = 0, chunk_misses = 0, chunk_tokens = 0, chunk_recomputed_tokens = 0;
  // Prompts longer than the context pressed to fit (CompletionRequest::fit), and the prompt
  // tokens their presses took away.
  int64_t fit_requests = 0, fit_pressed_tokens = 0;
  Histogram ttft, inter_token, e2e;
};

class Runtime {
 public:
  static Result<std::unique_ptr<Runtime>> Create(const RuntimeOptions& options);
  ~Runtime();  // cancels what is left and stops the scheduler thread

  // Queues a request; its events go to on_event. Errors (nothing queued): InvalidArgument for an
  // empty prompt, a bad token id, max_tokens < 1, a prompt that leaves no room in the context or
  // needs more KV pages than the whole pool has (it could never run); ResourceExhausted when
  // max_requests() are already running or waiting (try again later).
  Result<uint64_t> Submit(CompletionRequest request, EventCallback on_event);
  // Stops a request at the next step boundary and frees its pages; its final event has
  // finish_reason "cancelled". Unknown or finished ids are ignored.
  void Cancel(uint64_t id);

  // Kept caches. CreateCache queues the context as a request's prompt (the same admission and
  // pool; Cancel takes its id) and keeps its session once it is prefilled and pressed; errors
  // (nothing queued) are Submit's. FindCache and DeleteCache answer NotFound alike for an id that
  // does not exist and one of another salt, so a tenant learns nothing of another's ids.
  // FindCache loads a cache from cache_dir or Redis when it is not resident; DeleteCache frees
  // its pages (requests running on it keep theirs until they end) and removes its stored copies.
  Result<uint64_t> CreateCache(KvCacheRequest request, CacheCallback on_done);
  Result<KvCacheInfo> FindCache(const std::string& id, const std::string& cache_salt);
  Status DeleteCache(const std::string& id, const std::string& cache_salt);
  std::vector<KvCacheInfo> ListCaches(const std::string& cache_salt) const;  // resident ones

  RuntimeMetrics Metrics() const;
  KvStats kv_stats() const;
  void ClearPrefixCache();

  const Tokenizer& tokenizer() const;
  const ModelConfig& config() const;
  int n_ctx() const;
  int threads() const;  // of the engine's thread pool
  // max_sequences + max_waiting: the most requests Submit holds at once, so the most choices one
  // request may have.
  int max_requests() const;

 private:
  struct Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cachet
