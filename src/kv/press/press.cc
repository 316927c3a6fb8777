#include "kv/press/press.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace cachet::press {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Scorers whose scores are attention weights (comparable across heads of a layer as they are).
bool AttentionLike(Scorer s) { return ScorerGatherings(s) != 0; }

double Dot(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += double(a[i]) * b[i];
  return s;
}

// H2O keeps half its budget b for the most recent tokens.
void ProtectRecentHalf(std::vector<float>& s, int b) {
  const int n = static_cast<int>(s.size());
  for (int j = std::max(0, n - b / 2); j < n; ++j) s[j] = std::numeric_limits<float>::infinity();
}

// Budgets near want[i] * lambda, each clamped to [lo[i], hi[i]], summing to total when reachable
// (largest-remainder rounding of the clamped real values).
std::vector<int> FitToTotal(const std::vector<double>& want, const std::vector<int>& lo,
                            const std::vector<int>& hi, int64_t total) {
  const size_t n = want.size();
  auto sum_at = [&](double lambda) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += std::clamp(want[i] * lambda, double(lo[i]), double(hi[i]));
    return s;
  };
  double a = 0, b = 1;
  while (sum_at(b) < total && b < 1e12) b *= 2;
  for (int it = 0; it < 100; ++it) {
    const double m = 0.5 * (a + b);
    (sum_at(m) < total ? a : b) = m;
  }
  std::vector<double> x(n);
  std::vector<int> out(n);
  int64_t assigned = 0;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::clamp(want[i] * b, double(lo[i]), double(hi[i]));
    out[i] = static_cast<int>(std::floor(x[i]));
    assigned += out[i];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t i, size_t j) { return x[i] - out[i] > x[j] - out[j]; });
  for (size_t k = 0; assigned < total && k < n; ++k) {
    if (out[order[k]] < hi[order[k]]) ++out[order[k]], ++assigned;
  }
  for (size_t k = n; assigned > total && k-- > 0;) {
    if (out[order[k]] > lo[order[k]]) --out[order[k]], --assigned;
  }
  return out;
}

// Indices of the b highest scores (ties to the earlier token), ascending.
std::vector<int32_t> TopIndices(const std::vector<float>& s, int b) {
  std::vector<int32_t> idx(std::clamp(b, 0, static_cast<int>(s.size())));
  if (!idx.empty())
    kernels::TopK(s.data(), static_cast<int>(s.size()), int(idx.size()), idx.data());
  return idx;
}

}  // namespace

PressObserver::PressObserver(int n_layers, int n_kv_heads, int head_dim, int32_t end, int window,
                             uint32_t gatherings)
    : gatherings_(gatherings),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      end_(end),
      window_(window),
      heads_(size_t(n_layers) * n_kv_heads) {
  min_pos_[kAll] = 0;
  min_pos_[kWindow] = end - std::max(window, 1);
  min_pos_[kLast] = end - 1;
  min_pos_[kWindowMax] = min_pos_[kWindow];
  if (gatherings >> kWindow & 1) {
    for (Head& h : heads_) {
      h.q_sum.assign(head_dim, 0.0);
      h.q_outer.assign(size_t(head_dim) * head_dim, 0.0);
    }
  }
}

namespace {
// One attention call's gatherings, private to the thread making it (Observe, kernel, Merge).
struct CallBuffers {
  std::vector<float> weights;  // [gatherings observed][n_keys]
  kernels::AttnObserve observe[PressObserver::kGatherings];
  int n_keys = 0;
  std::vector<double> q_sum, q_outer, q0, cs, sn;
  int64_t q_rows = 0;
};
thread_local CallBuffers tls_call;
}  // namespace

