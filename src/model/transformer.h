// The Llama-family forward pass (llama, mistral, qwen2, qwen3) on CPU, one step over one or many
// sequences. The step's tokens go through each weight matrix together (matrix-matrix kernels; a
// lone token takes the matrix-vector ones); K and V go straight into each token's own KV cache
// through KvSequence and attention reads them back through its page-table view.
#pragma once

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cachet/model_config.h"
#include "model/kv_sequence.h"
#include "model/weights.h"
#include "util/thread_pool.h"

namespace cachet {

// One sequence's share of a batched forward step: its next token when it is decoding, a chunk of
// its prompt when it is prefilling.
struct SeqChunk {
  KvSequence* kv = nullptr;            // the tokens' K and V are appended to it
  std::span<const int32_t> tokens;     // may be empty: the entry is skipped
  std::span<const int32_t> positions;  // one per token
  // vocab_size floats per token when all_logits, else for the last token only; null: no logits,
  // and no LM head rows are computed for this entry (a prompt chunk before the last).
  float* logits = nullptr;
  bool all_logits = false;
};

// Part of the model for one step. first > 0 starts at that layer from x_in ([tokens][hidden]: the
// hidden states entering it) instead of the embeddings. kv_only >= 0 stops the step early: the
// layers before it run whole, that layer only computes and appends its K/V rows, x_out (when
// given) receives the hidden states entering it, and nothing is committed and no logits are
// computed.
struct LayerRange {
  int first = 0;
  const float* x_in = nullptr;
  int kv_only = -1;
  float* x_out = nullptr;
};

class Transformer {
 public:
  // max_batch bounds the tokens of one step (the ubatch); scratch is sized for it once.
  Transformer(ModelConfig config, ModelWeights weights, int max_batch);

  // copy_weights: the files read into huge-page memory, not mapped (EngineOptions::no_mmap).
  static Result<std::unique_ptr<Transformer>> Load(const std::string& model_dir, int max_batch,
                                                   bool copy_weights = false);

  // One step over many sequences. All entries' tokens (at most max_batch in all) are concatenated
  // so that each weight matrix is read once for all of them; each token is rotated at its own
  // position, its K/V appended to its own sequence, and attention runs per (sequence, KV head,
  // block of that sequence's tokens) on the pool; each sequence then commits its tokens, and the
  // LM head runs only over the rows whose logits are wanted.
  //
  // A sequence gets the same logits, bit for bit, whatever it is batched with and however its
  // prompt is chunked: every kernel computes a token's row the same way alone or among others.
  // One exception: q4_0 / q8_0 / q4_K weights on the int8 kernels (AVX-512 VNNI), whose
  // matrix-vector path (a step of one token, an LM head of one row) rounds each dot product
  // differently from their matrix-matrix one (kernels/cpu/quant_int8.cc). The difference is a
  // few f32 roundings, but the next layer quantizes its activations to int8 again and may turn it
  // into a different code: a sequence decoded alone and the same sequence decoded in a batch can
  // end up with different greedy tokens. Any two batched runs agree bit for bit as long as
  // neither took the sequence through a matrix-vector product.
  //
  // Errors name the entry (its index in seqs): InvalidArgument for a null kv, a sequence named by
  // two entries, positions not one per token, a token id outside the vocabulary, or more than
  // max_batch tokens; the error of the first Reserve that fails (ResourceExhausted when the KV
  // pool is full). Everything is validated before anything changes. Then each entry's sequence
  // reserves room for its tokens, in entry order, before any K/V is written: when entry i's
  // Reserve fails, no sequence has appended or committed anything; entries after i are untouched,
  // entries before i keep the room they reserved (pages held, no tokens: KvSequence has no way to
  // give a reservation back), which a retried step, or the sequence's next tokens, use without
  // allocating again.
  //
  // layers runs part of the model (CacheBlend's passes, through a KvSequence that writes rows
  // over or compares them instead of appending; see LayerRange).
  Status ForwardBatch(std::span<const SeqChunk> seqs, ThreadPool& pool,
                      const LayerRange& layers = {});

  // The one-entry case: tokens (at the given positions) through the model, their K/V appended to
  // kv; logits receives vocab_size floats per token when all_logits, else for the last token
  // only. Bad token ids or a full KV pool return an error and leave kv unchanged.
  Status Forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                 KvSequence& kv, ThreadPool& pool, float* logits, bool all_logits);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  int max_batch() const { return max_batch_; }

 private:
  // ForwardBatch's checks of the step (its errors), and its token count.
  Status ValidateBatch(std::span<const SeqChunk> seqs, int64_t* total);
  // Layer l up to its K/V rows, appended to each entry's sequence (kv_only: no queries).
  void LayerKv(int l, std::span<const SeqChunk> seqs, int n, bool kv_only, ThreadPool& pool);
  // The rest of layer l: attention, its output projection, the FFN, both residuals.
  void LayerRest(int l, std::span<const SeqChunk> seqs, int n, ThreadPool& pool);
  // The final norm and LM head over the rows whose logits are wanted, into the entries' buffers.
  void LmHead(std::span<const SeqChunk> seqs, ThreadPool& pool);
  // Attention of every entry's tokens over its own sequence, as the tasks of PlanAttention.
  void Attention(int layer, std::span<const SeqChunk> seqs, ThreadPool& pool);
  // Splits each entry's tokens into blocks, about 4 per thread in all, in proportion to their
  // attention work, and a long decode step's pages into parts; heaviest tasks first, so that the
  // pool balances them.
  void PlanAttention(std::span<const SeqChunk> seqs, int threads);

  // A block of one entry's tokens [begin, end) (indices into the step), attended per KV head, in
  // `parts` parts (a decode step over a long context: KvSequence::DecodeParts) whose rows wait in
  // parts_out_ from part row group `part_base` on (KV head h's part p: part_base + h * parts + p).
  struct AttnBlock {
    int entry, begin, end;
    double cost;
    int parts = 1, part_base = 0;
  };
  struct AttnTask {
    int block, kv_head, part;
  };

  ModelConfig config_;
  ModelWeights weights_;
  int max_batch_;
  std::vector<float> inv_freq_;
  // Activations for one batch, [max_batch][width] each.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_;
  // The step's tokens and positions, concatenated; where each entry starts in them.
  std::vector<int32_t> tokens_, positions_, entry_begin_;
  std::vector<AttnBlock> attn_blocks_;
  std::vector<AttnTask> attn_tasks_;              // heaviest first
  std::vector<std::pair<int, int>> attn_merges_;  // (block, KV head) of split blocks
  // Split blocks' rows, one group of n_heads / n_kv_heads rows per (KV head, part), and their
  // softmax statistics (AttnBatch::row_max, row_sum).
  std::vector<float> parts_out_, parts_max_, parts_sum_;
  std::vector<std::pair<const KvSequence*, int>> kv_order_;  // (sequence, entry), sorted
  // LM head: the step's rows whose logits are wanted, and their logits when they go to more than
  // one entry's buffer.
  std::vector<int32_t> out_rows_;
  std::vector<float> logits_;
};

}  // namespace cachet
