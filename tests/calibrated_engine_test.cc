// The calibrated KV codecs inside the engine (issue 18): attention on pca, kvq and cq4 pages
// equals attention on their decoded rows, the caches are closer to f32 than q4_0's, kvq keys
// follow their tokens to new positions, saved caches and presses compose, and a missing or
// mismatched calibration is a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cachet/calibrate.h"
#include "cachet/engine.h"
#include "calibration_fixture.h"
#include "codec_check.h"
#include "kv/codecs/calibration.h"
#include "kv/codecs/codec.h"
#include "kv/paged_sequence.h"
#include "runtime/engine_access.h"
#include "test_util.h"

namespace cachet {
namespace {

using codecs::Codec;
using testing::BuildSynthetic;
using testing::KvtinyCalibration;
using testing::MeanKl;
using testing::PcaEngine;

// Next-token distributions of engines whose keys are in a codec (values f16) against the f32
// cache's, over the same tokens.
class KeysVsF32 {
 public:
  explicit KeysVsF32(std::span<const int32_t> tokens) : tokens_(tokens) {
    auto f32 = PcaEngine("f32", "f32");
    vocab_ = f32->config().vocab_size;
    EXPECT_TRUE(f32->NewSession()->Eval(tokens_, &ref_, true).ok());
  }
  // Mean KL of keys in codec k; *bytes: the cache's high water.
  double Kl(const std::string& k, int64_t* bytes = nullptr) const {
    auto e = PcaEngine(k, "f16");
    std::vector<float> got;
    EXPECT_TRUE(e->NewSession()->Eval(tokens_, &got, true).ok());
    if (bytes != nullptr) *bytes = e->kv_stats().bytes_high_water;
    return MeanKl(ref_, got, vocab_);
  }

