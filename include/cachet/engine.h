// Cachet's public C++ API: load a model, open sessions (one sequence and its paged KV cache
// each), evaluate tokens and generate text.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/dtype.h"
#include "cachet/model_config.h"
#include "cachet/press.h"
#include "cachet/reuse.h"
#include "cachet/sampling.h"
#include "cachet/status.h"
#include "cachet/tokenizer.h"

namespace cachet {

// Opaque: the engine's internals (src/), reached only by the library itself (EngineAccess).
class ThreadPool;
class Transformer;
class PagePool;
class PagedSequence;
class PrefixTree;
class ChunkCache;
namespace press {
class PressObserver;
}
namespace tiers {
class KvTiers;
struct TierNamespace;
}  // namespace tiers

// A snapshot of the KV cache's accounting.
struct KvStats {
  int64_t page_bytes = 0;  // one page: page_tokens tokens of one KV head of one layer
  int32_t page_tokens = 0;
  int32_t pages_total = 0;
  int32_t pages_used = 0;  // referenced by a sequence or the prefix cache
  int32_t pages_free = 0;
  int32_t pages_cached = 0;       // held by the prefix cache (some also used by live sequences)
  int32_t pages_reclaimable = 0;  // cached pages no sequence uses: evicted LRU on demand
  int32_t pages_high_water = 0;
  int64_t bytes_total = 0;
  std::string codec;           // "f32" or "<k codec>/<v codec>"
  double bytes_per_token = 0;  // of a full page in the layout's codec, all layers and heads
  int64_t bytes_used = 0;
  int64_t bytes_high_water = 0;
  std::vector<std::pair<std::string, int64_t>> bytes_by_codec;  // codec name -> bytes in use
  int64_t prefix_lookups = 0;
  int64_t prefix_hits = 0;
  int64_t prefix_misses = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_cached_blocks = 0;
  int64_t evicted_blocks = 0;
  int64_t evicted_pages = 0;
  // The chunk cache (Session::EvalChunked): chunks held, their bytes (in bytes_used too).
  int64_t chunk_entries = 0, chunk_bytes = 0;
  int64_t chunk_lookups = 0, chunk_hits = 0, chunk_evicted = 0;
  int64_t cold_bytes_used = 0;  // in the cold pools of demoting presses (not in bytes_used)
  // The prefix cache's tiers below RAM (--disk-cache, --redis), top first.
  struct Tier {
    std::string name;              // "disk", "redis"
    int64_t hits = 0, misses = 0;  // runs (of up to 256 tokens) looked up
    int64_t corrupt = 0, errors = 0;
    int64_t rejected = 0;       // runs found but not served (damaged, another model or layout)
    int64_t loaded_tokens = 0;  // prompt tokens served from the tier
    int64_t bytes_read = 0, bytes_written = 0, bytes_held = 0, entries = 0;
    // Runs not stored: Redis's write queue full, or its server failing; on disk, a run larger
    // than --disk-cache-mib, or one with room only by evicting its own chain.
    int64_t dropped = 0;
  };
  std::vector<Tier> tiers;

