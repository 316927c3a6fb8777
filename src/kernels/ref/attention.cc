// Reference attention. ContiguousAttention is the textbook computation (scores, max-subtracted
// softmax, weighted sum of values) over K/V rows in plain arrays; PagedAttention copies the keys
// of the page table into such arrays, in logical order, and calls it (so observed key weights,
// indexed by key, come out in page-table order). PagedAttentionRows scores block-quantized key
// pages as block_keys.h defines, every other page on its keys widened to f32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/block_keys.h"
#include "kernels/kernels.h"

namespace cachet::kernels::ref {

namespace {

// Softmax of precomputed scores (row t * n_heads + h of n_keys, times scale) then the weighted
// sum of values: the part of attention every reference shares.
void AttendScored(const AttnBatch& b, const float* scores, const float* v, const int32_t* k_pos,
                  int n_keys, int head_dim) {
  std::vector<float> probs(std::max(n_keys, 1));
  std::vector<float> acc(head_dim);
  for (int t = 0; t < b.n_tok; ++t) {
    for (int h = 0; h < b.n_heads; ++h) {
      const float* row = scores + (int64_t{t} * b.n_heads + h) * n_keys;
      float* out = b.out + t * b.out_stride + static_cast<int64_t>(h) * head_dim;

      // Scores of the visible keys and their maximum.
      float max_score = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < n_keys; ++j) {
        if (k_pos[j] > b.q_pos[t]) continue;
        probs[j] = row[j];
        max_score = std::max(max_score, probs[j]);
      }

      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;  // stays 0 where no key is visible
      if (max_score != -std::numeric_limits<float>::infinity()) {  // some key is visible
        for (int j = 0; j < n_keys; ++j) {
          if (k_pos[j] > b.q_pos[t]) continue;
          probs[j] = std::exp(probs[j] - max_score);
          sum += probs[j];
        }
        for (int j = 0; j < n_keys; ++j) {
          if (k_pos[j] > b.q_pos[t]) continue;
          const float* v_j = v + static_cast<int64_t>(j) * head_dim;
          for (int d = 0; d < head_dim; ++d) acc[d] += probs[j] * v_j[d];
        }
        for (int d = 0; d < head_dim; ++d) acc[d] /= sum;
        for (int i = 0; i < b.n_observe; ++i) {
          const AttnObserve& o = b.observe[i];
          if (b.q_pos[t] < o.min_pos) continue;
          for (int j = 0; j < n_keys; ++j) {
            if (k_pos[j] > b.q_pos[t]) continue;
            float& w = o.key_weight[j];
            w = o.max ? std::max(w, probs[j] / sum) : w + probs[j] / sum;
          }
        }
      }
      if (b.row_max != nullptr) {
        b.row_max[t * b.n_heads + h] = max_score;
        b.row_sum[t * b.n_heads + h] = sum;
      }
      std::memcpy(out, acc.data(), sizeof(float) * head_dim);
    }
  }
}

// scores[r * s_stride + j] = scale * q_r . k_j over f32 key rows.
void DotScores(const AttnBatch& b, const float* k, int n_keys, int head_dim, float* scores,
               int64_t s_stride) {
  for (int t = 0; t < b.n_tok; ++t) {
    for (int h = 0; h < b.n_heads; ++h) {
      const float* q = b.q + t * b.q_stride + static_cast<int64_t>(h) * head_dim;
      float* row = scores + (int64_t{t} * b.n_heads + h) * s_stride;
      for (int j = 0; j < n_keys; ++j) {
        const float* k_j = k + static_cast<int64_t>(j) * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += q[d] * k_j[d];
        row[j] = b.scale * dot;
      }
    }
  }
}

template <DType kType>
void BlockKeyScoresT(const uint8_t* keys, int cnt, int hd, const QueryQ8* rows, int n_rows,
                     float scale, float* scores, int s_stride) {
  const int nb = hd / 32;
  const int64_t row_bytes = DTypeRowBytes(kType, hd);
  const int32_t off = BlockKeyOffset(kType);
  std::vector<float> dk(nb), o(nb);
  std::vector<int32_t> ints(nb);
  for (int j = 0; j < cnt; ++j) {
    const uint8_t* key = keys + j * row_bytes;
    BlockScales<kType>(key, nb, dk.data(), o.data());
    for (int r = 0; r < n_rows; ++r) {
      for (int blk = 0; blk < nb; ++blk) {
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) dot += BlockCode<kType>(key, blk, i) * rows[r].q[blk * 32 + i];
        ints[blk] = dot - off * rows[r].sum[blk];
      }
      scores[int64_t{r} * s_stride + j] =
          BlockKeyScore(ints.data(), rows[r].d, dk.data(), nb, scale);
    }
  }
}

}  // namespace

void ContiguousAttention(const AttnBatch& b, const float* k, const float* v, const int32_t* k_pos,
                         int n_keys, int head_dim) {
  std::vector<float> scores(size_t(b.n_tok) * b.n_heads * n_keys);
  DotScores(b, k, n_keys, head_dim, scores.data(), n_keys);
  AttendScored(b, scores.data(), v, k_pos, n_keys, head_dim);
}

void QuantizeQuery(const float* q, int head_dim, int8_t* codes, float* d, int32_t* sum) {
  std::vector<float> s(head_dim / 32);
  QuantizeQ8(q, head_dim, codes, d, s.data());
  for (int blk = 0; blk < head_dim / 32; ++blk) {
    sum[blk] = 0;
    for (int i = 0; i < 32; ++i) sum[blk] += codes[blk * 32 + i];
  }
}

