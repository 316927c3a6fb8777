#include "runtime/kv_namespace.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>

namespace cachet {

// What a stored KV page depends on: the weights (a sample of each tensor's bytes, with the tensor
// table: identical files give identical hashes wherever they live, and weights that differ
// anywhere differ in every sample of practice), RoPE and the KV layout.
uint64_t WeightsHash(const Transformer& model) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  for (const auto& [name, t] : model.weights().store.tensors()) {
    XXH3_64bits_update(h, name.data(), name.size());
    const uint64_t meta[2] = {static_cast<uint64_t>(t.dtype), t.n_bytes};
    XXH3_64bits_update(h, meta, sizeof(meta));
    const auto* bytes = static_cast<const uint8_t*>(t.data);
    constexpr size_t kSample = 4096;
    for (size_t at : {size_t{0}, t.n_bytes / 2, t.n_bytes > kSample ? t.n_bytes - kSample : 0}) {
      XXH3_64bits_update(h, bytes + at, std::min(kSample, t.n_bytes - at));
    }
  }
  const uint64_t hash = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return hash;
}

tiers::TierNamespace TierNamespaceOf(const ModelConfig& c, uint64_t weights_hash,
                                     const KvLayout& layout) {
  tiers::TierNamespace ns;
  ns.model_hash = weights_hash;
  ns.codec_k = codecs::CodecName(layout.codec_k);
  ns.codec_v = codecs::CodecName(layout.codec_v);
  if (layout.calibration) {  // pages coded by one calibration are unreadable by any other
    char tag[24];
    std::snprintf(tag, sizeof(tag), "#%016llx",
                  static_cast<unsigned long long>(layout.calibration->Hash()));
    ns.codec_k += tag;
    ns.codec_v += tag;
  }
  ns.page_tokens = layout.page_tokens;
  ns.n_layers = layout.n_layers;
  ns.n_kv_heads = layout.n_kv_heads;
  ns.head_dim = layout.head_dim;
  ns.sinks = layout.sinks;
  ns.window = layout.window;
  ns.rope_theta = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  ns.rope_scaling = r.type == RopeScaling::Type::kNone
                        ? ""
                        : std::to_string(static_cast<int>(r.type)) + ":" +
                              std::to_string(r.factor) + ":" + std::to_string(r.low_freq_factor) +
                              ":" + std::to_string(r.high_freq_factor) + ":" +
                              std::to_string(r.original_max_position_embeddings);
  return ns;
}

Result<std::shared_ptr<const codecs::Calibration>> LoadKvCalibration(const ModelConfig& c,
                                                                     uint64_t weights_hash,
                                                                     const EngineOptions& o,
                                                                     const KvLayout& layout) {
  const bool needs = codecs::IsCalibrated(layout.codec_k) || codecs::IsCalibrated(layout.codec_v);
  if (o.kv_calibration.empty()) {
    if (!needs) return std::shared_ptr<const codecs::Calibration>();
    return InvalidArgument(
        std::string("KV codec ") +
        codecs::CodecName(codecs::IsCalibrated(layout.codec_k) ? layout.codec_k : layout.codec_v) +
        " needs a calibration of this model: --kv-calibration FILE (make one with `cachet "
        "calibrate`)");
  }
  CACHET_ASSIGN_OR_RETURN(codecs::Calibration cal, codecs::LoadCalibration(o.kv_calibration));
  if (cal.n_layers != c.n_layers || cal.n_kv_heads != c.n_kv_heads || cal.head_dim != c.head_dim) {
    return InvalidArgument(o.kv_calibration + ": calibrated for " + std::to_string(cal.n_layers) +
                           " layers x " + std::to_string(cal.n_kv_heads) + " KV heads x head_dim " +
                           std::to_string(cal.head_dim) + ", the model has " +
                           std::to_string(c.n_layers) + " x " + std::to_string(c.n_kv_heads) +
                           " x " + std::to_string(c.head_dim));
  }
  if (cal.model_hash != weights_hash) {
    return InvalidArgument(o.kv_calibration +
                           ": calibrated on other weights than this model's (run `cachet "
                           "calibrate` on it)");
  }
  return std::make_shared<const codecs::Calibration>(std::move(cal));
}

void AddRopeTable(const ModelConfig& c, int n_ctx, KvLayout* layout) {
  if (layout->rope || !codecs::StoredBeforeRope(layout->codec_k, codecs::Role::kKey)) return;
  layout->rope = std::make_shared<const codecs::RopeTable>(c.RopeInvFreq(), std::min(n_ctx, 32768));
}

}  // namespace cachet