  std::string ToString() const;  // a few human-readable lines
};

// What a saved cache file (Session::Save) holds, read and checked without a model.
struct SavedCacheInfo {
  std::string codec_k, codec_v;  // the engine options it needs: kv_codec_k / kv_codec_v,
  int page_tokens = 0;           // page_tokens, kv_sinks, kv_window
  int sinks = 0, window = 0;
  std::string cold_codec;   // cold tokens' codec, K or K:V ("" for none)
  int cold_after = 0;       // kv_cold_after of a cache that ages (0: its cold tokens are demoted)
  std::string compression;  // as given to Save
  int n_tokens = 0;         // tokens of the context it caches
  int64_t held_rows = 0;    // token rows kept over all (layer, KV head) tables
  int64_t page_bytes = 0;   // bytes of the pages stored
  uint64_t model_hash = 0;  // of the model's weights (a sample of every tensor)
  std::string calibration;  // the hash (hex) of the kv_calibration it was coded with, or ""
};
Result<SavedCacheInfo> ReadSavedCacheInfo(const std::string& path);

// The model directory used when none is given (the embedded kvtiny).
std::string DefaultModelDir();

struct EngineOptions {
  std::string model_dir;           // empty: DefaultModelDir()
  int threads = 0;                 // 0 or more than the CPUs it may use: one per such CPU
  int ubatch = 512;                // tokens per prefill chunk
  int page_tokens = 16;            // tokens per KV page
  int64_t kv_mem_mib = 0;          // KV pool capacity; 0: enough for one sequence of n_ctx tokens
  bool prefix_cache = true;        // share and reuse full pages of common prompt prefixes
  std::string kv_codec_k = "f32";  // how K pages are stored (names: cachet/kv_codecs.h)
  std::string kv_codec_v = "f32";
  // The calibrated codecs' statistics (pca4..pca2, kvq4..kvq2, cq4, cq2, gear4): a file `cachet
  // calibrate` made for this model. Given, it also keys the stored caches (tiers, saved files):
  // pages one calibration coded are never read with another.
  std::string kv_calibration = "";
  int kv_sinks = 0;   // pages holding the first kv_sinks tokens stay f16
  int kv_window = 0;  // pages stay f16 until kv_window newer tokens follow
  // Precision by age: full pages whose tokens are all kv_cold_after or more tokens old move to a
  // second pool in the row-wise codec kv_cold ("" = off), which attention reads whole. Codec
  // layouts only, as kv_window (f32 K and V is the reference layout).
  std::string kv_cold = "";
  int kv_cold_after = 256;
  int n_ctx = 0;  // max tokens of a sequence; 0: the model's max_position_embeddings
  // A disk tier under the prefix cache (empty: none): published prefixes are written there and
  // read back by any later process with the same model and KV layout. disk_cache_mib caps it
  // (0: 4096 MiB); least recently used runs go first.
  std::string disk_cache_dir = "";
  int64_t disk_cache_mib = 0;
  // A Redis tier under the prefix cache (and under the disk tier, if any), shared by every
  // process and machine pointed at it: "redis://host[:port][/db]", or a Redis Cluster's nodes
  // comma-separated. Writes never block a request (a bounded background queue drops instead);
  // a failing server makes lookups misses until it recovers. Empty: none.
  std::string redis_url = "";
  // Compress the runs stored in the tiers with zstd (level 1; a run it does not shrink is stored
  // as is): about half the bytes of f32/f16 pages on disk and over the network, little for
  // quantized codes, at the cost of compressing on store and inflating on load.
  bool tier_zstd = false;
  // The chunk cache's cap (Session::EvalChunked); 0: none but the pool's (its least recently used
  // chunks go when the pool runs dry, after the prefix cache's pages).
  int64_t chunk_cache_mib = 0;
  // Read the weights into memory advised for transparent huge pages instead of mapping the model
  // files (llama.cpp's --no-mmap): huge pages whatever the page cache holds (a mapping gets them
  // only where it holds the file in 2 MiB folios: README, "Huge pages"), for a longer load and no
  // sharing of the page cache between processes.
  bool no_mmap = false;
};

// MiB of a KV pool that holds `sequences` sequences of n_tokens tokens each in f32 pages (the
// largest codec: an upper bound for any other), two spare pages per (sequence, layer, KV head).
int64_t KvPoolMibFor(const ModelConfig& config, int page_tokens, int n_tokens, int sequences);

// Session::EvalFitting: a prompt longer than the context, made to fit by pressing its middle
// (a chat's history between its system prompt and its last turn).
struct FitOptions {
  press::PressOptions press;  // OnFull's press: a scorer that reads the cache alone, +max or +mean
  int protect = 0;            // leading tokens never pressed (BOS and the system prompt)
  int tail = 0;               // tokens from here on (the last turn) are evaluated once it fits
  int reserve = 0;            // tokens the context keeps free after the prompt (the reply)
};

struct GenerateOptions {
  int max_tokens = 128;  // -n
  SamplingParams sampling;
  bool stop_at_eos = true;
  // Evict with this press after the prompt is evaluated, before the first token is sampled.
  std::optional<press::PressOptions> press;
};

struct GenerateResult {
  std::string text;
  std::vector<int32_t> tokens;  // generated ids
  int prompt_tokens = 0;
  std::string finish_reason;  // "stop" (EOS), "length" (-n or context)
  double prefill_ms = 0;      // time to first token
  double decode_ms = 0;
  std::optional<press::PressResult> press;  // what the prompt's press did (options.press)
};

// Called with each completed piece of text as it is generated; return false to stop.
using TextCallback = std::function<bool(std::string_view piece)>;

class Engine;
class EngineAccess;  // the library's own view inside engines and sessions (src/runtime/)

// One sequence and its KV cache. Not thread-safe; sessions of one engine share its pool and
// threads, so use them from one thread at a time.
class Session {
 public:
  ~Session();
  // Appends tokens (in ubatch chunks) and returns the logits of the last one, or of all of them.
  // On error (bad id, context or KV pool exhausted) the session is unchanged.
  Status Eval(std::span<const int32_t> tokens, std::vector<float>* logits, bool all_logits = false);
  // Generates a continuation of the tokens so far plus prompt_tokens (which may be empty when
  // the session already holds logits from a previous Eval/Generate).
  Result<GenerateResult> Generate(std::span<const int32_t> prompt_tokens,
                                  const GenerateOptions& options,
                                  const TextCallback& on_text = nullptr);
  // Rolls back to the first n tokens (0 <= n <= n_tokens(), else InvalidArgument and nothing
  // changes): their K/V stays, the rest's pages go back to the pool (shared ones are never
  // written). The pending sampled token and the last logits are dropped: Eval/Generate must be
  // given new tokens next. A pressed sequence keeps the tokens it still holds at positions < n.
  Status Truncate(int n);
  // Context shift: drops the tokens at positions [begin, end) and moves every later token back
  // by end - begin, its cached key re-rotated (RoPE) to its new position, in every codec, pressed
  // and demoted tokens included (0 <= begin <= end <= n_tokens(), else InvalidArgument and
  // nothing changes). The moved tokens' K/V still reflect the dropped tokens they attended to, as
  // in llama.cpp's context shift; the last logits and the pending token stay. Frees the dropped
  // tokens' pages; shared pages are copied before they are written (ResourceExhausted, with
  // nothing changed, when the pool cannot supply the copies).
  Status Shift(int begin, int end);
  // After a press that kept the same tokens in every (layer, KV head) table (a +max or +mean
  // selection, nothing demoted): moves the kept tokens to positions 0..m-1, keys re-rotated, so
  // positions free up with the pages (StreamingLLM's positions within the cache); tokens() then
  // holds the kept tokens. FailedPrecondition when the tables hold different tokens.
  Status CompactPositions();
  // A new session sharing this one's KV pages (copy-on-write).
  std::unique_ptr<Session> Fork() const;
  // Offers this session's full pages to the prefix cache (Generate does it when it ends).
  void Publish();
  // Saves the KV cache as it stands (compressed or not: evicted tokens stay gone, demoted ones
  // cold, every page in its own codec) with the tokens and last logits to a file that
  // Engine::LoadSession continues from, in this or another process (written to a temporary file,
  // then renamed). compression: how it was made, for `cachet cache info` ("expected ratio 0.75").
  // With --kv-cold, pages old enough move to the cold codec first, as the next step would.
  Status Save(const std::string& path, std::string_view compression = {}) const;

