// Per-thread scratch memory for the SIMD kernels: grows on demand, never shrinks, so the hot path
// allocates only the first time a thread needs a larger buffer.
#pragma once

#include <cstddef>

namespace cachet::kernels::cpu {

enum ScratchSlot : int {
  kScratchMatMulX = 0,    // MatMul: prepared activations (filled by the calling thread)
  kScratchMatMulW = 1,    // MatMul: a block of weight rows converted to f32 (each worker thread)
  kScratchMatMulAcc = 2,  // MatMul: tile accumulators between column chunks (each worker thread)
  kScratchAttention = 3,
  kScratchAttentionObserve = 4,  // PagedAttention: per-row softmax terms kept for AttnObserve
  kScratchInt8Acts = 5,          // Int8MatMul: quantized activations (filled by the calling thread)
  kScratchInt8Scales = 6,   // Int8MatMul: block scales of a task's weight rows (each worker thread)
  kScratchAttentionQ8 = 7,  // PagedAttention: the tile's query rows quantized for block keys
  kScratchAttentionKept = 8,  // PagedAttention: pages decoded by the first tile, for the others
  kScratchSlots = 9,
};

// At least n floats, 64-byte aligned, owned by the calling thread; contents are unspecified.
// The pointer stays valid until the same thread asks the same slot for more.
float* ThreadScratch(ScratchSlot slot, size_t n);

}  // namespace cachet::kernels::cpu
