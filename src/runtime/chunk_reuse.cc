// Session::EvalChunked: chunks of a prompt reused from the chunk cache at any position, keys
// re-rotated, and blended (docs/REUSE.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>

#include "cachet/engine.h"
#include "kernels/kernels.h"
#include "kv/chunk_cache.h"
#include "kv/compaction.h"
#include "runtime/engine_access.h"
#include "util/clock.h"

namespace cachet {
namespace {

struct Part {
  std::vector<int32_t> tokens;
  bool chunk = false;
};

// What a prompt starts with before its text: the model's BOS, when its tokenizer adds one.
std::vector<int32_t> Lead(const Tokenizer& tok) {
  if (tok.add_bos() && tok.bos_id() >= 0) return {tok.bos_id()};
  return {};
}

// Tokens through the model at positions from `at` on, in ubatch pieces, their K/V into kv; no
// logits. Room must be reserved.
Status ForwardAt(Engine& e, std::span<const int32_t> tokens, int32_t at, KvSequence& kv,
                 int kv_only_layer = -1, float* hidden = nullptr) {
  Transformer& model = EngineAccess::model(e);
  const int ub = e.options().ubatch;
  std::vector<int32_t> pos;
  for (size_t start = 0; start < tokens.size(); start += ub) {
    const size_t n = std::min<size_t>(ub, tokens.size() - start);
    pos.resize(n);
    std::iota(pos.begin(), pos.end(), at + static_cast<int32_t>(start));
    const SeqChunk one{&kv, tokens.subspan(start, n), pos, nullptr, false};
    LayerRange layers;
    layers.kv_only = kv_only_layer;
    if (hidden) layers.x_out = hidden + start * size_t(model.config().hidden_size);
    CACHET_RETURN_IF_ERROR(
        model.ForwardBatch(std::span<const SeqChunk>(&one, 1), EngineAccess::threads(e), layers));
  }
  return OkStatus();
}

// The chunk's entry: from the cache, or computed on its own (after BOS) and cached. It is
// computed as a prompt of BOS and the chunk, which is exactly what the prefix cache holds for such
// a prompt: its full blocks come from the prefix cache and its disk and Redis tiers when they hold
// them (another process computed the chunk), and go to them otherwise.
Result<std::shared_ptr<const ChunkEntry>> EntryOf(Engine& e, ChunkCache& cache, uint64_t salt,
                                                  std::span<const int32_t> tokens,
                                                  ChunkReuseStats& stats) {
  if (auto hit = cache.Find(salt, tokens)) {
    ++stats.chunk_hits;
    stats.hit_tokens += static_cast<int>(tokens.size());
    return hit;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto entry = std::make_shared<ChunkEntry>();
  entry->tokens.assign(tokens.begin(), tokens.end());
  std::vector<int32_t> ids = Lead(e.tokenizer());
  entry->lead = static_cast<int>(ids.size());
  ids.insert(ids.end(), tokens.begin(), tokens.end());
  std::unique_ptr<Session> alone = EngineAccess::NewSession(e, salt);
  const PrefixTree* tree = EngineAccess::prefix(e);
  const int64_t before = tree != nullptr ? tree->stats().hit_tokens : 0;
  CACHET_RETURN_IF_ERROR(alone->Eval(ids, nullptr));
  stats.prefix_tokens +=
      static_cast<int>((tree != nullptr ? tree->stats().hit_tokens : 0) - before);
  entry->seq = EngineAccess::kv(*alone).Fork();
  cache.Insert(salt, entry);
  ++stats.chunk_misses;
  stats.chunk_compute_ms += MsSince(t0);
  return std::shared_ptr<const ChunkEntry>(std::move(entry));
}

// Tokens [from, size) of a chunk's entry appended to `into` at positions at, at + 1, ..., keys
// re-rotated by the difference to the position they were computed at (one angle for them all,
// as RerotateKey computes it).
Status Splice(const ChunkEntry& e, int from, PagedSequence& into, int32_t at,
              std::span<const float> inv_freq) {
  const KvLayout& lay = into.layout();
  const int n = static_cast<int>(e.tokens.size()) - from, hd = lay.head_dim, half = hd / 2;
  if (n <= 0) return OkStatus();
  CACHET_RETURN_IF_ERROR(into.Reserve(n));
  const int32_t delta = at - from - e.lead;
  std::vector<float> cs;
  RopeShift(hd, delta, inv_freq, &cs);
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  const size_t first = size_t(e.lead + from) * hd;
  for (int l = 0; l < lay.n_layers; ++l) {
    for (int h = 0; h < lay.n_kv_heads; ++h) {
      e.seq->Gather(l, h, &k, &v, &pos);  // every token of an entry: row r holds position r
      if (delta != 0) kernels::RopeRotateHalf(k.data() + first, n, hd, cs.data(), cs.data() + half);
      for (int i = 0; i < n; ++i) {
        into.Append(l, h, k.data() + first + size_t(i) * hd, v.data() + first + size_t(i) * hd,
                    at + i);
      }
    }
  }
  into.CommitTokens(n);
  return OkStatus();
}

// CacheBlend's passes over a private f32 copy of the sequence: the K/V rows of the tokens given
// are written over in place, except at check_layer (>= 0), where their squared deviation from the
// rows there is summed per token instead (and the pass stops: LayerRange::kv_only).
class Recompute final : public KvSequence {
 public:
  Recompute(PagedSequence& work, const std::vector<int32_t>& first_row, int32_t p0, int check_layer,
            std::vector<double>* deviation)
      : work_(work),
        first_row_(first_row),
        p0_(p0),
        check_layer_(check_layer),
        deviation_(deviation) {}
  Status Reserve(int) override { return OkStatus(); }
  void Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) override {
    const int row = first_row_[layer * work_.layout().n_kv_heads + kv_head] + (pos - p0_);
    if (layer != check_layer_) {
      work_.OverwriteRow(layer, kv_head, row, k, v);
      return;
    }
    const float* old_k = work_.RawKey(layer, kv_head, row);
    const float* old_v = work_.RawValue(layer, kv_head, row);
    double d = 0;
    for (int j = 0; j < work_.layout().head_dim; ++j) {
      d +=
          double(k[j] - old_k[j]) * (k[j] - old_k[j]) + double(v[j] - old_v[j]) * (v[j] - old_v[j]);
    }
    (*deviation_)[pos - p0_] += d;
  }
  void SealAged(int) override {}
  void CommitTokens(int) override {}
  void Attend(int layer, int kv_head, const kernels::AttnBatch& batch) const override {
    work_.Attend(layer, kv_head, batch);
  }

 private:
  PagedSequence& work_;
  const std::vector<int32_t>& first_row_;
  int32_t p0_;
  int check_layer_;
  std::vector<double>* deviation_;
};

class ChunkReuse {
 public:
  ChunkReuse(Session& s, Engine& e, PagedSequence& seq, ChunkCache& cache, uint64_t salt,
             const BlendOptions& blend, ChunkReuseStats& stats)
      : s_(s), e_(e), seq_(seq), cache_(cache), salt_(salt), blend_(blend), stats_(stats) {
    inv_freq_ = e.config().RopeInvFreq();
  }

