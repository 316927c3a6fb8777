// A tier: a store of encoded runs (format.h) beyond the pool's RAM, keyed by RunKey. The prefix
// cache falls through its tiers on lookup and spills evicted runs into them. Calls are batched
// (a sequence's chain of runs is one call: one round trip for a network tier) and synchronous;
// a tier is a cache, so losing an entry is always allowed and a lookup's miss is never an error.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cachet/status.h"
#include "kv/tiers/format.h"

namespace cachet::tiers {

struct TierStats {
  int64_t hits = 0;           // keys Get returned bytes for
  int64_t misses = 0;         // keys Get returned nothing for (corrupt entries and errors included)
  int64_t corrupt = 0;        // entries found damaged (and removed)
  int64_t errors = 0;         // I/O or connection failures
  int64_t bytes_read = 0;     // bytes returned by Get
  int64_t bytes_written = 0;  // bytes stored by Put
  int64_t entries = 0;        // entries the tier knows it holds now
  int64_t bytes_held = 0;     // their bytes
  int64_t evicted = 0;        // entries removed to stay under the tier's cap
  int64_t dropped = 0;  // runs Put accepted but never stored (a full queue, a failure, no room)
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual std::string_view name() const = 0;  // "disk", "redis": for metrics and messages

  // The stored runs of keys, in order; nullopt for a miss. A tier checks what it returns is an
  // intact run stored under that key (CheckRun); whether it is the run the caller wants
  // (namespace, tokens) is DecodeRun's to say. The keys are a chain (each run's key chains from
  // the one before), used only up to its first gap, so a tier may return nothing past the first
  // key it does not hold (the Redis tier does not fetch them).
  virtual std::vector<std::optional<std::string>> Get(std::span<const RunKey> keys) = 0;
  // Stores runs (EncodeRun's bytes under their key). A key already held is kept, not rewritten:
  // keys are content addresses. Malformed input (bytes that are not an intact run of that key)
  // is InvalidArgument and stores nothing; a failure to store some runs is reported after the
  // others are stored.
  virtual Status Put(std::span<const std::pair<RunKey, std::string>> runs) = 0;
  // Whether each key is held, as far as the tier knows without reading it: a hint (Get may
  // still miss), cheap enough to plan a lookup with.
  virtual std::vector<bool> Exists(std::span<const RunKey> keys) = 0;
  // Drops an entry, e.g. one DecodeRun refused. Erasing a key not held does nothing.
  virtual void Erase(const RunKey& key) = 0;

  virtual TierStats stats() const = 0;
};

}  // namespace cachet::tiers