  // Presses (kv/press). ObserveForPress makes the following Evals gather the attention weights
  // attention-based presses score by, for a prompt that ends at token position `end` (prefix
  // reuse is off while observing, so every prompt query is seen); Compress evicts to the press's
  // budget, frees the pages and stops observing. Forks share what was observed (read-only).
  // gatherings: PressObserver's mask (press::GatheringsFor the presses to be applied).
  void ObserveForPress(int32_t end, int window, uint32_t gatherings = 7);
  // Before a prompt (ending at token position end) that Compress(options) will press: observes
  // what the press scores by, and turns Quest's page selection on already (press::PrepareQuest),
  // so that page key bounds are built as the prompt fills the pages, not by the first decode step.
  void PrepareForPress(const press::PressOptions& options, int32_t end);
  // keep_observing: go on gathering attention after the press (for presses repeated while
  // decoding); otherwise the observer is dropped.
  Result<press::PressResult> Compress(const press::PressOptions& options,
                                      bool keep_observing = false);
  // Eval of a prompt compressed as it is prefilled: after every ubatch chunk the cache is pressed
  // back to the budget ((1 - ratio) of the whole prompt, or budget tokens), so it never holds
  // more than the budget plus one chunk. *peak_bytes gets the most the sequence held.
  // *result: the chunks' presses added up (before = after + what they removed).
  Status EvalCompressing(std::span<const int32_t> tokens, const press::PressOptions& options,
                         std::vector<float>* logits, size_t* peak_bytes = nullptr,
                         press::PressResult* result = nullptr);
  // Eval of a prompt, then the press: observed and compressed after the prompt, or chunk by
  // chunk for presses that compress during prefill.
  Status EvalPressed(std::span<const int32_t> tokens, const press::PressOptions& options,
                     std::vector<float>* logits, bool keep_observing = false,
                     press::PressResult* result = nullptr);

