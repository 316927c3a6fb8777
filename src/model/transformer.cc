#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "kernels/kernels.h"
#include "model/gguf_model.h"

namespace cachet {

Transformer::Transformer(ModelConfig config, ModelWeights weights, int max_batch)
    : config_(std::move(config)), weights_(std::move(weights)), max_batch_(max_batch) {
  const ModelConfig& c = config_;
  const size_t b = static_cast<size_t>(max_batch_);
  inv_freq_ = c.RopeInvFreq();
  x_.resize(b * c.hidden_size);
  xn_.resize(b * c.hidden_size);
  q_.resize(b * c.n_heads * c.head_dim);
  k_.resize(b * c.n_kv_heads * c.head_dim);
  v_.resize(b * c.n_kv_heads * c.head_dim);
  attn_.resize(b * c.n_heads * c.head_dim);
  gate_.resize(b * c.intermediate_size);
  up_.resize(b * c.intermediate_size);
  rope_.resize(b * c.head_dim);  // cos then sin, head_dim / 2 each, per token
}

Result<std::unique_ptr<Transformer>> Transformer::Load(const std::string& dir, int max_batch,
                                                       bool copy_weights) {
  if (IsGgufPath(dir)) {  // a single .gguf file instead of a HF directory
    CACHET_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(dir, copy_weights));
    CACHET_ASSIGN_OR_RETURN(ModelConfig config, GgufConfig(file));
    CACHET_ASSIGN_OR_RETURN(TensorStore store, TensorStore::FromGguf(std::move(file)));
    CACHET_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Load(config, std::move(store)));
    return std::make_unique<Transformer>(std::move(config), std::move(weights), max_batch);
  }
  CACHET_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(dir));
  CACHET_ASSIGN_OR_RETURN(TensorStore store, TensorStore::OpenDir(dir, copy_weights));
  CACHET_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Load(config, std::move(store)));
  return std::make_unique<Transformer>(std::move(config), std::move(weights), max_batch);
}

namespace {

// Runs fn(i) for i in [0, n): on the pool in blocks when there is enough work, inline otherwise.
template <class Fn>
void ForEachToken(int n, ThreadPool& pool, Fn&& fn) {
  if (n < 8 || pool.size() == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  const int blocks = std::min(n, pool.size() * 4);
  pool.Run(blocks, [&](int64_t b, int) {
    const int lo = static_cast<int>(n * b / blocks), hi = static_cast<int>(n * (b + 1) / blocks);
    for (int i = lo; i < hi; ++i) fn(i);
  });
}

std::string Entry(size_t i) { return "ForwardBatch entry " + std::to_string(i) + ": "; }

}  // namespace

Status Transformer::Forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                            KvSequence& kv, ThreadPool& pool, float* logits, bool all_logits) {
  const SeqChunk one{&kv, tokens, positions, logits, all_logits};
  return ForwardBatch(std::span<const SeqChunk>(&one, 1), pool);
}

