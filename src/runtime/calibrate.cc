#include "cachet/calibrate.h"

#include <chrono>
#include <filesystem>
#include <vector>

#include "cachet/progress.h"
#include "kv/codecs/calibration.h"
#include "kv/press/press.h"
#include "runtime/engine_access.h"

namespace cachet {

Result<CalibrateResult> Calibrate(Engine& engine, std::span<const int32_t> text,
                                  const CalibrateOptions& o, const std::string& path) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = engine.config();
  if (!EngineAccess::kv_pool(engine).layout().plain()) {
    return InvalidArgument("calibrate: the engine must keep K and V in f32 (--ctk/--ctv f32)");
  }
  const int window = std::min(o.window, engine.n_ctx());
  if (window < 16) return InvalidArgument("calibrate: --window must be >= 16 tokens");
  // Principal axes of head_dim coordinates need several times head_dim rows: fewer left axes of
  // no variance, and the pca codecs decoded NaN from such a file.
  const size_t min_tokens = size_t(4) * c.head_dim;
  if (text.size() < min_tokens) {
    return InvalidArgument("calibrate: the text has " + std::to_string(text.size()) +
                           " tokens; at least " + std::to_string(min_tokens) +
                           " (4 x head_dim) are needed (--tokens, -f)");
  }
  const Tokenizer& tok = engine.tokenizer();
  const bool bos = tok.add_bos() && tok.bos_id() >= 0;  // as the eval harness's windows
  codecs::CalibrationBuilder builder(c.n_layers, c.n_kv_heads, c.head_dim);
  const codecs::RopeTable rope(c.RopeInvFreq(), window);
  CalibrateResult r;
  std::vector<int32_t> ids;
  std::vector<float> logits, k, v;
  std::vector<int32_t> positions;
  std::vector<double> mean, cov, moment(size_t(c.head_dim) * c.head_dim);
  std::unique_ptr<ProgressBar> bar;
  if (o.progress) bar = std::make_unique<ProgressBar>("calibrate (tokens)", int64_t(text.size()));
  for (size_t at = 0; at < text.size(); at += window - 1) {
    const size_t n = std::min<size_t>(window - 1, text.size() - at);
    if (n < 8 && r.windows > 0) break;  // a scrap of a window adds nothing
    ids.clear();
    if (bos) ids.push_back(tok.bos_id());
    ids.insert(ids.end(), text.begin() + at, text.begin() + at + n);
    auto session = engine.NewSession();
    PagedSequence& seq = EngineAccess::kv(*session);
    // The queries of every position, as attention sees them (after RoPE, like the cached keys).
    const int32_t end = static_cast<int32_t>(ids.size());
    press::PressObserver obs(c.n_layers, c.n_kv_heads, c.head_dim, end, end,
                             1u << press::PressObserver::kWindow);
    seq.set_observer(&obs);
    const Status st = session->Eval(ids, &logits);
    seq.set_observer(nullptr);
    CACHET_RETURN_IF_ERROR(st);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const int ti = l * c.n_kv_heads + h;
        seq.Gather(l, h, &k, &v, &positions);
        builder.AddRows(ti, codecs::Role::kKey, k);
        builder.AddRows(ti, codecs::Role::kValue, v);
        // kvq's statistics: keys as it stores them, before RoPE.
        rope.Turn(k.data(), int(positions.size()), c.head_dim, positions.data(), true);
        builder.AddChannelRows(ti, codecs::Role::kKey, k);
        builder.AddChannelRows(ti, codecs::Role::kValue, v);
        obs.QueryStats(l, h, 0, &mean, &cov);
        for (int i = 0; i < c.head_dim; ++i) {
          for (int j = 0; j < c.head_dim; ++j) {
            moment[size_t(i) * c.head_dim + j] =
                cov[size_t(i) * c.head_dim + j] + mean[i] * mean[j];
          }
        }
        builder.AddQueryMoment(ti, moment, end);
      }
    }
    r.tokens += end;
    ++r.windows;
    if (bar) bar->Add(int64_t(n));
  }
  bar.reset();
  CACHET_ASSIGN_OR_RETURN(codecs::Calibration cal,
                          builder.Finish(o.outliers, EngineAccess::model_hash(engine), o.source));
  for (size_t i = 0; i < cal.heads.size(); ++i) {  // [table][K, V]
    const std::vector<float>& var = cal.heads[i].variance;
    const size_t top_axes = std::max<size_t>(1, var.size() / 8);
    double top = 0, all = 0;
    for (size_t a = 0; a < var.size(); ++a) (a < top_axes ? top : all) += var[a];
    all += top;
    (i % 2 == 0 ? r.key_top_share : r.value_top_share) += all > 0 ? top / all : 0;
  }
  const double heads = double(cal.heads.size()) / 2;
  r.key_top_share /= heads;
  r.value_top_share /= heads;
  CACHET_RETURN_IF_ERROR(codecs::SaveCalibration(cal, path));
  r.hash = cal.Hash();
  std::error_code ec;
  r.bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace cachet
