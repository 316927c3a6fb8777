// Runtime's methods (include/cachet/serving.h): what other threads call. They check and queue
// requests and commands for the scheduler thread (scheduler.cc) and read the snapshots it
// publishes; none touches a session.
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "cachet/serving.h"
#include "runtime/engine_access.h"
#include "runtime/scheduler.h"

namespace cachet {

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeOptions& options) {
  if (options.max_sequences < 1) return InvalidArgument("-np must be >= 1");
  if (options.batch_tokens < 1) return InvalidArgument("--batch-tokens must be >= 1");
  if (options.max_waiting < 0) return InvalidArgument("max_waiting must be >= 0");
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  EngineOptions eo = options.engine;
  eo.ubatch = std::max(eo.ubatch, options.batch_tokens);  // one step is one ForwardBatch
  CACHET_ASSIGN_OR_RETURN(impl->engine, Engine::Create(eo));
  impl->vocab = impl->engine->config().vocab_size;
  impl->heads_total = int64_t{impl->engine->config().n_layers} * impl->engine->config().n_kv_heads;
  std::string cache_dir = options.cache_dir;
  if (cache_dir.empty() && !eo.disk_cache_dir.empty()) cache_dir = eo.disk_cache_dir + "/caches";
  std::unique_ptr<tiers::RedisTier> cache_redis;  // its own connections, beside the tier's
  if (!eo.redis_url.empty()) {
    CACHET_ASSIGN_OR_RETURN(const tiers::RedisTierOptions r,
                            tiers::RedisOptionsFromUrl(eo.redis_url));
    CACHET_ASSIGN_OR_RETURN(cache_redis, tiers::RedisTier::Open(r));
  }
  if (options.cache_mem_bytes < 0) return InvalidArgument("--cache-mem-mib must be >= 0");
  const int64_t cache_mem =
      options.cache_mem_bytes > 0
          ? options.cache_mem_bytes
          : static_cast<int64_t>(EngineAccess::kv_pool(*impl->engine).capacity_bytes() / 2);
  impl->caches = std::make_unique<CacheRegistry>(cache_dir, std::move(cache_redis), cache_mem);
  impl->Publish();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

Status Runtime::Impl::Check(const CompletionRequest& request) const {
  const Impl& m = *this;
  if (request.prompt.empty()) return InvalidArgument("prompt: empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= m.vocab) {
      return InvalidArgument("prompt: token id " + std::to_string(request.prompt[i]) +
                             " at index " + std::to_string(i) + " is outside the vocabulary [0, " +
                             std::to_string(m.vocab) + ")");
    }
  }
  if (request.max_tokens < 1) return InvalidArgument("max_tokens: must be >= 1");
  if (request.press && !request.cache_id.empty()) {
    return InvalidArgument(
        "kv_press: not with cache_id (the cache was compressed when it was made)");
  }
  if (request.press) {
    const press::PressOptions& p = *request.press;
    if (!(p.ratio >= 0 && p.ratio < 1) || p.budget < 0) {
      return InvalidArgument("press: the ratio must be in [0, 1) and the budget >= 0");
    }
    if (p.decode_every > 0) {
      return InvalidArgument("press: pressing again while decoding (decode_every) is not served");
    }
  }
  if (!request.chunks.empty() && (request.press || !request.cache_id.empty())) {
    return InvalidArgument("chunks: not with kv_press or cache_id");
  }
  if (request.fit && (request.press || !request.cache_id.empty() || !request.chunks.empty())) {
    return InvalidArgument("a prompt pressed to fit: not with kv_press, cache_id or chunks");
  }
  for (size_t i = 0, last = 0; i < request.chunks.size(); ++i) {
    const auto [begin, end] = request.chunks[i];
    if (begin < static_cast<int64_t>(last) || end <= begin ||
        end > static_cast<int64_t>(request.prompt.size())) {
      return InvalidArgument("chunks[" + std::to_string(i) + "]: [" + std::to_string(begin) + ", " +
                             std::to_string(end) +
                             ") is not a range of the prompt after the chunk before it");
    }
    last = static_cast<size_t>(end);
  }
  const int n_ctx = m.engine->n_ctx();
  // A prompt pressed to fit holds the context at most; its protected part, last turn and reply
  // must fit (EvalFitting says so again at admission, as a failed request).
  int64_t held = static_cast<int64_t>(request.prompt.size());
  if (request.fit) {
    const FitOptions& f = *request.fit;
    if (f.protect < 0 || f.tail < f.protect || f.tail >= held || f.reserve < 0 ||
        int64_t{f.protect} + (held - f.tail) + f.reserve >= n_ctx) {
      return InvalidArgument("prompt: its first " + std::to_string(f.protect) +
                             " tokens and last " + std::to_string(held - f.tail) +
                             " with room for " + std::to_string(f.reserve) +
                             " more do not fit in the context of " + std::to_string(n_ctx) +
                             ", however much the history is pressed");
    }
    held = std::min<int64_t>(held, n_ctx - 1);
  } else if (held >= n_ctx) {
    return InvalidArgument("prompt: " + std::to_string(request.prompt.size()) +
                           " tokens leave no room in the context of " + std::to_string(n_ctx));
  }
  const KvLayout& lay = EngineAccess::kv_pool(*m.engine).layout();
  const int64_t pages = (held + lay.page_tokens) / lay.page_tokens * lay.heads_total();
  if (pages > EngineAccess::kv_pool(*m.engine).capacity_pages()) {
    return InvalidArgument("prompt: " + std::to_string(request.prompt.size()) + " tokens need " +
                           std::to_string(pages) + " KV pages; the pool holds " +
                           std::to_string(EngineAccess::kv_pool(*m.engine).capacity_pages()) +
                           " (--kv-mem)");
  }
  return OkStatus();
}

