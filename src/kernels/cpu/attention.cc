// Highway PagedAttention: block-wise online softmax over the pages of a page table.
//
// The query rows of a GQA group (every head of up to kMaxTileRows / n_heads tokens) form a tile
// that walks the pages once, so each K/V row loaded serves every head and token of the tile. Per
// page: the scores of all its keys for all rows (dot products two query rows x four keys at a
// time), masking keys whose position is past the row's query position; then per row one rescale of
// the running sum and accumulator to the new running max, exp of the scores, and acc += p . V.
// Positions are read per key: they need not be contiguous or sorted. Single-threaded; scratch is
// per thread and reused.
//
// AttnObserve: the final softmax weights are known only once a tile has walked every page, so for
// the observed rows each page's exp(s - m) terms and the running max m they were taken against are
// kept (per row, per key / per page), and at the end of the tile folded into
// weight_j = p_j * exp(m_page - m_final) / sum_final.

// clang-format off
#include "kernels/cpu/hwy_targets.h"  // must precede every Highway header
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/scratch.h"
#include "kernels/kernels.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/cpu/hwy_util-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace cachet::kernels::cpu::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR
// The fallback target for CPUs without SSE4 (HWY_SCALAR with GCC < 12.3): the reference kernel.
void PagedAttentionImpl(const AttnBatch& b, const PagedKv& kv) { ref::PagedAttention(b, kv); }
void PagedAttentionRowsImpl(const AttnBatch& b, const PageRows& kv) {
  ref::PagedAttentionRows(b, kv);
}
#else
namespace {

// Query rows (token, head) of a tile; a group with more heads than this still forms one tile per
// token.
constexpr int kMaxTileRows = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// K/V rows are f32, or f16 / bf16 (KV codecs) widened to f32 as they are loaded.
template <class T>
HWY_INLINE VF LoadRow(const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(DF(), p);
  } else {
    return hn::PromoteTo(DF(), hn::LoadU(hn::Rebind<T, DF>(), p));
  }
}
template <class T>
HWY_INLINE float Elem(const T* p, int i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else if constexpr (std::is_same_v<T, hwy::float16_t>) {
    return F16ToF32(reinterpret_cast<const uint16_t*>(p)[i]);
  } else {
    return Bf16ToF32(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}

// s0[i] = q0 . k_i and s1[i] = q1 . k_i for four keys.
template <class T>
HWY_INLINE void Dot2x4(const float* HWY_RESTRICT q0, const float* HWY_RESTRICT q1,
                       const T* const* HWY_RESTRICT k, int hd, V4& s0, V4& s1) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const T* HWY_RESTRICT k0 = k[0];
  const T* HWY_RESTRICT k1 = k[1];
  const T* HWY_RESTRICT k2 = k[2];
  const T* HWY_RESTRICT k3 = k[3];
  VF a00 = hn::Zero(df), a01 = hn::Zero(df), a02 = hn::Zero(df), a03 = hn::Zero(df);
  VF a10 = hn::Zero(df), a11 = hn::Zero(df), a12 = hn::Zero(df), a13 = hn::Zero(df);
  int d = 0;
  for (; d + N <= hd; d += N) {
    const VF vk0 = LoadRow(k0 + d);
    const VF vk1 = LoadRow(k1 + d);
    const VF vk2 = LoadRow(k2 + d);
    const VF vk3 = LoadRow(k3 + d);
    const VF vq0 = hn::LoadU(df, q0 + d);
    const VF vq1 = hn::LoadU(df, q1 + d);
    a00 = hn::MulAdd(vq0, vk0, a00);
    a01 = hn::MulAdd(vq0, vk1, a01);
    a02 = hn::MulAdd(vq0, vk2, a02);
    a03 = hn::MulAdd(vq0, vk3, a03);
    a10 = hn::MulAdd(vq1, vk0, a10);
    a11 = hn::MulAdd(vq1, vk1, a11);
    a12 = hn::MulAdd(vq1, vk2, a12);
    a13 = hn::MulAdd(vq1, vk3, a13);
  }
  s0 = Reduce4(a00, a01, a02, a03);
  s1 = Reduce4(a10, a11, a12, a13);
  if (d < hd) {
    float t0[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float t1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; d < hd; ++d) {
      for (int i = 0; i < 4; ++i) {
        t0[i] += q0[d] * Elem(k[i], d);
        t1[i] += q1[d] * Elem(k[i], d);
      }
    }
    const D4 d4;
    s0 = hn::Add(s0, hn::LoadU(d4, t0));
    s1 = hn::Add(s1, hn::LoadU(d4, t1));
  }
}

// acc += p[0] * v[0] + ... + p[3] * v[3].
template <class T>
HWY_INLINE void Axpy4(const float* HWY_RESTRICT p, const T* const* HWY_RESTRICT v, int hd,
                      float* HWY_RESTRICT acc) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const T* HWY_RESTRICT v0 = v[0];
  const T* HWY_RESTRICT v1 = v[1];
  const T* HWY_RESTRICT v2 = v[2];
  const T* HWY_RESTRICT v3 = v[3];
  const VF p0 = hn::Set(df, p[0]);
  const VF p1 = hn::Set(df, p[1]);
  const VF p2 = hn::Set(df, p[2]);
  const VF p3 = hn::Set(df, p[3]);
  int d = 0;
  for (; d + N <= hd; d += N) {
    const VF t01 = hn::MulAdd(p1, LoadRow(v1 + d), hn::Mul(p0, LoadRow(v0 + d)));
    const VF t23 = hn::MulAdd(p3, LoadRow(v3 + d), hn::Mul(p2, LoadRow(v2 + d)));
    hn::StoreU(hn::Add(hn::LoadU(df, acc + d), hn::Add(t01, t23)), df, acc + d);
  }
  for (; d < hd; ++d) {
    acc[d] += (p[0] * Elem(v0, d) + p[1] * Elem(v1, d)) + (p[2] * Elem(v2, d) + p[3] * Elem(v3, d));
  }
}

