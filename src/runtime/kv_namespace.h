// What stored KV pages (the tiers' runs, saved caches) depend on, for an engine's model and layout.
#pragma once

#include <memory>

#include "cachet/engine.h"
#include "kv/codecs/calibration.h"
#include "kv/page_pool.h"
#include "kv/tiers/format.h"
#include "model/transformer.h"

namespace cachet {

// The weights by content: a sample of every tensor, with the tensor table.
uint64_t WeightsHash(const Transformer& model);
// The model by its content (its WeightsHash), RoPE and the layout.
tiers::TierNamespace TierNamespaceOf(const ModelConfig& c, uint64_t weights_hash,
                                     const KvLayout& layout);
// The calibration layout's codecs need (o.kv_calibration; null when none is given and none needs
// one), checked against the model: its shape and its WeightsHash.
Result<std::shared_ptr<const codecs::Calibration>> LoadKvCalibration(const ModelConfig& c,
                                                                     uint64_t weights_hash,
                                                                     const EngineOptions& o,
                                                                     const KvLayout& layout);
// Gives the layout the model's RoPE when a codec of it stores keys before RoPE (kvq): positions
// below n_ctx (at most 32768) are tabled.
void AddRopeTable(const ModelConfig& c, int n_ctx, KvLayout* layout);

}  // namespace cachet