std::span<const kernels::AttnObserve> PressObserver::Observe(int, int, int n_keys,
                                                             const kernels::AttnBatch& b) {
  CallBuffers& cb = tls_call;
  cb.n_keys = n_keys;
  const int n_observe = std::popcount(gatherings_);
  cb.weights.assign(size_t(n_observe) * n_keys, 0.0f);
  for (int g = 0, i = 0; g < kGatherings; ++g) {  // buffer i holds the i-th gathering observed
    if (!(gatherings_ >> g & 1)) continue;
    cb.observe[i].min_pos = min_pos_[g];
    cb.observe[i].key_weight = cb.weights.data() + size_t(i) * n_keys;
    cb.observe[i].max = g == kWindowMax;
    ++i;
  }
  const int d = head_dim_;
  cb.q_rows = 0;
  if (!(gatherings_ >> kWindow & 1)) return {cb.observe, size_t(n_observe)};
  cb.q_sum.assign(d, 0.0);
  cb.q_outer.assign(size_t(d) * d, 0.0);
  cb.q0.resize(d);
  const int half = d / 2;
  const bool rope = !inv_freq_.empty();
  cb.cs.resize(half);
  cb.sn.resize(half);
  for (int t = 0; t < b.n_tok; ++t) {
    if (b.q_pos[t] < min_pos_[kWindow]) continue;
    if (rope) {  // the RoPE angles of this position, shared by the group's heads
      for (int i = 0; i < half; ++i) {
        const double a = double(b.q_pos[t]) * inv_freq_[i];
        cb.cs[i] = std::cos(a);
        cb.sn[i] = std::sin(a);
      }
    }
    for (int head = 0; head < b.n_heads; ++head) {
      const float* q = b.q + t * b.q_stride + int64_t(head) * d;
      double* q0 = cb.q0.data();
      for (int i = 0; i < d; ++i) q0[i] = q[i];
      for (int i = 0; rope && i < half; ++i) {  // undo RoPE (rotate-half pairs i, i + d/2)
        const double x = q0[i], y = q0[i + half];
        q0[i] = x * cb.cs[i] + y * cb.sn[i];
        q0[i + half] = y * cb.cs[i] - x * cb.sn[i];
      }
      for (int i = 0; i < d; ++i) {
        cb.q_sum[i] += q0[i];
        double* row = cb.q_outer.data() + size_t(i) * d;
        for (int j = 0; j < d; ++j) row[j] += q0[i] * q0[j];
      }
      ++cb.q_rows;
    }
  }
  return {cb.observe, size_t(n_observe)};
}

void PressObserver::Merge(int layer, int kv_head) {
  const CallBuffers& cb = tls_call;
  Head& h = heads_[layer * n_kv_heads_ + kv_head];
  std::lock_guard<std::mutex> lock(h.mu);
  for (int g = 0, i = 0; g < kGatherings; ++g) {
    if (!(gatherings_ >> g & 1)) continue;
    std::vector<float>& w = h.weights[g];
    if (static_cast<int>(w.size()) < cb.n_keys) w.resize(cb.n_keys, 0.0f);
    const float* src = cb.weights.data() + size_t(i++) * cb.n_keys;
    if (g == kWindowMax) {
      for (int j = 0; j < cb.n_keys; ++j) w[j] = std::max(w[j], src[j]);
    } else {
      for (int j = 0; j < cb.n_keys; ++j) w[j] += src[j];
    }
  }
  if (cb.q_rows > 0) {
    for (size_t i = 0; i < h.q_sum.size(); ++i) h.q_sum[i] += cb.q_sum[i];
    for (size_t i = 0; i < h.q_outer.size(); ++i) h.q_outer[i] += cb.q_outer[i];
    h.q_rows += cb.q_rows;
  }
}

void PressObserver::QueryStats(int layer, int kv_head, int future, std::vector<double>* mean,
                               std::vector<double>* cov) const {
  const Head& h = heads_[layer * n_kv_heads_ + kv_head];
  const int d = head_dim_;
  const double n = std::max<int64_t>(h.q_rows, 1);
  mean->resize(d);
  cov->resize(size_t(d) * d);
  for (int i = 0; i < d; ++i) (*mean)[i] = h.q_sum[i] / n;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      (*cov)[size_t(i) * d + j] = h.q_outer[size_t(i) * d + j] / n - (*mean)[i] * (*mean)[j];
    }
  }
  if (inv_freq_.empty() || future < 1) return;
  // A: per rotate-half pair, the rotation by (end + delta) * theta averaged over delta < future.
  const int half = d / 2;
  std::vector<double> cs(half), sn(half);
  for (int i = 0; i < half; ++i) {
    for (int t = 0; t < future; ++t) {
      const double a = double(end_ + t) * inv_freq_[i];
      cs[i] += std::cos(a) / future;
      sn[i] += std::sin(a) / future;
    }
  }
  // x <- A x on the strided vector x[0], x[stride], ... (a row or a column of the covariance).
  auto rotate = [&](double* x, size_t stride) {
    for (int i = 0; i < half; ++i) {
      double& lo = x[i * stride];
      double& hi = x[(i + half) * stride];
      const double a = lo, b = hi;
      lo = cs[i] * a - sn[i] * b;
      hi = sn[i] * a + cs[i] * b;
    }
  };
  rotate(mean->data(), 1);
  for (int r = 0; r < d; ++r) rotate(cov->data() + size_t(r) * d, 1);  // rows: Sigma A^T
  for (int c = 0; c < d; ++c) rotate(cov->data() + c, size_t(d));      // columns: A Sigma A^T
}