Status Transformer::ValidateBatch(std::span<const SeqChunk> seqs, int64_t* total) {
  const ModelConfig& c = config_;
  *total = 0;
  for (size_t e = 0; e < seqs.size(); ++e) {
    const SeqChunk& s = seqs[e];
    if (s.kv == nullptr) return InvalidArgument(Entry(e) + "no KV sequence");
    if (s.positions.size() != s.tokens.size()) {
      return InvalidArgument(Entry(e) + std::to_string(s.positions.size()) + " positions for " +
                             std::to_string(s.tokens.size()) + " tokens");
    }
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      if (s.tokens[i] < 0 || s.tokens[i] >= c.vocab_size) {
        return InvalidArgument(Entry(e) + "token id " + std::to_string(s.tokens[i]) + " at index " +
                               std::to_string(i) + " is outside the vocabulary [0, " +
                               std::to_string(c.vocab_size) + ")");
      }
    }
    *total += static_cast<int64_t>(s.tokens.size());
    if (*total > max_batch_) {
      return InvalidArgument(Entry(e) + "brings the step to " + std::to_string(*total) +
                             " tokens, over the batch of " + std::to_string(max_batch_) +
                             " (max_batch)");
    }
  }
  // One entry per sequence: sorted by sequence, a repeat is next to its first entry.
  kv_order_.clear();
  for (size_t e = 0; e < seqs.size(); ++e) kv_order_.emplace_back(seqs[e].kv, int(e));
  std::sort(kv_order_.begin(), kv_order_.end(), [](const auto& a, const auto& b) {
    return std::less<const KvSequence*>()(a.first, b.first) ||
           (a.first == b.first && a.second < b.second);
  });
  size_t repeat = seqs.size(), first = 0;  // the lowest entry index that repeats a sequence
  for (size_t k = 1; k < kv_order_.size(); ++k) {
    if (kv_order_[k].first == kv_order_[k - 1].first && size_t(kv_order_[k].second) < repeat) {
      repeat = kv_order_[k].second;
      first = kv_order_[k - 1].second;
    }
  }
  if (repeat < seqs.size()) {
    return InvalidArgument(Entry(repeat) + "its KV sequence is also entry " +
                           std::to_string(first) + "'s (one entry per sequence in a step)");
  }
  return OkStatus();
}

Status Transformer::ForwardBatch(std::span<const SeqChunk> seqs, ThreadPool& pool,
                                 const LayerRange& layers) {
  const ModelConfig& c = config_;
  // Validate everything before anything changes.
  int64_t total = 0;
  CACHET_RETURN_IF_ERROR(ValidateBatch(seqs, &total));
  const int n = static_cast<int>(total);
  if (n == 0) return OkStatus();
  if (layers.first > 0 && layers.x_in == nullptr) {
    return InvalidArgument("ForwardBatch: starting at layer " + std::to_string(layers.first) +
                           " needs the hidden states entering it");
  }
  // Room for every entry's tokens before any K/V is written (see the header for a failure).
  for (size_t e = 0; e < seqs.size(); ++e) {
    if (seqs[e].tokens.empty()) continue;
    if (Status s = seqs[e].kv->Reserve(static_cast<int>(seqs[e].tokens.size())); !s.ok()) {
      return Status(s.code(), Entry(e) + s.message());
    }
  }

  entry_begin_.resize(seqs.size() + 1);
  tokens_.resize(n);
  positions_.resize(n);
  for (size_t e = 0, i = 0; e < seqs.size(); ++e) {
    entry_begin_[e] = static_cast<int32_t>(i);
    std::copy(seqs[e].tokens.begin(), seqs[e].tokens.end(), tokens_.begin() + i);
    std::copy(seqs[e].positions.begin(), seqs[e].positions.end(), positions_.begin() + i);
    i += seqs[e].tokens.size();
  }
  entry_begin_[seqs.size()] = n;
  PlanAttention(seqs, pool.size());

  const int d = c.hidden_size, hd = c.head_dim;
  float* x = x_.data();
  ForEachToken(n, pool, [&](int i) {
    if (layers.first > 0) {
      std::copy_n(layers.x_in + static_cast<size_t>(i) * d, d, x + static_cast<size_t>(i) * d);
    } else {
      kernels::DequantRow(weights_.embed, tokens_[i], x + static_cast<size_t>(i) * d);
    }
    kernels::RopeAngles(inv_freq_.data(), hd / 2, positions_[i],
                        rope_.data() + static_cast<size_t>(i) * hd);
  });
  for (int l = layers.first; l < c.n_layers; ++l) {
    if (l == layers.kv_only) {
      if (layers.x_out != nullptr) std::copy_n(x, size_t(n) * d, layers.x_out);
      LayerKv(l, seqs, n, true, pool);
      return OkStatus();
    }
    LayerKv(l, seqs, n, false, pool);
    LayerRest(l, seqs, n, pool);
  }
  for (size_t e = 0; e < seqs.size(); ++e) {
    if (!seqs[e].tokens.empty()) seqs[e].kv->CommitTokens(static_cast<int>(seqs[e].tokens.size()));
  }
  LmHead(seqs, pool);
  return OkStatus();
}

