// cachet calibrate: a model's K and V rows measured on calibration text, per (layer, KV head),
// for the calibrated KV codecs (pca4..pca2, kvq4..kvq2, cq4, cq2, gear4;
// EngineOptions::kv_calibration reads the file).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "cachet/engine.h"
#include "cachet/status.h"

namespace cachet {

struct CalibrateOptions {
  int window = 2048;     // tokens per pass (BOS first, each pass a fresh sequence)
  int outliers = 4;      // outlier channels recorded per (layer, KV head, role)
  std::string source;    // what the text was (recorded in the file)
  bool progress = true;  // a progress bar on stderr
};

struct CalibrateResult {
  int64_t tokens = 0;  // evaluated, BOS included
  int windows = 0;
  double seconds = 0;
  uint64_t hash = 0;  // of the statistics: what stored caches coded with it are keyed by
  int64_t bytes = 0;  // of the file
  // Per role, the share of variance on the first eighth of the principal axes (mean over heads):
  // how much a low-rank basis gains over a random rotation.
  double key_top_share = 0, value_top_share = 0;
};

// Evaluates the text (token ids, no BOS: each window gets one) in windows on an engine with f32 KV,
// gathers every (layer, KV head)'s K and V rows and the queries that read them, and writes the
// statistics to path (a .kvcal file). Nothing is written on error.
Result<CalibrateResult> Calibrate(Engine& engine, std::span<const int32_t> text,
                                  const CalibrateOptions& options, const std::string& path);

}  // namespace cachet
