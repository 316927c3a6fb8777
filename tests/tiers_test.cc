// KV tiers: the stored format of a run (every corruption detected and named before any payload
// byte is returned).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <random>
#include <thread>

#include "kv/tiers/format.h"
#include "test_util.h"

namespace cachet::tiers {
namespace {

namespace fs = std::filesystem;

// The documented version 1 layout (docs/ARCHITECTURE.md): tests poke fields by offset, so a
// change of layout fails here first.
constexpr size_t kOffVersion = 4, kOffHeaderBytes = 8, kOffFlags = 12, kOffSalt = 64,
                 kOffTokens = 72, kOffPayloadBytes = 80, kOffHeaderSum = 96;

TierNamespace Ns() {
  TierNamespace ns;
  ns.model_hash = 0x1234abcd5678ef00ull;
  ns.codec_k = "q4_0";
  ns.codec_v = "q8_0";
  ns.page_tokens = 16;
  ns.n_layers = 4;
  ns.n_kv_heads = 2;
  ns.head_dim = 64;
  ns.rope_theta = 10000.0;
  ns.rope_scaling = "";
  return ns;
}

std::vector<int32_t> Tokens(int blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(size_t(blocks) * 16);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 32000);
  return t;
}

std::vector<uint8_t> Payload(size_t n, uint32_t seed, bool compressible) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = compressible ? uint8_t(i % 7 + (i / 512)) : uint8_t(rng());
  return p;
}

struct TestRun {
  RunKey key;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> payload;
  std::string bytes;
};

TestRun MakeRun(uint32_t id, size_t payload_bytes, bool zstd = false, bool compressible = false,
                uint64_t salt = 7) {
  TestRun r;
  r.tokens = Tokens(1 + int(id % 3), id);
  r.payload = Payload(payload_bytes, id, compressible);
  const RunKey parent = NamespaceKey(Ns());
  r.key = RunKey::Of(parent, salt, r.tokens);
  r.bytes = EncodeRun(Ns(), RunMeta{parent, salt, r.tokens}, r.payload, zstd);
  return r;
}

template <class T>
void Poke(std::string& s, size_t off, T v) {
  std::memcpy(s.data() + off, &v, sizeof(T));
}
// Recomputes both checksums: the bytes become an intact run of whatever the fields now say.
void Reseal(std::string& s) {
  Poke<uint64_t>(s, kOffHeaderSum, XXH3_64bits(s.data(), kOffHeaderSum));
  Poke<uint64_t>(s, s.size() - 8, XXH3_64bits(s.data(), s.size() - 8));
}

TierError ErrorOf(const Result<DecodedRun>& r) {
  EXPECT_FALSE(r.ok());
  const std::optional<TierError> e = TierErrorOf(r.status());
  EXPECT_TRUE(e.has_value()) << r.status().ToString();
  return e.value_or(TierError::kOk);
}

std::vector<uint8_t> PayloadOf(const DecodedRun& d) {
  return std::vector<uint8_t>(d.payload().begin(), d.payload().end());
}

// ---------------------------------------------------------------------------------------------
// The format

TEST(TierFormat, RoundTripRaw) {
  const TestRun r = MakeRun(1, 1000);
  EXPECT_EQ(r.bytes.size(), kHeaderBytes + 4 * r.tokens.size() + 1000 + 8);
  EXPECT_EQ(r.bytes.substr(0, 4), "CKVT");
  auto d = DecodeRun(r.bytes, Ns(), r.key, r.tokens);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE(d->header.zstd);
  EXPECT_EQ(d->header.key, r.key);
  EXPECT_EQ(d->header.parent, NamespaceKey(Ns()));
  EXPECT_EQ(d->header.salt, 7u);
  EXPECT_EQ(d->header.n_tokens, r.tokens.size());
  EXPECT_EQ(PayloadOf(*d), r.payload);
  // Uncompressed payloads are not copied: the view points into the stored bytes.
  EXPECT_EQ(reinterpret_cast<const char*>(d->payload().data()),
            r.bytes.data() + kHeaderBytes + 4 * r.tokens.size());
}

