// What the forward pass needs from the KV cache for one sequence. kv/ implements it over pages;
// the model never sees pages, pools or block tables beyond the kernels' page-table view.
#pragma once

#include <cstdint>

#include "cachet/status.h"
#include "kernels/kernels.h"

namespace cachet {

class KvSequence {
 public:
  virtual ~KvSequence() = default;
  // Makes room for n more tokens in every (layer, KV head), all or nothing: on failure
  // (ResourceExhausted) nothing has changed.
  virtual Status Reserve(int n) = 0;
  // Appends one token's K and V rows (head_dim floats each) at its original position. Room must
  // have been reserved.
  virtual void Append(int layer, int kv_head, const float* k, const float* v, int32_t pos) = 0;
  // The layer's appended tokens have attended: a cache that holds recent tokens at a higher
  // precision before coding them (staged layouts) may code those now old enough. A prompt chunk
  // thus reads its own tokens as a decode step reads its own page.
  virtual void SealAged(int layer) = 0;
  // Marks the tokens appended since the last call as part of the sequence (all layers done).
  virtual void CommitTokens(int n) = 0;
  // Attention of a GQA group's queries over the cached K/V of (layer, kv_head), whatever codec
  // stores it.
  virtual void Attend(int layer, int kv_head, const kernels::AttnBatch& batch) const = 0;
  // Into how many parts (AttnBatch::part) a decode step's Attend may split each (layer, KV head)'s
  // pages, so that `threads` threads share a long context's keys; 1: one pass. Asked once per
  // step; the answer may not depend on what else the step computes (a sequence gets the same bits
  // alone as in a batch).
  virtual int DecodeParts(int /*threads*/) const { return 1; }
};

}  // namespace cachet