void BlockKeyScores(const uint8_t* keys, DType type, int cnt, int head_dim, const QueryQ8* rows,
                    int n_rows, float scale, float* scores, int s_stride) {
  if (type == DType::kQ4_0) {
    BlockKeyScoresT<DType::kQ4_0>(keys, cnt, head_dim, rows, n_rows, scale, scores, s_stride);
  } else {
    BlockKeyScoresT<DType::kQ8_0>(keys, cnt, head_dim, rows, n_rows, scale, scores, s_stride);
  }
}

void PagedAttention(const AttnBatch& b, const PagedKv& kv) {
  const int hd = kv.head_dim;
  const int n = kv.n_tokens;
  std::vector<float> k(static_cast<size_t>(n) * hd);
  std::vector<float> v(static_cast<size_t>(n) * hd);
  std::vector<int32_t> pos(n);
  for (int j = 0; j < n; ++j) {
    const int page = j / kv.page_tokens;
    const int in_page = j % kv.page_tokens;
    const int64_t slot = kv.page_ids[page];
    const float* base = kv.slots + slot * kv.slot_floats;
    const float* k_row = base + static_cast<int64_t>(in_page) * hd;
    const float* v_row = base + static_cast<int64_t>(kv.page_tokens + in_page) * hd;
    std::memcpy(&k[static_cast<size_t>(j) * hd], k_row, sizeof(float) * hd);
    std::memcpy(&v[static_cast<size_t>(j) * hd], v_row, sizeof(float) * hd);
    pos[j] = kv.positions[slot * kv.page_tokens + in_page];
  }
  ContiguousAttention(b, k.data(), v.data(), pos.data(), n, hd);
}

void PagedAttentionRows(const AttnBatch& b, const PageRows& kv) {
  const int hd = kv.head_dim(), n = kv.n_keys();
  const size_t page_floats = size_t(kv.page_tokens()) * hd;
  const int n_rows = b.n_tok * b.n_heads;
  std::vector<float> k(page_floats), v(size_t(n) * hd), k_buf(page_floats), v_buf(page_floats);
  std::vector<float> scores(size_t(n_rows) * n);
  std::vector<int32_t> pos;
  // Query rows quantized, for block-quantized key pages.
  const int nb = hd / 32;
  std::vector<int8_t> q8(size_t(n_rows) * hd);
  std::vector<float> q8_d(size_t(n_rows) * nb);
  std::vector<int32_t> q8_sum(size_t(n_rows) * nb);
  std::vector<QueryQ8> q8_rows(n_rows);
  bool quantized = false;
  for (int page = 0; page < kv.n_pages(); ++page) {
    int cnt = 0;
    const PagePositions p = kv.Positions(page, &cnt);
    const PageData rows = kv.Rows(page, k_buf.data(), v_buf.data());
    auto widen = [&](const void* data, DType t, float* out) {
      if (DTypeIsQuantized(t)) {
        for (int r = 0; r < cnt; ++r) QuantDequantRow({data, t, cnt, hd}, r, out + int64_t{r} * hd);
      } else {
        for (int64_t i = 0; i < int64_t{cnt} * hd; ++i) out[i] = LoadAsF32(data, t, i);
      }
    };
    float* page_scores = scores.data() + pos.size();
    if (rows.k_channels != nullptr) {
      const uint8_t* codes = static_cast<const uint8_t*>(rows.k);
      for (int64_t i = 0; i < int64_t{cnt} * hd; ++i) {
        const int c = i % hd, bit = static_cast<int>(i * rows.k_bits % 8);
        const int code = (codes[i * rows.k_bits / 8] >> bit) & ((1 << rows.k_bits) - 1);
        k[i] = F16ToF32(rows.k_channels[2 * c]) + F16ToF32(rows.k_channels[2 * c + 1]) * code;
      }
      DotScores(b, k.data(), cnt, hd, page_scores, n);
    } else if (IsBlockKeyType(rows.k_type)) {
      if (!quantized) {
        for (int r = 0; r < n_rows; ++r) {
          const float* q = b.q + (r / b.n_heads) * b.q_stride + int64_t{r % b.n_heads} * hd;
          q8_rows[r] = {&q8[size_t(r) * hd], &q8_d[size_t(r) * nb], &q8_sum[size_t(r) * nb]};
          QuantizeQuery(q, hd, &q8[size_t(r) * hd], &q8_d[size_t(r) * nb], &q8_sum[size_t(r) * nb]);
        }
        quantized = true;
      }
      BlockKeyScores(static_cast<const uint8_t*>(rows.k), rows.k_type, cnt, hd, q8_rows.data(),
                     n_rows, b.scale, page_scores, n);
    } else {
      widen(rows.k, rows.k_type, k.data());
      DotScores(b, k.data(), cnt, hd, page_scores, n);
    }
    if (rows.v_levels != nullptr) {  // 2-bit level blocks
      const auto* in = static_cast<const uint8_t*>(rows.v);
      float* out = &v[pos.size() * hd];
      for (int64_t blk = 0; blk < int64_t{cnt} * hd / 32; ++blk, in += kLevelBlockBytes) {
        uint16_t s;
        std::memcpy(&s, in, 2);
        for (int i = 0; i < 32; ++i) {
          out[blk * 32 + i] = F16ToF32(s) * rows.v_levels[LevelCode(in, i)];
        }
      }
    } else {
      widen(rows.v, rows.v_type, &v[pos.size() * hd]);
    }
    for (int r = 0; r < cnt; ++r) pos.push_back(p[r]);
  }
  AttendScored(b, scores.data(), v.data(), pos.data(), n, hd);
}

}  // namespace cachet::kernels::ref
