// KV tiers: the stored format of a run (every corruption detected and named before any payload
// byte is returned) and the disk tier (atomic files, LRU under a cap, restart, damage under a
// live process, threads, two processes' views of one directory, a randomized model check).
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

#include "kv/tiers/disk_tier.h"
#include "kv/tiers/format.h"
#include "kv/tiers/kv_tiers.h"
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

// ---------------------------------------------------------------------------------------------
// The disk tier

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Rewrites a file in place keeping its mtime, as damage that leaves the LRU order alone.
void Rewrite(const std::string& path, const std::string& contents) {
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << contents;
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}
void FlipByte(const std::string& path, size_t offset) {
  std::string s = ReadFile(path);
  ASSERT_LT(offset, s.size());
  s[offset] = char(s[offset] ^ 0x10);
  Rewrite(path, s);
}

std::vector<std::string> FilesUnder(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) names.push_back(fs::relative(e.path(), dir).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::unique_ptr<DiskTier> OpenTier(const std::string& dir, uint64_t cap) {
  auto t = DiskTier::Open(DiskTierOptions{dir, cap});
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

Status PutRuns(Tier& tier, std::initializer_list<const TestRun*> runs) {
  std::vector<std::pair<RunKey, std::string>> batch;
  for (const TestRun* r : runs) batch.emplace_back(r->key, r->bytes);
  return tier.Put(batch);
}

std::optional<std::string> GetOne(Tier& tier, const RunKey& key) {
  return std::move(tier.Get(std::span(&key, 1))[0]);
}
bool Has(Tier& tier, const RunKey& key) { return tier.Exists(std::span(&key, 1))[0]; }

TEST(DiskTier, PutGetExists) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->name(), "disk");
  const TestRun a = MakeRun(20, 500), b = MakeRun(21, 700, true, true), c = MakeRun(22, 0);
  ASSERT_TRUE(PutRuns(*tier, {&a, &b, &c}).ok());
  const TestRun missing = MakeRun(23, 10);
  const RunKey keys[] = {a.key, missing.key, b.key, c.key};
  const auto got = tier->Get(keys);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0], a.bytes);
  EXPECT_FALSE(got[1].has_value());
  EXPECT_EQ(got[2], b.bytes);
  EXPECT_EQ(got[3], c.bytes);
  EXPECT_EQ(tier->Exists(keys), (std::vector<bool>{true, false, true, true}));
  auto d = DecodeRun(*got[2], Ns(), b.key, b.tokens);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(PayloadOf(*d), b.payload);

  const TierStats s = tier->stats();
  EXPECT_EQ(s.hits, 3);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.corrupt, 0);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(s.entries, 3);
  const int64_t total = int64_t(a.bytes.size() + b.bytes.size() + c.bytes.size());
  EXPECT_EQ(s.bytes_held, total);
  EXPECT_EQ(s.bytes_written, total);
  EXPECT_EQ(s.bytes_read, total);
  // One file per run, in the shard its key's first two hex digits name; no temp file remains.
  const std::string hex = a.key.Hex();
  EXPECT_EQ(tier->PathOf(a.key), dir.path() + "/" + hex.substr(0, 2) + "/" + hex);
  EXPECT_EQ(ReadFile(tier->PathOf(a.key)), a.bytes);
  EXPECT_EQ(FilesUnder(dir.path()).size(), 3u);

  // A key already held is kept (touched), not rewritten.
  ASSERT_TRUE(PutRuns(*tier, {&a}).ok());
  EXPECT_EQ(tier->stats().bytes_written, total);
  tier->Erase(a.key);
  tier->Erase(missing.key);  // not held: nothing happens
  EXPECT_FALSE(Has(*tier, a.key));
  EXPECT_FALSE(fs::exists(tier->PathOf(a.key)));
  EXPECT_EQ(tier->stats().entries, 2);
}

TEST(DiskTier, MalformedPutIsRefusedWhole) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  const TestRun a = MakeRun(30, 100), b = MakeRun(31, 100);
  std::string damaged = b.bytes;
  damaged[kHeaderBytes + 3] ^= 1;
  const std::vector<std::pair<RunKey, std::string>> bad_bytes = {{a.key, a.bytes},
                                                                 {b.key, damaged}};
  Status s = tier->Put(bad_bytes);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("Put run 1 of 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("checksum_mismatch"), std::string::npos) << s.message();
  const std::vector<std::pair<RunKey, std::string>> wrong_key = {{a.key, a.bytes},
                                                                 {a.key, b.bytes}};
  s = tier->Put(wrong_key);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the bytes are run " + b.key.Hex()), std::string::npos) << s.message();
  EXPECT_FALSE(Has(*tier, a.key));
  EXPECT_EQ(tier->stats().entries, 0);
  EXPECT_TRUE(FilesUnder(dir.path()).empty());
}