std::vector<int> AllocateBudgets(const PressOptions& o, int n_layers, int n_kv_heads, int n_tokens,
                                 int64_t total, int min_keep,
                                 std::span<const std::vector<float>> scores) {
  const int T = n_layers * n_kv_heads;
  min_keep = std::min(min_keep, n_tokens);
  const std::vector<int> lo(T, min_keep), hi(T, n_tokens);
  total = std::clamp<int64_t>(total, int64_t(T) * min_keep, int64_t(T) * n_tokens);
  const double mean = double(total) / T;
  std::vector<double> want(T, 1.0);
  if (o.allocator == Allocator::kPyramid && n_layers > 1) {
    // Linear from the bottom layer down to mean / beta at the top, averaging to the mean.
    const double top = mean / o.pyramid_beta, bottom = 2 * mean - top;
    for (int l = 0; l < n_layers; ++l) {
      const double w = bottom + (top - bottom) * l / (n_layers - 1);
      for (int h = 0; h < n_kv_heads; ++h) want[l * n_kv_heads + h] = w;
    }
  } else if (o.allocator == Allocator::kAda && !scores.empty()) {
    // Per layer: every head keeps its own top floor; the rest of the layer's budget goes to the
    // best remaining scores of all its heads pooled.
    const int floor_b =
        std::clamp(static_cast<int>(std::ceil(o.ada_floor * mean)), min_keep, n_tokens);
    std::vector<int> out(T, floor_b);
    for (int l = 0; l < n_layers; ++l) {
      struct Cand {
        float s;
        int head;
      };
      std::vector<Cand> pool;
      for (int h = 0; h < n_kv_heads; ++h) {
        std::vector<float> s = scores[l * n_kv_heads + h];
        std::sort(s.begin(), s.end(), std::greater<>());
        for (size_t i = floor_b; i < s.size(); ++i) pool.push_back({s[i], h});
      }
      const int64_t rest = std::clamp<int64_t>(
          std::llround(mean * n_kv_heads) - int64_t(floor_b) * n_kv_heads, 0, int64_t(pool.size()));
      std::nth_element(pool.begin(), pool.begin() + rest, pool.end(),
                       [](const Cand& a, const Cand& b) { return a.s > b.s; });
      for (int64_t i = 0; i < rest; ++i) ++out[l * n_kv_heads + pool[i].head];
    }
    for (int i = 0; i < T; ++i) want[i] = out[i];
  }
  return FitToTotal(want, lo, hi, total);
}

namespace {

// Low key norm ~ high attention.
void KNormScores(const std::vector<float>& k, int n, float* s) {
  const int d = n > 0 ? static_cast<int>(k.size() / n) : 0;
  for (int j = 0; j < n; ++j) {
    const float* kj = k.data() + size_t(j) * d;
    s[j] = -float(std::sqrt(Dot(kj, kj, d)));
  }
}

// Distinctive keys: far (in angle) from the mean key.
void KeyDiffScores(const std::vector<float>& k, int n, float* s) {
  const int d = n > 0 ? static_cast<int>(k.size() / n) : 0;
  std::vector<double> mk(d, 0.0);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < d; ++i) mk[i] += k[size_t(j) * d + i];
  double mn = 0;
  for (double x : mk) mn += x * x;
  mn = std::sqrt(mn) + 1e-30;
  for (int j = 0; j < n; ++j) {
    const float* kj = k.data() + size_t(j) * d;
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += mk[i] * kj[i];
    s[j] = -float(dot / (mn * (std::sqrt(Dot(kj, kj, d)) + 1e-30)));
  }
}

