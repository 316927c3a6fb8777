// Engine: the model, one KV pool and what shares it (prefix tree, tiers, chunk cache, cold pools)
// for every Session, and its accounting. Sessions: session.cc.
#include "cachet/engine.h"

#include <xxhash.h>

#include <algorithm>
#include <sstream>

#include "cachet/machine.h"
#include "cachet/tokenizer.h"
#include "kv/chunk_cache.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "kv/tiers/disk_tier.h"
#include "kv/tiers/kv_tiers.h"
#include "kv/tiers/redis_tier.h"
#include "model/transformer.h"
#include "runtime/kv_namespace.h"
#include "util/mmap_file.h"
#include "util/thread_pool.h"

namespace cachet {

std::string DefaultModelDir() {
  if (const char* env = std::getenv("CACHET_MODEL_DIR"); env && *env) return env;
  return CACHET_DEFAULT_MODEL_DIR;
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  std::unique_ptr<Engine> e(new Engine());
  e->options_ = options;
  if (e->options_.model_dir.empty()) e->options_.model_dir = DefaultModelDir();
  const EngineOptions& o = e->options_;
  if (o.ubatch < 1) return InvalidArgument("--ubatch must be >= 1");
  if (o.page_tokens < 1 || o.page_tokens > 256) {
    return InvalidArgument("page_tokens must be in [1, 256]");
  }
  CACHET_ASSIGN_OR_RETURN(e->model_, Transformer::Load(o.model_dir, o.ubatch, o.no_mmap));
  CACHET_ASSIGN_OR_RETURN(e->tokenizer_, Tokenizer::Load(o.model_dir));
  const ModelConfig& c = e->model_->config();
  if (e->tokenizer_->vocab_size() > c.vocab_size) {
    return InvalidArgument(o.model_dir + ": tokenizer has " +
                           std::to_string(e->tokenizer_->vocab_size()) +
                           " tokens but the model's vocab_size is " + std::to_string(c.vocab_size));
  }
  e->n_ctx_ = o.n_ctx > 0 ? o.n_ctx : c.max_position_embeddings;
  const int cpus = ThreadPool::DefaultThreads();  // more threads than CPUs only wait on each other
  e->pool_ = std::make_unique<ThreadPool>(o.threads > 0 ? std::min(o.threads, cpus) : cpus);
  KvLayout layout{c.n_layers, c.n_kv_heads, c.head_dim, o.page_tokens};
  layout.max_tokens = e->n_ctx_;  // positions in 16 bits where the context allows
  CACHET_ASSIGN_OR_RETURN(layout.codec_k, codecs::ParseCodec(o.kv_codec_k));
  CACHET_ASSIGN_OR_RETURN(layout.codec_v, codecs::ParseCodec(o.kv_codec_v));
  CACHET_RETURN_IF_ERROR(codecs::CheckDim(layout.codec_k, c.head_dim));
  CACHET_RETURN_IF_ERROR(codecs::CheckDim(layout.codec_v, c.head_dim));
  const uint64_t weights_hash = WeightsHash(*e->model_);  // read once: the namespace's too
  CACHET_ASSIGN_OR_RETURN(layout.calibration, LoadKvCalibration(c, weights_hash, o, layout));
  AddRopeTable(c, e->n_ctx_, &layout);
  if (o.kv_sinks < 0) return InvalidArgument("--kv-sinks must be >= 0");
  layout.sinks = o.kv_sinks;
  if (o.kv_window < 0) return InvalidArgument("--kv-window must be >= 0");
  layout.window = layout.plain() ? 0 : o.kv_window;
  // The default holds one full context: the larger of a raw (f16) and a codec page (a codec page
  // with f32 rows on one side outweighs a raw one), and for staged layouts (KIVI keys, a recent
  // window) both, since one Eval reserves its whole span raw before sealing it into codec pages.
  // The pool only reserves address space: unused capacity costs no memory.
  const size_t raw_bytes = layout.raw_page_bytes();
  const size_t default_page_bytes = layout.plain() ? raw_bytes
                                    : layout.staged()
                                        ? raw_bytes + layout.codec_page_bytes()
                                        : std::max(raw_bytes, layout.codec_page_bytes());
  // The pool maps address space only and keeps books on the slots it hands out, but a budget
  // past the machine's memory is a typo that would end at the OOM killer, not a full pool.
  const double ram_mib = PhysicalMemoryBytes() / (1 << 20);
  if (o.kv_mem_mib > 0 && ram_mib > 0 && double(o.kv_mem_mib) > ram_mib) {
    char ram[32];
    std::snprintf(ram, sizeof ram, "%.1f GiB", ram_mib / 1024);
    return InvalidArgument("--kv-mem " + std::to_string(o.kv_mem_mib) +
                           " MiB is more than this machine's memory (" + ram + ")");
  }
  size_t capacity = o.kv_mem_mib > 0 ? static_cast<size_t>(o.kv_mem_mib) << 20
                                     : static_cast<size_t>(layout.heads_total()) *
                                           ((e->n_ctx_ + o.page_tokens - 1) / o.page_tokens) *
                                           default_page_bytes;
  e->kv_pool_ = std::make_unique<PagePool>(layout, capacity);
  if (e->ages()) {
    if (o.kv_cold_after < 1) return InvalidArgument("--kv-cold-after must be >= 1");
    CACHET_RETURN_IF_ERROR(e->ColdPool(o.kv_cold, "--kv-cold").status());
  }
  if (o.prefix_cache) {
    // Cached pages are only valid for the same weights: key them by config and tensor layout.
    // (A GGUF file has no config.json: its path and tensor table identify it.)
    auto config_text = ReadTextFile(o.model_dir + "/config.json");
    std::string identity = config_text.ok() ? config_text.value() : o.model_dir;
    for (const auto& [name, t] : e->model_->weights().store.tensors()) {
      identity += name + DTypeName(t.dtype) + std::to_string(t.n_bytes);
    }
    e->prefix_ =
        std::make_unique<PrefixTree>(*e->kv_pool_, XXH3_64bits(identity.data(), identity.size()));
  }
  if (o.chunk_cache_mib < 0) return InvalidArgument("--chunk-cache-mib must be >= 0");
  e->chunks_ = std::make_unique<ChunkCache>(*e->kv_pool_, size_t(o.chunk_cache_mib) << 20);
  // The tiers under the prefix cache, nearest first: the local disk, then a shared Redis.
  std::vector<std::unique_ptr<tiers::Tier>> stack;
  if (!o.disk_cache_dir.empty()) {
    if (!e->prefix_)
      return InvalidArgument("--disk-cache needs the prefix cache (drop --no-prefix-cache)");
    if (o.disk_cache_mib < 0) return InvalidArgument("--disk-cache-mib must be >= 0");
    tiers::DiskTierOptions d;
    d.dir = o.disk_cache_dir;
    d.capacity_bytes = uint64_t(o.disk_cache_mib > 0 ? o.disk_cache_mib : 4096) << 20;
    CACHET_ASSIGN_OR_RETURN(std::unique_ptr<tiers::DiskTier> disk, tiers::DiskTier::Open(d));
    stack.push_back(std::move(disk));
  }
  if (!o.redis_url.empty()) {
    if (!e->prefix_)
      return InvalidArgument("--redis needs the prefix cache (drop --no-prefix-cache)");
    CACHET_ASSIGN_OR_RETURN(const tiers::RedisTierOptions r,
                            tiers::RedisOptionsFromUrl(o.redis_url));
    CACHET_ASSIGN_OR_RETURN(std::unique_ptr<tiers::RedisTier> redis, tiers::RedisTier::Open(r));
    stack.push_back(std::move(redis));
  }
  e->kv_namespace_ =
      std::make_unique<tiers::TierNamespace>(TierNamespaceOf(c, weights_hash, layout));
  if (!stack.empty()) {
    e->tiers_ = std::make_unique<tiers::KvTiers>(*e->kv_pool_, *e->kv_namespace_, std::move(stack),
                                                 o.tier_zstd);
    e->prefix_->set_tiers(e->tiers_.get());
  }
  return e;
}

Engine::~Engine() {
  prefix_.reset();  // return their pages before the pool goes
  chunks_.reset();
}

const ModelConfig& Engine::config() const { return model_->config(); }

int64_t KvPoolMibFor(const ModelConfig& c, int page_tokens, int n_tokens, int sequences) {
  const KvLayout layout{c.n_layers, c.n_kv_heads, c.head_dim, page_tokens};
  const double pages = double((n_tokens + page_tokens - 1) / page_tokens + 2);
  const double bytes =
      double(sequences) * layout.heads_total() * pages * double(layout.page_bytes());
  return static_cast<int64_t>(bytes / (1 << 20)) + 1;
}

int Engine::threads() const { return pool_->size(); }

int64_t Engine::weight_bytes_per_token() const {
  // All but the embedding, of which a step reads one row (unless it is the LM head too).
  int64_t total = 0;
  for (const MatrixInfo& m : weight_matrices()) {
    if (m.name != "token_embd" || config().tie_word_embeddings) total += m.bytes;
  }
  return total;
}

Engine::WeightResidency Engine::weight_residency() const {
  const Residency r = model_->weights().residency();
  return {r.resident_bytes, r.huge_page_bytes};
}

std::vector<Engine::MatrixInfo> Engine::weight_matrices() const {
  const ModelWeights& w = model_->weights();
  std::vector<MatrixInfo> out;
  auto add = [&](std::string name, const kernels::Matrix& m) {
    out.push_back({std::move(name), m.dtype, m.rows, m.cols, m.bytes()});
  };
  add("token_embd", w.embed);
  if (w.lm_head.data != w.embed.data) add("output", w.lm_head);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_q", L.wq);
    add(p + "attn_k", L.wk);
    add(p + "attn_v", L.wv);
    add(p + "attn_output", L.wo);
    add(p + "ffn_gate", L.w_gate);
    add(p + "ffn_up", L.w_up);
    add(p + "ffn_down", L.w_down);
  }
  return out;
}