TEST(DiskTier, OpenRefusesBadOptions) {
  testing::TempDir dir;
  EXPECT_EQ(DiskTier::Open({"", 100}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DiskTier::Open({dir.path(), 0}).status().code(), StatusCode::kInvalidArgument);
  const std::string file = dir.Write("plain-file", "x");
  auto t = DiskTier::Open({file, 100});
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(file), std::string::npos) << t.status().message();
}

TEST(DiskTier, RunLargerThanTheCapIsRefusedOthersStored) {
  testing::TempDir dir;
  const TestRun small = MakeRun(32, 100), big = MakeRun(33, 5000);
  auto tier = OpenTier(dir.path(), 2000);
  ASSERT_TRUE(tier);
  const Status s = PutRuns(*tier, {&big, &small});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find(big.key.Hex()), std::string::npos) << s.message();
  EXPECT_FALSE(Has(*tier, big.key));
  EXPECT_EQ(GetOne(*tier, small.key), small.bytes);
  EXPECT_EQ(tier->stats().dropped, 1);  // said in --kv-stats (it was silent)
}

TEST(DiskTier, RestartSeesTheEntries) {
  testing::TempDir dir;
  const TestRun a = MakeRun(40, 300), b = MakeRun(41, 3000, true, true);
  {
    auto tier = OpenTier(dir.path(), 1 << 20);
    ASSERT_TRUE(PutRuns(*tier, {&a, &b}).ok());
  }
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->stats().entries, 2);
  EXPECT_EQ(tier->stats().bytes_held, int64_t(a.bytes.size() + b.bytes.size()));
  EXPECT_EQ(GetOne(*tier, a.key), a.bytes);
  EXPECT_EQ(GetOne(*tier, b.key), b.bytes);
}

TEST(DiskTier, OpenDeletesDamagedRunsAndLeavesForeignFiles) {
  testing::TempDir dir;
  const TestRun good = MakeRun(50, 200), trunc = MakeRun(51, 200), misplaced = MakeRun(52, 200),
                other_version = MakeRun(53, 200), garbage = MakeRun(54, 200);
  std::string v2 = other_version.bytes;
  Poke<uint32_t>(v2, kOffVersion, 2);
  Reseal(v2);
  std::string foreign_in_shard, stale_temp, fresh_temp;
  {
    auto tier = OpenTier(dir.path(), 1 << 20);
    ASSERT_TRUE(PutRuns(*tier, {&good, &trunc, &misplaced, &other_version, &garbage}).ok());
    Rewrite(tier->PathOf(trunc.key), trunc.bytes.substr(0, trunc.bytes.size() - 1));
    Rewrite(tier->PathOf(misplaced.key), good.bytes);
    Rewrite(tier->PathOf(other_version.key), v2);
    Rewrite(tier->PathOf(garbage.key), "not a run at all");
    const std::string shard = fs::path(tier->PathOf(good.key)).parent_path().string();
    foreign_in_shard = shard + "/notes.txt";
    stale_temp = shard + "/.tmp-0000000000000001-1";
    fresh_temp = shard + "/.tmp-0000000000000001-2";
  }
  std::ofstream(dir.path() + "/README") << "the user's";
  std::ofstream(foreign_in_shard) << "the user's too";
  std::ofstream(stale_temp) << "a crashed writer's";
  std::ofstream(fresh_temp) << "a live writer's";
  const struct timespec old[2] = {{0, UTIME_OMIT}, {::time(nullptr) - 3600, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, stale_temp.c_str(), old, 0), 0);

  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->stats().entries, 1);
  EXPECT_EQ(tier->stats().corrupt, 3);  // truncated, misplaced, garbage
  EXPECT_FALSE(fs::exists(tier->PathOf(trunc.key)));
  EXPECT_FALSE(fs::exists(tier->PathOf(misplaced.key)));
  EXPECT_FALSE(fs::exists(tier->PathOf(garbage.key)));
  EXPECT_EQ(ReadFile(tier->PathOf(other_version.key)), v2);  // a newer process's: kept
  EXPECT_FALSE(Has(*tier, trunc.key));
  EXPECT_TRUE(fs::exists(dir.path() + "/README"));
  EXPECT_TRUE(fs::exists(foreign_in_shard));
  EXPECT_FALSE(fs::exists(stale_temp));
  EXPECT_TRUE(fs::exists(fresh_temp));
  EXPECT_EQ(GetOne(*tier, good.key), good.bytes);
  // The other version's run is a miss, neither corrupt nor deleted.
  EXPECT_FALSE(GetOne(*tier, other_version.key).has_value());
  EXPECT_EQ(tier->stats().corrupt, 3);
  EXPECT_TRUE(fs::exists(tier->PathOf(other_version.key)));
}