  // Chunk reuse (docs/REUSE.md): evaluates a prompt made of parts after the tokens so far. A chunk
  // part's K/V comes from the engine's chunk cache, computed on its own first when it is not
  // there (after the model's BOS, from position 0; cached under the session's salt), with its
  // keys re-rotated to where it now stands; plain parts are computed in place, and so is the
  // prompt's last token, whose logits are returned. blend says how the attention each chunk did
  // not see (to what precedes it) is restored. The chunks' K/V differs from a fresh prefill's, so
  // blocks from the first chunk on are not published to the prefix cache. Errors (a bad id, the
  // context or the pool full, a session observing for a press: FailedPrecondition) leave the
  // session with the tokens it had (its last logits kept).
  Status EvalChunked(std::span<const PromptPart> parts, const BlendOptions& blend,
                     std::vector<float>* logits, ChunkReuseStats* stats = nullptr);

  // Evaluates a prompt into an empty session, pressing tokens [protect, tail) with fit.press
  // whenever the next ubatch piece, the tail and the reserve would not fit in the context, the
  // freed positions given back (CompactPositions); a history pressed before is pressed again with
  // the pieces since. Then the tail. Returns the prompt tokens pressed away. Errors leave the
  // session empty: OutOfRange when the protected tokens, the tail and the reserve alone do not
  // fit (or pressing frees too little), InvalidArgument for a press that needs attention.
  Result<int> EvalFitting(std::span<const int32_t> tokens, const FitOptions& fit,
                          std::vector<float>* logits);

