// KV codecs: how one page of K or V rows (page_tokens rows of head_dim values) is stored, and the
// fused operations attention runs on the stored form (q.k over a page's keys, p.v accumulated
// over its values) without materializing a dequantized copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "cachet/kv_codecs.h"
#include "cachet/status.h"

namespace cachet::codecs {

inline constexpr int kMaxDim = 512;  // the widest head a codec stores (bounds stack scratch)

enum class Codec : uint8_t {
  kF32,
  kF16,
  kBF16,
  kInt8,   // per token, symmetric absmax, f32 scale
  kQ8_0,   // llama.cpp block_q8_0: per 32 values an f16 scale and 32 int8
  kQ4_0,   // llama.cpp block_q4_0: per 32 values an f16 scale and 16 bytes of nibbles
  kKivi4,  // KIVI: keys per channel over the page, values per token in groups of 32 channels
  kKivi2,
  kRot4,  // randomized Hadamard rotation + Lloyd-Max levels of N(0,1), per-token f16 scale
  kRot3,
  kRot2,
  // rot3/rot2 plus QJL: the sign bits of a second randomized Hadamard transform of the
  // quantization residual and its f16 norm, decoded so that q.k is unbiased (TurboQuant-prod).
  kRot3Qjl,
  kRot2Qjl,
  // Calibrated (a .kvcal file, cachet calibrate): rows projected on their (layer, KV head)'s
  // principal axes, 4/3/2 bits per value on average spent by variance, a per-row f16 scale.
  kPca4,
  kPca3,
  kPca2,
  // Calibrated, KVQuant: each channel over its calibrated mean and scale (keys before RoPE, where
  // a channel keeps its scale at every position: rows are turned back by their position's RoPE
  // when written and turned again when read), coded to 4/3/2-bit non-uniform levels times a
  // one-byte row scale; a row's KvqOutliers(dim) largest values are kept apart (11/10/9 bits).
  kKvq4,
  kKvq3,
  kKvq2,
  // Calibrated q4_0: each channel (keys after RoPE) less its calibrated mean, over the square
  // root of its calibrated standard deviation, in llama.cpp's q4_0 blocks, which attention reads
  // as it reads q4_0 (queries turned into that basis once: each channel times the same factor).
  kCq4,
  // Calibrated 2-bit blocks, cq4's basis: per 32 channels an f16 scale and 2-bit codes of the
  // Lloyd-Max levels of N(0, 1) (byte i of a block holds codes i, 8 + i, 16 + i and 24 + i, two
  // bits each from the lowest), read in place by attention through a 4-entry table. Meant for
  // old values (--kv-cold cq4:cq2), which draw little attention.
  kCq2,
  // Calibrated, GEAR: a row in q4_0 blocks plus a rank-kGearRank correction of their error along
  // fixed calibrated axes (for keys the principal axes the queries read most, for values the
  // axes of largest variance): the error's coordinates on them in int8 with an f16 scale.
  // Decoded to plain rows as it is read.
  kGear4,
};
inline constexpr int kGearRank = 4;

struct CalPlan;  // calibration.h: how a calibrated codec codes one (layer, KV head, role)

enum class Role : uint8_t { kKey, kValue };

const char* CodecName(Codec c);
Result<Codec> ParseCodec(std::string_view name);
// "K" or "K:V": the keys' and the values' codecs (one name: both). PairName gives the canonical
// spelling back: "K" when they are the same.
struct CodecPair {
  Codec k, v;
};
Result<CodecPair> ParseCodecPair(std::string_view name);
std::string PairName(CodecPair c);
// Checks the codec can store rows of this width (block codecs need multiples of 32, rotation
// codecs a power of two).
Status CheckDim(Codec c, int dim);

// Bytes of one page of `tokens` rows of `dim` values, metadata (scales, norms) included.
size_t PageBytes(Codec c, Role role, int tokens, int dim);
// Nominal bits per stored value, metadata included, for a full page.
double BitsPerValue(Codec c, Role role, int tokens, int dim);
bool IsRotated(Codec c);
// The calibrated codecs (pca*, kvq*): every page operation needs their (layer, KV head, role)'s
// plan.
bool IsCalibrated(Codec c);
bool IsPca(Codec c);
bool IsKvq(Codec c);
bool IsCq(Codec c);  // cq4, cq2: calibrated blocks in the channels' basis
// cq2's four levels padded with zeros to 16 floats: the table attention looks its codes up in.
const float* Cq2Levels();
int CalBits(Codec c);  // a calibrated codec's bits per value, outliers and scales aside
// Values a kvq row keeps apart (its largest over the calibrated scales): 1 per 64 channels.
int KvqOutliers(int dim);
// Rows this codec stores before RoPE (kvq keys): the KV layer turns them back by their position's
// angles before EncodePage and forward after DecodePage / DecodeStored (RopeTable).
bool StoredBeforeRope(Codec c, Role role);
// The basis a codec stores rows in: attention scores rotated or projected queries against them.
enum class Basis : uint8_t { kPlain, kHadamard, kPca, kChannels };
Basis BasisOf(Codec c);
// A KIVI key page starts with each channel's f16 (minimum, scale), this many bytes, then the
// token-major packed codes (little-endian, 4 or 2 bits).
size_t KiviKeyMetaBytes(int dim);
// A rotation codec's bits per coordinate and its 1 << bits Lloyd-Max levels of N(0, 1); a row
// stores an f16 scale, then the coordinates' level indices packed little-endian (then, for +qjl,
// the residual's sign bits and f16 norm).
int RotBits(Codec c);
const float* RotLevels(Codec c);
bool IsQjl(Codec c);
// KIVI keys are quantized per channel over the whole page: encoding must wait until it is full.
bool NeedsFullPage(Codec c, Role role);

// Encodes rows [n][dim] (n <= tokens) into a page laid out for `tokens` rows. Rows past n are
// unspecified. Rotation codecs rotate the rows themselves.
void EncodePage(Codec c, Role role, const float* rows, int n, int tokens, int dim, uint8_t* page,
                const CalPlan* plan = nullptr);
// Bytes of one row of a row-wise codec (all but KIVI keys): row t of a page starts at t * stride,
// so rows can be encoded one at a time as tokens arrive.
size_t RowStride(Codec c, int dim);
// Bytes of n codes of b bits packed little-endian.
size_t PackedBytes(int n, int b);
// Decodes rows back to f32 (rotation codecs: into the original basis).
void DecodePage(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                const CalPlan* plan = nullptr);

// Decodes rows into the basis they are stored in (rotated for rotation codecs, centered and
// projected for pca codecs): what attention scores against rotated queries and accumulates into a
// rotated accumulator.
void DecodeStored(Codec c, Role role, const uint8_t* page, int n, int tokens, int dim, float* rows,
                  const CalPlan* plan = nullptr);

// out[t] = q . k_t for the first n keys of a page. For rotation codecs q must be rotated
// (Rotate) first.
void DotKeys(Codec c, const uint8_t* page, int n, int tokens, int dim, const float* q, float* out,
             const CalPlan* plan = nullptr);
// acc += sum_t p[t] * v_t over the first n values of a page. For rotation codecs acc is in the
// rotated basis: Unrotate it once after the last page.
void AccumulateValues(Codec c, const uint8_t* page, int n, int tokens, int dim, const float* p,
                      float* acc, const CalPlan* plan = nullptr);

// The fixed randomized Hadamard transform: x <- H D x / sqrt(dim) (orthogonal), and its inverse.
void Rotate(float* x, int dim);
void Unrotate(float* x, int dim);
// x into the basis codec c stores rows in, and back: the Hadamard rotation, for pca codecs the
// plan's axes, for cq4 the channels scaled; x - mean first for a row (a query is not centered:
// q.mean is the same for every key, so scores only shift). cq4 divides a row's channels by its
// factors and multiplies a query's by them, so that q.k keeps its value. Out of the basis,
// centered adds the mean back (a row, or attention's output: its weights sum to 1).
enum class BasisVec : uint8_t { kRow, kQuery };
void IntoBasis(Codec c, const CalPlan* plan, float* x, int dim, BasisVec what);
void OutOfBasis(Codec c, const CalPlan* plan, float* x, int dim, bool centered);

}  // namespace cachet::codecs