// Runs of equal size, so a cap of n runs holds exactly n.
std::vector<TestRun> EqualRuns(int n, uint32_t first_id) {
  std::vector<TestRun> runs;
  for (int i = 0; i < n; ++i) runs.push_back(MakeRun(first_id + 3 * i, 1000));  // id % 3 equal
  return runs;
}

TEST(DiskTier, EvictsLeastRecentlyUsedUnderTheCap) {
  testing::TempDir dir;
  const auto r = EqualRuns(5, 60);  // A B C D E
  auto tier = OpenTier(dir.path(), 3 * r[0].bytes.size());
  ASSERT_TRUE(tier);
  ASSERT_TRUE(PutRuns(*tier, {&r[0], &r[1], &r[2]}).ok());
  ASSERT_TRUE(GetOne(*tier, r[0].key));       // order now B C A
  ASSERT_TRUE(PutRuns(*tier, {&r[3]}).ok());  // evicts B
  EXPECT_FALSE(Has(*tier, r[1].key));
  EXPECT_FALSE(fs::exists(tier->PathOf(r[1].key)));
  EXPECT_TRUE(Has(*tier, r[0].key) && Has(*tier, r[2].key) && Has(*tier, r[3].key));
  ASSERT_TRUE(PutRuns(*tier, {&r[2]}).ok());  // a put touches too: order A D C
  ASSERT_TRUE(PutRuns(*tier, {&r[4]}).ok());  // evicts A
  EXPECT_FALSE(Has(*tier, r[0].key));
  EXPECT_TRUE(Has(*tier, r[2].key) && Has(*tier, r[3].key) && Has(*tier, r[4].key));
  const TierStats s = tier->stats();
  EXPECT_EQ(s.evicted, 2);
  EXPECT_EQ(s.entries, 3);
  EXPECT_LE(uint64_t(s.bytes_held), 3 * r[0].bytes.size());
  EXPECT_EQ(FilesUnder(dir.path()).size(), 3u);
}

// A chain of runs is useful only from its first run on: the cap evicts chains from their end,
// and never makes room for a run by evicting the runs before it. With room for two of a
// three-run chain, the third is not stored (it was, by evicting the first: every later lookup
// then found nothing, and stored the first again, evicting the second).
TEST(DiskTier, ChainsAreEvictedFromTheirEnd) {
  testing::TempDir dir;
  std::vector<TestRun> chain(3);
  RunKey parent = NamespaceKey(Ns());
  for (uint32_t i = 0; i < 3; ++i) {
    TestRun& r = chain[i];
    r.tokens = Tokens(1, 50 + i);
    r.payload = Payload(1000, 50 + i, false);
    r.key = RunKey::Of(parent, 7, r.tokens);
    r.bytes = EncodeRun(Ns(), RunMeta{parent, 7, r.tokens}, r.payload, false);
    parent = r.key;
  }
  const auto other = EqualRuns(1, 60);  // a run of one block and 1000 payload bytes, as these
  ASSERT_EQ(chain[0].bytes.size(), other[0].bytes.size());
  auto tier = OpenTier(dir.path(), 2 * chain[0].bytes.size());
  ASSERT_TRUE(tier);
  ASSERT_TRUE(PutRuns(*tier, {&chain[0], &chain[1], &chain[2]}).ok());
  EXPECT_TRUE(Has(*tier, chain[0].key) && Has(*tier, chain[1].key));
  EXPECT_FALSE(Has(*tier, chain[2].key));
  EXPECT_EQ(tier->stats().evicted, 0);
  EXPECT_EQ(tier->stats().dropped, 1);  // room only by evicting its own chain
  // The chain was read first to last: its end goes first when another run needs the room.
  const RunKey keys[] = {chain[0].key, chain[1].key};
  ASSERT_TRUE(tier->Get(keys)[1]);
  ASSERT_TRUE(PutRuns(*tier, {&other[0]}).ok());
  EXPECT_TRUE(Has(*tier, chain[0].key));
  EXPECT_FALSE(Has(*tier, chain[1].key));
}