// Expected attention of future queries ~ N(mean, cov) of the window's queries:
// E[exp(q.k / sqrt d)] = exp(mean.k / sqrt d + k' cov k / 2d), weighted by |v|; normalized to
// sum 1 over the head's keys.
void ExpectedScores(const std::vector<float>& k, const std::vector<float>& v, int n,
                    const std::vector<double>& mean, const std::vector<double>& cov, float* s) {
  const int d = n > 0 ? static_cast<int>(k.size() / n) : 0;
  const double rd = 1.0 / std::sqrt(double(d));
  std::vector<double> ls(n);
  double mx = -1e300;
  for (int j = 0; j < n; ++j) {
    const float* kj = k.data() + size_t(j) * d;
    const float* vj = v.data() + size_t(j) * d;
    double mu = 0, quad = 0, vn = 0;
    for (int i = 0; i < d; ++i) {
      mu += mean[i] * kj[i];
      vn += double(vj[i]) * vj[i];
      double row = 0;
      for (int c = 0; c < d; ++c) row += cov[size_t(i) * d + c] * kj[c];
      quad += kj[i] * row;
    }
    ls[j] = mu * rd + quad / (2.0 * d) + 0.5 * std::log(vn + 1e-30);
    mx = std::max(mx, ls[j]);
  }
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += (ls[j] = std::exp(ls[j] - mx));
  for (int j = 0; j < n; ++j) s[j] = float(ls[j] / sum);
}

}  // namespace

Status ScoreTokens(const PressOptions& o, const PagedSequence& seq, int n_layers, int n_kv_heads,
                   const PressObserver* observer, std::vector<std::vector<float>>* scores) {
  if (o.NeedsAttention() && observer == nullptr) {
    return FailedPrecondition(std::string("press '") + ScorerName(o.scorer) +
                              "' needs the prompt's attention weights, but no observer watched "
                              "the prompt");
  }
  scores->assign(size_t(n_layers) * n_kv_heads, {});
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  std::vector<double> mean, cov;
  for (int l = 0; l < n_layers; ++l) {
    for (int h = 0; h < n_kv_heads; ++h) {
      const int ti = l * n_kv_heads + h;
      std::vector<float>& s = (*scores)[ti];
      const int n = seq.head_length(l, h);
      s.assign(n, 0.0f);
      auto weights = [&](PressObserver::Gathering g) -> Status {
        const std::vector<float>& w = observer->weights(l, h, g);
        if (w.empty() && n > 0) {
          return FailedPrecondition(std::string("the prompt was observed without the attention "
                                                "weights press '") +
                                    ScorerName(o.scorer) + "' scores by");
        }
        // Attention passes read the hot table's keys, then the cold table's (demoted tokens,
        // during a chunked prefill): only the hot keys are candidates.
        const int cold = seq.cold_length(l, h);
        if (static_cast<int>(w.size()) != n && static_cast<int>(w.size()) != n + cold) {
          return FailedPrecondition("the press observer saw " + std::to_string(w.size()) +
                                    " keys in layer " + std::to_string(l) + " head " +
                                    std::to_string(h) + " but the cache holds " +
                                    std::to_string(n) + " (compress right after the prompt)");
        }
        s.assign(w.begin(), w.begin() + n);
        return OkStatus();
      };
      switch (o.scorer) {
        case Scorer::kStreaming:
          for (int j = 0; j < n; ++j) s[j] = float(j);  // table order is time order
          break;
        case Scorer::kRandom: {
          std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + ti);
          std::uniform_real_distribution<float> u(0.0f, 1.0f);
          for (float& x : s) x = u(rng);
          break;
        }
        case Scorer::kH2O:
          CACHET_RETURN_IF_ERROR(weights(PressObserver::kAll));
          break;

        case Scorer::kTova:
          CACHET_RETURN_IF_ERROR(weights(PressObserver::kLast));
          break;
        case Scorer::kSnapKV:
        case Scorer::kKvzip:
        case Scorer::kLookahead: {
          // kvzip, lookahead: their probes' largest weights (Session::Compress evaluates them).
          CACHET_RETURN_IF_ERROR(
              weights(o.Probes() ? PressObserver::kWindowMax : PressObserver::kWindow));
          const int r = std::max(o.pool_kernel, 1) / 2;
          if (r > 0) {
            const std::vector<float> w = s;
            for (int j = 0; j < n; ++j) {
              float m = w[j];
              for (int i = std::max(0, j - r); i <= std::min(n - 1, j + r); ++i)
                m = std::max(m, w[i]);
              s[j] = m;
            }
          }
          break;
        }
        case Scorer::kKNorm:
          seq.Gather(l, h, &k, &v, &pos);
          KNormScores(k, n, s.data());
          break;
        case Scorer::kKeyDiff:
          seq.Gather(l, h, &k, &v, &pos);
          KeyDiffScores(k, n, s.data());
          break;
        case Scorer::kExpected:
          seq.Gather(l, h, &k, &v, &pos);
          observer->QueryStats(l, h, o.expected_future, &mean, &cov);
          ExpectedScores(k, v, n, mean, cov, s.data());
          break;
      }
    }
  }
  return OkStatus();
}