  // Tokens whose K/V is in the cache.
  int n_tokens() const;
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Bytes of the KV pages this session holds (pages shared with forks or the prefix cache count
  // in full), cold pages of demoting presses included.
  size_t kv_bytes() const;

 private:
  friend class Engine;
  friend class EngineAccess;
  Session(Engine& engine, std::unique_ptr<PagedSequence> seq, uint64_t salt);

  Engine& engine_;
  uint64_t salt_;
  std::unique_ptr<PagedSequence> seq_;
  std::vector<int32_t> tokens_;
  std::vector<float> last_logits_;
  std::vector<int32_t> pending_;    // sampled but not yet evaluated (the last token of Generate)
  std::vector<int32_t> positions_;  // scratch
  void StopObserving();
  // Compress for kvzip and lookahead: their probes evaluated after the cache while observed, then
  // dropped again, and their attention the scores.
  Result<press::PressResult> CompressByProbes(const press::PressOptions& options);
  // Compress's work; Compress adds its time and peak.
  Result<press::PressResult> RunPress(const press::PressOptions& options, bool keep_observing);

  std::shared_ptr<press::PressObserver> observer_;  // attached to seq_ while it observes
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  // cache_salt isolates tenants: sessions of different salts never share cached pages, so one
  // tenant's cached prompt cannot speed up (and so leak through timing to) another's.
  std::unique_ptr<Session> NewSession(std::string_view cache_salt = {});
  // A session continuing from a file Session::Save wrote. A file of another model or KV layout
  // (codecs, page size, sinks, window) is FailedPrecondition naming what differs; a damaged one
  // DataLoss; a pool without room for its pages ResourceExhausted. Nothing changes on error.
  Result<std::unique_ptr<Session>> LoadSession(const std::string& path,
                                               std::string_view cache_salt = {});
  // Tokenizes prompt (BOS added as the tokenizer says) and generates in a fresh session.
  Result<GenerateResult> Generate(std::string_view prompt, const GenerateOptions& options,
                                  const TextCallback& on_text = nullptr,
                                  std::string_view cache_salt = {});

  const ModelConfig& config() const;
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const EngineOptions& options() const { return options_; }
  int threads() const;  // of the engine's thread pool
  // Bytes of weight matrices one decode step reads (every layer's projections and the LM head,
  // in their stored types): with KvStats::bytes_per_token, a decode step's memory traffic.
  int64_t weight_bytes_per_token() const;
  // Every weight matrix as loaded, named as llama.cpp names them in a GGUF (token_embd, output
  // unless tied, blk.N.attn_q .. blk.N.ffn_down), in that order.
  struct MatrixInfo {
    std::string name;
    DType type;
    int64_t rows, cols, bytes;
  };
  std::vector<MatrixInfo> weight_matrices() const;
  // The weights in memory now, from /proc/self/smaps: bytes resident, and of those the bytes in
  // 2 MiB pages (a decode step streams them with a TLB miss per 2 MiB instead of per 4 KiB).
  struct WeightResidency {
    int64_t resident_bytes = 0, huge_page_bytes = 0;
  };
  WeightResidency weight_residency() const;
  KvStats kv_stats() const;
  // The pool demoted (or, with kv_cold, aged) tokens go to in this codec (row-wise codecs only),
  // created on first use with the hot pool's capacity; flag names the option in errors.
  Result<PagePool*> ColdPool(std::string_view codec, std::string_view flag = "--demote");
  void ClearPrefixCache();  // drops every cached page no session uses (prefix and chunk caches)
  int n_ctx() const { return n_ctx_; }
  // Whether sessions age their pages (kv_cold): as --kv-window, only in a codec layout, f32 K and
  // V being the reference.
  bool ages() const;
  // The options given that the f32 layout ignores (it keeps every row as computed), as their
  // flags: "--kv-cold q4_0", "--kv-window 16", "--kv-sinks 4". Empty in a codec layout.
  std::vector<std::string> IgnoredKvOptions() const;

 private:
  friend class Session;
  friend class EngineAccess;
  Engine() = default;
  static uint64_t SaltKey(std::string_view cache_salt);  // what sessions of that salt share under

  EngineOptions options_;
  int n_ctx_ = 0;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<PagePool> kv_pool_;
  std::unique_ptr<tiers::KvTiers> tiers_;  // null without --disk-cache or --redis
  // What stored pages depend on (model content hash, layout): saved caches are checked against it.
  std::unique_ptr<tiers::TierNamespace> kv_namespace_;
  std::unique_ptr<PrefixTree> prefix_;  // null when the prefix cache is off
  std::unique_ptr<ChunkCache> chunks_;
  std::vector<std::pair<std::string, std::unique_ptr<PagePool>>> cold_pools_;
};

}  // namespace cachet