// Scores (times scale) of a page's cnt keys for the rows of a tile, four keys at a time; a last
// partial group repeats its last key.
template <class T, class QRow>
HWY_INLINE void ScorePage(const T* k_page, int cnt, int hd, int rows, const QRow& q_row,
                          float scale, float* scores, int s_stride) {
  const D4 d4;
  const V4 vscale = hn::Set(d4, scale);
  for (int j = 0; j < cnt; j += 4) {
    const T* k[4];
    for (int i = 0; i < 4; ++i) k[i] = k_page + static_cast<int64_t>(std::min(j + i, cnt - 1)) * hd;
    for (int r = 0; r < rows; r += 2) {
      const int r1 = std::min(r + 1, rows - 1);
      V4 s0, s1;
      Dot2x4(q_row(r), q_row(r1), k, hd, s0, s1);
      hn::StoreU(hn::Mul(s0, vscale), d4, scores + static_cast<int64_t>(r) * s_stride + j);
      if (r1 != r)
        hn::StoreU(hn::Mul(s1, vscale), d4, scores + static_cast<int64_t>(r1) * s_stride + j);
    }
  }
}

// acc += sum_j p[j] * v_j over a page's cnt values (p is 0 in padding slots past cnt).
template <class T>
HWY_INLINE void AccumulatePage(const float* p, const T* v_page, int cnt, int hd, float* acc) {
  for (int j = 0; j < cnt; j += 4) {
    const T* v[4];
    for (int i = 0; i < 4; ++i) v[i] = v_page + static_cast<int64_t>(std::min(j + i, cnt - 1)) * hd;
    Axpy4(p + j, v, hd, acc);  // a repeated row sits in a padding slot, where p = 0
  }
}