size_t PressObserver::bytes() const {
  size_t n = 0;
  for (const Head& h : heads_) {
    for (const auto& w : h.weights) n += w.capacity() * sizeof(float);
    n += (h.q_sum.capacity() + h.q_outer.capacity()) * sizeof(double);
  }
  return n;
}

void PressObserver::Compact(std::span<const std::vector<int32_t>> keep) {
  for (size_t ti = 0; ti < heads_.size() && ti < keep.size(); ++ti) {
    Head& h = heads_[ti];
    std::lock_guard<std::mutex> lock(h.mu);
    for (auto& w : h.weights) {
      if (w.empty()) continue;
      size_t out = 0;
      for (int32_t j : keep[ti]) w[out++] = j < static_cast<int32_t>(w.size()) ? w[j] : 0.0f;
      w.resize(out);
    }
  }
}

void MergeValues(const PagedSequence& seq, int layer, int kv_head, const std::vector<int32_t>& keep,
                 const std::vector<float>* weights, std::vector<float>* values) {
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  seq.Gather(layer, kv_head, &k, &v, &pos);
  const int n = static_cast<int>(pos.size());
  values->clear();
  if (keep.empty() || n == 0) return;
  const int d = static_cast<int>(k.size() / n);
  auto w = [&](int j) { return weights ? std::max((*weights)[j], 1e-6f) : 1.0f; };
  auto cos = [&](int a, int b) {
    const float *ka = k.data() + size_t(a) * d, *kb = k.data() + size_t(b) * d;
    return Dot(ka, kb, d) / (std::sqrt(Dot(ka, ka, d) * Dot(kb, kb, d)) + 1e-30);
  };
  std::vector<double> acc(keep.size() * size_t(d), 0.0), wsum(keep.size(), 0.0);
  for (size_t x = 0; x < keep.size(); ++x) {
    wsum[x] = w(keep[x]);
    for (int i = 0; i < d; ++i) acc[x * d + i] = wsum[x] * v[size_t(keep[x]) * d + i];
  }
  size_t next = 0;  // first kept index > j
  for (int j = 0; j < n; ++j) {
    while (next < keep.size() && keep[next] <= j) ++next;
    if (next > 0 && keep[next - 1] == j) continue;  // kept
    size_t into;
    if (next == 0) {
      into = 0;
    } else if (next == keep.size()) {
      into = next - 1;
    } else {
      into = cos(j, keep[next - 1]) >= cos(j, keep[next]) ? next - 1 : next;
    }
    wsum[into] += w(j);
    for (int i = 0; i < d; ++i) acc[into * d + i] += w(j) * v[size_t(j) * d + i];
  }
  values->resize(keep.size() * size_t(d));
  for (size_t x = 0; x < keep.size(); ++x) {
    for (int i = 0; i < d; ++i) (*values)[x * d + i] = float(acc[x * d + i] / wsum[x]);
  }
}

void PrepareQuest(const PressOptions& o, PagedSequence& seq) {
  if (!o.quest || !(o.ratio >= 0 && o.ratio < 1) || o.budget < 0) return;
  const int pages = o.quest_pages > 0 ? o.quest_pages
                    : o.budget > 0    ? std::max(1, o.budget / seq.layout().page_tokens)
                                      : 0;
  seq.set_quest(pages, 1.0 - o.ratio);
}