void Transformer::LayerKv(int l, std::span<const SeqChunk> seqs, int n, bool kv_only,
                          ThreadPool& pool) {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layers[l];
  const int d = c.hidden_size, hd = c.head_dim, half = hd / 2;
  const int q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd;
  float* x = x_.data();
  float* xn = xn_.data();
  ForEachToken(n, pool, [&](int i) {
    kernels::RmsNorm(x + size_t(i) * d, L.attn_norm.data(), d, c.rms_norm_eps, xn + size_t(i) * d);
  });
  const float* bq = L.bq.empty() ? nullptr : L.bq.data();
  const float* bk = L.bk.empty() ? nullptr : L.bk.data();
  const float* bv = L.bv.empty() ? nullptr : L.bv.data();
  // Q or K of n_heads heads into out; from GGUF rows in llama.cpp's order, through attn_ (not yet
  // in use in this layer) and put back in HF order.
  auto project = [&](const kernels::Matrix& w, const float* bias, int n_heads, float* out) {
    const int dim = n_heads * hd;
    if (!weights_.qk_gguf_order) return kernels::MatMul(xn, n, w, bias, out, dim, pool);
    float* g = attn_.data();
    kernels::MatMul(xn, n, w, bias, g, dim, pool);
    ForEachToken(n, pool, [&](int i) {
      GgufRowsToHf(g + size_t(i) * dim, n_heads, hd, out + size_t(i) * dim);
    });
  };
  if (!kv_only) project(L.wq, bq, c.n_heads, q_.data());
  project(L.wk, bk, c.n_kv_heads, k_.data());
  kernels::MatMul(xn, n, L.wv, bv, v_.data(), kv_dim, pool);
  ForEachToken(n, pool, [&](int i) {
    float* qi = q_.data() + size_t(i) * q_dim;
    float* ki = k_.data() + size_t(i) * kv_dim;
    if (c.qk_norm && !kv_only) {
      for (int h = 0; h < c.n_heads; ++h) {
        kernels::RmsNorm(qi + h * hd, L.q_norm.data(), hd, c.rms_norm_eps, qi + h * hd);
      }
    }
    if (c.qk_norm) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        kernels::RmsNorm(ki + h * hd, L.k_norm.data(), hd, c.rms_norm_eps, ki + h * hd);
      }
    }
    const float* cs = rope_.data() + size_t(i) * hd;
    if (!kv_only) kernels::RopeRotateHalf(qi, c.n_heads, hd, cs, cs + half);
    kernels::RopeRotateHalf(ki, c.n_kv_heads, hd, cs, cs + half);
  });
  for (size_t e = 0; e < seqs.size(); ++e) {
    KvSequence& kv = *seqs[e].kv;
    for (int i = entry_begin_[e]; i < entry_begin_[e + 1]; ++i) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        kv.Append(l, h, k_.data() + size_t(i) * kv_dim + h * hd,
                  v_.data() + size_t(i) * kv_dim + h * hd, positions_[i]);
      }
    }
  }
}

