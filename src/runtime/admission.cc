// Runtime (src/runtime/scheduler.cc): which waiting requests a step admits. A request is admitted
// while the pool, less what the running requests have yet to take, holds the most pages it will
// hold itself (its prompt, or a pressed one's prompt until the press); among the next few in line
// a longer cached prefix goes first, and one whose prompt shares more blocks with a prompt being
// computed than the prefix cache holds waits for it to be published.
#include <algorithm>
#include <cmath>
#include <mutex>

#include "cachet/serving.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "runtime/engine_access.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"

namespace cachet {

// Pages (every layer and KV head) that `tokens` tokens fill.
int64_t Runtime::Impl::Pages(int64_t tokens) const {
  const KvLayout& lay = EngineAccess::kv_pool(*engine).layout();
  return (tokens + lay.page_tokens - 1) / lay.page_tokens * lay.heads_total();
}

// Tokens per (layer, KV head) that a pressed request keeps of its prompt (Quest keeps them all).
int64_t Runtime::Impl::Kept(const Request& q) {
  const press::PressOptions& o = *q.r.press;
  if (o.quest) return q.n_prompt;
  const int64_t kept =
      o.budget > 0 ? o.budget : std::llround((1.0 - o.ratio) * static_cast<double>(q.n_prompt));
  return std::min<int64_t>(kept, q.n_prompt);
}

// The most pages request q holds while its tokens are (re)computed, the first sampled one
// included, with `cached` of them already held from the prefix cache. A pressed request holds
// its whole prompt until the press, then what the press kept plus the tokens after the prompt
// (plus a partial page per table: per-head budgets differ); after_press: only the latter.
int64_t Runtime::Impl::PeakPages(const Request& q, int cached, bool after_press) const {
  const int64_t n = static_cast<int64_t>(q.tokens.size());
  // A fork holds its cache's pages already: it takes pages for its own tokens and a copy of each
  // table's partly filled last page.
  if (q.base) return Pages(n - q.context + 1) + heads_total;
  // Pressed to fit: never more than the context (one token set for every table).
  if (q.r.fit) return Pages(std::min<int64_t>(n, engine->n_ctx() - 1) + 1);
  if (!q.r.press) return Pages(n - cached + 1);
  const int64_t after =
      Pages(Kept(q) + n - q.n_prompt + 1) + EngineAccess::kv_pool(*engine).layout().heads_total();
  return after_press ? after : std::max(Pages(q.n_prompt + 1), after);
}

// Pages a running request has yet to take before it decodes (the rest of its prompt, or of what
// a preempted request recomputes). Admission keeps them free: a request admitted while others
// are still prefilling must not take the pages their prompts were admitted with.
int64_t Runtime::Impl::Outstanding(const Request& q) const {
  if (q.evaluated + 1 >= static_cast<int>(q.tokens.size())) return 0;  // decoding
  if (q.base) return Pages(static_cast<int64_t>(q.tokens.size()) - q.evaluated + 1) + heads_total;
  const bool pressed = q.r.press && q.evaluated >= q.n_prompt;
  const int64_t held = EngineAccess::kv(*q.session).pages_held();
  return std::max<int64_t>(0, PeakPages(q, 0, pressed) - held);
}

int Runtime::Impl::Cached(const Request& q) const {
  PrefixTree* tree = EngineAccess::prefix(*engine);
  if (tree == nullptr || q.r.press || q.r.fit || q.base) return 0;
  return tree->Match(q.tokens, q.salt, static_cast<int>(q.tokens.size()) - 1);
}

// Whether q should wait for a running request that is computing a prompt sharing at least one
// more block with q's than the prefix cache holds now (requests on one system prompt, the `n`
// choices of one request): that prompt is published when it is done, and q then reuses it
// instead of computing the same blocks beside it.
bool Runtime::Impl::AwaitsSharedPrefill(const Request& q, int cached) const {
  if (!Publishes(q) || EngineAccess::prefix(*engine) == nullptr) {
    return false;
  }
  const int pt = EngineAccess::kv_pool(*engine).layout().page_tokens;
  for (const auto& r : running) {
    if (!Publishes(*r) || r->salt != q.salt || r->evaluated >= r->n_prompt) continue;
    const size_t n = std::min<size_t>(q.tokens.size() - 1, r->n_prompt);
    const auto end = q.tokens.begin() + static_cast<std::ptrdiff_t>(n);
    const int shared = static_cast<int>(
        std::mismatch(q.tokens.begin(), end, r->tokens.begin()).first - q.tokens.begin());
    if (shared / pt * pt >= cached + pt) return true;
  }
  return false;
}

void Runtime::Impl::Admit() {
  constexpr size_t kLookahead = 8;  // FCFS among the next few, a longer cached prefix first
  while (!waiting.empty() && static_cast<int>(running.size()) < opt.max_sequences) {
    size_t best = 0;
    int best_cached = -1;
    for (size_t i = 0; i < std::min(kLookahead, waiting.size()); ++i) {
      const int c = Cached(*waiting[i]);
      if (c > best_cached && !AwaitsSharedPrefill(*waiting[i], c)) {
        best = i;
        best_cached = c;
      }
    }
    if (best_cached < 0) break;  // each waits for a prompt being computed: admit it after
    Request& q = *waiting[best];
    const PagePool& pool = EngineAccess::kv_pool(*engine);
    PrefixTree* tree = EngineAccess::prefix(*engine);
    int64_t available = pool.free_pages() + (tree != nullptr ? tree->ReclaimablePages() : 0);
    for (const auto& r : running) available -= Outstanding(*r);
    if (PeakPages(q, best_cached) > available && !running.empty()) break;
    q.session = q.base ? q.base->Fork() : engine->NewSession(q.r.cache_salt);
    if (q.base) {
      q.evaluated = q.context;  // the cache's pages: no prefix lookup, no press
    } else if (!q.r.chunks.empty() || q.r.fit) {
      if (Status s = q.r.fit ? EvalFitted(q) : EvalChunks(q); !s.ok()) {
        std::unique_ptr<Request> failed = std::move(waiting[best]);
        waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(best));
        {
          std::lock_guard<std::mutex> lock(mu);
          --queued;
        }
        failed->session.reset();
        Finish(*failed, "error", s);
        continue;
      }
    } else if (q.r.press) {
      // Observed up to the end of the prompt: a preempted request recomputes its prompt, is
      // pressed there again, then recomputes the tokens it had generated.
      q.session->PrepareForPress(*q.r.press, q.n_prompt);
    } else if (tree != nullptr) {
      Session& s = *q.session;
      std::vector<int> from_tier;
      const int reused =
          tree->Lookup(q.tokens, EngineAccess::salt(s), static_cast<int>(q.tokens.size()) - 1,
                       EngineAccess::kv(s), &from_tier);
      EngineAccess::tokens(s).assign(q.tokens.begin(), q.tokens.begin() + reused);
      q.evaluated = reused;
      if (!q.ever_admitted) q.cached = reused;
      std::lock_guard<std::mutex> lock(mu);
      metrics.prefix_query_tokens += static_cast<int64_t>(q.tokens.size());
      metrics.prefix_hit_tokens += reused;
      if (tier_tokens.size() < from_tier.size()) tier_tokens.resize(from_tier.size(), 0);
      for (size_t t = 0; t < from_tier.size(); ++t) tier_tokens[t] += from_tier[t];
    }
    if (!q.ever_admitted) {
      q.sampler = std::make_unique<Sampler>(q.r.sampling, vocab, &engine->tokenizer());
      q.decoder = std::make_unique<StreamDecoder>(engine->tokenizer());
      q.logits.resize(vocab);
      q.ever_admitted = true;
    }
    q.admitted_order = admissions++;
    running.push_back(std::move(waiting[best]));
    waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(best));
    std::lock_guard<std::mutex> lock(mu);
    --queued;
  }
}

}  // namespace cachet