 private:
  std::span<const int32_t> tokens_;
  std::vector<float> ref_;
  int vocab_ = 0;
};

TEST(CalibratedEngine, AttentionOnPcaPagesEqualsAttentionOnDecodedRows) {
  const auto prompt = testing::LoadGolden().back().ids;
  for (const auto& [k, v] :
       {std::pair{"pca4", "pca3"}, {"f16", "pca2"}, {"pca3", "q4_0"}, {"gear4", "gear4"}}) {
    auto e = PcaEngine(k, v, /*sinks=*/4);  // the sink pages (f16) turned into the basis
    ASSERT_NE(e, nullptr);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    const PagedSequence& kv = EngineAccess::kv(*s);
    SCOPED_TRACE(std::string(k) + ":" + v);
    const double bound = std::string(v) == "q4_0" ? testing::Q4ValuesBound(1e-5) : 1e-5;
    EXPECT_LT(testing::AttendVsDecoded(*e, kv, 5, 1, {150, 201, 202}), bound);
  }
}

// A calibration on a repetitive text never sees the model's rows move along most axes; rows that
// do move along them still give finite logits (their scale over the axes' zero deviation was
// infinite: every logit NaN, exit 0).
TEST(CalibratedEngine, RepetitiveCalibrationTextGivesFiniteLogits) {
  testing::TempDir dir;
  const std::string cal = dir.path() + "/flat.kvcal";
  {
    EngineOptions o;
    o.model_dir = testing::ModelDir();
    o.threads = 2;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok());
    std::string text;
    for (int i = 0; i < 60; ++i) text += "The Lord said unto Moses. ";
    CalibrateOptions co;
    co.progress = false;
    auto r = Calibrate(**e, (*e)->tokenizer().EncodePrompt(text), co, cal);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  for (const char* codec : {"pca4", "pca2"}) {
    auto e = PcaEngine("f32", codec, 0, cal);
    ASSERT_NE(e, nullptr);
    std::vector<float> logits;
    auto s = e->NewSession();
    ASSERT_TRUE(
        s->Eval(e->tokenizer().EncodePrompt("In the beginning God created the heaven"), &logits)
            .ok());
    for (float x : logits) ASSERT_TRUE(std::isfinite(x)) << codec;
  }
}

// cq4 pages are read by the q4_0 kernel with queries turned into the channels' basis (and f16
// sink pages turned into it): attention matches the decoded rows to the query quantization the
// int8 kernel does (as q4_0's own keys); cq4 values to the rounding of their weights.
TEST(CalibratedEngine, Cq4AttendsAsDecoded) {
  const auto prompt = testing::LoadGolden().back().ids;
  for (const auto& [k, v, bound] :
       {std::tuple{"f16", "cq4", testing::Q4ValuesBound(1e-5)}, {"cq4", "q4_0", 3e-3}}) {
    auto e = PcaEngine(k, v, /*sinks=*/4);
    ASSERT_NE(e, nullptr);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    SCOPED_TRACE(std::string(k) + ":" + v);
    EXPECT_LT(testing::AttendVsDecoded(*e, EngineAccess::kv(*s), 5, 1, {150, 201, 202}), bound);
  }
}

// cq4 keys come closer to f32 than q4_0's at the same bytes (over the first 512 golden tokens:
// the whole prompt told no more, at twice the time).
TEST(CalibratedEngine, Cq4KeysAreCloserToF32ThanQ4_0sAtTheSameBytes) {
  const auto prompt = testing::LoadGolden().back().ids;
  const KeysVsF32 keys{std::span<const int32_t>(prompt).first(512)};
  int64_t cq4_bytes = 0, q4_bytes = 0;
  const double cq4 = keys.Kl("cq4", &cq4_bytes), q4 = keys.Kl("q4_0", &q4_bytes);
  EXPECT_GT(cq4, 0.0);
  EXPECT_LT(cq4, 0.8 * q4) << "cq4 keys " << cq4 << ", q4_0 keys " << q4;
  EXPECT_EQ(cq4_bytes, q4_bytes);
}

// gear4 keys (q4_0 and a rank-4 correction along the axes the queries read most) come closer to
// f32 than q4_0's, at 0.75 bits a value more.
TEST(CalibratedEngine, Gear4KeysAreCloserToF32ThanQ4_0s) {
  const auto prompt = testing::LoadGolden().back().ids;
  const KeysVsF32 keys{std::span<const int32_t>(prompt).first(512)};
  const double gear = keys.Kl("gear4"), q4 = keys.Kl("q4_0");
  EXPECT_GT(gear, 0.0);
  EXPECT_LT(gear, 0.9 * q4) << "gear4 keys " << gear << ", q4_0 keys " << q4;
}

// Pages aged into a cold pool of another basis: kvq2 pages beside cq4 ones are turned into the
// hot pool's channels' basis as they are read; cq4 (and cq2 values) beside kvq4 pages, most of
// the pass, are read in place in theirs, the recent kvq4 rows turned into it. Attention matches
// the decoded rows (cq4 keys: to the int8 kernel's query quantization).
TEST(CalibratedEngine, Cq4BesideAColdPoolOfAnotherBasisAttendsAsDecoded) {
  const auto prompt = testing::LoadGolden().back().ids;
  for (const auto& [hot, cold, bound] : {std::tuple{"cq4", "kvq2", 3e-3},
                                         {"kvq4", "cq4", 3e-3},
                                         {"kvq4", "cq4:cq2", 3e-3},
                                         {"kvq4", "f16:cq2", 1e-5}}) {
    EngineOptions o = testing::CalibratedOptions(hot, hot);
    o.kv_cold = cold;
    o.kv_cold_after = 64;
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    auto s = (*e)->NewSession();
    // Pages age between calls: each chunk finds the one before's old pages moved.
    ASSERT_TRUE(s->Eval(std::span(prompt).first(140), nullptr).ok());
    ASSERT_TRUE(s->Eval(std::span(prompt).subspan(140, 63), nullptr).ok());
    ASSERT_TRUE(s->Eval(std::span(prompt).subspan(203, 1), nullptr).ok());
    SCOPED_TRACE(std::string(hot) + " then " + cold);
    EXPECT_EQ(EngineAccess::kv(*s).cold_length(5, 1), 128);  // most of the 204 tokens
    EXPECT_LT(testing::AttendVsDecoded(**e, EngineAccess::kv(*s), 5, 1, {150, 201, 202}), bound);
  }
}

TEST(CalibratedEngine, PcaKeysAreCloserToF32ThanQ4_0AtFewerBytes) {
  const auto prompt = testing::LoadGolden().back().ids;
  const KeysVsF32 keys(prompt);
  int64_t pca_bytes = 0, q4_bytes = 0;
  const double pca = keys.Kl("pca4", &pca_bytes), q4 = keys.Kl("q4_0", &q4_bytes);
  EXPECT_GT(pca, 0.0);
  EXPECT_LT(pca, 0.7 * q4) << "pca4 keys " << pca << ", q4_0 keys " << q4;
  EXPECT_LT(pca_bytes, q4_bytes);
}

TEST(CalibratedEngine, KvqKeysStoredBeforeRopeAttendAsDecoded) {
  const auto prompt = testing::LoadGolden().back().ids;
  // Sinks (f16 pages beside kvq ones) are read alike. (q4_0 keys are left out: their fused
  // kernel quantizes the query, 8e-4 from the decoded rows by design.)
  for (const auto& [k, v] : {std::pair{"kvq4", "kvq3"}, {"kvq2", "f16"}, {"rot4", "kvq4"}}) {
    auto e = PcaEngine(k, v, /*sinks=*/4);
    ASSERT_NE(e, nullptr);
    auto s = e->NewSession();
    ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
    SCOPED_TRACE(std::string(k) + ":" + v);
    EXPECT_LT(testing::AttendVsDecoded(*e, EngineAccess::kv(*s), 5, 1, {150, 201, 202}), 1e-5);
  }
}

TEST(CalibratedEngine, KvqKeysAreCloserToF32ThanQ4_0) {
  // Keys turned back by the wrong angles would be noise: the KL would be far above q4_0's.
  const auto prompt = testing::LoadGolden().back().ids;
  const KeysVsF32 keys(prompt);
  const double kvq = keys.Kl("kvq4"), q4 = keys.Kl("q4_0");
  EXPECT_GT(kvq, 0.0);
  EXPECT_LT(kvq, 0.6 * q4) << "kvq4 keys " << kvq << ", q4_0 keys " << q4;
}

TEST(CalibratedEngine, KvqKeysFollowTheirTokensToNewPositions) {
  // Shift re-rotates kept keys: kvq decodes them at their old position and stores them back at
  // the new one, so they stay what an f32 cache holds there (to the codec's error).
  const auto prompt = testing::LoadGolden().back().ids;
  auto kvq = PcaEngine("kvq4", "f16");
  auto f32 = PcaEngine("f32", "f32");
  auto a = kvq->NewSession(), b = f32->NewSession();
  for (auto* s : {a.get(), b.get()}) {
    ASSERT_TRUE(s->Eval(std::span(prompt).first(120), nullptr).ok());
    ASSERT_TRUE(s->Shift(10, 50).ok());
  }
  for (int l : {0, 7}) {
    std::vector<float> ka, va, kb, vb;
    std::vector<int32_t> pa, pb;
    EngineAccess::kv(*a).Gather(l, 0, &ka, &va, &pa);
    EngineAccess::kv(*b).Gather(l, 0, &kb, &vb, &pb);
    ASSERT_EQ(pa, pb);
    ASSERT_EQ(pa[50], 50);
    double num = 0, den = 0;
    for (size_t i = 0; i < kb.size(); ++i) {
      num += (ka[i] - kb[i]) * double(ka[i] - kb[i]);
      den += double(kb[i]) * kb[i];
    }
    EXPECT_LT(std::sqrt(num / den), 0.15) << "layer " << l;
  }
}

// keydiff keeping half the tokens, the evicted ones demoted into a cold pool of `codec`.
press::PressOptions HalfDemotedInto(const std::string& codec) {
  press::PressOptions p;
  EXPECT_TRUE(press::ParsePressSpec("keydiff", &p).ok());
  p.ratio = 0.5;
  p.demote = codec;
  return p;
}

// Saves a session holding the prompt, loads it back, and checks the two decode alike.
void ExpectSavedCacheReloads(Engine& e, const std::vector<int32_t>& prompt,
                             const std::string& path) {
  auto s = e.NewSession();
  ASSERT_TRUE(s->Eval(prompt, nullptr).ok());
  ASSERT_TRUE(s->Save(path).ok());
  auto loaded = e.LoadSession(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::vector<float> a, b;
  const std::vector<int32_t> next = {prompt[5], prompt[6]};
  ASSERT_TRUE(s->Eval(next, &a).ok());
  ASSERT_TRUE((*loaded)->Eval(next, &b).ok());
  EXPECT_EQ(a, b);
}

TEST(CalibratedEngine, KvqCachesSaveLoadAndDemote) {
  // A saved kvq cache holds keys before RoPE with their positions: loaded, it decodes alike.
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("kvq4", "kvq3", /*sinks=*/4);
  ExpectSavedCacheReloads(*e, prompt, ::testing::TempDir() + "/kvq_cache.ckv");
  // Evicted tokens demoted into kvq2 from an f16 cache: the cold pool turns its keys by RoPE too.
  auto hot = PcaEngine("f16", "f16");
  auto h = hot->NewSession();
  const press::PressOptions p = HalfDemotedInto("kvq2");
  ASSERT_TRUE(h->EvalPressed(std::span(prompt).first(200), p, nullptr).ok());
  EXPECT_GT(hot->kv_stats().cold_bytes_used, 0);
  std::vector<float> logits, ref;
  ASSERT_TRUE(h->Eval(std::vector<int32_t>{prompt[200]}, &logits).ok());
  // Against the same press demoting into f16 (the cold rows exact): close, not noise.
  auto exact = PcaEngine("f16", "f16");
  auto x = exact->NewSession();
  ASSERT_TRUE(x->EvalPressed(std::span(prompt).first(200), HalfDemotedInto("f16"), nullptr).ok());
  ASSERT_TRUE(x->Eval(std::vector<int32_t>{prompt[200]}, &ref).ok());
  EXPECT_LT(MeanKl(ref, logits, hot->config().vocab_size), 0.1);  // 0.03; unturned keys: 0.33
}

TEST(CalibratedEngine, SavedCachesNeedTheirCalibration) {
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("pca4", "pca3");
  const std::string path = ::testing::TempDir() + "/pca_cache.ckv";
  ExpectSavedCacheReloads(*e, prompt, path);
  auto info = ReadSavedCacheInfo(path);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->codec_k, "pca4");
  EXPECT_EQ(info->calibration.size(), 16u);

  // Another calibration (the same statistics, another model hash, so another file hash).
  auto cal = codecs::LoadCalibration(KvtinyCalibration());
  ASSERT_TRUE(cal.ok());
  const std::string other = ::testing::TempDir() + "/other.kvcal";
  cal->source = "other";
  cal->heads[0].mean[0] += 1e-3f;
  ASSERT_TRUE(codecs::SaveCalibration(*cal, other).ok());
  auto e2 = PcaEngine("pca4", "pca3", 0, other);
  ASSERT_NE(e2, nullptr);
  auto refused = e2->LoadSession(path);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("KV calibration (--kv-calibration) " +
                                            info->calibration + " (this engine: "),
            std::string::npos)
      << refused.status().ToString();
  std::filesystem::remove(other);
}

TEST(CalibratedEngine, MissingOrMismatchedCalibrationIsAClearError) {
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_codec_k = "pca4";
  auto e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--kv-calibration"), std::string::npos);

  auto cal = codecs::LoadCalibration(KvtinyCalibration());
  ASSERT_TRUE(cal.ok());
  cal->model_hash ^= 1;
  const std::string wrong = ::testing::TempDir() + "/wrong_model.kvcal";
  ASSERT_TRUE(codecs::SaveCalibration(*cal, wrong).ok());
  o.kv_calibration = wrong;
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("other weights"), std::string::npos);