// Calls f with the page's rows as a typed pointer.
template <class F>
HWY_INLINE void WithRows(const void* rows, DType t, const F& f) {
  switch (t) {
    case DType::kF16:
      return f(static_cast<const hwy::float16_t*>(rows));
    case DType::kBF16:
      return f(static_cast<const hwy::bfloat16_t*>(rows));
    default:
      return f(static_cast<const float*>(rows));
  }
}

// y += c * x.
HWY_INLINE void AxpyRow(float c, const float* HWY_RESTRICT x, int n, float* HWY_RESTRICT y) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const VF vc = hn::Set(df, c);
  int i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::MulAdd(vc, hn::LoadU(df, x + i), hn::LoadU(df, y + i)), df, y + i);
  }
  for (; i < n; ++i) y[i] += c * x[i];
}

HWY_INLINE void ScaleRow(float* HWY_RESTRICT x, int n, float s) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const VF vs = hn::Set(df, s);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, x + i), vs), df, x + i);
  for (; i < n; ++i) x[i] *= s;
}

// The kernel over any page source: `pages` gives logical page i's positions and key count
// (Positions) and its f32 K/V rows (Rows, which may decode into the two page-sized buffers it is
// passed). Page i's keys are numbered from the sum of the earlier pages' counts.
template <class Pages>
void AttendPages(const AttnBatch& b, const Pages& pages, int n_pages, int n_keys, int pt, int hd) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const int n_heads = b.n_heads;
  if (b.n_tok <= 0 || n_heads <= 0 || hd <= 0) return;

  const int tile_tok = std::max(1, kMaxTileRows / n_heads);
  const int max_rows = std::min(tile_tok, b.n_tok) * n_heads;
  // Score rows hold a page's keys padded with -inf to whole vectors, hence to groups of four keys
  // (N >= 4 on every SIMD target).
  const int s_stride = (pt + N - 1) / N * N;

  const size_t acc_floats = static_cast<size_t>(max_rows) * hd;
  const size_t score_floats = static_cast<size_t>(max_rows) * s_stride;
  const size_t page_floats = static_cast<size_t>(pt) * hd;
  float* scratch =
      ThreadScratch(kScratchAttention, acc_floats + score_floats + 2 * max_rows + 2 * page_floats);
  float* acc = scratch;
  float* scores = acc + acc_floats;
  float* run_max = scores + score_floats;
  float* run_sum = run_max + max_rows;
  float* k_buf = run_sum + max_rows;  // one decoded page, for sources that store pages encoded
  float* v_buf = k_buf + page_floats;

  // Observed rows: those of tokens with q_pos >= the smallest min_pos. For each, obs_p holds the
  // exp(s - m) of every key ([row][n_tokens], page-table order) and obs_m the m of each page
  // ([row][n_pages], -inf where the row saw nothing of the page). Rows are indexed by the
  // token's slot among the observed tokens of the tile.
  float* obs_p = nullptr;
  float* obs_m = nullptr;
  int32_t obs_min_pos = 0;
  int obs_slot[kMaxTileRows];  // tile token -> its slot among observed tokens, or -1
  // Observed passes: the first key of each page (and the total last), for folding the kept terms.
  thread_local std::vector<int64_t> page_first;
  if (b.n_observe > 0 && n_pages > 0) {
    obs_min_pos = b.observe[0].min_pos;
    for (int i = 1; i < b.n_observe; ++i) obs_min_pos = std::min(obs_min_pos, b.observe[i].min_pos);
    int n_obs_tok = 0;
    for (int t = 0; t < b.n_tok; ++t) n_obs_tok += b.q_pos[t] >= obs_min_pos;
    if (n_obs_tok > 0) {
      const size_t obs_rows = static_cast<size_t>(std::min(tile_tok, n_obs_tok)) * n_heads;
      obs_p = ThreadScratch(kScratchAttentionObserve,
                            obs_rows * (static_cast<size_t>(n_keys) + n_pages));
      obs_m = obs_p + obs_rows * n_keys;
      page_first.assign(n_pages + 1, 0);
      for (int page = 0; page < n_pages; ++page) {
        int cnt = 0;
        pages.Positions(page, &cnt);
        page_first[page + 1] = page_first[page] + cnt;
      }
    }
  }

  for (int t0 = 0; t0 < b.n_tok; t0 += tile_tok) {
    const int nt = std::min(tile_tok, b.n_tok - t0);
    const int rows = nt * n_heads;
    const int32_t* q_pos = b.q_pos + t0;
    const int32_t q_min = *std::min_element(q_pos, q_pos + nt);
    const int32_t q_max = *std::max_element(q_pos, q_pos + nt);
    auto q_row = [&](int r) {
      return b.q + (t0 + r / n_heads) * b.q_stride + static_cast<int64_t>(r % n_heads) * hd;
    };

    std::fill(acc, acc + static_cast<size_t>(rows) * hd, 0.0f);
    std::fill(run_max, run_max + rows, kNegInf);
    std::fill(run_sum, run_sum + rows, 0.0f);
    int obs_tok = 0;  // observed tokens in this tile
    if (obs_p != nullptr) {
      for (int t = 0; t < nt; ++t) obs_slot[t] = q_pos[t] >= obs_min_pos ? obs_tok++ : -1;
      std::fill(obs_m, obs_m + static_cast<size_t>(obs_tok) * n_heads * n_pages, kNegInf);
    }

    int64_t first_key = 0;  // of the page, among all keys
    for (int page = 0; page < n_pages; ++page) {
      int cnt = 0;
      const int32_t* pos = pages.Positions(page, &cnt);
      const int64_t j0 = first_key;
      first_key += cnt;
      const int32_t p_min = *std::min_element(pos, pos + cnt);
      const int32_t p_max = *std::max_element(pos, pos + cnt);
      if (p_min > q_max) continue;  // no key of the page is visible to the tile
      const bool all_visible = p_max <= q_min;
      const PageData rows_of = pages.Rows(page, k_buf, v_buf);
      WithRows(rows_of.k, rows_of.k_type, [&](const auto* k_page) {
        ScorePage(k_page, cnt, hd, rows, q_row, b.scale, scores, s_stride);
      });

      for (int r = 0; r < rows; ++r) {
        float* s = scores + static_cast<int64_t>(r) * s_stride;
        if (!all_visible) {
          const int32_t qp = q_pos[r / n_heads];
          for (int j = 0; j < cnt; ++j) {
            if (pos[j] > qp) s[j] = kNegInf;
          }
        }
        std::fill(s + cnt, s + s_stride, kNegInf);

        VF vmax = hn::Set(df, kNegInf);
        for (int j = 0; j < s_stride; j += N) vmax = hn::Max(vmax, hn::LoadU(df, s + j));
        const float page_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
        if (page_max == kNegInf) continue;  // nothing visible to this row in this page

        float* acc_r = acc + static_cast<int64_t>(r) * hd;
        const float m_new = std::max(run_max[r], page_max);
        if (run_max[r] != kNegInf && m_new > run_max[r]) {
          const float correction = std::exp(run_max[r] - m_new);
          run_sum[r] *= correction;
          ScaleRow(acc_r, hd, correction);
        }
        run_max[r] = m_new;

        const VF vm = hn::Set(df, m_new);
        VF vsum = hn::Zero(df);
        for (int j = 0; j < s_stride; j += N) {
          const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + j), vm));  // exp(-inf) = 0
          hn::StoreU(p, df, s + j);
          vsum = hn::Add(vsum, p);
        }
        run_sum[r] += ReduceSum(vsum);
        if (obs_tok > 0 && obs_slot[r / n_heads] >= 0) {
          const int64_t o = static_cast<int64_t>(obs_slot[r / n_heads]) * n_heads + r % n_heads;
          std::copy_n(s, cnt, obs_p + o * n_keys + j0);
          obs_m[o * n_pages + page] = m_new;
        }

        WithRows(rows_of.v, rows_of.v_type,
                 [&](const auto* v_page) { AccumulatePage(s, v_page, cnt, hd, acc_r); });
      }
    }

    for (int r = 0; r < rows; ++r) {
      float* out =
          b.out + (t0 + r / n_heads) * b.out_stride + static_cast<int64_t>(r % n_heads) * hd;
      const float* acc_r = acc + static_cast<int64_t>(r) * hd;
      if (run_sum[r] == 0.0f) {
        std::fill(out, out + hd, 0.0f);  // no key visible
        continue;
      }
      const float inv = 1.0f / run_sum[r];
      const VF vinv = hn::Set(df, inv);
      int d = 0;
      for (; d + N <= hd; d += N) hn::StoreU(hn::Mul(hn::LoadU(df, acc_r + d), vinv), df, out + d);
      for (; d < hd; ++d) out[d] = acc_r[d] * inv;
    }

    // Fold the kept terms of the observed rows into their final weights.
    for (int r = 0; r < rows && obs_tok > 0; ++r) {
      const int32_t qp = q_pos[r / n_heads];
      if (obs_slot[r / n_heads] < 0 || run_sum[r] == 0.0f) continue;
      const int64_t o = static_cast<int64_t>(obs_slot[r / n_heads]) * n_heads + r % n_heads;
      const float* p_row = obs_p + o * n_keys;
      const float* m_row = obs_m + o * n_pages;
      const float inv = 1.0f / run_sum[r];
      for (int page = 0; page < n_pages; ++page) {
        const int64_t j0 = page_first[page];
        const int cnt = static_cast<int>(page_first[page + 1] - j0);
        if (m_row[page] == kNegInf) continue;  // nothing of the page visible to the row
        const float c = std::exp(m_row[page] - run_max[r]) * inv;
        for (int i = 0; i < b.n_observe; ++i) {
          if (qp >= b.observe[i].min_pos) AxpyRow(c, p_row + j0, cnt, b.observe[i].key_weight + j0);
        }
      }
    }
  }
}