TEST(TierFormat, RoundTripZstd) {
  const TestRun plain = MakeRun(2, 20000, false, true);
  const TestRun z = MakeRun(2, 20000, true, true);
  EXPECT_EQ(z.key, plain.key);
  EXPECT_LT(z.bytes.size(), plain.bytes.size() / 4);
  auto d = DecodeRun(z.bytes, Ns(), z.key, z.tokens);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->header.zstd);
  EXPECT_EQ(d->header.payload_bytes, 20000u);
  EXPECT_EQ(d->header.stored_bytes, z.bytes.size() - kHeaderBytes - 4 * z.tokens.size() - 8);
  EXPECT_EQ(PayloadOf(*d), z.payload);
}

TEST(TierFormat, ZstdThatDoesNotShrinkIsStoredRaw) {
  const TestRun r = MakeRun(3, 4000, true, false);  // random bytes do not compress
  auto d = DecodeRun(r.bytes, Ns(), r.key, r.tokens);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_FALSE(d->header.zstd);
  EXPECT_EQ(PayloadOf(*d), r.payload);
}

TEST(TierFormat, EmptyPayloadRoundTrips) {
  for (bool zstd : {false, true}) {
    const TestRun r = MakeRun(4, 0, zstd);
    auto d = DecodeRun(r.bytes, Ns(), r.key, r.tokens);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_TRUE(d->payload().empty());
  }
}

TEST(TierFormat, KeysChainParentSaltAndTokens) {
  const RunKey root = NamespaceKey(Ns());
  const auto t = Tokens(2, 1);
  auto t2 = t;
  t2.back() ^= 1;
  const RunKey k = RunKey::Of(root, 7, t);
  EXPECT_EQ(k, RunKey::Of(root, 7, t));
  EXPECT_NE(k, RunKey::Of(root, 8, t));
  EXPECT_NE(k, RunKey::Of(k, 7, t));
  EXPECT_NE(k, RunKey::Of(root, 7, t2));
  EXPECT_NE(k, RunKey::Of(root, 7, std::span(t).first(16)));
  EXPECT_EQ(k.Hex().size(), 32u);
  EXPECT_EQ(k.Hex().find_first_not_of("0123456789abcdef"), std::string::npos);
}

// Every field of the namespace changes its hash (and so every key chained from it).
std::vector<TierNamespace> NamespaceVariants() {
  std::vector<TierNamespace> v(10, Ns());
  v[0].model_hash ^= 1;
  v[1].codec_k = "q8_0";
  v[2].codec_v = "q4_0";
  v[3].page_tokens = 32;
  v[4].n_layers = 5;
  v[5].n_kv_heads = 4;
  v[6].head_dim = 128;
  v[7].rope_theta = 500000.0;
  v[8].rope_scaling = "llama3:8,1,4,8192";
  v[9].payload_layout = 1;
  return v;
}

TEST(TierFormat, NamespaceCoversEveryField) {
  std::vector<RunKey> keys = {NamespaceKey(Ns())};
  for (const auto& ns : NamespaceVariants()) keys.push_back(NamespaceKey(ns));
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = i + 1; j < keys.size(); ++j) EXPECT_NE(keys[i], keys[j]) << i << " " << j;
  }
  // Strings are length-prefixed: moving a character between the codec names is another namespace.
  TierNamespace a = Ns(), b = Ns();
  a.codec_k = "q4_0q";
  a.codec_v = "8_0";
  b.codec_k = "q4_0";
  b.codec_v = "q8_0";
  EXPECT_NE(NamespaceKey(a), NamespaceKey(b));
}

TEST(TierFormat, TruncationAtEveryByteIsNamed) {
  for (bool zstd : {false, true}) {
    const TestRun r = MakeRun(5, 300, zstd, true);
    for (size_t n = 0; n < r.bytes.size(); ++n) {
      auto d = DecodeRun(std::string_view(r.bytes).substr(0, n), Ns(), r.key, r.tokens);
      ASSERT_EQ(ErrorOf(d), TierError::kTruncated)
          << "length " << n << ": " << d.status().ToString();
      EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
    }
  }
}

