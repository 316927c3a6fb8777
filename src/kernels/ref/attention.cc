// Reference attention. ContiguousAttention is the textbook computation (scores, max-subtracted
// softmax, weighted sum of values) over K/V rows in plain arrays; PagedAttention copies the keys
// of the page table into such arrays, in logical order, and calls it (so observed key weights,
// indexed by key, come out in page-table order).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/kernels.h"

namespace cachet::kernels::ref {

void ContiguousAttention(const AttnBatch& b, const float* k, const float* v, const int32_t* k_pos,
                         int n_keys, int head_dim) {
  std::vector<float> probs(std::max(n_keys, 1));
  std::vector<float> acc(head_dim);
  for (int t = 0; t < b.n_tok; ++t) {
    for (int h = 0; h < b.n_heads; ++h) {
      const float* q = b.q + t * b.q_stride + static_cast<int64_t>(h) * head_dim;
      float* out = b.out + t * b.out_stride + static_cast<int64_t>(h) * head_dim;

      // Scores of the visible keys and their maximum.
      float max_score = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < n_keys; ++j) {
        if (k_pos[j] > b.q_pos[t]) continue;
        const float* k_j = k + static_cast<int64_t>(j) * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += q[d] * k_j[d];
        probs[j] = b.scale * dot;
        max_score = std::max(max_score, probs[j]);
      }

      std::fill(acc.begin(), acc.end(), 0.0f);
      if (max_score != -std::numeric_limits<float>::infinity()) {  // some key is visible
        float sum = 0.0f;
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
            if (k_pos[j] <= b.q_pos[t]) o.key_weight[j] += probs[j] / sum;
          }
        }
      }
      std::memcpy(out, acc.data(), sizeof(float) * head_dim);
    }
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
  std::vector<float> k(size_t(n) * hd), v(size_t(n) * hd), k_buf(page_floats), v_buf(page_floats);
  std::vector<int32_t> pos;
  for (int page = 0; page < kv.n_pages(); ++page) {
    int cnt = 0;
    const int32_t* p = kv.Positions(page, &cnt);
    const PageData rows = kv.Rows(page, k_buf.data(), v_buf.data());
    auto widen = [&](const void* data, DType t, float* out) {
      if (DTypeIsQuantized(t)) {
        for (int r = 0; r < cnt; ++r) QuantDequantRow({data, t, cnt, hd}, r, out + int64_t{r} * hd);
      } else {
        for (int64_t i = 0; i < int64_t{cnt} * hd; ++i) out[i] = LoadAsF32(data, t, i);
      }
    };
    if (rows.k_channels != nullptr) {
      const uint8_t* codes = static_cast<const uint8_t*>(rows.k);
      for (int64_t i = 0; i < int64_t{cnt} * hd; ++i) {
        const int c = i % hd, bit = static_cast<int>(i * rows.k_bits % 8);
        const int code = (codes[i * rows.k_bits / 8] >> bit) & ((1 << rows.k_bits) - 1);
        k[pos.size() * hd + i] =
            F16ToF32(rows.k_channels[2 * c]) + F16ToF32(rows.k_channels[2 * c + 1]) * code;
      }
    } else {
      widen(rows.k, rows.k_type, &k[pos.size() * hd]);
    }
    widen(rows.v, rows.v_type, &v[pos.size() * hd]);
    pos.insert(pos.end(), p, p + cnt);
  }
  ContiguousAttention(b, k.data(), v.data(), pos.data(), n, hd);
}

}  // namespace cachet::kernels::ref
