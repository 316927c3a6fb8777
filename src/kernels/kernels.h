// The compute kernels of the forward pass. Each has a plain scalar reference (kernels/ref/) and a
// Highway SIMD version (kernels/cpu/) with identical semantics; the un-namespaced entry points
// dispatch to cpu:: unless CACHET_REF_KERNELS=1 is set in the environment.
// Kernels know nothing of requests or pools: attention sees a page-table view.
#pragma once

#include <cstdint>

#include "util/dtype.h"
#include "util/thread_pool.h"

namespace cachet::kernels {

// Row-major weight matrix [rows][cols] in its file dtype (an nn.Linear weight is [out][in]). For
// quantized dtypes each row is its own sequence of blocks (DTypeRowBytes(dtype, cols) bytes).
struct Matrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t bytes() const { return rows * DTypeRowBytes(dtype, cols); }
};

// Page-table view of the cached K/V of one (sequence, layer, KV head). A slot holds page_tokens
// K rows followed by page_tokens V rows (f32, head_dim floats each); token positions live in a
// parallel int32 array, page_tokens entries per slot.
struct PagedKv {
  const float* slots = nullptr;        // slot s starts at slots + s * slot_floats
  const int32_t* positions = nullptr;  // slot s positions start at positions + s * page_tokens
  int64_t slot_floats = 0;             // >= 2 * page_tokens * head_dim
  int page_tokens = 16;
  int head_dim = 0;
  const int32_t* page_ids = nullptr;  // logical page i -> slot id
  int n_tokens = 0;  // logical pages [0, n_tokens / page_tokens) are full, the last holds the rest
};

// Attention weights gathered for presses inside the attention pass (no second pass over the keys).
// For every query row (token, head of the group) whose position is >= min_pos, the row's final
// softmax weight of logical key j is added to key_weight[j]; key_weight has one float per key of
// the page table (PagedKv::n_tokens). So the sum over j grows by the number of observed rows that
// see at least one key.
struct AttnObserve {
  int32_t min_pos = 0;
  float* key_weight = nullptr;
  bool max = false;  // keep each key's largest weight over the queries, instead of their sum
};

// The queries of the n_heads query heads that share one KV head (a GQA group), for n_tok tokens.
struct AttnBatch {
  const float* q = nullptr;  // head h of token t at q + t * q_stride + h * head_dim
  int64_t q_stride = 0;
  float* out = nullptr;  // same layout, out_stride
  int64_t out_stride = 0;
  const int32_t* q_pos = nullptr;  // key j is visible to token t iff key_pos[j] <= q_pos[t]
  int n_tok = 0;
  int n_heads = 0;
  float scale = 1.0f;
  const AttnObserve* observe = nullptr;  // n_observe independent gatherings (may be none)
  int n_observe = 0;
  // A decode step: the sequence's only token in this forward step (not one token of a prompt
  // chunk split among threads). Sequences may then read a subset of their pages (Quest, the
  // fetched part of demoted pages).
  bool decode = false;
  // Part `part` of a pass split over its pages (flash decoding: a decode step's keys shared out
  // among threads). The page source gives the kernel the pass's logical pages [n * part / n_parts,
  // n * (part + 1) / n_parts) only (kv/table_attention.cc); the kernels read whatever pages they
  // are given. Not with observers.
  int part = 0, n_parts = 1;
  // When set, each output row's softmax statistics: its largest visible score (times scale; -inf
  // where it sees no key) and the sum of exp(score - that maximum) (0 there), row t * n_heads + h.
  // The row itself is normalized by that sum, as always: MergeAttnParts combines the parts.
  float* row_max = nullptr;
  float* row_sum = nullptr;
};

// The rows of a pass split into n_parts (AttnBatch::part), merged into b.out's rows (its n_tok,
// n_heads, out, out_stride): part p's row r (r = t * n_heads + h) at parts_out + (p * n_rows + r)
// * head_dim, its statistics at row_max / row_sum[p * n_rows + r], n_rows = n_tok * n_heads.
// Each part weighs sum_p * exp(max_p - max), max over the parts; a row no part sees is zero.
void MergeAttnParts(const float* parts_out, const float* row_max, const float* row_sum, int n_parts,
                    int head_dim, const AttnBatch& b);

