// Calibrated KV codecs: what `cachet calibrate` measures per (layer, KV head) and role on
// calibration text (a .kvcal file next to the model), and the plans the pca and kvq codecs derive
// from it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cachet/status.h"
#include "kv/codecs/codec.h"

namespace cachet::codecs {

inline constexpr int kCalMaxBits = 8;
inline constexpr int kCalLevels = (2 << kCalMaxBits) - 2;  // the levels of 1 .. 8 bits

// One (layer, KV head, role): rows as the cache holds them (keys after RoPE).
struct HeadStats {
  std::vector<float> mean;         // [dim]
  std::vector<float> channel_std;  // [dim]
  std::vector<int32_t> outliers;   // the channels of largest std, largest first
  // [dim][dim]: row i is the i-th principal axis (unit), in order of decreasing variance.
  std::vector<float> axes;
  std::vector<float> variance;  // [dim] along each axis
  // [dim] what an error along each axis costs: for keys the queries' mean square along it (an
  // error e in a key moves the score by q.e), for values 1.
  std::vector<float> weight;
  // Lloyd-Max levels fitted to the normalized coordinates of every axis (a coordinate over its
  // axis's standard deviation and the row's scale, as the pca codecs quantize them), for 1 .. 8
  // bits, ascending, concatenated: Levels(b) has 1 << b of them. Pooled over the axes: levels
  // fitted per axis measured worse on held-out text (they fit the sample's noise).
  std::vector<float> levels;
  std::vector<float> distortion;  // [9]: their mean square error at 0 .. 8 bits
  const float* Levels(int bits) const { return levels.data() + ((1 << bits) - 2); }

  // The kvq codecs' per-channel statistics, of rows as they store them (keys before RoPE): each
  // channel's mean and standard deviation, what an error in it costs, Lloyd-Max levels (as
  // `levels`) of z = (x - mean) / std over the row's RMS once each row's KvqOutliers largest |z|
  // are set apart, and the range of |z| the outliers' codes span.
  std::vector<float> ch_mean, ch_scale;  // [dim]
  std::vector<float> ch_weight;          // [dim] what an error in each channel costs (as weight)
  std::vector<float> ch_levels;          // [kCalLevels]
  std::vector<float> ch_distortion;      // [9]
  float ch_zmax = 0;
  const float* ChannelLevels(int bits) const { return ch_levels.data() + ((1 << bits) - 2); }
};

// How a calibrated codec stores one (layer, KV head, role).
// pca: a row x becomes c = A (x - mean) on the principal axes, then each axis i gets bits[i] bits
// (the budget of `bits` per value spent where weight x variance is largest, by greedy reverse
// water-filling), coded as the nearest level of c_i / (sigma_i r) with r the row's f16 scale.
// kvq: the same allotment over the channels (sigma: ch_scale, weight: ch_weight), channel i coded
// as the nearest of its levels to (x_i - ch_mean_i) / (ch_scale_i r), r the row's scale byte's.
struct CalPlan {
  const HeadStats* stats = nullptr;
  int dim = 0;
  int bits_per_value = 0;     // the codec's: bits[] averages it
  std::vector<uint8_t> bits;  // [dim]
  std::vector<float> sigma;   // [dim] standard deviation along each axis
  std::vector<float> weight;  // [dim] what the row scale's fit weighs each axis by
  std::vector<float> table;   // each axis's levels times its sigma, concatenated, then one 0
  // [dim] where axis i's levels start in table (an axis of no bits: at the final 0), and where its
  // code sits in a row: the little-endian 32-bit word at byte byte_at[i], shifted right by
  // shift[i], masked by mask[i] (what the SIMD decoder gathers).
  std::vector<int32_t> level_at, byte_at, shift, mask;
  std::vector<float> outlier_step;  // kvq: [dim] an outlier's code step in z, by its channel's bits
  bool uniform = false;             // every coordinate has bits_per_value bits
  // The kvq decoder's view of rows of mixed widths (lanes_ok: dim a multiple of 16, every width at
  // least 1 bit and at most kMaxWide of more than 5): code i's first bit is bit lane_bit[i] of
  // dword lane_word[i] of the row's 16-dword window that starts at dword lane_base[i / 16]; its
  // levels start at lane_level[i] among the pooled ones, which fit four vectors of 16 up to 5 bits.
  // The wider channels are decoded apart.
  static constexpr int kMaxWide = 4;
  std::vector<int32_t> lane_base, lane_word, lane_bit, lane_level, wide;
  bool lanes_ok = false;
  // Midpoints of the pooled levels the codes index, laid out as they are (width b's 1 << b levels
  // at (1 << b) - 2: their midpoints from there): the encoder's thresholds.
  std::vector<float> mids;
  // cq4 (which reads the pca plans' statistics): [dim] each channel's factor, the square root of
  // its calibrated standard deviation (floored: a channel the calibration never saw move). Of the
  // powers of the deviation 0, 0.25, 0.4, 0.5, 0.75, 1 and 1.25, 0.5 gave the least KL (kvtiny's
  // held-out windows, docs/BENCHMARKS.md): not dividing leaves a block's range to its widest
  // channels; dividing by the deviation itself gives every channel an equal share, the narrow
  // ones the queries hardly read included.
  std::vector<float> channel_factor;
  // gear4 (which reads the pca plans too): [kGearRank][dim] the axes its residual is corrected
  // along, the principal axes of largest weight (keys: the queries' energy along them; values,
  // all of weight 1: the first, of largest variance).
  std::vector<float> gear_axes;
};

// The plans of each calibrated codec kind, in Calibration::plans.
enum class CalKind : uint8_t { kPca, kKvq };
inline constexpr int kCalKinds = 2;

// Move-only: the plans point into heads.
struct Calibration {
  Calibration() = default;
  Calibration(Calibration&&) = default;
  Calibration& operator=(Calibration&&) = default;
  Calibration(const Calibration&) = delete;
  Calibration& operator=(const Calibration&) = delete;