void Transformer::LayerRest(int l, std::span<const SeqChunk> seqs, int n, ThreadPool& pool) {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layers[l];
  const int d = c.hidden_size, f = c.intermediate_size;
  float* x = x_.data();
  float* xn = xn_.data();
  Attention(l, seqs, pool);
  for (const SeqChunk& s : seqs) s.kv->SealAged(l);
  kernels::MatMul(attn_.data(), n, L.wo, nullptr, xn, d, pool);
  ForEachToken(n, pool, [&](int i) {
    float* xi = x + size_t(i) * d;
    const float* oi = xn + size_t(i) * d;
    for (int j = 0; j < d; ++j) xi[j] += oi[j];
    kernels::RmsNorm(xi, L.ffn_norm.data(), d, c.rms_norm_eps, xn + size_t(i) * d);
  });
  kernels::MatMul(xn, n, L.w_gate, nullptr, gate_.data(), f, pool);
  kernels::MatMul(xn, n, L.w_up, nullptr, up_.data(), f, pool);
  ForEachToken(n, pool, [&](int i) {
    kernels::SiluMul(gate_.data() + size_t(i) * f, up_.data() + size_t(i) * f,
                     gate_.data() + size_t(i) * f, f);
  });
  kernels::MatMul(gate_.data(), n, L.w_down, nullptr, xn, d, pool);
  ForEachToken(n, pool, [&](int i) {
    float* xi = x + size_t(i) * d;
    const float* oi = xn + size_t(i) * d;
    for (int j = 0; j < d; ++j) xi[j] += oi[j];
  });
}

void Transformer::LmHead(std::span<const SeqChunk> seqs, ThreadPool& pool) {
  const ModelConfig& c = config_;
  const int d = c.hidden_size;
  float* x = x_.data();
  float* xn = xn_.data();
  out_rows_.clear();
  int wanting = 0;  // entries that want logits
  for (size_t e = 0; e < seqs.size(); ++e) {
    if (seqs[e].logits == nullptr || seqs[e].tokens.empty()) continue;
    ++wanting;
    for (int i = seqs[e].all_logits ? entry_begin_[e] : entry_begin_[e + 1] - 1;
         i < entry_begin_[e + 1]; ++i) {
      out_rows_.push_back(i);
    }
  }
  const int n_out = static_cast<int>(out_rows_.size());
  if (n_out == 0) return;
  ForEachToken(n_out, pool, [&](int k) {
    kernels::RmsNorm(x + size_t(out_rows_[k]) * d, weights_.final_norm.data(), d, c.rms_norm_eps,
                     xn + size_t(k) * d);
  });
  const size_t vocab = static_cast<size_t>(c.vocab_size);
  if (wanting == 1) {  // straight into the one buffer
    float* out = nullptr;
    for (const SeqChunk& s : seqs) {
      if (s.logits != nullptr && !s.tokens.empty()) out = s.logits;
    }
    kernels::MatMul(xn, n_out, weights_.lm_head, nullptr, out, c.vocab_size, pool);
    return;
  }
  logits_.resize(size_t(n_out) * vocab);
  kernels::MatMul(xn, n_out, weights_.lm_head, nullptr, logits_.data(), c.vocab_size, pool);
  const float* row = logits_.data();
  for (const SeqChunk& s : seqs) {
    if (s.logits == nullptr || s.tokens.empty()) continue;
    const size_t rows = s.all_logits ? s.tokens.size() : 1;
    std::copy(row, row + rows * vocab, s.logits);
    row += rows * vocab;
  }
}

