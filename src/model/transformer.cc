#include "model/transformer.h"

#include <cmath>

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

Result<std::unique_ptr<Transformer>> Transformer::Load(const std::string& dir, int max_batch) {
  if (IsGgufPath(dir)) {  // a single .gguf file instead of a HF directory
    CACHET_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(dir));
    CACHET_ASSIGN_OR_RETURN(ModelConfig config, GgufConfig(file));
    CACHET_ASSIGN_OR_RETURN(TensorStore store, TensorStore::FromGguf(std::move(file)));
    CACHET_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Load(config, std::move(store)));
    return std::make_unique<Transformer>(std::move(config), std::move(weights), max_batch);
  }
  CACHET_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(dir));
  CACHET_ASSIGN_OR_RETURN(TensorStore store, TensorStore::OpenDir(dir));
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

}  // namespace

Status Transformer::Forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                            KvSequence& kv, ThreadPool& pool, float* logits, bool all_logits) {
  const ModelConfig& c = config_;
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return OkStatus();
  if (n > max_batch_ || positions.size() != tokens.size()) {
    return InvalidArgument("Forward: " + std::to_string(n) + " tokens exceed the batch of " +
                           std::to_string(max_batch_) + " or positions do not match");
  }
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return InvalidArgument("token id " + std::to_string(tokens[i]) + " at index " +
                             std::to_string(i) + " is outside the vocabulary [0, " +
                             std::to_string(c.vocab_size) + ")");
    }
  }
  CACHET_RETURN_IF_ERROR(kv.Reserve(n));

  const int d = c.hidden_size, hd = c.head_dim, half = hd / 2;
  const int q_dim = c.n_heads * hd, kv_dim = c.n_kv_heads * hd, f = c.intermediate_size;
  float* x = x_.data();
  float* xn = xn_.data();

  ForEachToken(n, pool, [&](int i) {
    kernels::DequantRow(weights_.embed, tokens[i], x + static_cast<size_t>(i) * d);
    // As HF: angle = f32(position) * inv_freq in f32, then cos/sin of that f32 angle.
    float* cs = rope_.data() + static_cast<size_t>(i) * hd;
    for (int j = 0; j < half; ++j) {
      const float angle = static_cast<float>(positions[i]) * inv_freq_[j];
      cs[j] = static_cast<float>(std::cos(static_cast<double>(angle)));
      cs[half + j] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  });

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = weights_.layers[l];
    ForEachToken(n, pool, [&](int i) {
      kernels::RmsNorm(x + size_t(i) * d, L.attn_norm.data(), d, c.rms_norm_eps,
                       xn + size_t(i) * d);
    });
    const float* bq = L.bq.empty() ? nullptr : L.bq.data();
    const float* bk = L.bk.empty() ? nullptr : L.bk.data();
    const float* bv = L.bv.empty() ? nullptr : L.bv.data();
    kernels::MatMul(xn, n, L.wq, bq, q_.data(), q_dim, pool);
    kernels::MatMul(xn, n, L.wk, bk, k_.data(), kv_dim, pool);
    kernels::MatMul(xn, n, L.wv, bv, v_.data(), kv_dim, pool);
    ForEachToken(n, pool, [&](int i) {
      float* qi = q_.data() + size_t(i) * q_dim;
      float* ki = k_.data() + size_t(i) * kv_dim;
      if (c.qk_norm) {
        for (int h = 0; h < c.n_heads; ++h) {
          kernels::RmsNorm(qi + h * hd, L.q_norm.data(), hd, c.rms_norm_eps, qi + h * hd);
        }
        for (int h = 0; h < c.n_kv_heads; ++h) {
          kernels::RmsNorm(ki + h * hd, L.k_norm.data(), hd, c.rms_norm_eps, ki + h * hd);
        }
      }
      const float* cs = rope_.data() + size_t(i) * hd;
      kernels::RopeRotateHalf(qi, c.n_heads, hd, cs, cs + half);
      kernels::RopeRotateHalf(ki, c.n_kv_heads, hd, cs, cs + half);
    });
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        kv.Append(l, h, k_.data() + size_t(i) * kv_dim + h * hd,
                  v_.data() + size_t(i) * kv_dim + h * hd, positions[i]);
      }
    }
    Attention(l, n, positions.data(), kv, pool);
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
  kv.CommitTokens(n);

  const int first = all_logits ? 0 : n - 1;
  const int n_out = n - first;
  ForEachToken(n_out, pool, [&](int i) {
    kernels::RmsNorm(x + size_t(first + i) * d, weights_.final_norm.data(), d, c.rms_norm_eps,
                     xn + size_t(i) * d);
  });
  kernels::MatMul(xn, n_out, weights_.lm_head, nullptr, logits, c.vocab_size, pool);
  return OkStatus();
}

void Transformer::Attention(int layer, int n, const int32_t* positions, KvSequence& kv,
                            ThreadPool& pool) {
  const ModelConfig& c = config_;
  const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads, q_dim = c.n_heads * hd;
  // Tasks: (KV head, block of query tokens); later tokens see more keys, so blocks are small
  // enough for the pool to balance them.
  const int blocks = n == 1 ? 1 : std::min(n, std::max(1, 4 * pool.size()));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  pool.Run(int64_t{c.n_kv_heads} * blocks, [&](int64_t task, int) {
    const int h = static_cast<int>(task / blocks), b = static_cast<int>(task % blocks);
    const int lo = n * b / blocks, hi = n * (b + 1) / blocks;
    if (lo == hi) return;
    kernels::AttnBatch batch;
    batch.q = q_.data() + size_t(lo) * q_dim + size_t(h) * group * hd;
    batch.q_stride = q_dim;
    batch.out = attn_.data() + size_t(lo) * q_dim + size_t(h) * group * hd;
    batch.out_stride = q_dim;
    batch.q_pos = positions + lo;
    batch.n_tok = hi - lo;
    batch.n_heads = group;
    batch.scale = scale;
    kv.Attend(layer, h, batch);
  });
}

}  // namespace cachet