  uint64_t model_hash = 0;  // the model it was measured on (Engine's weights hash)
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;            // calibration tokens evaluated
  std::string source;            // what they were
  std::vector<HeadStats> heads;  // [layer][kv head][K, V]
  // Plans of each kind for 2, 3 and 4 bits, [kind][bits - 2][table][K, V]: MakePlans.
  std::vector<CalPlan> plans;

  const HeadStats& head(int table, Role role) const {
    return heads[size_t(table) * 2 + (role == Role::kValue)];
  }
  // c: a calibrated codec.
  const CalPlan& plan(int table, Role role, Codec c) const {
    return plans[PlanIndex(IsKvq(c) ? CalKind::kKvq : CalKind::kPca, CalBits(c), table, role)];
  }
  size_t PlanIndex(CalKind kind, int bits, int table, Role role) const {
    const size_t tables = size_t(n_layers) * n_kv_heads;
    return ((size_t(kind) * 3 + size_t(bits - 2)) * tables + table) * 2 + (role == Role::kValue);
  }
  // Of every statistic: pages one calibration encoded, no other can read.
  uint64_t Hash() const;
};

// Fills c->plans from c->heads.
void MakePlans(Calibration* c);

Status SaveCalibration(const Calibration& c, const std::string& path);
// Reads and checks a .kvcal file (plans made); DataLoss names the field that is damaged.
Result<Calibration> LoadCalibration(const std::string& path);

// Gathers rows per (table, role), and the queries' second moments per table, then fits the
// statistics. Rows are sampled (at most max_rows per table and role, evenly) for the levels.
class CalibrationBuilder {
 public:
  CalibrationBuilder(int n_layers, int n_kv_heads, int head_dim, int max_rows = 4096);
  void AddRows(int table, Role role, std::span<const float> rows);  // [n][head_dim]
  // Rows as the kvq codecs store them (keys before RoPE), [n][head_dim].
  void AddChannelRows(int table, Role role, std::span<const float> rows);
  // The second moment E[q q^T] of the queries that read this table, [dim][dim], over n queries.
  void AddQueryMoment(int table, std::span<const double> moment, int64_t n);
  // outliers: channels listed per head and role.
  Result<Calibration> Finish(int outliers, uint64_t model_hash, std::string source);

 private:
  struct Acc {
    std::vector<double> sum, outer;  // [dim], [dim][dim] (channel rows: the diagonal only)
    int64_t n = 0;                   // rows seen
    std::vector<float> sample;       // rows kept for the levels
  };
  void Add(Acc& a, std::span<const float> rows, bool full_outer);
  void FinishChannels(int table, Role role, const Acc& a, HeadStats* h) const;
  int n_layers_, n_kv_heads_, dim_, max_rows_;
  std::vector<Acc> acc_, ch_acc_;        // [table][K, V]
  std::vector<std::vector<double>> q2_;  // [table][dim][dim]
  std::vector<int64_t> q_n_;
};

// The symmetric eigendecomposition (cyclic Jacobi) of a [n][n] matrix: eigenvalues descending,
// vectors[i] (row i) the unit eigenvector of values[i].
void SymmetricEigen(std::span<const double> a, int n, std::vector<double>* values,
                    std::vector<double>* vectors);
// Lloyd-Max levels (1 << bits, ascending) of the samples, from their quantiles; returns the
// mean square error.
double FitLevels(std::span<const float> sorted, int bits, float* levels);

}  // namespace cachet::codecs