  // Parts from the first chunk on, the last one excluded when it is plain text, into seq_.
  Status Region(std::span<const Part> parts) {
    return blend_.kind == BlendOptions::Kind::kNone ? InPlace(parts) : Blended(parts);
  }

 private:
  // none: straight into the session's own cache.
  Status InPlace(std::span<const Part> parts) {
    for (const Part& p : parts) {
      const int32_t at = seq_.n_tokens();
      if (!p.chunk) {
        CACHET_RETURN_IF_ERROR(seq_.Reserve(static_cast<int>(p.tokens.size())));
        CACHET_RETURN_IF_ERROR(ForwardAt(e_, p.tokens, at, seq_));
        Commit(p.tokens);
        continue;
      }
      CACHET_ASSIGN_OR_RETURN(auto entry, EntryOf(e_, cache_, salt_, p.tokens, stats_));
      CACHET_RETURN_IF_ERROR(Splice(*entry, 0, seq_, at, inv_freq_));
      Commit(p.tokens);
    }
    return OkStatus();
  }

  // EPIC and CacheBlend: the region spliced into a private f32 copy of the sequence, the tokens
  // they pick recomputed there in one pass (their rows written over in place, each layer's before
  // that layer attends, so a picked token sees the picked ones before it as computed in context),
  // then copied back in the session's codecs.
  Status Blended(std::span<const Part> parts) {
    const KvLayout& lay = seq_.layout();
    const int32_t p0 = seq_.n_tokens();
    int region = 0;
    for (const Part& p : parts) region += static_cast<int>(p.tokens.size());
    KvLayout wl = lay;
    wl.codec_k = wl.codec_v = codecs::Codec::kF32;
    wl.sinks = wl.window = 0;
    const int64_t pages = (seq_.longest_head() + region + wl.page_tokens - 1) / wl.page_tokens + 1;
    PagePool pool(wl, size_t(wl.heads_total()) * pages * wl.raw_page_bytes());
    PagedSequence work(pool);
    // The tokens so far, decoded.
    std::vector<float> k, v;
    std::vector<int32_t> pos, first_row(wl.heads_total());
    CACHET_RETURN_IF_ERROR(work.Reserve(seq_.longest_head()));
    for (int l = 0; l < wl.n_layers; ++l) {
      for (int h = 0; h < wl.n_kv_heads; ++h) {
        seq_.Gather(l, h, &k, &v, &pos);
        for (size_t r = 0; r < pos.size(); ++r) {
          work.Append(l, h, k.data() + r * wl.head_dim, v.data() + r * wl.head_dim, pos[r]);
        }
        first_row[l * wl.n_kv_heads + h] = static_cast<int32_t>(pos.size());
      }
    }
    work.CommitTokens(p0);
    // The region as plain concatenation: chunks spliced, text computed over them.
    std::vector<int32_t> tokens;
    std::vector<int32_t> pick;  // EPIC: the first tokens of each chunk
    for (const Part& p : parts) {
      const int32_t at = p0 + static_cast<int32_t>(tokens.size());
      if (p.chunk && blend_.kind == BlendOptions::Kind::kEpic) {
        const int first = std::min<int>(blend_.epic_tokens, static_cast<int>(p.tokens.size()));
        for (int i = 0; i < first; ++i) pick.push_back(static_cast<int32_t>(tokens.size()) + i);
      }
      if (p.chunk) {
        CACHET_ASSIGN_OR_RETURN(auto entry, EntryOf(e_, cache_, salt_, p.tokens, stats_));
        CACHET_RETURN_IF_ERROR(Splice(*entry, 0, work, at, inv_freq_));
      } else {
        CACHET_RETURN_IF_ERROR(work.Reserve(static_cast<int>(p.tokens.size())));
        CACHET_RETURN_IF_ERROR(ForwardAt(e_, p.tokens, at, work));
      }
      tokens.insert(tokens.end(), p.tokens.begin(), p.tokens.end());
    }
    // Which tokens' K/V deviate most at the check layer from a computation in context.
    const int d = e_.config().hidden_size;
    std::vector<float> hidden;  // [region][d] entering the check layer, when it was measured
    const int check = std::clamp(blend_.check_layer, 1, std::max(1, wl.n_layers - 1));
    const int n_pick =
        std::clamp(static_cast<int>(std::lround(blend_.recompute * region)), 0, region);
    if (blend_.kind == BlendOptions::Kind::kEpic) {
      // picked above
    } else if (n_pick == region) {
      pick.resize(region);
      std::iota(pick.begin(), pick.end(), 0);
    } else if (n_pick > 0) {
      std::vector<double> deviation(region, 0.0);
      Recompute measure(work, first_row, p0, check, &deviation);
      // The hidden states entering the check layer too: the picked tokens start there.
      hidden.resize(size_t(region) * d);
      CACHET_RETURN_IF_ERROR(ForwardAt(e_, tokens, p0, measure, check, hidden.data()));
      pick.resize(region);
      std::iota(pick.begin(), pick.end(), 0);
      std::nth_element(pick.begin(), pick.begin() + n_pick, pick.end(), [&](int32_t a, int32_t b) {
        return deviation[a] > deviation[b] || (deviation[a] == deviation[b] && a < b);
      });
      pick.resize(n_pick);
      std::sort(pick.begin(), pick.end());
    }
    // The picked tokens through every layer, in position order, over the rows as they stand;
    // from the check layer on when the measuring pass left their hidden states there (the layers
    // before it were computed in context for every token already).
    if (!pick.empty()) {
      Recompute rewrite(work, first_row, p0, -1, nullptr);
      const Transformer& model = EngineAccess::model(e_);
      const int ub = std::min(e_.options().ubatch, model.max_batch());
      std::vector<int32_t> ids, at;
      std::vector<float> x;
      for (size_t start = 0; start < pick.size(); start += ub) {
        const size_t n = std::min<size_t>(ub, pick.size() - start);
        ids.resize(n);
        at.resize(n);
        x.resize(hidden.empty() ? 0 : n * d);
        for (size_t i = 0; i < n; ++i) {
          ids[i] = tokens[pick[start + i]];
          at[i] = p0 + pick[start + i];
          if (!hidden.empty()) {
            std::copy_n(hidden.data() + size_t(pick[start + i]) * d, d, x.data() + i * d);
          }
        }
        const SeqChunk one{&rewrite, ids, at, nullptr, false};
        LayerRange layers;
        if (!hidden.empty()) {
          layers.first = check;
          layers.x_in = x.data();
        }
        CACHET_RETURN_IF_ERROR(EngineAccess::model(e_).ForwardBatch(
            std::span<const SeqChunk>(&one, 1), EngineAccess::threads(e_), layers));
      }
    }
    stats_.recomputed_tokens += static_cast<int>(pick.size());
    // Back into the session's cache, in its own codecs.
    CACHET_RETURN_IF_ERROR(seq_.Reserve(region));
    for (int l = 0; l < wl.n_layers; ++l) {
      for (int h = 0; h < wl.n_kv_heads; ++h) {
        const int32_t first = first_row[l * wl.n_kv_heads + h];
        for (int i = 0; i < region; ++i) {
          seq_.Append(l, h, work.RawKey(l, h, first + i), work.RawValue(l, h, first + i), p0 + i);
        }
      }
    }
    seq_.CommitTokens(region);
    Commit(tokens);
    return OkStatus();
  }

