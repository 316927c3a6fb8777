// What stored KV pages (the tiers' runs, saved caches) depend on, for an engine's model and layout.
#pragma once

#include "kv/page_pool.h"
#include "kv/tiers/format.h"
#include "model/transformer.h"

namespace cachet {

// The weights by content: a sample of every tensor, with the tensor table.
uint64_t WeightsHash(const Transformer& model);
// The model by its content (a sample of every tensor, with the tensor table), RoPE and the layout.
tiers::TierNamespace TierNamespaceOf(const Transformer& model, const KvLayout& layout);

}  // namespace cachet