namespace {

// Which tokens of each (layer, KV head) no press removes: sinks (by original position), the
// observation window for the scorers that use one, and with protect_boundaries the edge tokens
// at each end of every segment (a share of the mean budget mean_b). Returns the most protected
// in one head.
int ProtectTokens(const PressOptions& o, const PagedSequence& seq, int n_layers, int n_kv_heads,
                  const PressObserver* observer, int64_t mean_b,
                  std::vector<std::vector<uint8_t>>* prot) {
  const bool keeps_window = o.scorer == Scorer::kSnapKV || o.scorer == Scorer::kExpected;
  const int32_t window_from = observer ? observer->end() - o.window : 0;
  std::vector<int32_t> starts = o.segment_starts;
  if (starts.empty()) starts.push_back(0);
  std::sort(starts.begin(), starts.end());
  const int32_t edge = std::max<int32_t>(
      1, static_cast<int32_t>(o.boundary_share * double(mean_b) / (2.0 * starts.size())));
  std::vector<int32_t> pos;
  int protected_max = 0;
  prot->assign(size_t(n_layers) * n_kv_heads, {});
  for (size_t ti = 0; ti < prot->size(); ++ti) {
    seq.Positions(int(ti) / n_kv_heads, int(ti) % n_kv_heads, &pos);
    std::vector<uint8_t>& p = (*prot)[ti];
    p.assign(pos.size(), 0);
    const int32_t end = pos.empty() ? 0 : *std::max_element(pos.begin(), pos.end()) + 1;
    int count = 0;
    for (size_t j = 0; j < pos.size(); ++j) {
      bool keep = pos[j] < o.sinks || (keeps_window && observer && pos[j] >= window_from);
      if (o.protect_boundaries) {
        // The segment holding pos[j]: the last start <= pos[j].
        const auto it = std::upper_bound(starts.begin(), starts.end(), pos[j]);
        if (it != starts.begin()) {
          const int32_t s0 = *(it - 1), s1 = it == starts.end() ? end : *it;
          keep |= pos[j] < s0 + edge || pos[j] >= s1 - edge;
        }
      }
      p[j] = keep;
      count += keep;
    }
    protected_max = std::max(protected_max, count);
  }
  return protected_max;
}

// The scores Ada-KV pools and cross-layer selection combine: attention weights divided by their
// layer's sum, other scores min-max scaled per head; protected tokens infinite.
std::vector<std::vector<float>> PooledScores(const PressOptions& o,
                                             const std::vector<std::vector<float>>& scores,
                                             const std::vector<std::vector<uint8_t>>& prot,
                                             int n_layers, int n_kv_heads) {
  std::vector<std::vector<float>> norm = scores;
  for (int l = 0; l < n_layers; ++l) {
    if (AttentionLike(o.scorer)) {
      double sum = 0;
      for (int h = 0; h < n_kv_heads; ++h)
        for (float x : norm[l * n_kv_heads + h]) sum += x;
      const float inv = sum > 0 ? float(1.0 / sum) : 0.0f;
      for (int h = 0; h < n_kv_heads; ++h)
        for (float& x : norm[l * n_kv_heads + h]) x *= inv;
    } else {
      for (int h = 0; h < n_kv_heads; ++h) {
        auto& s = norm[l * n_kv_heads + h];
        if (s.empty()) continue;
        const auto [lo, hi] = std::minmax_element(s.begin(), s.end());
        const float a = *lo, span = *hi - *lo;
        for (float& x : s) x = span > 0 ? (x - a) / span : 1.0f;
      }
    }
  }
  for (size_t ti = 0; ti < norm.size(); ++ti) {
    for (size_t j = 0; j < norm[ti].size(); ++j) {
      if (prot[ti][j]) norm[ti][j] = kInf;
    }
  }
  return norm;
}

// Cross-layer selection: one set of tokens for every (layer, KV head), by their pooled scores
// combined (max or mean); every head must hold the same tokens.
Status SharedKeep(const PressOptions& o, const PagedSequence& seq, int n_kv_heads,
                  const std::vector<std::vector<float>>& norm, int budget,
                  std::vector<std::vector<int32_t>>* keep) {
  const int T = static_cast<int>(norm.size());
  std::vector<int32_t> pos0, pos;
  seq.Positions(0, 0, &pos0);
  for (int ti = 1; ti < T; ++ti) {
    seq.Positions(ti / n_kv_heads, ti % n_kv_heads, &pos);
    if (pos != pos0) {
      return FailedPrecondition(
          "cross-layer selection needs every (layer, KV head) to hold the same tokens; this "
          "cache was already compressed per head");
    }
  }
  std::vector<float> combined(pos0.size(), o.share == ShareLayers::kMax ? -kInf : 0.0f);
  for (int ti = 0; ti < T; ++ti) {
    for (size_t j = 0; j < combined.size(); ++j) {
      combined[j] = o.share == ShareLayers::kMax ? std::max(combined[j], norm[ti][j])
                                                 : combined[j] + norm[ti][j] / T;
    }
  }
  if (o.scorer == Scorer::kH2O) ProtectRecentHalf(combined, budget);
  const std::vector<int32_t> shared = TopIndices(combined, budget);
  for (auto& k : *keep) k = shared;
  return OkStatus();
}

}  // namespace