TEST(TierFormat, TrailingBytesAreNamed) {
  const TestRun r = MakeRun(6, 100);
  auto d = DecodeRun(r.bytes + "x", Ns(), r.key, r.tokens);
  EXPECT_EQ(ErrorOf(d), TierError::kTrailingBytes);
  EXPECT_NE(d.status().message().find(r.key.Hex()), std::string::npos) << d.status().message();
}

TEST(TierFormat, EveryBitFlipIsDetectedAndNamed) {
  for (bool zstd : {false, true}) {
    const TestRun r = MakeRun(7, 200, zstd, true);
    for (size_t byte = 0; byte < r.bytes.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string b = r.bytes;
        b[byte] = char(b[byte] ^ (1 << bit));
        auto d = DecodeRun(b, Ns(), r.key, r.tokens);
        const TierError e = ErrorOf(d);
        ASSERT_TRUE(IsCorrupt(e)) << "byte " << byte << " bit " << bit << ": "
                                  << d.status().ToString();
        EXPECT_EQ(d.status().code(), StatusCode::kDataLoss);
        if (byte < 4) {
          EXPECT_EQ(e, TierError::kBadMagic) << byte;
        } else if (byte >= kOffHeaderBytes && byte < kOffFlags) {
          // A damaged header size points the header checksum elsewhere, or past the end.
          EXPECT_TRUE(e == TierError::kHeaderCorrupt || e == TierError::kTruncated) << byte;
        } else if (byte < kHeaderBytes) {
          EXPECT_EQ(e, TierError::kHeaderCorrupt) << byte;  // the version included
        } else {
          EXPECT_EQ(e, TierError::kChecksumMismatch) << byte;  // tokens, payload, checksum
        }
      }
    }
  }
}

TEST(TierFormat, WrongMagicIsNamed) {
  TestRun r = MakeRun(8, 64);
  r.bytes[0] = 'X';
  EXPECT_EQ(ErrorOf(DecodeRun(r.bytes, Ns(), r.key, r.tokens)), TierError::kBadMagic);
  EXPECT_EQ(ErrorOf(DecodeRun("GGUF and more", Ns(), r.key, r.tokens)), TierError::kBadMagic);
}

TEST(TierFormat, IntactRunOfAnotherVersionIsAMissNotDamage) {
  TestRun r = MakeRun(9, 64);
  Poke<uint32_t>(r.bytes, kOffVersion, 2);
  Reseal(r.bytes);
  auto d = DecodeRun(r.bytes, Ns(), r.key, r.tokens);
  EXPECT_EQ(ErrorOf(d), TierError::kVersionMismatch);
  EXPECT_FALSE(IsCorrupt(TierError::kVersionMismatch));
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("version 2"), std::string::npos) << d.status().message();
}

TEST(TierFormat, ImpossibleFieldsUnderAValidChecksumAreBadHeader) {
  const TestRun base = MakeRun(10, 64);
  {
    std::string b = base.bytes;
    Poke<uint32_t>(b, kOffFlags, 2);  // a flag this version does not know
    Reseal(b);
    EXPECT_EQ(ErrorOf(DecodeRun(b, Ns(), base.key, base.tokens)), TierError::kBadHeader);
  }
  {
    std::string b = base.bytes;
    Poke<uint64_t>(b, kOffPayloadBytes, 65);  // raw payload whose sizes disagree
    Reseal(b);
    EXPECT_EQ(ErrorOf(DecodeRun(b, Ns(), base.key, base.tokens)), TierError::kBadHeader);
  }
  {
    std::string b = base.bytes;
    Poke<uint32_t>(b, kOffHeaderBytes, 200);  // a version 1 header of another size
    Poke<uint64_t>(b, 192, XXH3_64bits(b.data(), 192));
    EXPECT_EQ(ErrorOf(DecodeRun(b, Ns(), base.key, base.tokens)), TierError::kBadHeader);
  }
  // Breaking EncodeRun's preconditions is refused on read, not handed out.
  const RunKey root = NamespaceKey(Ns());
  const std::string empty = EncodeRun(Ns(), RunMeta{root, 7, {}}, std::vector<uint8_t>(8), false);
  EXPECT_EQ(ErrorOf(DecodeRun(empty, Ns(), RunKey::Of(root, 7, {}), {})), TierError::kBadHeader);
}