  o.kv_codec_k = "f16";
  o.kv_codec_v = "kvq3";
  o.kv_calibration.clear();
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("KV codec kvq3 needs a calibration of this model: "
                                      "--kv-calibration FILE"),
            std::string::npos)
      << e.status().ToString();
  o.kv_codec_k = o.kv_codec_v = "pca4";
  EXPECT_FALSE(codecs::CheckDim(Codec::kKvq4, 20).ok());  // codes pack whole bytes: head_dim % 8

  codecs::Calibration small = BuildSynthetic(32);
  const std::string shape = ::testing::TempDir() + "/wrong_shape.kvcal";
  ASSERT_TRUE(codecs::SaveCalibration(small, shape).ok());
  o.kv_calibration = shape;
  e = Engine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("head_dim 32"), std::string::npos);
  std::filesystem::remove(wrong);
  std::filesystem::remove(shape);
}

TEST(CalibratedEngine, PressesDemoteIntoAPcaCodec) {
  const auto prompt = testing::LoadGolden().back().ids;
  auto e = PcaEngine("pca4", "pca4");
  auto s = e->NewSession();
  const press::PressOptions p = HalfDemotedInto("pca2");
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalPressed(prompt, p, &logits).ok());
  EXPECT_GT(e->kv_stats().cold_bytes_used, 0);
  std::vector<float> next;
  ASSERT_TRUE(s->Eval(std::vector<int32_t>{prompt[3]}, &next).ok());
  for (float x : next) ASSERT_TRUE(std::isfinite(x));
  // Demoting into a pca codec without a calibration is refused.
  EngineOptions o;
  o.model_dir = testing::ModelDir();
  o.kv_codec_k = o.kv_codec_v = "q4_0";
  auto plain = Engine::Create(o);
  ASSERT_TRUE(plain.ok());
  auto s2 = (*plain)->NewSession();
  const Status st = s2->EvalPressed(prompt, p, &logits);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--kv-calibration"), std::string::npos);
}