TEST(DiskTier, AccessOrderSurvivesARestart) {
  testing::TempDir dir;
  const auto r = EqualRuns(12, 70);
  const uint64_t run_bytes = r[0].bytes.size();
  // An access order unlike the write order (and, with 720 orders of 6, unlike the keys' order).
  const int order[] = {3, 0, 5, 1, 4, 2};
  {
    auto tier = OpenTier(dir.path(), 6 * run_bytes);
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(PutRuns(*tier, {&r[i]}).ok());
    for (int i : order) ASSERT_TRUE(GetOne(*tier, r[i].key));
  }
  {
    // Each new run evicts the oldest access of the previous process, in its order.
    auto tier = OpenTier(dir.path(), 6 * run_bytes);
    ASSERT_EQ(tier->stats().entries, 6);
    for (int j = 0; j < 3; ++j) {
      ASSERT_TRUE(PutRuns(*tier, {&r[6 + j]}).ok());
      EXPECT_FALSE(Has(*tier, r[order[j]].key)) << j;
      for (int k = j + 1; k < 6; ++k) EXPECT_TRUE(Has(*tier, r[order[k]].key)) << j << k;
    }
  }
  // A smaller cap at the next start evicts the oldest at once: order[3] goes, then order[4].
  auto tier = OpenTier(dir.path(), 4 * run_bytes);
  EXPECT_EQ(tier->stats().entries, 4);
  EXPECT_EQ(tier->stats().evicted, 2);
  EXPECT_FALSE(Has(*tier, r[order[3]].key) || Has(*tier, r[order[4]].key));
  EXPECT_TRUE(Has(*tier, r[order[5]].key) && Has(*tier, r[6].key) && Has(*tier, r[8].key));
}

TEST(DiskTier, DamageUnderALiveTierIsAMissNeverWrongBytes) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  const TestRun truncated = MakeRun(80, 500), flipped = MakeRun(81, 500),
                deleted = MakeRun(82, 500), replaced = MakeRun(83, 500), fine = MakeRun(84, 500);
  ASSERT_TRUE(PutRuns(*tier, {&truncated, &flipped, &deleted, &replaced, &fine}).ok());
  Rewrite(tier->PathOf(truncated.key), truncated.bytes.substr(0, 200));
  FlipByte(tier->PathOf(flipped.key), flipped.bytes.size() - 100);
  fs::remove(tier->PathOf(deleted.key));
  Rewrite(tier->PathOf(replaced.key), fine.bytes);  // an intact run, but not this key's
  const RunKey keys[] = {truncated.key, flipped.key, deleted.key, replaced.key, fine.key};
  const auto got = tier->Get(keys);
  EXPECT_FALSE(got[0] || got[1] || got[2] || got[3]);
  EXPECT_EQ(got[4], fine.bytes);
  TierStats s = tier->stats();
  EXPECT_EQ(s.corrupt, 3);
  EXPECT_EQ(s.misses, 4);
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(s.entries, 1);
  EXPECT_EQ(s.bytes_held, int64_t(fine.bytes.size()));
  EXPECT_FALSE(fs::exists(tier->PathOf(truncated.key)));  // damaged files are deleted
  EXPECT_FALSE(fs::exists(tier->PathOf(flipped.key)));
  EXPECT_FALSE(fs::exists(tier->PathOf(replaced.key)));
  // The runs can be stored again.
  ASSERT_TRUE(PutRuns(*tier, {&truncated, &flipped}).ok());
  EXPECT_EQ(GetOne(*tier, truncated.key), truncated.bytes);
  EXPECT_EQ(GetOne(*tier, flipped.key), flipped.bytes);
}

TEST(DiskTier, EveryByteOfAStoredRunIsChecked) {
  testing::TempDir dir;
  auto tier = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(tier);
  const TestRun r = MakeRun(90, 64, true, true);
  for (size_t off = 0; off < r.bytes.size(); ++off) {
    ASSERT_TRUE(PutRuns(*tier, {&r}).ok());
    FlipByte(tier->PathOf(r.key), off);
    ASSERT_FALSE(GetOne(*tier, r.key).has_value()) << "byte " << off;
    ASSERT_EQ(tier->stats().corrupt, int64_t(off + 1)) << "byte " << off;
    ASSERT_FALSE(fs::exists(tier->PathOf(r.key)));
  }
}

