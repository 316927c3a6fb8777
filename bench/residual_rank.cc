// How low-rank the q4_0 quantization residual of a model's K and V rows is: what a GEAR-style
// low-rank correction on top of q4_0 (issue 18, codec c) could remove. Prints, for ranks 1-16,
// the share of the residual's energy on its top principal axes per (layer, KV head) (a fixed,
// calibrated basis: a few coefficients per row) and on each 64-token page's own top singular
// vectors (GEAR's per-group SVD: factors stored per page). White noise would give r / head_dim
// and, per page, what pages of Gaussian noise give (printed beside).
// Usage: build/residual_rank [MODEL_DIR] (the first 8188 tokens of the calibration quarter).
#include <cstdio>
#include <random>

#include "cachet/engine.h"
#include "cachet/eval/tasks.h"
#include "kv/codecs/calibration.h"
#include "kv/codecs/codec.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "util/mmap_file.h"

using namespace cachet;
using codecs::Codec;
using codecs::Role;

constexpr int kRanks = 5;  // 1, 2, 4, 8, 16

// Adds the share of a page's energy on its top 1, 2, 4, 8, 16 singular vectors.
void AddPageShares(const float* page, int n, int d, double* share) {
  std::vector<double> gram(size_t(d) * d, 0.0), values, vectors;
  for (int t = 0; t < n; ++t) {
    const float* x = page + size_t(t) * d;
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) gram[size_t(i) * d + j] += double(x[i]) * x[j];
    }
  }
  codecs::SymmetricEigen(gram, d, &values, &vectors);
  double all = 0, top = 0;
  for (double x : values) all += x;
  for (int r = 0, a = 0; r < kRanks; ++r) {
    for (; a < (1 << r); ++a) top += values[a];
    share[r] += all > 0 ? top / all : 0;
  }
}

int main(int argc, char** argv) {
  EngineOptions o;
  o.model_dir = argc > 1 ? argv[1] : "models/kvtiny";
  o.threads = 2;
  auto e = Engine::Create(o);
  if (!e.ok()) return std::fprintf(stderr, "%s\n", e.status().ToString().c_str()), 1;
  const ModelConfig& c = (*e)->config();
  auto text = ReadTextFile(eval::DefaultHaystackDir() + "/pydocs.txt");
  if (!text.ok()) return std::fprintf(stderr, "%s\n", text.status().ToString().c_str()), 1;
  text->resize(text->size() / 4);  // the calibration quarter (cachet calibrate's default)
  std::vector<int32_t> ids = (*e)->tokenizer().Encode(*text);
  const int d = c.head_dim, window = 2047, kPage = 64;
  codecs::CalibrationBuilder basis(c.n_layers, c.n_kv_heads, d);
  double page_share[kRanks] = {};
  int64_t pages = 0;
  std::vector<float> k, v, back(d);
  std::vector<int32_t> pos;
  std::vector<uint8_t> enc(codecs::PageBytes(Codec::kQ4_0, Role::kKey, 1, d));
  for (size_t at = 0; at + window <= std::min<size_t>(ids.size(), 4 * window); at += window) {
    std::vector<int32_t> w = {(*e)->tokenizer().bos_id()};
    w.insert(w.end(), ids.begin() + at, ids.begin() + at + window);
    auto s = (*e)->NewSession();
    if (!s->Eval(w, nullptr).ok()) return 1;
    PagedSequence& seq = EngineAccess::kv(*s);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        seq.Gather(l, h, &k, &v, &pos);
        for (std::vector<float>* rows : {&k, &v}) {
          const int n = static_cast<int>(rows->size() / d);
          for (int r = 0; r < n; ++r) {  // the rows become their q4_0 residuals
            float* x = rows->data() + size_t(r) * d;
            codecs::EncodePage(Codec::kQ4_0, Role::kKey, x, 1, 1, d, enc.data());
            codecs::DecodePage(Codec::kQ4_0, Role::kKey, enc.data(), 1, 1, d, back.data());
            for (int i = 0; i < d; ++i) x[i] -= back[i];
          }
          for (int p0 = 0; p0 + kPage <= n; p0 += 4 * kPage) {  // every 4th page's own SVD
            AddPageShares(rows->data() + size_t(p0) * d, kPage, d, page_share);
            ++pages;
          }
        }
        const int table = l * c.n_kv_heads + h;
        basis.AddRows(table, Role::kKey, k);
        basis.AddRows(table, Role::kValue, v);
        basis.AddChannelRows(table, Role::kKey, k);
        basis.AddChannelRows(table, Role::kValue, v);
      }
    }
  }
  double white_share[kRanks] = {};  // pages of Gaussian noise, the same way
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  std::vector<float> noise(size_t(kPage) * d);
  constexpr int kNoisePages = 100;
  for (int i = 0; i < kNoisePages; ++i) {
    for (float& x : noise) x = g(rng);
    AddPageShares(noise.data(), kPage, d, white_share);
  }
  auto cal = basis.Finish(0, 0, "q4_0 residual");
  if (!cal.ok()) return std::fprintf(stderr, "%s\n", cal.status().ToString().c_str()), 1;
  std::printf("%s: share of the q4_0 residual's energy a rank-r correction could remove\n",
              o.model_dir.c_str());
  std::printf(
      "rank | fixed basis, keys | fixed basis, values | white | own SVD per %d-token page | "
      "white page\n",
      kPage);
  for (int r = 0; r < kRanks; ++r) {
    double share[2] = {};
    for (size_t i = 0; i < cal->heads.size(); ++i) {
      double top = 0, all = 0;
      for (int a = 0; a < d; ++a) (a < (1 << r) ? top : all) += cal->heads[i].variance[a];
      share[i % 2] += top / (top + all);
    }
    const double heads = cal->heads.size() / 2.0;
    std::printf("%4d | %16.1f%% | %18.1f%% | %4.1f%% | %25.1f%% | %.1f%%\n", 1 << r,
                100 * share[0] / heads, 100 * share[1] / heads, 100.0 * (1 << r) / d,
                100 * page_share[r] / pages, 100 * white_share[r] / kNoisePages);
  }
}
