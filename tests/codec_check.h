// Checks shared by the codec tests (codec_engine_test.cc, calibrated_engine_test.cc): attention
// over a sequence's encoded pages against attention over its decoded rows, and the KL between
// logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "cachet/engine.h"
#include "kernels/kernels.h"
#include "kv/paged_sequence.h"

namespace cachet::testing {

// Relative L2 error of PagedSequence::Attend (the codes, read as attention reads them) against
// the reference attention over the tables' decoded rows (Gather, GatherCold), for a tile of query
// tokens at qpos and a fixed pseudo-random query.
inline double AttendVsDecoded(const Engine& e, const PagedSequence& kv, int layer, int kv_head,
                              const std::vector<int32_t>& qpos) {
  const int hd = e.config().head_dim, group = e.config().n_heads / e.config().n_kv_heads;
  const int n_tok = static_cast<int>(qpos.size());
  std::vector<float> q(size_t(n_tok) * group * hd);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * i);
  kernels::AttnBatch b;
  b.q = q.data();
  b.q_stride = group * hd;
  b.n_tok = n_tok;
  b.n_heads = group;
  b.q_pos = qpos.data();
  b.scale = 0.125f;
  std::vector<float> got(q.size()), want(q.size());
  b.out = got.data();
  b.out_stride = group * hd;
  kv.Attend(layer, kv_head, b);
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  kv.Gather(layer, kv_head, &k, &v, &pos);
  std::vector<float> ck, cv;  // a cold pool's rows too: attention reads them after the hot ones
  std::vector<int32_t> cpos;
  kv.GatherCold(layer, kv_head, &ck, &cv, &cpos);
  k.insert(k.end(), ck.begin(), ck.end());
  v.insert(v.end(), cv.begin(), cv.end());
  pos.insert(pos.end(), cpos.begin(), cpos.end());
  b.out = want.data();
  kernels::ref::ContiguousAttention(b, k.data(), v.data(), pos.data(), static_cast<int>(pos.size()),
                                    hd);
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * double(got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

// AttendVsDecoded's bound where a pass reads q4_0 (or cq4) values: where the CPU has the int8
// kernels, 64-wide heads sum them with each 16 keys' weights rounded to 8 bits
// (kernels/cpu/value_sums_int8.cc), 1.5e-3 - 1.6e-3 on kvtiny's pages; else as exact as the rest.
inline double Q4ValuesBound(double exact) { return kernels::cpu::HasInt8Kernels() ? 3e-3 : exact; }

// Mean KL(p_ref || p) of next-token distributions over every position (rows of vocab logits).
inline double MeanKl(const std::vector<float>& ref, const std::vector<float>& got, int vocab) {
  double total = 0;
  const size_t n = ref.size() / vocab;
  for (size_t t = 0; t < n; ++t) {
    const float* a = ref.data() + t * vocab;
    const float* b = got.data() + t * vocab;
    const float ma = *std::max_element(a, a + vocab), mb = *std::max_element(b, b + vocab);
    double za = 0, zb = 0;
    for (int i = 0; i < vocab; ++i) za += std::exp(a[i] - ma), zb += std::exp(b[i] - mb);
    for (int i = 0; i < vocab; ++i) {
      const double la = a[i] - ma - std::log(za), lb = b[i] - mb - std::log(zb);
      total += std::exp(la) * (la - lb);
    }
  }
  return total / double(n);
}

}  // namespace cachet::testing