Result<uint64_t> Runtime::Impl::Queue(std::unique_ptr<Request> q) {
  Impl& m = *this;
  q->tokens = q->r.prompt;
  q->n_prompt = static_cast<int>(q->tokens.size());
  q->arrival = Clock::now();
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.live >= m.opt.max_sequences + m.opt.max_waiting) {
      return ResourceExhausted("too many requests (" + std::to_string(m.live) +
                               " running or waiting: -np + --max-waiting)");
    }
    id = q->id = m.next_id++;
    ++m.queued;
    ++m.live;
    m.incoming.push_back(std::move(q));
  }
  m.cv.notify_all();
  return id;
}

void Runtime::Impl::OnScheduler(const std::function<void()>& fn) {
  Impl& m = *this;
  std::promise<void> done;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.commands.push_back([&] {
      fn();
      done.set_value();
    });
  }
  m.cv.notify_all();
  done.get_future().wait();
}

Result<uint64_t> Runtime::Submit(CompletionRequest request, EventCallback on_event) {
  CACHET_RETURN_IF_ERROR(impl_->Check(request));
  auto q = std::make_unique<Impl::Request>();
  q->r = std::move(request);
  q->on_event = std::move(on_event);
  return impl_->Queue(std::move(q));
}

Result<uint64_t> Runtime::CreateCache(KvCacheRequest request, CacheCallback on_done) {
  auto q = std::make_unique<Impl::Request>();
  q->r.prompt = std::move(request.prompt);
  q->r.max_tokens = 1;
  q->r.cache_salt = std::move(request.cache_salt);
  q->r.press = std::move(request.press);
  CACHET_RETURN_IF_ERROR(impl_->Check(q->r));
  q->note = std::move(request.note);
  q->on_cache = std::move(on_done);
  return impl_->Queue(std::move(q));
}

Result<KvCacheInfo> Runtime::FindCache(const std::string& id, const std::string& cache_salt) {
  CacheRegistry& caches = *impl_->caches;
  if (auto info = caches.Resident(id, cache_salt)) return *info;
  if (!caches.has_store() || !IsCacheId(id)) {
    return NotFound("cache_id: no cache '" + id + "' (it was never made, was deleted, or has " +
                    "another cache_salt)");
  }
  Status loaded;
  impl_->OnScheduler([&] {
    loaded = caches.Get(*impl_->engine, id, cache_salt).status();
    impl_->Publish();
  });
  CACHET_RETURN_IF_ERROR(loaded);
  if (auto info = caches.Resident(id, cache_salt)) return *info;
  return NotFound("cache_id: the cache '" + id + "' was deleted as it was loaded");
}

Status Runtime::DeleteCache(const std::string& id, const std::string& cache_salt) {
  Status s;
  impl_->OnScheduler([&] {
    s = impl_->caches->Remove(id, cache_salt);
    impl_->Publish();
  });
  return s;
}

std::vector<KvCacheInfo> Runtime::ListCaches(const std::string& cache_salt) const {
  return impl_->caches->List(cache_salt);
}
void Runtime::Cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->cancels.insert(id);
  }
  impl_->cv.notify_all();
}

RuntimeMetrics Runtime::Metrics() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->metrics;
}

KvStats Runtime::kv_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->kv;
}

void Runtime::ClearPrefixCache() {
  impl_->OnScheduler([&] {
    impl_->engine->ClearPrefixCache();
    impl_->Publish();
  });
}

const Tokenizer& Runtime::tokenizer() const { return impl_->engine->tokenizer(); }
const ModelConfig& Runtime::config() const { return impl_->engine->config(); }
int Runtime::n_ctx() const { return impl_->engine->n_ctx(); }
int Runtime::threads() const { return impl_->engine->threads(); }
int Runtime::max_requests() const { return impl_->opt.max_sequences + impl_->opt.max_waiting; }

}  // namespace cachet
