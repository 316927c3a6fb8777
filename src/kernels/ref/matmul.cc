// Reference MatMul and DequantRow: each weight row is converted to f32 and dotted with every
// token, accumulating in f32 in column order. Rows are split over the pool only so that the
// reference path stays usable end to end.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"

namespace cachet::kernels::ref {

void DequantRow(const Matrix& w, int64_t r, float* out) {
  if (DTypeIsQuantized(w.dtype)) return QuantDequantRow(w, r, out);
  const char* row = static_cast<const char*>(w.data) + r * w.cols * DTypeSize(w.dtype);
  for (int64_t c = 0; c < w.cols; ++c) out[c] = LoadAsF32(row, w.dtype, c);
}

void MatMul(const float* x, int64_t n, const Matrix& w, const float* bias, float* y,
            int64_t y_stride, ThreadPool& pool) {
  constexpr int64_t kRowsPerTask = 16;
  const int64_t n_tasks = (w.rows + kRowsPerTask - 1) / kRowsPerTask;
  pool.Run(n_tasks, [&](int64_t task, int /*thread*/) {
    std::vector<float> w_row(w.cols);
    const int64_t r_end = std::min(w.rows, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < r_end; ++r) {
      ref::DequantRow(w, r, w_row.data());
      for (int64_t t = 0; t < n; ++t) {
        const float* x_t = x + t * w.cols;
        float sum = 0.0f;
        for (int64_t c = 0; c < w.cols; ++c) sum += x_t[c] * w_row[c];
        y[t * y_stride + r] = sum + (bias != nullptr ? bias[r] : 0.0f);
      }
    }
  });
}

}  // namespace cachet::kernels::ref