void Transformer::PlanAttention(std::span<const SeqChunk> seqs, int threads) {
  attn_blocks_.clear();
  // An entry's work: each token attends to about (its position + 1) keys.
  double total_work = 0.0;
  for (const SeqChunk& s : seqs) {
    for (int32_t p : s.positions) total_work += double(p) + 1.0;
  }
  const int target = std::max(1, 4 * threads);  // blocks in all (each is n_kv_heads tasks)
  for (size_t e = 0; e < seqs.size(); ++e) {
    const int n = static_cast<int>(seqs[e].tokens.size());
    if (n == 0) continue;
    double work = 0.0;
    for (int32_t p : seqs[e].positions) work += double(p) + 1.0;
    // Later tokens see more keys, so blocks are small enough for the pool to balance them.
    const int blocks =
        n == 1 ? 1 : std::clamp(static_cast<int>(std::ceil(target * work / total_work)), 1, n);
    for (int b = 0; b < blocks; ++b) {
      const int lo = entry_begin_[e] + n * b / blocks, hi = entry_begin_[e] + n * (b + 1) / blocks;
      if (lo == hi) continue;
      double cost = 0.0;
      for (int i = lo; i < hi; ++i) cost += double(positions_[i]) + 1.0;
      // A decode step over a long context: its keys shared out among the threads too.
      const int parts = n == 1 ? seqs[e].kv->DecodeParts(threads) : 1;
      attn_blocks_.push_back({static_cast<int>(e), lo, hi, cost / parts, parts});
    }
  }
  std::stable_sort(attn_blocks_.begin(), attn_blocks_.end(),
                   [](const AttnBlock& a, const AttnBlock& b) { return a.cost > b.cost; });
  attn_tasks_.clear();
  attn_merges_.clear();
  int part_groups = 0;
  for (int b = 0; b < static_cast<int>(attn_blocks_.size()); ++b) {
    AttnBlock& blk = attn_blocks_[b];
    for (int h = 0; h < config_.n_kv_heads; ++h) {
      for (int p = 0; p < blk.parts; ++p) attn_tasks_.push_back({b, h, p});
      if (blk.parts > 1) attn_merges_.push_back({b, h});
    }
    if (blk.parts > 1) {
      blk.part_base = part_groups;
      part_groups += config_.n_kv_heads * blk.parts;
    }
  }
  const size_t group = config_.n_heads / config_.n_kv_heads;
  parts_out_.resize(size_t(part_groups) * group * config_.head_dim);
  parts_max_.resize(size_t(part_groups) * group);
  parts_sum_.resize(size_t(part_groups) * group);
}

void Transformer::Attention(int layer, std::span<const SeqChunk> seqs, ThreadPool& pool) {
  const ModelConfig& c = config_;
  const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads, q_dim = c.n_heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // The batch of block b's KV head h, writing into attn_.
  auto batch_of = [&](const AttnBlock& blk, int h) {
    kernels::AttnBatch batch;
    batch.q = q_.data() + size_t(blk.begin) * q_dim + size_t(h) * group * hd;
    batch.q_stride = q_dim;
    batch.out = attn_.data() + size_t(blk.begin) * q_dim + size_t(h) * group * hd;
    batch.out_stride = q_dim;
    batch.q_pos = positions_.data() + blk.begin;
    batch.n_tok = blk.end - blk.begin;
    batch.n_heads = group;
    batch.scale = scale;
    batch.decode = seqs[blk.entry].tokens.size() == 1;
    return batch;
  };
  pool.Run(static_cast<int64_t>(attn_tasks_.size()), [&](int64_t task, int) {
    const AttnTask& t = attn_tasks_[task];
    const AttnBlock& blk = attn_blocks_[t.block];
    kernels::AttnBatch batch = batch_of(blk, t.kv_head);
    if (blk.parts > 1) {  // one token's rows: a group of them per part
      const size_t g = size_t(blk.part_base) + size_t(t.kv_head) * blk.parts + t.part;
      batch.out = parts_out_.data() + g * group * hd;
      batch.row_max = parts_max_.data() + g * group;
      batch.row_sum = parts_sum_.data() + g * group;
      batch.part = t.part;
      batch.n_parts = blk.parts;
    }
    seqs[blk.entry].kv->Attend(layer, t.kv_head, batch);
  });
  if (attn_merges_.empty()) return;
  pool.Run(static_cast<int64_t>(attn_merges_.size()), [&](int64_t task, int) {
    const auto [b, h] = attn_merges_[task];
    const AttnBlock& blk = attn_blocks_[b];
    const size_t g = size_t(blk.part_base) + size_t(h) * blk.parts;
    kernels::MergeAttnParts(parts_out_.data() + g * group * hd, parts_max_.data() + g * group,
                            parts_sum_.data() + g * group, blk.parts, hd, batch_of(blk, h));
  });
}

}  // namespace cachet