// gear4 is a row-wise codec like any other: behind a recent window and sink pages it attends as
// its decoded rows, a saved cache of it reloads, and a press demotes evicted tokens into it.
TEST(CalibratedEngine, Gear4ComposesWithWindowSinksSavesAndDemotion) {
  const auto prompt = testing::LoadGolden().back().ids;
  EngineOptions o = testing::CalibratedOptions("gear4", "gear4");
  o.kv_window = 32;
  o.kv_sinks = 4;
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto s = (*e)->NewSession();
  ASSERT_TRUE(s->Eval(std::span(prompt).first(203), nullptr).ok());
  EXPECT_LT(testing::AttendVsDecoded(**e, EngineAccess::kv(*s), 5, 1, {150, 201, 202}), 1e-5);
  ExpectSavedCacheReloads(**e, prompt, ::testing::TempDir() + "/gear_cache.ckv");

  // Demoted into gear4, the evicted tokens stay closer to exact than demoted into q4_0 (one
  // step's KL against a press demoting into f16: 0.148 and 0.273 when written).
  std::vector<float> ref;
  auto exact = PcaEngine("f16", "f16");
  auto x = exact->NewSession();
  ASSERT_TRUE(x->EvalPressed(std::span(prompt).first(200), HalfDemotedInto("f16"), nullptr).ok());
  ASSERT_TRUE(x->Eval(std::vector<int32_t>{prompt[200]}, &ref).ok());
  auto demoted_kl = [&](const std::string& codec) {
    auto hot = PcaEngine("f16", "f16");
    auto h = hot->NewSession();
    std::vector<float> logits;
    EXPECT_TRUE(h->EvalPressed(std::span(prompt).first(200), HalfDemotedInto(codec), nullptr).ok());
    EXPECT_GT(hot->kv_stats().cold_bytes_used, 0);
    EXPECT_TRUE(h->Eval(std::vector<int32_t>{prompt[200]}, &logits).ok());
    return MeanKl(ref, logits, hot->config().vocab_size);
  };
  const double gear = demoted_kl("gear4"), q4 = demoted_kl("q4_0");
  EXPECT_GT(gear, 0.0);
  EXPECT_LT(gear, 0.8 * q4) << "gear4 " << gear << ", q4_0 " << q4;
}