Result<PressResult> Compress(const PressOptions& o, PagedSequence& seq, int n_layers,
                             int n_kv_heads, const PressObserver* observer,
                             PressObserver* compact_observer) {
  if (!(o.ratio >= 0 && o.ratio < 1)) {
    return InvalidArgument("press ratio is the fraction of KV removed and must be in [0, 1)");
  }
  if (o.budget < 0) return InvalidArgument("press budget must be a positive token count");
  if (o.merge && !o.demote.empty()) {
    return InvalidArgument("a press either merges evicted tokens or demotes them, not both");
  }
  const int T = n_layers * n_kv_heads;
  PressResult r;
  r.bytes_before = r.bytes_after = seq.bytes_held();
  if (o.quest) {
    PrepareQuest(o, seq);
    for (int l = 0; l < n_layers; ++l)
      for (int h = 0; h < n_kv_heads; ++h) r.tokens_before += seq.head_length(l, h);
    r.tokens_after = r.tokens_before;
    return r;
  }
  int n_max = 0;
  for (int l = 0; l < n_layers; ++l) {
    for (int h = 0; h < n_kv_heads; ++h) {
      r.tokens_before += seq.head_length(l, h);
      n_max = std::max(n_max, seq.head_length(l, h));
    }
  }
  std::vector<std::vector<float>> scores;
  CACHET_RETURN_IF_ERROR(ScoreTokens(o, seq, n_layers, n_kv_heads, observer, &scores));
  // Merge weights: attention scores as they came (protection overwrites scores below).
  const std::vector<std::vector<float>> merge_w =
      o.merge && AttentionLike(o.scorer) ? scores : std::vector<std::vector<float>>{};
  const int64_t mean_b =
      o.budget > 0 ? o.budget : std::llround((1.0 - o.ratio) * static_cast<double>(n_max));
  std::vector<std::vector<uint8_t>> prot;
  const int protected_max = ProtectTokens(o, seq, n_layers, n_kv_heads, observer, mean_b, &prot);
  const bool pooled = o.share != ShareLayers::kNone || o.allocator == Allocator::kAda;
  const std::vector<std::vector<float>> norm =
      pooled ? PooledScores(o, scores, prot, n_layers, n_kv_heads)
             : std::vector<std::vector<float>>{};

  // Budgets, then the tokens each (layer, KV head) keeps.
  std::vector<int> budgets;
  if (o.share != ShareLayers::kNone) {
    budgets.assign(T, static_cast<int>(std::clamp<int64_t>(mean_b, protected_max, n_max)));
  } else {
    budgets = AllocateBudgets(o, n_layers, n_kv_heads, n_max, mean_b * T, protected_max, norm);
  }
  std::vector<std::vector<int32_t>> keep(T);
  if (o.share != ShareLayers::kNone) {
    CACHET_RETURN_IF_ERROR(SharedKeep(o, seq, n_kv_heads, norm, budgets[0], &keep));
  } else {
    for (int ti = 0; ti < T; ++ti) {
      std::vector<float>& s = scores[ti];
      for (size_t j = 0; j < s.size(); ++j) {
        if (prot[ti][j]) s[j] = kInf;
      }
      const int b = std::min<int>(budgets[ti], static_cast<int>(s.size()));
      if (o.scorer == Scorer::kH2O) ProtectRecentHalf(s, b);
      keep[ti] = TopIndices(s, b);
    }
  }
  std::vector<std::vector<float>> merged;
  if (o.merge) {
    merged.resize(T);
    for (int ti = 0; ti < T; ++ti) {
      MergeValues(seq, ti / n_kv_heads, ti % n_kv_heads, keep[ti],
                  merge_w.empty() ? nullptr : &merge_w[ti], &merged[ti]);
    }
  }
  CACHET_RETURN_IF_ERROR(seq.Retain(keep, /*demote=*/!o.demote.empty(), merged));
  if (compact_observer) compact_observer->Compact(keep);
  for (const auto& k : keep) r.tokens_after += static_cast<int64_t>(k.size());
  r.bytes_after = seq.bytes_held();
  return r;
}

}  // namespace cachet::press