TEST(DiskTier, ConcurrentPutsAndGets) {
  testing::TempDir dir;
  std::vector<TestRun> runs;
  for (int i = 0; i < 24; ++i)
    runs.push_back(MakeRun(100 + i, 200 + 50 * i, i % 2 == 0, i % 4 == 0));
  uint64_t total = 0;
  for (const auto& r : runs) total += r.bytes.size();
  auto tier = OpenTier(dir.path(), total / 2);  // eviction runs concurrently too
  ASSERT_TRUE(tier);
  std::atomic<int> wrong{0}, hits{0}, gets{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int step = 0; step < 300; ++step) {
        const TestRun& r = runs[rng() % runs.size()];
        if (rng() % 2) {
          if (!PutRuns(*tier, {&r}).ok()) ++wrong;
        } else {
          ++gets;
          const auto got = GetOne(*tier, r.key);
          if (got) ++hits;
          if (got && *got != r.bytes) ++wrong;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  const TierStats s = tier->stats();
  EXPECT_EQ(s.hits, hits.load());
  EXPECT_EQ(s.hits + s.misses, gets.load());
  EXPECT_GT(s.hits, 0);
  EXPECT_GT(s.evicted, 0);
  EXPECT_EQ(s.corrupt, 0);
  EXPECT_LE(uint64_t(s.bytes_held), total / 2);
  // Nothing but whole runs under their names: every file decodes.
  for (const auto& name : FilesUnder(dir.path())) {
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
    EXPECT_TRUE(CheckRun(ReadFile(dir.path() + "/" + name)).ok()) << name;
  }
  EXPECT_EQ(FilesUnder(dir.path()).size(), size_t(s.entries));
}

TEST(DiskTier, TwoTiersShareOneDirectory) {
  testing::TempDir dir;
  auto one = OpenTier(dir.path(), 1 << 20);
  auto two = OpenTier(dir.path(), 1 << 20);
  ASSERT_TRUE(one && two);
  const TestRun a = MakeRun(130, 300), b = MakeRun(131, 300);
  ASSERT_TRUE(PutRuns(*one, {&a}).ok());
  EXPECT_TRUE(Has(*two, a.key));            // found on disk, though not in two's index
  EXPECT_EQ(GetOne(*two, a.key), a.bytes);  // and adopted into it
  EXPECT_EQ(two->stats().entries, 1);
  two->Erase(a.key);  // as if two evicted it
  EXPECT_FALSE(GetOne(*one, a.key).has_value());
  TierStats s = one->stats();
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.corrupt, 0);
  EXPECT_EQ(s.entries, 0);  // gone from one's index too
  ASSERT_TRUE(PutRuns(*two, {&b}).ok());
  ASSERT_TRUE(PutRuns(*one, {&b}).ok());  // both write the same content: still one whole file
  EXPECT_EQ(GetOne(*one, b.key), b.bytes);
  EXPECT_EQ(GetOne(*two, b.key), b.bytes);

  // Concurrently, each thread through its own tier: only right bytes, only whole files.
  std::vector<TestRun> runs;
  for (int i = 0; i < 16; ++i) runs.push_back(MakeRun(140 + i, 400));
  std::atomic<int> wrong{0};
  auto work = [&](DiskTier& tier, int seed) {
    std::mt19937 rng(seed);
    for (int step = 0; step < 300; ++step) {
      const TestRun& r = runs[rng() % runs.size()];
      switch (rng() % 3) {
        case 0:
          if (!PutRuns(tier, {&r}).ok()) ++wrong;
          break;
        case 1: {
          const auto got = GetOne(tier, r.key);
          if (got && *got != r.bytes) ++wrong;
          break;
        }
        default:
          tier.Erase(r.key);
      }
    }
  };
  std::thread t1(work, std::ref(*one), 1), t2(work, std::ref(*two), 2);
  t1.join();
  t2.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(one->stats().corrupt + two->stats().corrupt, 0);
  for (const auto& name : FilesUnder(dir.path())) {
    EXPECT_TRUE(CheckRun(ReadFile(dir.path() + "/" + name)).ok()) << name;
  }
}

// 2000 random steps of put / get / exists / erase / damage / restart against an exact model of
// the tier: which keys it holds, in which LRU order, and in what state their files are. After
// every step the tier's answers and counters must equal the model's.
TEST(DiskTier, RandomizedAgainstAModel) {
  testing::TempDir dir;
  constexpr int kKeys = 40;
  std::vector<TestRun> runs;
  uint64_t total = 0;
  for (int i = 0; i < kKeys; ++i) {
    runs.push_back(MakeRun(200 + i, 100 + (i * 37) % 900, i % 3 == 0, i % 6 == 0));
    total += runs.back().bytes.size();
  }
  const uint64_t cap = total * 2 / 5;
  // A file's state as the tier cannot know it: scan-invisible damage (tokens, payload, checksum)
  // survives a restart, header damage does not.
  enum class State { kGood, kPayloadDamaged, kHeaderDamaged, kDeleted };
  struct Held {
    int id;
    State state;
  };
  std::list<Held> lru;  // front: least recently used
  int64_t corrupt = 0, evicted = 0, hits = 0, misses = 0;
  auto find = [&](int id) {
    return std::find_if(lru.begin(), lru.end(), [&](const Held& h) { return h.id == id; });
  };
  auto held_bytes = [&] {
    uint64_t b = 0;
    for (const Held& h : lru) b += runs[h.id].bytes.size();
    return b;
  };
  auto evict_for = [&](uint64_t incoming) {
    while (!lru.empty() && held_bytes() + incoming > cap) {
      lru.pop_front();
      ++evicted;
    }
  };

  std::unique_ptr<DiskTier> tier = OpenTier(dir.path(), cap);
  ASSERT_TRUE(tier);
  std::mt19937 rng(2024);
  for (int step = 0; step < 2000; ++step) {
    const int id = int(rng() % kKeys);
    const TestRun& r = runs[id];
    const std::string path = tier->PathOf(r.key);
    auto it = find(id);
    const int op = int(rng() % 100);
    std::string what;
    if (op < 35) {
      what = "put";
      ASSERT_TRUE(PutRuns(*tier, {&r}).ok());
      if (it != lru.end() && it->state != State::kDeleted) {
        lru.splice(lru.end(), lru, it);  // kept as it is (damaged or not), touched
      } else {
        if (it != lru.end()) lru.erase(it);
        evict_for(r.bytes.size());
        lru.push_back({id, State::kGood});
      }
    } else if (op < 70) {
      what = "get";
      const auto got = GetOne(*tier, r.key);
      const bool expect_hit = it != lru.end() && it->state == State::kGood;
      ASSERT_EQ(got.has_value(), expect_hit) << "step " << step;
      if (expect_hit) {
        ASSERT_EQ(*got, r.bytes) << "step " << step;
        auto d = DecodeRun(*got, Ns(), r.key, r.tokens);
        ASSERT_TRUE(d.ok()) << d.status().ToString();
        ASSERT_EQ(PayloadOf(*d), r.payload);
        lru.splice(lru.end(), lru, it);
        ++hits;
      } else {
        ++misses;
        if (it != lru.end()) {
          if (it->state != State::kDeleted) ++corrupt;
          lru.erase(it);
        }
      }
    } else if (op < 78) {
      what = "exists";
      ASSERT_EQ(Has(*tier, r.key), it != lru.end()) << "step " << step;
    } else if (op < 83) {
      what = "erase";
      tier->Erase(r.key);
      if (it != lru.end()) lru.erase(it);
    } else if (op < 97) {
      what = "damage";
      // Only files still whole in size are damaged further, so every offset below exists.
      if (it == lru.end() || (it->state != State::kGood && it->state != State::kPayloadDamaged)) {
        continue;
      }
      switch (rng() % 5) {
        case 0:  // a flipped bit past the header
          FlipByte(path, kHeaderBytes + rng() % (r.bytes.size() - kHeaderBytes));
          if (it->state == State::kGood) it->state = State::kPayloadDamaged;
          break;
        case 1:  // a flipped bit in the header
          FlipByte(path, rng() % kHeaderBytes);
          it->state = State::kHeaderDamaged;
          break;
        case 2:  // truncated
          Rewrite(path, ReadFile(path).substr(0, rng() % r.bytes.size()));
          it->state = State::kHeaderDamaged;  // the size no longer matches the header's
          break;
        case 3:  // another run's bytes under this name
          Rewrite(path, runs[(id + 1) % kKeys].bytes);
          it->state = State::kHeaderDamaged;
          break;
        default:
          ASSERT_TRUE(fs::remove(path));
          it->state = State::kDeleted;
      }
    } else {
      what = "restart";
      tier.reset();
      tier = OpenTier(dir.path(), cap);
      ASSERT_TRUE(tier);
      // Counters are per process. The scan keeps intact-looking files in access order and
      // deletes (and counts) those whose header gives them away.
      evicted = corrupt = hits = misses = 0;
      for (auto h = lru.begin(); h != lru.end();) {
        if (h->state == State::kGood || h->state == State::kPayloadDamaged) {
          ++h;
          continue;
        }
        if (h->state == State::kHeaderDamaged) ++corrupt;
        h = lru.erase(h);
      }
    }
    const TierStats s = tier->stats();
    ASSERT_EQ(s.entries, int64_t(lru.size())) << "step " << step << " after " << what;
    ASSERT_EQ(uint64_t(s.bytes_held), held_bytes()) << "step " << step << " after " << what;
    ASSERT_LE(uint64_t(s.bytes_held), cap);
    ASSERT_EQ(s.corrupt, corrupt) << "step " << step << " after " << what;
    ASSERT_EQ(s.evicted, evicted) << "step " << step << " after " << what;
    ASSERT_EQ(s.hits, hits);
    ASSERT_EQ(s.misses, misses);
    ASSERT_EQ(s.errors, 0);
    if (step % 100 == 99) {  // the directory holds exactly the files the model says
      std::vector<std::string> want;
      for (const Held& h : lru) {
        if (h.state == State::kDeleted) continue;
        const std::string hex = runs[h.id].key.Hex();
        want.push_back(hex.substr(0, 2) + "/" + hex);
      }
      std::sort(want.begin(), want.end());
      ASSERT_EQ(FilesUnder(dir.path()), want) << "step " << step;
    }
  }
}

// ---------------------------------------------------------------- KvTiers over a lossy tier

// Runs in memory; Put drops everything while `drop` is set (a full write queue, Redis refusing).
class MemoryTier : public Tier {
 public:
  std::string_view name() const override { return "memory"; }
  std::vector<std::optional<std::string>> Get(std::span<const RunKey> keys) override {
    std::vector<std::optional<std::string>> out;
    for (const RunKey& k : keys) {
      auto it = runs.find(k.Hex());
      out.push_back(it == runs.end() ? std::nullopt : std::optional<std::string>(it->second));
    }
    return out;
  }
  Status Put(std::span<const std::pair<RunKey, std::string>> batch) override {
    if (!drop) {
      for (const auto& [k, v] : batch) runs.emplace(k.Hex(), v);
    }
    return OkStatus();  // accepted: the loss shows only later, as with a background queue
  }
  std::vector<bool> Exists(std::span<const RunKey> keys) override {
    std::vector<bool> out;
    for (const RunKey& k : keys) out.push_back(runs.contains(k.Hex()));
    return out;
  }
  void Erase(const RunKey& k) override { runs.erase(k.Hex()); }
  TierStats stats() const override { return {}; }
  std::map<std::string, std::string> runs;
  bool drop = false;
};

// A run the tier lost after taking it (dropped, evicted, expired) is stored again by a later
// publish once the memo of stored runs is older than the recheck interval; before that it is not
// asked about (publishing a prefix again packs nothing).
TEST(KvTiersStore, LostRunsAreStoredAgainAfterTheRecheckInterval) {
  const KvLayout lay{1, 1, 8, 4};
  PagePool pool(lay, 1 << 20);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.Alloc(4, &pages).ok());
  const int32_t zero[4] = {0, 0, 0, 0};
  for (int32_t p : pages) pool.SetPositions(p, 0, zero, 4);
  TierNamespace ns = Ns();
  ns.page_tokens = 4;
  ns.n_layers = ns.n_kv_heads = 1;
  ns.head_dim = 8;
  auto owned = std::make_unique<MemoryTier>();
  MemoryTier* mem = owned.get();
  std::vector<std::unique_ptr<Tier>> stack;
  stack.push_back(std::move(owned));
  KvTiers tiers(pool, ns, std::move(stack), /*zstd=*/false, /*run_blocks=*/2);
  std::vector<int32_t> tokens(16);
  for (int i = 0; i < 16; ++i) tokens[i] = 10 + i;
  const auto pages_of = [&](int b) { return std::span<const int32_t>(&pages[b], 1); };
  mem->drop = true;
  tiers.Store(tokens, 0, 4, pages_of);
  EXPECT_TRUE(mem->runs.empty());
  mem->drop = false;
  tiers.Store(tokens, 0, 4, pages_of);  // within the interval: taken to be stored
  EXPECT_TRUE(mem->runs.empty());
  tiers.set_recheck(std::chrono::steady_clock::duration::zero());
  tiers.Store(tokens, 0, 4, pages_of);
  EXPECT_EQ(mem->runs.size(), 2u);  // two runs of two blocks
  mem->runs.clear();                // evicted under the process
  tiers.Store(tokens, 0, 4, pages_of);
  EXPECT_EQ(mem->runs.size(), 2u);
}