bool Engine::ages() const { return !options_.kv_cold.empty() && !kv_pool_->layout().plain(); }

std::vector<std::string> Engine::IgnoredKvOptions() const {
  std::vector<std::string> out;
  if (!kv_pool_->layout().plain()) return out;
  if (!options_.kv_cold.empty()) out.push_back("--kv-cold " + options_.kv_cold);
  if (options_.kv_window > 0) out.push_back("--kv-window " + std::to_string(options_.kv_window));
  if (options_.kv_sinks > 0) out.push_back("--kv-sinks " + std::to_string(options_.kv_sinks));
  return out;
}

uint64_t Engine::SaltKey(std::string_view cache_salt) {
  return cache_salt.empty() ? 0 : XXH3_64bits(cache_salt.data(), cache_salt.size());
}

std::unique_ptr<Session> Engine::NewSession(std::string_view cache_salt) {
  auto seq = std::make_unique<PagedSequence>(*kv_pool_);
  if (ages()) {  // the cold pool made and checked by Create
    seq->set_cold_pool(ColdPool(options_.kv_cold).value(), 1.0);
    seq->set_age_out(options_.kv_cold_after);
  }
  return std::unique_ptr<Session>(new Session(*this, std::move(seq), SaltKey(cache_salt)));
}

Result<GenerateResult> Engine::Generate(std::string_view prompt, const GenerateOptions& options,
                                        const TextCallback& on_text, std::string_view cache_salt) {
  std::vector<int32_t> ids = tokenizer_->EncodePrompt(prompt);
  auto session = NewSession(cache_salt);
  return session->Generate(ids, options, on_text);
}

