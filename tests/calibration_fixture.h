// What the calibrated-codec tests share (tests/calibration_test.cc,
// tests/calibrated_engine_test.cc): rows of a known anisotropic distribution and a one-table
// calibration fitted to them, and kvtiny calibrated once per ctest run with an engine over it.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cachet/calibrate.h"
#include "cachet/engine.h"
#include "cachet/eval/tasks.h"
#include "kv/codecs/calibration.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet::testing {

using codecs::Role;

// Rows of a known anisotropic distribution: a mean, three strong directions, a weak rest and one
// channel of large spread.
inline std::vector<float> AnisotropicRows(int n, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> rows(size_t(n) * d);
  for (int t = 0; t < n; ++t) {
    float* x = rows.data() + size_t(t) * d;
    const float a = 4 * g(rng), b = 2 * g(rng), c = g(rng);
    for (int i = 0; i < d; ++i) {
      x[i] = 0.5f + a * std::cos(0.3f * i) / std::sqrt(d / 2.0f) +
             b * std::sin(0.7f * i) / std::sqrt(d / 2.0f) + c * (i % 2 ? 1 : -1) / std::sqrt(d) +
             0.05f * g(rng);
    }
    x[5] += 3 * g(rng);
  }
  return rows;
}

inline codecs::Calibration BuildSynthetic(int d, uint64_t hash = 7) {
  codecs::CalibrationBuilder b(1, 1, d, 2048);
  const auto k = AnisotropicRows(6000, d, 11), v = AnisotropicRows(6000, d, 12);
  b.AddRows(0, Role::kKey, k);
  b.AddRows(0, Role::kValue, v);
  b.AddChannelRows(0, Role::kKey, k);
  b.AddChannelRows(0, Role::kValue, v);
  auto c = b.Finish(/*outliers=*/2, hash, "synthetic");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(c).value();
}

// Removes the shared calibrations of ctest runs that have ended (their parent pid is gone), so
// repeated runs leave at most the live ones' files in the temporary directory.
inline void RemoveEndedRunsCalibrations() {
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(::testing::TempDir(), ec)) {
    const std::string name = f.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "kvtiny_test_%d.kvcal", &pid) == 1 && pid > 1 &&
        ::kill(pid, 0) != 0 && errno == ESRCH) {
      std::filesystem::remove(f.path(), ec);
    }
  }
}

// kvtiny calibrated on a slice of the haystack (pydocs, the first quarter as `cachet calibrate`
// takes it), shared by the engine tests: made once per process, or read back from an
// earlier test process of the same ctest run (each test runs in its own, ctest is their parent),
// which is checked first.
inline const std::string& KvtinyCalibration() {
  static const std::string path = [] {
    EngineOptions o;
    o.model_dir = ModelDir();
    o.threads = 2;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok());
    const std::string p =
        ::testing::TempDir() + "/kvtiny_test_" + std::to_string(::getppid()) + ".kvcal";
    // Tests that start together wait for the first one's calibration instead of each making
    // their own (45 s apiece under ASan). The lock goes with the process.
    struct Lock {
      int fd;
      ~Lock() {
        if (fd >= 0) ::close(fd);
      }
    } lock{::open((p + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600)};
    if (lock.fd >= 0) ::flock(lock.fd, LOCK_EX);
    if (auto c = codecs::LoadCalibration(p);
        c.ok() && c->model_hash == EngineAccess::model_hash(**e) && c->tokens == 2048) {
      return p;
    }
    RemoveEndedRunsCalibrations();
    std::string text = ReadFile(eval::DefaultHaystackDir() + "/pydocs.txt");
    text.resize(text.size() / 4);
    std::vector<int32_t> ids = (*e)->tokenizer().Encode(text);
    ids.resize(2046);
    CalibrateOptions co;
    co.window = 1024;
    co.progress = false;
    auto r = Calibrate(**e, ids, co, p);  // written atomically: parallel tests never see half
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->windows, 2);  // 2 x (BOS + 1023 tokens)
    EXPECT_EQ(r->tokens, 2048);
    EXPECT_GT(r->key_top_share, 0.2);  // keys are far from isotropic (1/8 would be)
    return p;
  }();
  return path;
}

// kvtiny on 2 threads with K and V pages in codecs k and v and kvtiny's calibration.
inline EngineOptions CalibratedOptions(const std::string& k, const std::string& v) {
  EngineOptions o;
  o.model_dir = ModelDir();
  o.threads = 2;
  o.kv_codec_k = k;
  o.kv_codec_v = v;
  o.kv_calibration = KvtinyCalibration();
  return o;
}

inline std::unique_ptr<Engine> PcaEngine(const std::string& k, const std::string& v, int sinks = 0,
                                         const std::string& cal = KvtinyCalibration()) {
  EngineOptions o = CalibratedOptions(k, v);
  o.kv_sinks = sinks;
  o.kv_calibration = cal;
  auto e = Engine::Create(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

}  // namespace cachet::testing
