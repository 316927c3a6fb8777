#include "kernels/cpu/scratch.h"

#include <cstdlib>
#include <memory>
#include <new>

namespace cachet::kernels::cpu {
namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

struct Buffer {
  std::unique_ptr<float, FreeDeleter> data;
  size_t capacity = 0;
};

}  // namespace

float* ThreadScratch(ScratchSlot slot, size_t n) {
  thread_local Buffer buffers[kScratchSlots];
  Buffer& b = buffers[slot];
  if (n > b.capacity) {
    // Grow geometrically so that a slowly increasing demand reallocates rarely.
    size_t cap = b.capacity * 2 > n ? b.capacity * 2 : n;
    size_t bytes = (cap * sizeof(float) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    b.data.reset(static_cast<float*>(p));
    b.capacity = bytes / sizeof(float);
  }
  return b.data.get();
}

}  // namespace cachet::kernels::cpu