KvStats Engine::kv_stats() const {
  KvStats s;
  const PagePool& p = *kv_pool_;
  const KvLayout& lay = p.layout();
  s.page_bytes = static_cast<int64_t>(lay.page_bytes());
  s.page_tokens = lay.page_tokens;
  s.codec = lay.codec_name();
  s.bytes_per_token = double(lay.page_bytes()) * lay.heads_total() / lay.page_tokens;
  s.pages_total = p.capacity_pages();
  s.pages_used = p.used_pages();
  s.pages_free = p.free_pages();
  s.pages_high_water = p.high_water_pages();
  s.bytes_total = static_cast<int64_t>(p.capacity_bytes());
  s.bytes_used = static_cast<int64_t>(p.used_bytes());
  s.bytes_high_water = static_cast<int64_t>(p.high_water_bytes());
  s.bytes_by_codec = {{"f32", static_cast<int64_t>(p.raw_bytes_used())}};
  if (!lay.plain()) s.bytes_by_codec.emplace_back(s.codec, p.codec_bytes_used());
  for (const auto& [name, pool] : cold_pools_) {
    s.cold_bytes_used += static_cast<int64_t>(pool->used_bytes());
    s.bytes_by_codec.emplace_back("cold " + name, static_cast<int64_t>(pool->used_bytes()));
  }
  if (prefix_) {
    const PrefixStats& ps = prefix_->stats();
    s.pages_cached = prefix_->cached_pages();
    s.pages_reclaimable = prefix_->ReclaimablePages();
    s.prefix_lookups = ps.lookups;
    s.prefix_hits = ps.hits;
    s.prefix_misses = ps.lookups - ps.hits;
    s.prefix_hit_tokens = ps.hit_tokens;
    s.prefix_cached_blocks = prefix_->cached_blocks();
    s.evicted_blocks = ps.evicted_blocks;
    s.evicted_pages = ps.evicted_pages;
  }
  const ChunkCacheStats cs = chunks_->stats();
  s.chunk_entries = cs.entries;
  s.chunk_bytes = cs.bytes;
  s.chunk_lookups = cs.lookups;
  s.chunk_hits = cs.hits;
  s.chunk_evicted = cs.evicted;
  if (tiers_) {
    for (const tiers::TierReport& r : tiers_->Report()) {
      KvStats::Tier t;
      t.name = r.name;
      t.hits = r.stats.hits;
      t.misses = r.stats.misses;
      t.corrupt = r.stats.corrupt;
      t.errors = r.stats.errors;
      t.rejected = r.rejected;
      t.loaded_tokens = r.loaded_tokens;
      t.bytes_read = r.stats.bytes_read;
      t.bytes_written = r.stats.bytes_written;
      t.bytes_held = r.stats.bytes_held;
      t.entries = r.stats.entries;
      t.dropped = r.stats.dropped;
      s.tiers.push_back(std::move(t));
    }
  }
  return s;
}

