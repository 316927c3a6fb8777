// The stored form of a run of KV blocks, shared by every tier beyond RAM (disk, Redis): one
// sequence's consecutive prefix-tree blocks with their pages in the pages' own codec. A stored run
// is self-describing and self-checking, so a process can trust bytes another process (or another
// machine, or a dying disk) wrote: everything is verified before any payload byte is handed out.
// The byte layout is in docs/ARCHITECTURE.md ("KV tiers: the stored format").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet::tiers {

inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kHeaderBytes = 104;  // version 1's header, its own checksum included
// Bounds a header may declare: a forged or corrupt header must not make a reader allocate more.
inline constexpr uint32_t kMaxRunTokens = 1u << 16;
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 30;
inline constexpr int kDefaultRunBlocks = 16;  // 256 tokens of 16-token pages: fewer round trips

// A 128-bit xxh3 value: the key of a run, and the namespace hash.
struct RunKey {
  uint64_t lo = 0;
  uint64_t hi = 0;

  // The chained key of a run: xxh3-128 over (parent, salt, tokens). The parent of a sequence's
  // first run is NamespaceKey(ns), so runs of different models or layouts never share a key.
  static RunKey Of(const RunKey& parent, uint64_t salt, std::span<const int32_t> tokens);
  std::string Hex() const;  // 32 lowercase hex digits, hi first
  bool operator==(const RunKey&) const = default;
};

struct RunKeyHash {
  size_t operator()(const RunKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi >> 1)); }
};

// Everything that decides whether stored pages mean the same thing to this engine. The model is
// identified by its content, never its path, so a copied or renamed model still hits.
struct TierNamespace {
  uint64_t model_hash = 0;
  std::string codec_k;  // the K and V codec names (codecs::CodecName)
  std::string codec_v;
  int32_t page_tokens = 0;
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  double rope_theta = 0;
  std::string rope_scaling;  // canonical text of the RoPE scaling, "" for none
  int32_t sinks = 0;         // mixed precision (KvLayout): which pages stay raw
  int32_t window = 0;
  // The caller's packing of pages into a payload: bump it when that order or content changes.
  uint32_t payload_layout = 0;
};

// xxh3-128 over the namespace's fields and kFormatVersion: what a run records, and the parent key
// of a sequence's first run.
RunKey NamespaceKey(const TierNamespace& ns);

// Why stored bytes were refused. Corrupt entries (IsCorrupt) are damaged or were never a run;
// the others are intact runs that are not the one asked for (another format version, namespace,
// key or token sequence): a miss, not damage.
enum class TierError : uint8_t {
  kOk = 0,
  kTruncated,          // fewer bytes than the header (or the sizes it declares) needs
  kBadMagic,           // not a CKVT run
  kHeaderCorrupt,      // the header's own checksum fails
  kVersionMismatch,    // an intact run of another format version
  kBadHeader,          // the header's checksum holds but a field is impossible
  kTrailingBytes,      // more bytes than the header declares
  kChecksumMismatch,   // the checksum over header, tokens and payload fails
  kDecompressFailed,   // zstd rejected the payload or inflated it to another size
  kNamespaceMismatch,  // an intact run of another model, codec or layout
  kKeyMismatch,        // an intact run of another key, or whose key does not chain from its fields
  kTokenMismatch,      // an intact run of other tokens (a key collision)
};
const char* TierErrorName(TierError e);  // "checksum_mismatch", ...
bool IsCorrupt(TierError e);
// The TierError a format function's Status carries (its message starts "CKVT <name>:"): kOk for
// an ok status, nullopt for a status that did not come from this file.
std::optional<TierError> TierErrorOf(const Status& s);

// What a run describes besides its payload; EncodeRun derives the key from it.
struct RunMeta {
  RunKey parent;
  uint64_t salt = 0;  // the cache salt's hash (tenant isolation)
  std::span<const int32_t> tokens;
};

// The header's fields, as read back.
struct RunHeader {
  uint32_t version = 0;
  bool zstd = false;
  RunKey ns;
  RunKey key;
  RunKey parent;
  uint64_t salt = 0;
  uint32_t n_tokens = 0;
  uint64_t payload_bytes = 0;  // inflated
  uint64_t stored_bytes = 0;   // as stored (== payload_bytes without zstd)
  // Bytes of the whole run: header, tokens, stored payload, checksum.
  uint64_t total_bytes() const { return kHeaderBytes + 4ull * n_tokens + stored_bytes + 8; }
};

struct DecodedRun {
  RunHeader header;  // its tokens equal the ones asked for
  // Without zstd the payload is a view into the bytes given to DecodeRun (which must outlive
  // it); with zstd it is inflated into `inflated`.
  std::span<const uint8_t> stored;
  std::vector<uint8_t> inflated;
  std::span<const uint8_t> payload() const { return header.zstd ? inflated : stored; }
};

// The stored form of one run. Preconditions (DecodeRun rejects runs that break them, so a caller's
// mistake is a named error on read, never wrong pages): 0 < tokens <= kMaxRunTokens, a multiple of
// ns.page_tokens; payload.size() <= kMaxPayloadBytes. With zstd the payload is compressed (level
// 1), and stored as is if that does not make it smaller.
std::string EncodeRun(const TierNamespace& ns, const RunMeta& meta,
                      std::span<const uint8_t> payload, bool zstd);

// The header alone, from the first bytes of a run (at least kHeaderBytes of them, or the whole
// run): magic, header checksum, version and field ranges. For scanning stored runs cheaply.
Result<RunHeader> ParseRunHeader(std::string_view bytes);
// A whole run's integrity, whatever it stores: the header, its exact length and the checksum.
Result<RunHeader> CheckRun(std::string_view bytes);
// CheckRun, then that the run is the one asked for (namespace, key, tokens), then the payload.
// Errors are DATA_LOSS for corrupt bytes and NOT_FOUND for an intact run that is not this one;
// TierErrorOf names which.
Result<DecodedRun> DecodeRun(std::string_view bytes, const TierNamespace& expect, const RunKey& key,
                             std::span<const int32_t> expect_tokens);

}  // namespace cachet::tiers