// One page's K and V rows for the attention kernels: f32, f16 or bf16 (row i at i * head_dim
// values), or q8_0 / q4_0 blocks (head_dim a multiple of 32, row i at i * DTypeRowBytes).
struct PageData {
  const void* k = nullptr;
  const void* v = nullptr;
  DType k_type = DType::kF32, v_type = DType::kF32;
  // KIVI keys instead of k_type rows: k holds codes of k_bits (4 or 2) packed little-endian, row
  // i at i * head_dim * k_bits / 8 bytes (head_dim a multiple of 32), and k_channels each
  // channel's f16 (minimum, scale): key i, channel c is minimum + scale * code.
  const uint16_t* k_channels = nullptr;
  int k_bits = 0;
  // 2-bit level blocks instead of v_type rows (the cq2 codec): row i at i * head_dim / 32 *
  // kLevelBlockBytes, each block an f16 scale s and 8 code bytes, byte j holding the codes of
  // values j, 8 + j, 16 + j and 24 + j from its lowest bits; a value is s * v_levels[code].
  const float* v_levels = nullptr;
};
inline constexpr int kLevelBlockBytes = 10;
// Code i (0..31) of a level block (at its f16 scale).
inline int LevelCode(const uint8_t* block, int i) {
  return (block[2 + i % 8] >> (2 * (i / 8))) & 3;
}

// A page's token positions as its source stores them: int32, or uint16 where the context fits
// 16 bits (one of the two set).
struct PagePositions {
  const int32_t* wide = nullptr;
  const uint16_t* narrow = nullptr;
  int32_t operator[](int i) const { return wide != nullptr ? wide[i] : narrow[i]; }
};

// A page table whose pages are not all raw f32 (KV codecs, a cold pool): the kernel asks for each
// logical page's positions, then, if any key of it is visible, for its rows. Page i's keys are
// numbered from the sum of the earlier pages' counts (the AttnObserve key index).
class PageRows {
 public:
  virtual int n_pages() const = 0;
  virtual int n_keys() const = 0;
  virtual int page_tokens() const = 0;  // the most rows a page holds
  virtual int head_dim() const = 0;
  virtual PagePositions Positions(int page, int* cnt) const = 0;
  // Rows of other codecs are decoded into k_buf / v_buf (page_tokens x head_dim floats each).
  virtual PageData Rows(int page, float* k_buf, float* v_buf) const = 0;
  // A hint, called before the kernel works on the page before: start fetching the page's rows.
  // Pages a subset selects (Quest, a cold fetch) are scattered, so the prefetchers cannot guess.
  // light: the kernel's tile has so few query rows that a page takes less time to score than to
  // arrive from DRAM, so pages further ahead may be worth fetching too.
  virtual void Prefetch(int /*page*/, bool /*light*/) const {}

 protected:
  ~PageRows() = default;
};

#define CACHET_KERNEL_DECLS                                                                       \
  /* y[t][r] = sum_c x[t][c] * w[r][c] + bias[r] (bias may be null), t < n. x rows have w.cols */ \
  /* floats; y rows are y_stride floats apart. Parallel over rows of w on pool. */                \
  void MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,            \
              int64_t y_stride, ThreadPool& pool);                                                \
  /* Row r of w converted to f32 (embedding lookup). */                                           \
  void DequantRow(const Matrix& w, int64_t r, float* out);                                        \
  /* y = x / sqrt(mean(x^2) + eps) * weight; y may alias x. */                                    \
  void RmsNorm(const float* x, const float* weight, int64_t dim, float eps, float* y);            \
  /* Rotate-half RoPE in place on n_heads heads of head_dim; cos/sin hold head_dim/2 values. */   \
  void RopeRotateHalf(float* x, int n_heads, int head_dim, const float* cos, const float* sin);   \
  /* out[i] = silu(gate[i]) * up[i]; out may alias gate. */                                       \
  void SiluMul(const float* gate, const float* up, float* out, int64_t n);                        \
  /* Causal attention of a GQA group over a paged KV view (softmax(q.k * scale) . v). */          \
  void PagedAttention(const AttnBatch& b, const PagedKv& kv);                                     \
  /* The same over pages some other way stored. */                                                \
  void PagedAttentionRows(const AttnBatch& b, const PageRows& kv);                                \
  /* Quest: bounds of n keys of head_dim (lo = per-channel min, hi = max; n >= 1). */             \
  void KeyBounds(const float* keys, int n, int head_dim, float* lo, float* hi);                   \
  /* Quest page scores: out[p] = max over the n_heads queries (q + h * head_dim) of */            \
  /* sum_i max(q_i lo_i, q_i hi_i), an upper bound of q.k over page p's keys; page p's lo */      \
  /* is bounds + 2 p head_dim, its hi the head_dim values after, f16 (bits) rounded outward. */   \
  void PageBoundScores(const float* q, int n_heads, int head_dim, const uint16_t* bounds,         \
                       int n_pages, float* out);                                                  \
  /* The indices of the k largest of x[0..n) (0 < k <= n, no NaN; -0 equals +0), ascending: of */ \
  /* equal values the lower indices first. Quest's page selection. */                             \
  void TopK(const float* x, int n, int k, int32_t* out);                                          \
  /* Sum of n 64-bit words (wrapping), read as one stream: the read-bandwidth probe (with a */    \
  /* software prefetch 1 KiB ahead or without: which streams faster depends on the CPU). */       \
  uint64_t SumWords(const uint64_t* x, int64_t n, bool prefetch);