Result<PagePool*> Engine::ColdPool(std::string_view codec, std::string_view flag) {
  // K[:V]: one codec for both, or the keys' and the values' apart (kvq3:kvq2).
  CACHET_ASSIGN_OR_RETURN(const codecs::CodecPair pair, codecs::ParseCodecPair(codec));
  const std::string name = codecs::PairName(pair);
  for (auto& [have, pool] : cold_pools_) {
    if (have == name) return pool.get();
  }
  KvLayout layout = kv_pool_->layout().Cold(pair);
  CACHET_RETURN_IF_ERROR(codecs::CheckDim(layout.codec_k, layout.head_dim));
  CACHET_RETURN_IF_ERROR(codecs::CheckDim(layout.codec_v, layout.head_dim));
  if ((codecs::IsCalibrated(layout.codec_k) || codecs::IsCalibrated(layout.codec_v)) &&
      !layout.calibration) {
    return InvalidArgument(std::string(flag) + " " + std::string(codec) +
                           " needs a calibration of this model: --kv-calibration FILE (make one "
                           "with `cachet calibrate`)");
  }
  AddRopeTable(config(), n_ctx_, &layout);
  if (layout.staged()) {
    return InvalidArgument(std::string(flag) + " " + std::string(codec) +
                           ": cold tokens are appended one by one, so the cold codec must be "
                           "row-wise (not kivi4 or kivi2, whose keys are encoded per page)");
  }
  cold_pools_.emplace_back(name, std::make_unique<PagePool>(layout, kv_pool_->capacity_bytes()));
  return cold_pools_.back().second.get();
}

void Engine::ClearPrefixCache() {
  if (prefix_) prefix_->Clear();
  chunks_->Clear();
}

std::string KvStats::ToString() const {
  std::ostringstream o;
  const double mib = 1.0 / (1 << 20);
  o << "[kv] codec " << codec << ", " << bytes_per_token << " bytes/token; pages: " << pages_used
    << " used, " << pages_free << " free of " << pages_total << " (" << page_tokens << " tokens, "
    << page_bytes << " B each); high water " << pages_high_water << " pages ("
    << bytes_high_water * mib << " MiB)\n";
  o << "[kv] bytes in use: " << bytes_used * mib << " MiB";
  for (const auto& [codec, bytes] : bytes_by_codec)
    o << "; " << codec << " " << bytes * mib << " MiB";
  o << "\n[kv] prefix cache: " << prefix_cached_blocks << " blocks, " << pages_cached << " pages ("
    << pages_reclaimable << " reclaimable); lookups " << prefix_lookups << ", hits " << prefix_hits
    << ", misses " << prefix_misses << ", hit tokens " << prefix_hit_tokens << "; evicted "
    << evicted_blocks << " blocks / " << evicted_pages << " pages\n";
  if (chunk_lookups > 0) {
    o << "[kv] chunk cache: " << chunk_entries << " chunks, " << chunk_bytes * mib
      << " MiB; lookups " << chunk_lookups << ", hits " << chunk_hits << ", evicted "
      << chunk_evicted << "\n";
  }
  for (const Tier& t : tiers) {
    o << "[kv] " << t.name << " tier: " << t.entries << " runs, " << t.bytes_held * mib
      << " MiB; hits " << t.hits << ", misses " << t.misses << ", corrupt " << t.corrupt
      << ", errors " << t.errors << ", rejected " << t.rejected << "; served " << t.loaded_tokens
      << " tokens; read " << t.bytes_read * mib << " MiB, wrote " << t.bytes_written * mib
      << " MiB, dropped " << t.dropped << " runs\n";
  }
  return o.str();
}

}  // namespace cachet