  // The session's token list follows what its cache holds now.
  void Commit(std::span<const int32_t> tokens) {
    auto& all = EngineAccess::tokens(s_);
    all.insert(all.end(), tokens.begin(), tokens.end());
  }

  Session& s_;
  Engine& e_;
  PagedSequence& seq_;
  ChunkCache& cache_;
  uint64_t salt_;
  const BlendOptions& blend_;
  ChunkReuseStats& stats_;
  std::vector<float> inv_freq_;
};

}  // namespace

Status Session::EvalChunked(std::span<const PromptPart> parts_in, const BlendOptions& blend,
                            std::vector<float>* logits, ChunkReuseStats* stats_out) {
  ChunkReuseStats stats;
  const int vocab = engine_.config().vocab_size;
  // The parts, the pending token of a Generate first; empty ones dropped.
  std::vector<Part> parts;
  if (!pending_.empty()) parts.push_back({pending_, false});
  int64_t total = 0;
  for (size_t i = 0; i < parts_in.size(); ++i) {
    const PromptPart& p = parts_in[i];
    for (size_t j = 0; j < p.tokens.size(); ++j) {
      if (p.tokens[j] < 0 || p.tokens[j] >= vocab) {
        return InvalidArgument("prompt part " + std::to_string(i) + ": token id " +
                               std::to_string(p.tokens[j]) + " at index " + std::to_string(j) +
                               " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    if (p.chunk) stats.chunk_tokens += static_cast<int>(p.tokens.size());
    total += static_cast<int64_t>(p.tokens.size());
    if (!p.tokens.empty()) parts.push_back({{p.tokens.begin(), p.tokens.end()}, p.chunk});
  }
  stats.prompt_tokens = static_cast<int>(total);
  if (n_tokens() + total + static_cast<int64_t>(pending_.size()) > engine_.n_ctx()) {
    return OutOfRange("context full: " + std::to_string(n_tokens()) + " + " +
                      std::to_string(total + pending_.size()) + " tokens exceed n_ctx " +
                      std::to_string(engine_.n_ctx()));
  }
  if (parts.empty()) return Eval({}, logits);
  if (observer_) {
    return FailedPrecondition("chunk reuse while observing for a press: press after it instead");
  }
  if (blend.kind != BlendOptions::Kind::kNone && seq_->cold_bytes_held() > 0) {
    return FailedPrecondition(
        "blending after a press that demoted tokens (their cold pages are "
        "not in the copy blending recomputes over): blend none, or press "
        "after");
  }
  const int n0 = n_tokens();
  const std::vector<float> logits0 = last_logits_;
  const std::vector<int32_t> pending0 = pending_;
  pending_.clear();
  auto fail = [&](Status s) {
    if (n_tokens() > n0) (void)Truncate(n0);
    last_logits_ = logits0;
    pending_ = pending0;
    return s;
  };
  // Plain text before the first chunk, as any prompt (the prefix cache serves it).
  size_t first = 0;
  std::vector<int32_t> head;
  for (; first < parts.size() && !parts[first].chunk; ++first) {
    head.insert(head.end(), parts[first].tokens.begin(), parts[first].tokens.end());
  }
  // A chunk right after BOS in a fresh session is a prefix: its entry was computed as exactly that
  // prompt and published, so the prefix cache serves it with the entry's own pages, shared rather
  // than copied (many requests on one document hold it once), and its K/V exact.
  if (engine_.prefix_ && tokens_.empty() && first < parts.size() &&
      head == Lead(engine_.tokenizer())) {
    CACHET_ASSIGN_OR_RETURN(auto entry,
                            EntryOf(engine_, *engine_.chunks_, salt_, parts[first].tokens, stats));
    for (head.insert(head.end(), entry->tokens.begin(), entry->tokens.end());
         ++first < parts.size() && !parts[first].chunk;) {
      head.insert(head.end(), parts[first].tokens.begin(), parts[first].tokens.end());
    }
  }
  const bool chunk_last = parts.back().chunk;
  const size_t end = chunk_last ? parts.size() : parts.size() - 1;
  if (first >= end) {  // no chunk left to splice
    Status s = Eval(head, logits);
    if (s.ok() && stats_out) *stats_out = stats;
    return s.ok() ? s : fail(s);
  }
  if (!head.empty()) {
    if (Status s = Eval(head, nullptr); !s.ok()) return fail(s);
  }
  seq_->MarkInexactFrom(n_tokens());
  ChunkReuse reuse(*this, engine_, *seq_, *engine_.chunks_, salt_, blend, stats);
  if (Status s = reuse.Region(std::span(parts).subspan(first, end - first)); !s.ok()) {
    return fail(s);
  }
  // The last token is computed in place for its logits: the last chunk's redone, or the text.
  std::vector<int32_t> tail;
  if (chunk_last) {
    tail.push_back(tokens_.back());
    if (Status s = Truncate(n_tokens() - 1); !s.ok()) return fail(s);
  } else {
    tail = parts.back().tokens;
  }
  if (Status s = Eval(tail, logits); !s.ok()) return fail(s);
  if (stats_out) *stats_out = stats;
  return OkStatus();
}

}  // namespace cachet
