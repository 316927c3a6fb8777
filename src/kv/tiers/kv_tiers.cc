#include "kv/tiers/kv_tiers.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

namespace cachet::tiers {
namespace {

constexpr size_t kMaxKnownRuns = size_t{1} << 20;
constexpr uint8_t kRawPage = 0, kCodecPage = 1;

}  // namespace

KvTiers::KvTiers(PagePool& pool, TierNamespace ns, std::vector<std::unique_ptr<Tier>> tiers,
                 bool zstd, int run_blocks)
    : pool_(pool),
      ns_(std::move(ns)),
      tiers_(std::move(tiers)),
      zstd_(zstd),
      run_blocks_(std::max(1, run_blocks)) {
  ns_.payload_layout = kPayloadLayout;
  root_ = NamespaceKey(ns_);
  reports_.resize(tiers_.size());
  for (size_t t = 0; t < tiers_.size(); ++t) reports_[t].name = tiers_[t]->name();
}

void KvTiers::RunKeys(std::span<const int32_t> tokens, uint64_t salt, int n_blocks,
                      std::vector<RunKey>* keys) const {
  const size_t pt = static_cast<size_t>(pool_.layout().page_tokens);
  keys->clear();
  RunKey parent = root_;
  for (int b = 0; b < n_blocks; b += run_blocks_) {
    const int n = std::min(run_blocks_, n_blocks - b);
    parent = RunKey::Of(parent, salt, tokens.subspan(b * pt, n * pt));
    keys->push_back(parent);
  }
}

std::string KvTiers::Pack(int first_block, int n_blocks, const PagesOf& pages_of) const {
  std::string out;
  // Positions travel as int32 whatever the pool stores them in, so a tier serves engines of any
  // context length.
  const int pt = pool_.layout().page_tokens;
  std::vector<int32_t> pos(pt);
  for (int b = first_block; b < first_block + n_blocks; ++b) {
    for (int32_t page : pages_of(b)) {
      const bool codec = IsCodecPage(page);
      out.push_back(static_cast<char>(codec ? kCodecPage : kRawPage));
      out.append(reinterpret_cast<const char*>(pool_.data(page)), pool_.data_bytes(codec));
      pool_.ReadPositions(page, pt, pos.data());
      out.append(reinterpret_cast<const char*>(pos.data()), pt * sizeof(int32_t));
    }
  }
  return out;
}

int KvTiers::Unpack(std::span<const Piece> pieces, std::vector<int32_t>* pages) {
  const KvLayout& lay = pool_.layout();
  const int heads = lay.heads_total(), pt = lay.page_tokens;
  const size_t pos_bytes = pt * sizeof(int32_t);
  std::vector<int32_t> pos(pt);
  // Appends the kind of each wanted page of a piece (block-major, as packed); false when the
  // payload is not what this layout packs, or holds positions past this engine's context.
  std::vector<uint8_t> is_codec;
  auto wanted_kinds = [&](const Piece& pc) {
    size_t at = 0;
    for (int b = 0; b < pc.n_blocks; ++b) {
      for (int h = 0; h < heads; ++h) {
        const uint8_t kind = at < pc.payload.size() ? pc.payload[at] : 0xFF;
        if (kind != kRawPage && (kind != kCodecPage || lay.plain())) return false;
        const size_t data = pool_.data_bytes(kind == kCodecPage);
        if (at + 1 + data + pos_bytes > pc.payload.size()) return false;
        std::memcpy(pos.data(), pc.payload.data() + at + 1 + data, pos_bytes);
        for (int32_t p : pos) {
          if (p < 0 || (lay.max_tokens > 0 && p >= lay.max_tokens)) return false;
        }
        if (b >= pc.skip) is_codec.push_back(kind == kCodecPage);
        at += 1 + data + pos_bytes;
      }
    }
    return at == pc.payload.size();
  };
  // Raw and codec pages wanted up to each piece's end; a payload that is not what this layout
  // packs ends the load before it.
  std::vector<std::array<int, 2>> kinds;
  for (const Piece& pc : pieces) {
    const size_t before = is_codec.size();
    if (!wanted_kinds(pc)) {
      is_codec.resize(before);
      break;
    }
    std::array<int, 2> n = kinds.empty() ? std::array<int, 2>{0, 0} : kinds.back();
    for (size_t i = before; i < is_codec.size(); ++i) ++n[is_codec[i]];
    kinds.push_back(n);
  }
  // All the pieces' pages in one allocation, or as many leading pieces as the pool holds.
  int n = static_cast<int>(kinds.size());
  std::vector<int32_t> raw, codec;
  while (n > 0 && !pool_.Alloc(kinds[n - 1][0], kinds[n - 1][1], &raw, &codec).ok()) --n;
  // Fresh slots come in order; each table (head) takes the next ones for all its blocks of the
  // load, so a table's pages lie side by side as a prompt's chunks write them and a decode step
  // streams them. Handed out block by block, one table's pages were heads_total() slots apart:
  // f16 KV of mha-85m restored at 16384 tokens decoded 1.23x slower (docs/BENCHMARKS.md).
  const size_t n_pages = n > 0 ? size_t(kinds[n - 1][0] + kinds[n - 1][1]) : 0;
  const size_t blocks = n_pages / heads;
  std::vector<int32_t> slot(n_pages);
  size_t next_raw = 0, next_codec = 0;
  for (int h = 0; h < heads; ++h) {
    for (size_t b = 0; b < blocks; ++b) {
      const size_t i = b * heads + h;
      slot[i] = is_codec[i] ? codec[next_codec++] : raw[next_raw++];
    }
  }
  size_t i = 0;
  for (int k = 0; k < n; ++k) {
    const Piece& pc = pieces[k];
    size_t at = 0;
    for (int b = 0; b < pc.n_blocks; ++b) {
      for (int h = 0; h < heads; ++h) {
        const size_t bytes = pool_.data_bytes(pc.payload[at] == kCodecPage);
        if (b >= pc.skip) {
          const int32_t page = slot[i++];
          std::memcpy(pool_.data(page), pc.payload.data() + at + 1, bytes);
          std::memcpy(pos.data(), pc.payload.data() + at + 1 + bytes, pos_bytes);
          pool_.SetPositions(page, 0, pos.data(), pt);
          pages->push_back(page);
        }
        at += 1 + bytes + pos_bytes;
      }
    }
  }
  return n;
}

int KvTiers::Load(std::span<const int32_t> tokens, uint64_t salt, int from_block, int to_block,
                  std::vector<int32_t>* pages, std::vector<int>* source) {
  if (tiers_.empty() || from_block >= to_block) return 0;
  std::vector<RunKey> keys;
  RunKeys(tokens, salt, to_block, &keys);
  const int r0 = from_block / run_blocks_;
  const int runs = static_cast<int>(keys.size()) - r0;
  // Each tier is asked, in order, for the runs the tiers above it did not have, from the first
  // such run on: one batched call per tier.
  std::vector<std::optional<std::string>> found(runs);
  std::vector<int> from(runs, -1);
  for (int t = 0; t < static_cast<int>(tiers_.size()); ++t) {
    const auto first_missing = std::find(found.begin(), found.end(), std::nullopt);
    if (first_missing == found.end()) break;
    const int i0 = static_cast<int>(first_missing - found.begin());
    std::vector<RunKey> ask(keys.begin() + r0 + i0, keys.end());
    std::vector<std::optional<std::string>> got = tiers_[t]->Get(ask);
    for (int i = i0; i < runs; ++i) {
      if (!found[i] && got[i - i0]) {
        found[i] = std::move(got[i - i0]);
        from[i] = t;
      }
    }
  }
  const size_t pt = static_cast<size_t>(pool_.layout().page_tokens);
  // Decoded up to the first run that is missing or damaged, then unpacked in one go.
  std::vector<DecodedRun> decoded;
  std::vector<Piece> pieces;
  decoded.reserve(runs);
  for (int i = 0; i < runs && found[i]; ++i) {
    const int r = r0 + i, b0 = r * run_blocks_;
    const int n_blocks = std::min(run_blocks_, to_block - b0);
    Result<DecodedRun> run =
        DecodeRun(*found[i], ns_, keys[r], tokens.subspan(b0 * pt, n_blocks * pt));
    if (!run.ok()) {  // damaged, or not this layout's: a miss, and gone from the tier
      ++reports_[from[i]].rejected;
      tiers_[from[i]]->Erase(keys[r]);
      break;
    }
    decoded.push_back(std::move(run).value());
    pieces.push_back({decoded.back().payload(), n_blocks, std::max(0, from_block - b0)});
  }
  // A payload the namespace says is ours but that does not unpack is a bug or damage the
  // checksums missed; either way not served, nor what follows it. A full pool ends the load too.
  const int n = Unpack(pieces, pages);
  int loaded = 0;
  for (int i = 0; i < n; ++i) {
    const int got = pieces[i].n_blocks - pieces[i].skip;
    source->insert(source->end(), got, from[i]);
    reports_[from[i]].loaded_tokens += static_cast<int64_t>(got) * pt;
    loaded += got;
    stored_[keys[r0 + i]] = std::chrono::steady_clock::now();
  }
  return loaded;
}

void KvTiers::Store(std::span<const int32_t> tokens, uint64_t salt, int n_blocks,
                    const PagesOf& pages_of) {
  if (tiers_.empty() || n_blocks <= 0) return;
  std::vector<RunKey> keys;
  RunKeys(tokens, salt, n_blocks, &keys);
  if (stored_.size() > kMaxKnownRuns) stored_.clear();
  // The runs not known to be stored, asked of every tier; each is packed and encoded at most
  // once, whichever tiers lack it.
  std::vector<size_t> unknown;
  std::vector<RunKey> ask;
  const auto now = std::chrono::steady_clock::now();
  for (size_t r = 0; r < keys.size(); ++r) {
    const auto it = stored_.find(keys[r]);
    if (it != stored_.end() && now - it->second < recheck_) continue;
    unknown.push_back(r);
    ask.push_back(keys[r]);
  }
  if (ask.empty()) return;
  const size_t pt = static_cast<size_t>(pool_.layout().page_tokens);
  std::vector<std::string> encoded(keys.size());
  auto encode = [&](size_t r) -> const std::string& {
    if (encoded[r].empty()) {
      const int b0 = static_cast<int>(r) * run_blocks_;
      const int n = std::min(run_blocks_, n_blocks - b0);
      const RunKey parent = r == 0 ? root_ : keys[r - 1];
      const std::string payload = Pack(b0, n, pages_of);
      const RunMeta meta{parent, salt, tokens.subspan(b0 * pt, n * pt)};
      encoded[r] = EncodeRun(
          ns_, meta, std::span(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()),
          zstd_);
    }
    return encoded[r];
  };
  std::vector<std::pair<RunKey, std::string>> batch;
  for (size_t t = 0; t < tiers_.size(); ++t) {
    const std::vector<bool> held = tiers_[t]->Exists(ask);
    batch.clear();
    for (size_t i = 0; i < unknown.size(); ++i) {
      if (!held[i]) batch.emplace_back(ask[i], encode(unknown[i]));
    }
    if (!batch.empty() && tiers_[t]->Put(batch).ok()) {
      reports_[t].stored_runs += static_cast<int64_t>(batch.size());
    }
  }
  // Held by every tier now, or refused or dropped by one: asked again after recheck_, not at
  // every publish.
  for (const RunKey& k : keys) stored_[k] = now;
}

std::vector<TierReport> KvTiers::Report() const {
  std::vector<TierReport> out = reports_;
  for (size_t t = 0; t < tiers_.size(); ++t) out[t].stats = tiers_[t]->stats();
  return out;
}

}  // namespace cachet::tiers