TEST(CalibratedEngine, RecentWindowAndQuestCompose) {
  const auto prompt = testing::LoadGolden().back().ids;
  EngineOptions o = testing::CalibratedOptions("pca4", "pca3");
  o.kv_window = 32;  // staged pages: f16 until 32 newer tokens follow, then coded whole
  auto e = Engine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto s = (*e)->NewSession();
  press::PressOptions p;
  ASSERT_TRUE(press::ParsePressSpec("quest", &p).ok());
  p.ratio = 0.5;
  std::vector<float> logits;
  ASSERT_TRUE(s->EvalPressed(std::span(prompt).first(200), p, &logits).ok());
  const PagedSequence& kv = EngineAccess::kv(*s);
  EXPECT_LT(testing::AttendVsDecoded(**e, kv, 2, 0, {120, 199}), 1e-5);
  ASSERT_TRUE(s->Eval(std::vector<int32_t>{prompt[200]}, &logits).ok());  // a Quest decode step
  // Quest's bounds, built from the keys turned back out of the pca basis, bound the keys.
  const int hd = (*e)->config().head_dim, pt = 16;
  for (int l = 0; l < (*e)->config().n_layers; ++l) {
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    kv.Gather(l, 1, &k, &v, &pos);
    const auto bounds = kv.key_bounds(l, 1);
    ASSERT_GE(bounds.size(), size_t(2 * hd * 10)) << "layer " << l;
    for (size_t page = 0; page < bounds.size() / (2 * hd); ++page) {
      for (int r = 0; r < pt; ++r) {
        for (int i = 0; i < hd; ++i) {
          const float x = k[(page * pt + r) * hd + i];
          ASSERT_LE(F16ToF32(bounds[page * 2 * hd + i]), x) << l << " " << page << " " << i;
          ASSERT_GE(F16ToF32(bounds[page * 2 * hd + hd + i]), x) << l << " " << page << " " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace cachet