TEST(TierFormat, ZstdFrameThatDisagreesWithTheHeaderIsNamed) {
  const TestRun z = MakeRun(11, 5000, true, true);
  {
    std::string b = z.bytes;
    Poke<uint64_t>(b, kOffPayloadBytes, 5001);
    Reseal(b);
    EXPECT_EQ(ErrorOf(DecodeRun(b, Ns(), z.key, z.tokens)), TierError::kDecompressFailed);
  }
  {
    std::string b = z.bytes;
    b[kHeaderBytes + 4 * z.tokens.size()] ^= 0x55;  // the zstd frame's magic
    Reseal(b);
    EXPECT_EQ(ErrorOf(DecodeRun(b, Ns(), z.key, z.tokens)), TierError::kDecompressFailed);
  }
}

TEST(TierFormat, AnotherNamespaceIsAMissNamedAsSuch) {
  const TestRun r = MakeRun(12, 64);
  for (const auto& ns : NamespaceVariants()) {
    auto d = DecodeRun(r.bytes, ns, r.key, r.tokens);
    EXPECT_EQ(ErrorOf(d), TierError::kNamespaceMismatch);
    EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  }
  auto d = DecodeRun(r.bytes, NamespaceVariants()[1], r.key, r.tokens);
  EXPECT_NE(d.status().message().find("q8_0/q8_0"), std::string::npos) << d.status().message();
}

TEST(TierFormat, AnotherKeyOrOtherTokensAreMisses) {
  const TestRun r = MakeRun(13, 64);
  const TestRun other = MakeRun(14, 64);
  EXPECT_EQ(ErrorOf(DecodeRun(r.bytes, Ns(), other.key, r.tokens)), TierError::kKeyMismatch);
  auto tokens = r.tokens;
  tokens[5] += 1;
  EXPECT_EQ(ErrorOf(DecodeRun(r.bytes, Ns(), r.key, tokens)), TierError::kTokenMismatch);
  tokens = r.tokens;
  tokens.push_back(1);
  EXPECT_EQ(ErrorOf(DecodeRun(r.bytes, Ns(), r.key, tokens)), TierError::kTokenMismatch);
  EXPECT_EQ(ErrorOf(DecodeRun(r.bytes, Ns(), r.key, std::span(r.tokens).first(16))),
            TierError::kTokenMismatch);
}

TEST(TierFormat, KeyThatDoesNotChainFromItsFieldsIsRefused) {
  // Another tenant's run relabelled with this tenant's key (checksums recomputed): the stored
  // salt does not produce the key, so the run is refused although everything else matches.
  const TestRun mine = MakeRun(15, 64, false, false, /*salt=*/7);
  TestRun forged = MakeRun(15, 64, false, false, /*salt=*/99);
  std::memcpy(forged.bytes.data() + 32, mine.bytes.data() + 32, 16);  // the key field
  Reseal(forged.bytes);
  EXPECT_EQ(ErrorOf(DecodeRun(forged.bytes, Ns(), mine.key, mine.tokens)), TierError::kKeyMismatch);
  Poke<uint64_t>(forged.bytes, kOffSalt, 7);
  Reseal(forged.bytes);
  EXPECT_TRUE(DecodeRun(forged.bytes, Ns(), mine.key, mine.tokens).ok());
}

TEST(TierFormat, ErrorNamesRoundTrip) {
  EXPECT_EQ(TierErrorOf(OkStatus()), TierError::kOk);
  EXPECT_EQ(TierErrorOf(DataLoss("checksum_mismatch: not ours")), std::nullopt);
  for (int i = 1; i <= int(TierError::kTokenMismatch); ++i) {
    const auto e = static_cast<TierError>(i);
    const Status s(IsCorrupt(e) ? StatusCode::kDataLoss : StatusCode::kNotFound,
                   std::string("CKVT ") + TierErrorName(e) + ": x");
    EXPECT_EQ(TierErrorOf(s), e) << TierErrorName(e);
  }
  EXPECT_EQ(TierErrorOf(DataLoss("CKVT truncatedx: x")), std::nullopt);
}

}  // namespace
}  // namespace cachet::tiers
