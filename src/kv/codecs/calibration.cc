#include "kv/codecs/calibration.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kv/codecs/calibrated_rows.h"
#include "util/byte_io.h"
#include "util/mmap_file.h"

namespace cachet::codecs {
namespace {

constexpr char kMagic[8] = {'C', 'K', 'V', 'C', 'A', 'L', '\n', 0};
constexpr uint32_t kVersion = 3;  // 3: the kvq channel statistics
constexpr uint32_t kMaxDimInFile = 512;
constexpr uint32_t kMaxTablesInFile = 1u << 16;

// The pooled greedy allotment: a bit goes where it removes the most weighted error,
// weight_i sigma_i^2 (D(b) - D(b + 1)), until bits * dim are spent.
std::vector<uint8_t> AllotBits(int dim, int bits, const float* sigma, const float* weight,
                               const float* distortion) {
  std::vector<uint8_t> b(dim, 0);
  for (int spent = 0; spent < bits * dim; ++spent) {
    int best = -1;
    double gain = -1;
    for (int i = 0; i < dim; ++i) {
      if (b[i] >= kCalMaxBits) continue;
      const double g =
          double(weight[i]) * sigma[i] * sigma[i] * (distortion[b[i]] - distortion[b[i] + 1]);
      if (g > gain) gain = g, best = i;
    }
    if (best < 0) break;
    ++b[best];
  }
  return b;
}

}  // namespace

void SymmetricEigen(std::span<const double> a_in, int n, std::vector<double>* values,
                    std::vector<double>* vectors) {
  std::vector<double> a(a_in.begin(), a_in.end()), v(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) v[size_t(i) * n + i] = 1.0;
  auto A = [&](int i, int j) -> double& { return a[size_t(i) * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; ++i) {
      diag += A(i, i) * A(i, i);
      for (int j = i + 1; j < n; ++j) off += A(i, j) * A(i, j);
    }
    if (off <= 1e-22 * std::max(diag, 1e-300)) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        if (std::fabs(A(p, q)) < 1e-300) continue;
        const double theta = (A(q, q) - A(p, p)) / (2 * A(p, q));
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A <- J^T A J: columns p, q, then rows p, q
          const double akp = A(k, p), akq = A(k, q);
          A(k, p) = c * akp - s * akq;
          A(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {
          const double apk = A(p, k), aqk = A(q, k);
          A(p, k) = c * apk - s * aqk;
          A(q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {  // V <- V J: column k of V is an eigenvector
          const double vkp = v[size_t(k) * n + p], vkq = v[size_t(k) * n + q];
          v[size_t(k) * n + p] = c * vkp - s * vkq;
          v[size_t(k) * n + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return A(x, x) > A(y, y); });
  values->resize(n);
  vectors->resize(size_t(n) * n);
  for (int r = 0; r < n; ++r) {
    (*values)[r] = A(order[r], order[r]);
    for (int k = 0; k < n; ++k) (*vectors)[size_t(r) * n + k] = v[size_t(k) * n + order[r]];
  }
}

double FitLevels(std::span<const float> sorted, int bits, float* levels) {
  const int m = 1 << bits;
  const size_t n = sorted.size();
  if (n == 0) {
    for (int i = 0; i < m; ++i) levels[i] = 0;
    return 0;
  }
  std::vector<double> prefix(n + 1, 0.0), prefix2(n + 1, 0.0);
  for (size_t i = 0; i < n; ++i) {
    prefix[i + 1] = prefix[i] + sorted[i];
    prefix2[i + 1] = prefix2[i] + double(sorted[i]) * sorted[i];
  }
  std::vector<double> lv(m);
  for (int i = 0; i < m; ++i) lv[i] = sorted[std::min(n - 1, size_t((i + 0.5) / m * n))];
  std::vector<size_t> edge(m + 1);
  double mse = 0;
  for (int iter = 0; iter < 60; ++iter) {
    edge[0] = 0;
    edge[m] = n;
    for (int i = 1; i < m; ++i) {
      const float t = static_cast<float>(0.5 * (lv[i - 1] + lv[i]));
      edge[i] = std::max(
          edge[i - 1], size_t(std::upper_bound(sorted.begin(), sorted.end(), t) - sorted.begin()));
    }
    double err = 0, moved = 0;
    for (int i = 0; i < m; ++i) {
      const size_t a = edge[i], b = edge[i + 1];
      if (b > a) {
        const double mean = (prefix[b] - prefix[a]) / double(b - a);
        moved = std::max(moved, std::fabs(mean - lv[i]));
        lv[i] = mean;
      }
      // sum (x - l)^2 over the cell
      err += prefix2[b] - prefix2[a] - 2 * lv[i] * (prefix[b] - prefix[a]) +
             double(b - a) * lv[i] * lv[i];
    }
    mse = err / double(n);
    if (moved < 1e-7) break;
  }
  std::sort(lv.begin(), lv.end());
  for (int i = 0; i < m; ++i) levels[i] = static_cast<float>(lv[i]);
  return mse;
}

namespace {

// The expected weighted error of a row coded with these widths: sum_i w_i sigma_i^2 D(b_i).
double ExpectedError(const std::vector<uint8_t>& b, const float* sigma, const float* weight,
                     const float* distortion) {
  double e = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    e += double(weight[i]) * sigma[i] * sigma[i] * distortion[b[i]];
  }
  return e;
}

// Allots the bits over the coordinates and lays their codes out after `header` bytes of a row;
// table: each coordinate's levels times its sigma. prefer_uniform: one width for every coordinate
// unless the allotment removes more than a tenth of the expected error (the kvq decoder reads one
// width at once: kvtiny's kvq4 decodes 1.3x faster with every table uniform, but its keys' KL is
// 0.035 so against 0.031 allotted; this rule keeps 12 of its 16 key tables allotted: 0.031).
void LayOut(int dim, int bits, const float* sigma, const float* weight, const float* distortion,
            const float* pooled_levels, size_t header, bool prefer_uniform, CalPlan* p) {
  p->bits = AllotBits(dim, bits, sigma, weight, distortion);
  const std::vector<uint8_t> uniform(dim, static_cast<uint8_t>(bits));
  if (prefer_uniform && ExpectedError(p->bits, sigma, weight, distortion) >
                            0.9 * ExpectedError(uniform, sigma, weight, distortion)) {
    p->bits = uniform;
  }
  p->sigma.assign(sigma, sigma + dim);
  p->weight.assign(weight, weight + dim);
  p->level_at.resize(dim);
  p->byte_at.resize(dim);
  p->shift.resize(dim);
  p->mask.resize(dim);
  p->table.clear();
  int bit = 0;
  for (int i = 0; i < dim; ++i) {
    p->byte_at[i] = static_cast<int32_t>(header) + bit / 8;
    p->shift[i] = bit % 8;
    p->mask[i] = (1 << p->bits[i]) - 1;
    bit += p->bits[i];
    p->level_at[i] = static_cast<int32_t>(p->table.size());
    if (p->bits[i] == 0) continue;
    const float* lv = pooled_levels + ((1 << p->bits[i]) - 2);
    for (int l = 0; l < 1 << p->bits[i]; ++l) p->table.push_back(sigma[i] * lv[l]);
  }
  p->table.push_back(0.0f);
  for (int i = 0; i < dim; ++i) {
    if (p->bits[i] == 0) p->level_at[i] = static_cast<int32_t>(p->table.size()) - 1;
  }
  p->uniform = std::all_of(p->bits.begin(), p->bits.end(), [&](uint8_t b) { return b == bits; });
  const int widest = *std::max_element(p->bits.begin(), p->bits.end());
  const int narrowest = *std::min_element(p->bits.begin(), p->bits.end());
  p->wide.clear();
  for (int i = 0; i < dim; ++i) {
    if (p->bits[i] > 5) p->wide.push_back(i);
  }
  p->lanes_ok = dim % 16 == 0 && narrowest >= 1 && int(p->wide.size()) <= CalPlan::kMaxWide;
  p->lane_base.assign(dim / 16, 0);
  p->lane_word.assign(dim, 0);
  p->lane_bit.assign(dim, 0);
  p->lane_level.assign(dim, 0);
  for (int i = 0; i < dim && p->lanes_ok; ++i) {
    const int at = 8 * p->byte_at[i] + p->shift[i];
    if (i % 16 == 0) p->lane_base[i / 16] = at / 32;
    p->lane_word[i] = at / 32 - p->lane_base[i / 16];
    p->lane_bit[i] = at % 32;
    p->lane_level[i] = p->bits[i] <= 5 ? (1 << p->bits[i]) - 2 : 0;
    p->lanes_ok = p->lane_word[i] <= 14;  // (16 codes of <= 8 bits span at most 5 dwords)
  }
  p->mids.assign(size_t(2) << widest, 0.0f);
  for (int b = 1; b <= widest; ++b) {
    const size_t at = (size_t(1) << b) - 2;
    for (int l = 0; l + 1 < 1 << b; ++l) {
      p->mids[at + l] = 0.5f * (pooled_levels[at + l] + pooled_levels[at + l + 1]);
    }
  }
}

}  // namespace

void MakePlans(Calibration* c) {
  const int tables = c->n_layers * c->n_kv_heads;
  c->plans.assign(size_t(kCalKinds) * 3 * tables * 2, {});
  for (int kind = 0; kind < kCalKinds; ++kind) {
    for (int bits = 2; bits <= 4; ++bits) {
      for (int t = 0; t < tables; ++t) {
        for (Role role : {Role::kKey, Role::kValue}) {
          const HeadStats& h = c->head(t, role);
          CalPlan& p = c->plans[c->PlanIndex(CalKind(kind), bits, t, role)];
          p.stats = &h;
          p.dim = c->head_dim;
          p.bits_per_value = bits;
          const int d = c->head_dim;
          if (kind == int(CalKind::kPca)) {
            // Axes are scaled by at least 1% of the largest axis's deviation: along an axis a
            // repetitive calibration text never moved (variance 0), a row's coordinate over a
            // zero sigma sent its scale past f16 and every logit to NaN. (kvtiny's real
            // calibrations: the smallest variance is 0.0066 of the largest, above the floor.)
            const float floor =
                std::max(1e-4f * *std::max_element(h.variance.begin(), h.variance.end()), 1e-20f);
            std::vector<float> sigma(d);
            for (int i = 0; i < d; ++i) sigma[i] = std::sqrt(std::max(h.variance[i], floor));
            // (after the row's f16 scale)
            LayOut(d, bits, sigma.data(), h.weight.data(), h.distortion.data(), h.levels.data(), 2,
                   /*prefer_uniform=*/false, &p);
            p.channel_factor.resize(d);
            for (int i = 0; i < d; ++i) {
              p.channel_factor[i] = std::sqrt(std::max(h.channel_std[i], 1e-6f));
            }
            std::vector<int> by_weight(d);
            std::iota(by_weight.begin(), by_weight.end(), 0);
            std::stable_sort(by_weight.begin(), by_weight.end(),
                             [&](int a, int b) { return h.weight[a] > h.weight[b]; });
            const int rank = std::min(kGearRank, d);
            p.gear_axes.assign(size_t(kGearRank) * d, 0.0f);
            for (int j = 0; j < rank; ++j) {
              std::copy_n(h.axes.begin() + size_t(by_weight[j]) * d, d,
                          p.gear_axes.begin() + size_t(j) * d);
            }
          } else {
            LayOut(d, bits, h.ch_scale.data(), h.ch_weight.data(), h.ch_distortion.data(),
                   h.ch_levels.data(), KvqCodesOffset(d), /*prefer_uniform=*/true, &p);
            p.outlier_step.resize(d);
            for (int i = 0; i < d; ++i) p.outlier_step[i] = KvqOutlierStep(h.ch_zmax, p.bits[i]);
          }
        }
      }
    }
  }
}

uint64_t Calibration::Hash() const {
  XXH3_state_t* s = XXH3_createState();
  XXH3_64bits_reset(s);
  auto add = [&](const auto& v) {
    if (!v.empty()) XXH3_64bits_update(s, v.data(), v.size() * sizeof(v[0]));
  };
  XXH3_64bits_update(s, &model_hash, sizeof(model_hash));
  for (const HeadStats& h : heads) {
    add(h.mean), add(h.axes), add(h.variance), add(h.weight), add(h.levels);
    add(h.ch_mean), add(h.ch_scale), add(h.ch_weight), add(h.ch_levels);
    XXH3_64bits_update(s, &h.ch_zmax, sizeof(h.ch_zmax));
  }
  const uint64_t out = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return out;
}

Status SaveCalibration(const Calibration& c, const std::string& path) {
  ByteWriter w;
  w.Bytes(kMagic, sizeof(kMagic));
  w.Put<uint32_t>(kVersion);
  w.Put<uint64_t>(c.model_hash);
  w.Put<int32_t>(c.n_layers);
  w.Put<int32_t>(c.n_kv_heads);
  w.Put<int32_t>(c.head_dim);
  w.Put<int64_t>(c.tokens);
  w.PutString(c.source);
  for (const HeadStats& h : c.heads) {
    w.PutVector(h.mean);
    w.PutVector(h.channel_std);
    w.PutVector(h.outliers);
    w.PutVector(h.axes);
    w.PutVector(h.variance);
    w.PutVector(h.weight);
    w.PutVector(h.levels);
    w.PutVector(h.distortion);
    w.PutVector(h.ch_mean);
    w.PutVector(h.ch_scale);
    w.PutVector(h.ch_weight);
    w.PutVector(h.ch_levels);
    w.PutVector(h.ch_distortion);
    w.Put<float>(h.ch_zmax);
  }
  const uint64_t sum = XXH3_64bits(w.out().data(), w.out().size());
  w.Put<uint64_t>(sum);
  return WriteFileAtomically(path, w.out());
}

Result<Calibration> LoadCalibration(const std::string& path) {
  const Result<std::string> file = ReadTextFile(path);
  if (!file.ok()) {
    return NotFound(path + ": no such calibration file (make one with `cachet calibrate`)");
  }
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(file->data()),
                                       file->size());
  const std::string kind = path + ": calibration";
  if (bytes.size() < sizeof(kMagic) + 8 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return DataLoss(kind + ": not a .kvcal file (no CKVCAL header)");
  }
  uint64_t sum;
  std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
  if (XXH3_64bits(bytes.data(), bytes.size() - 8) != sum) {
    return DataLoss(kind + ": checksum mismatch (the file is damaged or truncated)");
  }
  ByteReader r(bytes.first(bytes.size() - 8), kind, sizeof(kMagic));
  const uint32_t version = r.Get<uint32_t>("version");
  if (r.ok() && version != kVersion) {
    return DataLoss(kind + ": version " + std::to_string(version) + ", this build reads " +
                    std::to_string(kVersion) + " (run `cachet calibrate` again)");
  }
  Calibration c;
  c.model_hash = r.Get<uint64_t>("model hash");
  c.n_layers = r.Get<int32_t>("layers");
  c.n_kv_heads = r.Get<int32_t>("KV heads");
  c.head_dim = r.Get<int32_t>("head_dim");
  c.tokens = r.Get<int64_t>("tokens");
  c.source = r.GetString("source");
  const int64_t tables = int64_t(c.n_layers) * c.n_kv_heads;
  if (r.ok() && (c.n_layers <= 0 || c.n_kv_heads <= 0 || tables > kMaxTablesInFile ||
                 c.head_dim <= 0 || c.head_dim > int(kMaxDimInFile))) {
    r.Fail("shape", std::to_string(c.n_layers) + " layers x " + std::to_string(c.n_kv_heads) +
                        " KV heads x head_dim " + std::to_string(c.head_dim) + " is out of range");
  }
  const uint32_t d = static_cast<uint32_t>(std::max(c.head_dim, 0));
  auto get = [&](std::vector<float>* v, size_t n, const char* what) {
    *v = r.GetVector<float>(n, what);
    if (r.ok() && v->size() != n) {
      r.Fail(what, std::to_string(v->size()) + " entries, expected " + std::to_string(n));
    }
  };
  for (int64_t i = 0; r.ok() && i < tables * 2; ++i) {
    HeadStats h;
    get(&h.mean, d, "mean");
    get(&h.channel_std, d, "channel std");
    h.outliers = r.GetVector<int32_t>(d, "outliers");
    for (int32_t o : h.outliers) {
      if (r.ok() && (o < 0 || o >= int(d))) r.Fail("outliers", "channel out of range");
    }
    get(&h.axes, d * d, "axes");
    get(&h.variance, d, "variance");
    get(&h.weight, d, "weight");
    get(&h.levels, kCalLevels, "levels");
    get(&h.distortion, kCalMaxBits + 1, "distortion");
    get(&h.ch_mean, d, "channel mean");
    get(&h.ch_scale, d, "channel scale");
    get(&h.ch_weight, d, "channel weight");
    get(&h.ch_levels, kCalLevels, "channel levels");
    get(&h.ch_distortion, kCalMaxBits + 1, "channel distortion");
    h.ch_zmax = r.Get<float>("outlier range");
    c.heads.push_back(std::move(h));
  }
  if (r.ok() && r.at() != bytes.size() - 8) r.Fail("end", "bytes follow the last head");
  if (!r.ok()) return r.status();
  MakePlans(&c);
  return c;
}

CalibrationBuilder::CalibrationBuilder(int n_layers, int n_kv_heads, int head_dim, int max_rows)
    : n_layers_(n_layers),
      n_kv_heads_(n_kv_heads),
      dim_(head_dim),
      max_rows_(max_rows),
      acc_(size_t(n_layers) * n_kv_heads * 2),
      q2_(size_t(n_layers) * n_kv_heads, std::vector<double>(size_t(head_dim) * head_dim, 0.0)),
      q_n_(size_t(n_layers) * n_kv_heads, 0) {
  ch_acc_.resize(acc_.size());
  for (Acc& a : acc_) {
    a.sum.assign(dim_, 0.0);
    a.outer.assign(size_t(dim_) * dim_, 0.0);
  }
  for (Acc& a : ch_acc_) {
    a.sum.assign(dim_, 0.0);
    a.outer.assign(dim_, 0.0);
  }
}

void CalibrationBuilder::AddRows(int table, Role role, std::span<const float> rows) {
  Add(acc_[size_t(table) * 2 + (role == Role::kValue)], rows, true);
}

void CalibrationBuilder::AddChannelRows(int table, Role role, std::span<const float> rows) {
  Add(ch_acc_[size_t(table) * 2 + (role == Role::kValue)], rows, false);
}

void CalibrationBuilder::Add(Acc& a, std::span<const float> rows, bool full_outer) {
  const int d = dim_;
  const int64_t n = int64_t(rows.size()) / d;
  for (int64_t t = 0; t < n; ++t) {
    const float* x = rows.data() + t * d;
    for (int i = 0; i < d; ++i) {
      a.sum[i] += x[i];
      const double xi = x[i];
      if (!full_outer) {
        a.outer[i] += xi * xi;
        continue;
      }
      double* o = a.outer.data() + size_t(i) * d;
      for (int j = 0; j <= i; ++j) o[j] += xi * x[j];
    }
    // Keep every row until max_rows, then replace evenly (a deterministic reservoir).
    const int64_t seen = a.n++;
    if (seen < max_rows_) {
      a.sample.insert(a.sample.end(), x, x + d);
    } else {
      const uint64_t h = XXH3_64bits(&seen, sizeof(seen)) % uint64_t(seen + 1);
      if (h < uint64_t(max_rows_)) std::copy(x, x + d, a.sample.begin() + int64_t(h) * d);
    }
  }
}

void CalibrationBuilder::AddQueryMoment(int table, std::span<const double> moment, int64_t n) {
  for (size_t i = 0; i < moment.size(); ++i) q2_[table][i] += moment[i] * double(n);
  q_n_[table] += n;
}

void CalibrationBuilder::FinishChannels(int table, Role role, const Acc& a, HeadStats* h) const {
  const int d = dim_, k = KvqOutliers(d);
  h->ch_mean.resize(d);
  h->ch_scale.resize(d);
  std::vector<double> inv(d);
  for (int i = 0; i < d; ++i) {
    const double m = a.sum[i] / double(a.n);
    const double sd = std::sqrt(std::max(a.outer[i] / double(a.n) - m * m, 0.0));
    h->ch_mean[i] = float(m);
    h->ch_scale[i] = float(sd);
    inv[i] = sd > 1e-10 ? 1.0 / sd : 0.0;
  }
  // z of the sampled rows as the codec sees them: each row's k largest |z| are its outliers,
  // coded apart, so the levels fit the rest over their RMS.
  const int64_t rows = int64_t(a.sample.size()) / d;
  std::vector<float> z, zr(d);
  std::vector<int> order(d);
  z.reserve(size_t(rows) * (d - k));
  double zmax = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = a.sample.data() + r * d;
    for (int i = 0; i < d; ++i) {
      zr[i] = float((x[i] - h->ch_mean[i]) * inv[i]);
      zmax = std::max(zmax, double(std::fabs(zr[i])));
    }
    std::iota(order.begin(), order.end(), 0);  // order[k..]: the channels that are not outliers
    std::nth_element(order.begin(), order.begin() + k, order.end(),
                     [&](int x, int y) { return std::fabs(zr[x]) > std::fabs(zr[y]); });
    double ss = 0;
    for (int j = k; j < d; ++j) ss += double(zr[order[j]]) * zr[order[j]];
    const double rms = std::sqrt(ss / std::max(1, d - k));
    for (int j = k; j < d; ++j) z.push_back(rms > 0 ? float(zr[order[j]] / rms) : 0.0f);
  }
  std::sort(z.begin(), z.end());
  h->ch_levels.assign(kCalLevels, 0.0f);
  h->ch_distortion.assign(kCalMaxBits + 1, 0.0f);
  double m2 = 0;
  for (float v : z) m2 += double(v) * v;
  h->ch_distortion[0] = z.empty() ? 1.0f : float(m2 / double(z.size()));
  for (int b = 1; b <= kCalMaxBits; ++b) {
    h->ch_distortion[b] = std::min(h->ch_distortion[b - 1],
                                   float(FitLevels(z, b, h->ch_levels.data() + ((1 << b) - 2))));
  }
  // What an error in a channel costs. A key's error e before RoPE moves a score by
  // (R(p_q - p_k) q) . e: the rotation mixes each channel pair, so a channel weighs its pair's
  // mean query energy (E[q q^T]'s diagonal, after RoPE: a pair's energy is the same either side).
  h->ch_weight.assign(d, 1.0f);
  if (role == Role::kKey && q_n_[table] > 0) {
    const std::vector<double>& m = q2_[table];
    const int half = d / 2;
    for (int j = 0; j < half; ++j) {
      const double w =
          0.5 * (m[size_t(j) * d + j] + m[size_t(j + half) * d + j + half]) / double(q_n_[table]);
      h->ch_weight[j] = h->ch_weight[j + half] = float(w);
    }
  }
  // Rows past the sample's largest |z| clamp to it: a margin for the text not seen.
  h->ch_zmax = float(std::max(zmax * 1.25, 1.0));
}

Result<Calibration> CalibrationBuilder::Finish(int outliers, uint64_t model_hash,
                                               std::string source) {
  const int d = dim_, tables = n_layers_ * n_kv_heads_;
  Calibration c;
  c.model_hash = model_hash;
  c.n_layers = n_layers_;
  c.n_kv_heads = n_kv_heads_;
  c.head_dim = d;
  c.source = std::move(source);
  c.tokens = acc_.empty() ? 0 : acc_[0].n;
  outliers = std::clamp(outliers, 0, d);
  for (int t = 0; t < tables; ++t) {
    for (Role role : {Role::kKey, Role::kValue}) {
      const Acc& a = acc_[size_t(t) * 2 + (role == Role::kValue)];
      if (a.n < 2) {
        return InvalidArgument("calibration: too few tokens (" + std::to_string(a.n) + ")");
      }
      HeadStats h;
      std::vector<double> mean(d), cov(size_t(d) * d);
      for (int i = 0; i < d; ++i) mean[i] = a.sum[i] / double(a.n);
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j <= i; ++j) {
          const double v = a.outer[size_t(i) * d + j] / double(a.n) - mean[i] * mean[j];
          cov[size_t(i) * d + j] = cov[size_t(j) * d + i] = v;
        }
      }
      h.mean.assign(mean.begin(), mean.end());
      h.channel_std.resize(d);
      for (int i = 0; i < d; ++i)
        h.channel_std[i] = float(std::sqrt(std::max(cov[size_t(i) * d + i], 0.0)));
      std::vector<int32_t> order(d);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int x, int y) { return h.channel_std[x] > h.channel_std[y]; });
      h.outliers.assign(order.begin(), order.begin() + outliers);
      std::vector<double> values, vectors;
      SymmetricEigen(cov, d, &values, &vectors);
      h.axes.assign(vectors.begin(), vectors.end());
      h.variance.resize(d);
      for (int i = 0; i < d; ++i) h.variance[i] = float(std::max(values[i], 0.0));
      h.weight.assign(d, 1.0f);
      if (role == Role::kKey && q_n_[t] > 0) {  // w_i = a_i^T E[q q^T] a_i
        const std::vector<double>& m = q2_[t];
        for (int i = 0; i < d; ++i) {
          const double* ax = vectors.data() + size_t(i) * d;
          double s = 0;
          for (int x = 0; x < d; ++x) {
            double row = 0;
            for (int y = 0; y < d; ++y) row += m[size_t(x) * d + y] * ax[y];
            s += ax[x] * row;
          }
          h.weight[i] = float(s / double(q_n_[t]));
        }
      }
      // The sampled rows' normalized coordinates, as the codec makes them: z_i = c_i / sigma_i
      // over the row's RMS of z (axes of no variance left out).
      const int64_t rows = int64_t(a.sample.size()) / d;
      std::vector<float> z;
      z.reserve(a.sample.size());
      std::vector<double> zr(d);
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = a.sample.data() + r * d;
        double ss = 0;
        int live = 0;
        for (int i = 0; i < d; ++i) {
          const double* ax = vectors.data() + size_t(i) * d;
          double ci = 0;
          for (int k = 0; k < d; ++k) ci += ax[k] * (x[k] - mean[k]);
          const double sg = std::sqrt(std::max(values[i], 0.0));
          zr[i] = sg > 1e-10 ? ci / sg : 0.0;
          if (sg > 1e-10) ss += zr[i] * zr[i], ++live;
        }
        const double rms = live > 0 ? std::sqrt(ss / live) : 0.0;
        for (int i = 0; i < d; ++i) {
          if (rms > 0 && values[i] > 1e-20) z.push_back(float(zr[i] / rms));
        }
      }
      std::sort(z.begin(), z.end());
      h.levels.assign(kCalLevels, 0.0f);
      h.distortion.assign(kCalMaxBits + 1, 0.0f);
      double m2 = 0;
      for (float v : z) m2 += double(v) * v;
      h.distortion[0] = z.empty() ? 1.0f : float(m2 / double(z.size()));
      for (int b = 1; b <= kCalMaxBits; ++b) {
        h.distortion[b] =
            std::min(h.distortion[b - 1], float(FitLevels(z, b, h.levels.data() + ((1 << b) - 2))));
      }
      const Acc& ch = ch_acc_[size_t(t) * 2 + (role == Role::kValue)];
      if (ch.n < 2) {
        return InvalidArgument("calibration: too few channel rows (" + std::to_string(ch.n) + ")");
      }
      FinishChannels(t, role, ch, &h);
      c.heads.push_back(std::move(h));
    }
  }
  MakePlans(&c);
  return c;
}

}  // namespace cachet::codecs