// A plain page table of raw f32 pages.
struct RawPages {
  const PagedKv& kv;
  const int32_t* Positions(int page, int* cnt) const {
    *cnt = std::min(kv.page_tokens, kv.n_tokens - page * kv.page_tokens);
    return kv.positions + int64_t{kv.page_ids[page]} * kv.page_tokens;
  }
  PageData Rows(int page, float*, float*) const {
    const float* k = kv.slots + int64_t{kv.page_ids[page]} * kv.slot_floats;
    return {k, k + int64_t{kv.page_tokens} * kv.head_dim};
  }
};

}  // namespace

void PagedAttentionImpl(const AttnBatch& b, const PagedKv& kv) {
  const int pt = kv.page_tokens;
  const int n_pages = kv.n_tokens > 0 ? (kv.n_tokens + pt - 1) / pt : 0;
  AttendPages(b, RawPages{kv}, n_pages, kv.n_tokens, pt, kv.head_dim);
}

void PagedAttentionRowsImpl(const AttnBatch& b, const PageRows& kv) {
  AttendPages(b, kv, kv.n_pages(), kv.n_keys(), kv.page_tokens(), kv.head_dim());
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace cachet::kernels::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cachet::kernels::cpu {

HWY_EXPORT(PagedAttentionImpl);
HWY_EXPORT(PagedAttentionRowsImpl);

void PagedAttention(const AttnBatch& b, const PagedKv& kv) {
  HWY_DYNAMIC_DISPATCH(PagedAttentionImpl)(b, kv);
}
void PagedAttentionRows(const AttnBatch& b, const PageRows& kv) {
  HWY_DYNAMIC_DISPATCH(PagedAttentionRowsImpl)(b, kv);
}

}  // namespace cachet::kernels::cpu
#endif  // HWY_ONCE