// A load's pages are handed out table by table: each table's blocks lie in consecutive slots
// across the load's runs (as a prompt's chunks write them, so that a decode step streams them),
// and every page holds the bytes and positions stored for its block and table. With room for
// only some of the runs, the leading ones are loaded.
class KvTiersLoad : public ::testing::TestWithParam<int> {};

TEST_P(KvTiersLoad, EachTablesPagesAreConsecutiveSlots) {
  const KvLayout lay{2, 2, 8, 4};  // 2 layers x 2 KV heads: 4 tables
  const int heads = lay.heads_total(), n_blocks = 6;
  const int room = GetParam();  // pages the pool has beyond the stored ones
  PagePool pool(lay, (n_blocks * heads + room) * lay.page_bytes());
  std::vector<int32_t> pages;  // block-major: pages[b * heads + h]
  ASSERT_TRUE(pool.Alloc(n_blocks * heads, &pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) {
    uint8_t* d = pool.data(pages[i]);
    for (size_t j = 0; j < lay.raw_data_bytes(); ++j) d[j] = static_cast<uint8_t>(i * 31 + j);
    const int32_t at[4] = {int32_t(i), int32_t(i), int32_t(i), int32_t(i)};
    pool.SetPositions(pages[i], 0, at, 4);
  }
  TierNamespace ns = Ns();
  ns.page_tokens = 4;
  ns.n_layers = ns.n_kv_heads = 2;
  ns.head_dim = 8;
  std::vector<std::unique_ptr<Tier>> stack;
  stack.push_back(std::make_unique<MemoryTier>());
  KvTiers tiers(pool, ns, std::move(stack), /*zstd=*/false, /*run_blocks=*/3);
  std::vector<int32_t> tokens(n_blocks * 4);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 7 + static_cast<int32_t>(i);
  tiers.Store(tokens, 0, n_blocks,
              [&](int b) { return std::span<const int32_t>(pages.data() + b * heads, heads); });
  // Block 0 is held: the first run gives blocks 1-2 (8 pages), the second 3-5 (12 pages).
  const int want = room >= 20 ? n_blocks - 1 : room >= 8 ? 2 : 0;
  std::vector<int32_t> loaded;
  std::vector<int> source;
  ASSERT_EQ(tiers.Load(tokens, 0, 1, n_blocks, &loaded, &source), want);
  ASSERT_EQ(loaded.size(), size_t(want) * heads);
  EXPECT_EQ(source.size(), size_t(want));
  for (int b = 1; b <= want; ++b) {
    for (int h = 0; h < heads; ++h) {
      const int32_t page = loaded[(b - 1) * heads + h], stored = pages[b * heads + h];
      EXPECT_EQ(std::memcmp(pool.data(page), pool.data(stored), lay.raw_data_bytes()), 0)
          << "block " << b << " table " << h;
      EXPECT_EQ(pool.position(page, 0), pool.position(stored, 0));
      if (b > 1) {
        EXPECT_EQ(page, loaded[(b - 2) * heads + h] + 1) << "table " << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Room, KvTiersLoad, ::testing::Values(64, 12, 4));

// Tiers carry positions as int32 whatever a pool stores them in: pages stored from a pool of
// 16-bit positions load into one of 32 and back, and a run holding positions past a pool's context
// is not loaded into it.
TEST(KvTiersLoad, PositionsTravelAsInt32) {
  auto layout = [](int64_t max_tokens) {
    KvLayout l{1, 1, 8, 4};
    l.codec_k = l.codec_v = codecs::Codec::kF16;
    l.max_tokens = max_tokens;
    return l;
  };
  const int n_blocks = 4;
  TierNamespace ns = Ns();
  ns.page_tokens = 4;
  ns.n_layers = ns.n_kv_heads = 1;
  ns.head_dim = 8;
  std::vector<int32_t> tokens(n_blocks * 4);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 3 + static_cast<int32_t>(i);
  std::map<std::string, std::string> stored;
  for (int64_t from : {int64_t{65536}, int64_t{0}}) {
    PagePool src(layout(from), 64 * layout(from).page_bytes());
    ASSERT_EQ(src.layout().short_positions(), from != 0);
    std::vector<int32_t> pages;
    ASSERT_TRUE(src.Alloc(n_blocks, &pages).ok());
    for (int b = 0; b < n_blocks; ++b) {
      const int32_t at[4] = {60000 + 4 * b, 60001 + 4 * b, 60002 + 4 * b, 60003 + 4 * b};
      src.SetPositions(pages[b], 0, at, 4);
    }
    auto owned = std::make_unique<MemoryTier>();
    MemoryTier* mem = owned.get();
    std::vector<std::unique_ptr<Tier>> stack;
    stack.push_back(std::move(owned));
    KvTiers tiers(src, ns, std::move(stack), /*zstd=*/false, /*run_blocks=*/2);
    tiers.Store(tokens, 0, n_blocks, [&](int b) { return std::span<const int32_t>(&pages[b], 1); });
    ASSERT_EQ(mem->runs.size(), 2u);
    if (!stored.empty()) {
      EXPECT_EQ(mem->runs, stored);  // the same bytes from either pool
    }
    stored = mem->runs;
  }
  for (int64_t to : {int64_t{0}, int64_t{65536}, int64_t{60010}}) {
    PagePool dst(layout(to), 64 * layout(to).page_bytes());
    auto owned = std::make_unique<MemoryTier>();
    owned->runs = stored;
    std::vector<std::unique_ptr<Tier>> stack;
    stack.push_back(std::move(owned));
    KvTiers tiers(dst, ns, std::move(stack), /*zstd=*/false, /*run_blocks=*/2);
    std::vector<int32_t> loaded;
    std::vector<int> source;
    // A context of 60010 tokens holds the first run's positions (to 60007), not the second's.
    const int want = to == 60010 ? 2 : 4;  // blocks
    ASSERT_EQ(tiers.Load(tokens, 0, 0, n_blocks, &loaded, &source), want) << to;
    ASSERT_EQ(loaded.size(), size_t(want));
    for (int b = 0; b < want; ++b) {
      for (int r = 0; r < 4; ++r) EXPECT_EQ(dst.position(loaded[b], r), 60000 + 4 * b + r);
    }
  }
}

}  // namespace
}  // namespace cachet::tiers