namespace ref {
CACHET_KERNEL_DECLS
// Attention over contiguous K/V rows [n_keys][head_dim]: the reference paged attention is checked
// against.
void ContiguousAttention(const AttnBatch& b, const float* k, const float* v, const int32_t* k_pos,
                         int n_keys, int head_dim);
}  // namespace ref

namespace cpu {
CACHET_KERNEL_DECLS
}  // namespace cpu

#undef CACHET_KERNEL_DECLS

// Quantized weights (DTypeIsQuantized: GGUF blocks, w.cols a multiple of DTypeBlockElems; a row is
// DTypeRowBytes bytes). MatMul and DequantRow above dispatch them to these.
namespace ref {
void QuantDequantRow(const Matrix& w, int64_t r, float* out);  // kernels/ref/quant.cc
// Reference quantizer of one row of n values (n a multiple of the block size) into
// DTypeRowBytes(t, n) bytes at out, in llama.cpp's block layout.
void QuantizeRow(DType t, const float* x, int64_t n, void* out);  // kernels/ref/quantize.cc
}  // namespace ref
// The int8 path (kernels/int8_dot.h): activations quantized to 8 bits per block of 32, integer
// dot products with q4_0 / q8_0 / q4_K blocks. QuantizeQ8 quantizes one row of cols values.
namespace ref {
void QuantizeQ8(const float* x, int64_t cols, int8_t* q, float* d, float* s);
float Int8Dot(const Matrix& w, int64_t r, const int8_t* q, const float* d, const float* s);
void Int8MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool);
}  // namespace ref
namespace cpu {
// Whether this CPU runs the int8 kernels (AVX-512 VNNI); QuantMatMul uses them when it does.
bool HasInt8Kernels();
// Int8MatMul takes up to this many tokens through its matrix-vector path (each token gets the
// bits it gets alone), more through its prefill path (any batch of more gives a token the same
// bits); the two paths round the same integer products differently.
inline constexpr int64_t kInt8MaxDecodeTokens = 8;
void Int8MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                int64_t y_stride, ThreadPool& pool);  // kernels/cpu/quant_int8.cc
void QuantizeQ8(const float* x, int64_t cols, int8_t* q, float* d, float* s);
// acc[r * head_dim + d] += sum_j p[r * p_stride + j] * v_j[d] over cnt q4_0 value rows, for rows
// tile rows, with each 16 keys' weights rounded to 8 bits (kernels/cpu/value_sums_int8.cc: off by
// at most 1/254 of their largest). Heads of 64 on CPUs with the int8 kernels; elsewhere returns
// false and does nothing.
bool Q4ValueSums(const uint8_t* v, int cnt, int head_dim, int rows, const float* p, int p_stride,
                 float* acc);
}  // namespace cpu
// Block-quantized keys (kernels/block_keys.h): a query row quantized (codes, block scales d and
// integer code sums), and scores[r * s_stride + j] = scale * q_r . k_j of cnt q4_0 / q8_0 key rows
// (DTypeRowBytes apart) for n_rows quantized query rows.
struct QueryQ8;
#define CACHET_BLOCK_KEY_DECLS                                                                     \
  void QuantizeQuery(const float* q, int head_dim, int8_t* codes, float* d, int32_t* sum);         \
  void BlockKeyScores(const uint8_t* keys, DType type, int cnt, int head_dim, const QueryQ8* rows, \
                      int n_rows, float scale, float* scores, int s_stride);
