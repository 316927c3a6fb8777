#include "kv/tiers/format.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack: hashing allocates nothing
#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <memory>

namespace cachet::tiers {

// Fields are stored little-endian and written with memcpy; pages in the payload are in the host's
// layout anyway, so a big-endian host could not read them either.
static_assert(std::endian::native == std::endian::little, "the stored format is little-endian");

namespace {

constexpr char kMagic[4] = {'C', 'K', 'V', 'T'};
constexpr uint32_t kFlagZstd = 1;
constexpr int kZstdLevel = 1;  // KV codes are near-random: higher levels buy little, cost spills
// Offsets in the version 1 header. magic, version and header_bytes stay first in every version,
// and the header ends with its own checksum, so a reader tells a damaged header from a newer one.
constexpr size_t kOffVersion = 4, kOffHeaderBytes = 8, kOffFlags = 12, kOffNamespace = 16,
                 kOffKey = 32, kOffParent = 48, kOffSalt = 64, kOffTokens = 72, kOffReserved = 76,
                 kOffPayloadBytes = 80, kOffStoredBytes = 88, kOffHeaderSum = 96;
static_assert(kOffHeaderSum + 8 == kHeaderBytes);
constexpr size_t kMaxHeaderBytes = 4096;  // what any version's header may declare

template <class T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
void Store(char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
RunKey LoadKey(const char* p) { return {Load<uint64_t>(p), Load<uint64_t>(p + 8)}; }
void StoreKey(char* p, const RunKey& k) {
  Store(p, k.lo);
  Store(p + 8, k.hi);
}

struct Hasher128 {
  Hasher128() {
    XXH3_INITSTATE(&state);
    XXH3_128bits_reset(&state);
  }
  template <class T>
  void Add(const T& v) {
    XXH3_128bits_update(&state, &v, sizeof(T));
  }
  void Add(std::string_view s) {
    Add(static_cast<uint32_t>(s.size()));  // length-prefixed: ("ab","c") differs from ("a","bc")
    XXH3_128bits_update(&state, s.data(), s.size());
  }
  RunKey Digest() {
    const XXH128_hash_t h = XXH3_128bits_digest(&state);
    return {h.low64, h.high64};
  }
  XXH3_state_t state;
};

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

Status Fail(TierError e, const std::string& what) {
  std::string msg = std::string("CKVT ") + TierErrorName(e) + ": " + what;
  return IsCorrupt(e) ? DataLoss(std::move(msg)) : NotFound(std::move(msg));
}

struct ZstdCtxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
};
// One context per thread: creating one allocates its tables each time.
ZSTD_CCtx* CompressCtx() {
  thread_local std::unique_ptr<ZSTD_CCtx, ZstdCtxFree> ctx(ZSTD_createCCtx());
  return ctx.get();
}
ZSTD_DCtx* DecompressCtx() {
  thread_local std::unique_ptr<ZSTD_DCtx, ZstdCtxFree> ctx(ZSTD_createDCtx());
  return ctx.get();
}

}  // namespace

RunKey RunKey::Of(const RunKey& parent, uint64_t salt, std::span<const int32_t> tokens) {
  Hasher128 h;
  h.Add(parent.lo);
  h.Add(parent.hi);
  h.Add(salt);
  XXH3_128bits_update(&h.state, tokens.data(), tokens.size_bytes());
  return h.Digest();
}

std::string RunKey::Hex() const { return Hex64(hi) + Hex64(lo); }

RunKey NamespaceKey(const TierNamespace& ns) {
  Hasher128 h;
  h.Add(std::string_view("cachet kv namespace"));
  h.Add(kFormatVersion);
  h.Add(ns.model_hash);
  h.Add(std::string_view(ns.codec_k));
  h.Add(std::string_view(ns.codec_v));
  h.Add(ns.page_tokens);
  h.Add(ns.n_layers);
  h.Add(ns.n_kv_heads);
  h.Add(ns.head_dim);
  h.Add(std::bit_cast<uint64_t>(ns.rope_theta));
  h.Add(std::string_view(ns.rope_scaling));
  h.Add(ns.sinks);
  h.Add(ns.window);
  h.Add(ns.payload_layout);
  return h.Digest();
}

const char* TierErrorName(TierError e) {
  switch (e) {
    case TierError::kOk:
      return "ok";
    case TierError::kTruncated:
      return "truncated";
    case TierError::kBadMagic:
      return "bad_magic";
    case TierError::kHeaderCorrupt:
      return "header_corrupt";
    case TierError::kVersionMismatch:
      return "version_mismatch";
    case TierError::kBadHeader:
      return "bad_header";
    case TierError::kTrailingBytes:
      return "trailing_bytes";
    case TierError::kChecksumMismatch:
      return "checksum_mismatch";
    case TierError::kDecompressFailed:
      return "decompress_failed";
    case TierError::kNamespaceMismatch:
      return "namespace_mismatch";
    case TierError::kKeyMismatch:
      return "key_mismatch";
    case TierError::kTokenMismatch:
      return "token_mismatch";
  }
  return "unknown";
}

bool IsCorrupt(TierError e) {
  switch (e) {
    case TierError::kOk:
    case TierError::kVersionMismatch:
    case TierError::kNamespaceMismatch:
    case TierError::kKeyMismatch:
    case TierError::kTokenMismatch:
      return false;
    default:
      return true;
  }
}

std::optional<TierError> TierErrorOf(const Status& s) {
  if (s.ok()) return TierError::kOk;
  std::string_view m = s.message();
  if (!m.starts_with("CKVT ")) return std::nullopt;
  m.remove_prefix(5);
  for (int i = 1; i <= static_cast<int>(TierError::kTokenMismatch); ++i) {
    const auto e = static_cast<TierError>(i);
    const std::string_view name = TierErrorName(e);
    if (m.starts_with(name) && m.size() > name.size() && m[name.size()] == ':') return e;
  }
  return std::nullopt;
}

std::string EncodeRun(const TierNamespace& ns, const RunMeta& meta,
                      std::span<const uint8_t> payload, bool zstd) {
  const size_t n_tokens = meta.tokens.size();
  const size_t body = kHeaderBytes + n_tokens * sizeof(int32_t);
  std::string out;
  size_t stored = payload.size();
  if (zstd) {
    const size_t bound = ZSTD_compressBound(payload.size());
    out.resize(body + bound + 8);
    const size_t z = ZSTD_compressCCtx(CompressCtx(), out.data() + body, bound, payload.data(),
                                       payload.size(), kZstdLevel);
    // A compressed run must save bytes to be worth inflating on every read.
    if (ZSTD_isError(z) || z >= payload.size()) {
      zstd = false;
    } else {
      stored = z;
    }
  }
  out.resize(body + stored + 8);
  if (!zstd && !payload.empty()) std::memcpy(out.data() + body, payload.data(), payload.size());

  char* h = out.data();
  std::memcpy(h, kMagic, 4);
  Store<uint32_t>(h + kOffVersion, kFormatVersion);
  Store<uint32_t>(h + kOffHeaderBytes, kHeaderBytes);
  Store<uint32_t>(h + kOffFlags, zstd ? kFlagZstd : 0);
  StoreKey(h + kOffNamespace, NamespaceKey(ns));
  StoreKey(h + kOffKey, RunKey::Of(meta.parent, meta.salt, meta.tokens));
  StoreKey(h + kOffParent, meta.parent);
  Store<uint64_t>(h + kOffSalt, meta.salt);
  Store<uint32_t>(h + kOffTokens, static_cast<uint32_t>(n_tokens));
  Store<uint32_t>(h + kOffReserved, 0);
  Store<uint64_t>(h + kOffPayloadBytes, payload.size());
  Store<uint64_t>(h + kOffStoredBytes, stored);
  Store<uint64_t>(h + kOffHeaderSum, XXH3_64bits(h, kOffHeaderSum));
  if (n_tokens > 0) std::memcpy(h + kHeaderBytes, meta.tokens.data(), meta.tokens.size_bytes());
  Store<uint64_t>(h + out.size() - 8, XXH3_64bits(h, out.size() - 8));
  return out;
}

Result<RunHeader> ParseRunHeader(std::string_view bytes) {
  const char* p = bytes.data();
  const size_t n = bytes.size();
  auto need = [&](size_t want, const char* what) {
    return Fail(TierError::kTruncated,
                std::to_string(n) + " bytes, " + what + " needs " + std::to_string(want));
  };
  if (n < 4) return need(4, "the magic");
  if (std::memcmp(p, kMagic, 4) != 0) {
    return Fail(TierError::kBadMagic, "first bytes are not \"CKVT\"");
  }
  if (n < kOffFlags) return need(kOffFlags, "the header size");
  const uint32_t header_bytes = Load<uint32_t>(p + kOffHeaderBytes);
  if (header_bytes < kOffFlags + 8 || header_bytes > kMaxHeaderBytes) {
    return Fail(TierError::kHeaderCorrupt,
                "header size " + std::to_string(header_bytes) + " is out of range");
  }
  if (n < header_bytes) return need(header_bytes, "the header");
  const uint64_t header_sum = Load<uint64_t>(p + header_bytes - 8);
  if (XXH3_64bits(p, header_bytes - 8) != header_sum) {
    return Fail(TierError::kHeaderCorrupt, "the header's checksum does not match its " +
                                               std::to_string(header_bytes) + " bytes");
  }
  RunHeader h;
  h.version = Load<uint32_t>(p + kOffVersion);
  if (h.version != kFormatVersion) {
    return Fail(TierError::kVersionMismatch, "format version " + std::to_string(h.version) +
                                                 ", this reader knows " +
                                                 std::to_string(kFormatVersion));
  }
  if (header_bytes != kHeaderBytes) {
    return Fail(TierError::kBadHeader, "version 1 header of " + std::to_string(header_bytes) +
                                           " bytes, not " + std::to_string(kHeaderBytes));
  }
  const uint32_t flags = Load<uint32_t>(p + kOffFlags);
  h.zstd = (flags & kFlagZstd) != 0;
  h.ns = LoadKey(p + kOffNamespace);
  h.key = LoadKey(p + kOffKey);
  h.parent = LoadKey(p + kOffParent);
  h.salt = Load<uint64_t>(p + kOffSalt);
  h.n_tokens = Load<uint32_t>(p + kOffTokens);
  h.payload_bytes = Load<uint64_t>(p + kOffPayloadBytes);
  h.stored_bytes = Load<uint64_t>(p + kOffStoredBytes);
  const std::string where = "run " + h.key.Hex() + ": ";
  if ((flags & ~kFlagZstd) != 0 || Load<uint32_t>(p + kOffReserved) != 0) {
    return Fail(TierError::kBadHeader, where + "unknown flags " + std::to_string(flags));
  }
  if (h.n_tokens == 0 || h.n_tokens > kMaxRunTokens) {
    return Fail(TierError::kBadHeader, where + std::to_string(h.n_tokens) + " tokens (1 to " +
                                           std::to_string(kMaxRunTokens) + ")");
  }
  if (h.payload_bytes > kMaxPayloadBytes ||
      (h.zstd ? h.stored_bytes > ZSTD_compressBound(h.payload_bytes)
              : h.stored_bytes != h.payload_bytes)) {
    return Fail(TierError::kBadHeader, where + "payload of " + std::to_string(h.payload_bytes) +
                                           " bytes stored in " + std::to_string(h.stored_bytes) +
                                           (h.zstd ? " (zstd)" : " (raw)"));
  }
  return h;
}

Result<RunHeader> CheckRun(std::string_view bytes) {
  CACHET_ASSIGN_OR_RETURN(RunHeader h, ParseRunHeader(bytes));
  const std::string where = "run " + h.key.Hex() + ": ";
  const uint64_t total = h.total_bytes();
  if (bytes.size() < total) {
    return Fail(TierError::kTruncated,
                where + std::to_string(bytes.size()) + " of " + std::to_string(total) + " bytes");
  }
  if (bytes.size() > total) {
    return Fail(TierError::kTrailingBytes, where + std::to_string(bytes.size()) +
                                               " bytes, the header declares " +
                                               std::to_string(total));
  }
  const uint64_t stored_sum = Load<uint64_t>(bytes.data() + total - 8);
  const uint64_t sum = XXH3_64bits(bytes.data(), total - 8);
  if (sum != stored_sum) {
    return Fail(TierError::kChecksumMismatch, where + "checksum " + Hex64(sum) + " over " +
                                                  std::to_string(total - 8) + " bytes, stored " +
                                                  Hex64(stored_sum));
  }
  return h;
}

Result<DecodedRun> DecodeRun(std::string_view bytes, const TierNamespace& expect, const RunKey& key,
                             std::span<const int32_t> expect_tokens) {
  // Integrity first: a damaged namespace or token field is then reported as damage (corrupt),
  // and the mismatches below only ever describe intact runs.
  CACHET_ASSIGN_OR_RETURN(RunHeader h, CheckRun(bytes));
  const std::string where = "run " + key.Hex() + ": ";
  const RunKey ns = NamespaceKey(expect);
  if (h.ns != ns) {
    return Fail(TierError::kNamespaceMismatch,
                where + "stored for namespace " + h.ns.Hex() + ", this engine's is " + ns.Hex() +
                    " (model " + Hex64(expect.model_hash) + ", codecs " + expect.codec_k + "/" +
                    expect.codec_v + ", page_tokens " + std::to_string(expect.page_tokens) + ")");
  }
  if (h.key != key) {
    return Fail(TierError::kKeyMismatch, where + "the stored run is " + h.key.Hex());
  }
  const char* tok = bytes.data() + kHeaderBytes;
  if (h.n_tokens != expect_tokens.size() ||
      std::memcmp(tok, expect_tokens.data(), expect_tokens.size_bytes()) != 0) {
    return Fail(TierError::kTokenMismatch, where + "stored tokens differ from the " +
                                               std::to_string(expect_tokens.size()) + " asked for");
  }
  // The key must follow from the stored fields: a writer that forged a key (another tenant's
  // salt, another parent) is refused even though its checksums hold.
  const std::span<const int32_t> stored_tokens = expect_tokens;  // equal, checked above
  if (RunKey::Of(h.parent, h.salt, stored_tokens) != h.key) {
    return Fail(TierError::kKeyMismatch,
                where + "the key does not chain from the stored parent and salt");
  }
  DecodedRun run;
  run.header = h;
  run.stored = std::span<const uint8_t>(
      reinterpret_cast<const uint8_t*>(tok + expect_tokens.size_bytes()), h.stored_bytes);
  if (h.zstd) {
    const unsigned long long size = ZSTD_getFrameContentSize(run.stored.data(), run.stored.size());
    if (size != h.payload_bytes) {
      return Fail(TierError::kDecompressFailed,
                  where + "zstd frame declares " +
                      (size >= ZSTD_CONTENTSIZE_ERROR ? std::string("no size")
                                                      : std::to_string(size) + " bytes") +
                      ", the header " + std::to_string(h.payload_bytes));
    }
    run.inflated.resize(h.payload_bytes);
    const size_t got =
        ZSTD_decompressDCtx(DecompressCtx(), run.inflated.data(), run.inflated.size(),
                            run.stored.data(), run.stored.size());
    if (ZSTD_isError(got) || got != h.payload_bytes) {
      return Fail(TierError::kDecompressFailed,
                  where +
                      (ZSTD_isError(got) ? std::string(ZSTD_getErrorName(got))
                                         : std::to_string(got) + " bytes inflated") +
                      ", expected " + std::to_string(h.payload_bytes));
    }
  }
  return run;
}

}  // namespace cachet::tiers