namespace ref {
CACHET_BLOCK_KEY_DECLS
}  // namespace ref
namespace cpu {
CACHET_BLOCK_KEY_DECLS  // kernels/cpu/attention_int8.cc: AVX-512 VNNI, else the reference
}  // namespace cpu
#undef CACHET_BLOCK_KEY_DECLS
namespace cpu {
// The int8 kernels for q4_0 / q8_0 / q4_K where the CPU has them, else DequantMatMul: blocks
// widened to f32 in registers, f32 arithmetic.
void QuantMatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                 int64_t y_stride, ThreadPool& pool);  // kernels/cpu/quant.cc
void DequantMatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                   int64_t y_stride, ThreadPool& pool);
void QuantDequantRow(const Matrix& w, int64_t r, float* out);
}  // namespace cpu

bool UseReferenceKernels();  // CACHET_REF_KERNELS=1, read once

inline void MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
                   int64_t y_stride, ThreadPool& pool) {
  UseReferenceKernels() ? ref::MatMul(x, n, w, bias, y, y_stride, pool)
                        : cpu::MatMul(x, n, w, bias, y, y_stride, pool);
}
inline void DequantRow(const Matrix& w, int64_t r, float* out) {
  UseReferenceKernels() ? ref::DequantRow(w, r, out) : cpu::DequantRow(w, r, out);
}
inline void RmsNorm(const float* x, const float* weight, int64_t dim, float eps, float* y) {
  UseReferenceKernels() ? ref::RmsNorm(x, weight, dim, eps, y)
                        : cpu::RmsNorm(x, weight, dim, eps, y);
}
inline void RopeRotateHalf(float* x, int n_heads, int head_dim, const float* cos,
                           const float* sin) {
  UseReferenceKernels() ? ref::RopeRotateHalf(x, n_heads, head_dim, cos, sin)
                        : cpu::RopeRotateHalf(x, n_heads, head_dim, cos, sin);
}
// RopeRotateHalf's angles at a position: cos_sin[j] and cos_sin[half + j] are the cos and sin of
// f32(position) * inv_freq[j] (the angle in f32, as HF computes it; its cos and sin in double).
void RopeAngles(const float* inv_freq, int half, int32_t position, float* cos_sin);
inline void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  UseReferenceKernels() ? ref::SiluMul(gate, up, out, n) : cpu::SiluMul(gate, up, out, n);
}
inline void PagedAttention(const AttnBatch& b, const PagedKv& kv) {
  UseReferenceKernels() ? ref::PagedAttention(b, kv) : cpu::PagedAttention(b, kv);
}
inline void PagedAttentionRows(const AttnBatch& b, const PageRows& kv) {
  UseReferenceKernels() ? ref::PagedAttentionRows(b, kv) : cpu::PagedAttentionRows(b, kv);
}
inline uint64_t SumWords(const uint64_t* x, int64_t n, bool prefetch) {
  return UseReferenceKernels() ? ref::SumWords(x, n, prefetch) : cpu::SumWords(x, n, prefetch);
}
inline void KeyBounds(const float* keys, int n, int head_dim, float* lo, float* hi) {
  UseReferenceKernels() ? ref::KeyBounds(keys, n, head_dim, lo, hi)
                        : cpu::KeyBounds(keys, n, head_dim, lo, hi);
}
inline void PageBoundScores(const float* q, int n_heads, int head_dim, const uint16_t* bounds,
                            int n_pages, float* out) {
  UseReferenceKernels() ? ref::PageBoundScores(q, n_heads, head_dim, bounds, n_pages, out)
                        : cpu::PageBoundScores(q, n_heads, head_dim, bounds, n_pages, out);
}
inline void TopK(const float* x, int n, int k, int32_t* out) {
  UseReferenceKernels() ? ref::TopK(x, n, k, out) : cpu::TopK(x, n, k, out);
}

}  // namespace cachet::kernels
