#include "kv/sequence_file.h"

#include <xxhash.h>

#include <cstring>

#include "kv/codecs/codec.h"
#include "util/byte_io.h"

namespace cachet {
namespace {

constexpr char kMagic[4] = {'C', 'K', 'V', 'C'};
constexpr uint8_t kRawPage = 0, kCodecPage = 1;
// Bounds a file may declare: a corrupt or forged one must not make a reader allocate more.
constexpr uint32_t kMaxTokens = 1u << 24;
constexpr uint32_t kMaxLogits = 1u << 24;
constexpr uint32_t kMaxTables = 1u << 16;

void PutNamespace(ByteWriter& w, const tiers::TierNamespace& ns) {
  w.Put<uint64_t>(ns.model_hash);
  w.PutString(ns.codec_k);
  w.PutString(ns.codec_v);
  w.Put<int32_t>(ns.page_tokens);
  w.Put<int32_t>(ns.n_layers);
  w.Put<int32_t>(ns.n_kv_heads);
  w.Put<int32_t>(ns.head_dim);
  w.Put<double>(ns.rope_theta);
  w.PutString(ns.rope_scaling);
  w.Put<int32_t>(ns.sinks);
  w.Put<int32_t>(ns.window);
  w.Put<uint32_t>(ns.payload_layout);
}

tiers::TierNamespace GetNamespace(ByteReader& r) {
  tiers::TierNamespace ns;
  ns.model_hash = r.Get<uint64_t>("model hash");
  ns.codec_k = r.GetString("K codec");
  ns.codec_v = r.GetString("V codec");
  ns.page_tokens = r.Get<int32_t>("page tokens");
  ns.n_layers = r.Get<int32_t>("layers");
  ns.n_kv_heads = r.Get<int32_t>("KV heads");
  ns.head_dim = r.Get<int32_t>("head dim");
  ns.rope_theta = r.Get<double>("RoPE theta");
  ns.rope_scaling = r.GetString("RoPE scaling");
  ns.sinks = r.Get<int32_t>("sinks");
  ns.window = r.Get<int32_t>("window");
  ns.payload_layout = r.Get<uint32_t>("payload layout");
  return ns;
}

// The layout a namespace describes (page sizes of both kinds), for reading pages without a model.
Result<KvLayout> LayoutOf(const tiers::TierNamespace& ns) {
  KvLayout l;
  l.n_layers = ns.n_layers;
  l.n_kv_heads = ns.n_kv_heads;
  l.head_dim = ns.head_dim;
  l.page_tokens = ns.page_tokens;
  l.sinks = ns.sinks;
  l.window = ns.window;
  if (l.n_layers <= 0 || l.n_kv_heads <= 0 || l.head_dim <= 0 || l.page_tokens <= 0 ||
      int64_t{l.n_layers} * l.n_kv_heads > kMaxTables || l.head_dim > 4096 ||
      l.page_tokens > 4096) {
    return DataLoss("saved cache: impossible layout (" + std::to_string(l.n_layers) + " layers, " +
                    std::to_string(l.n_kv_heads) + " KV heads, head dim " +
                    std::to_string(l.head_dim) + ", " + std::to_string(l.page_tokens) +
                    "-token pages)");
  }
  // "<codec>#<calibration hash>" for a calibrated engine's: the sizes need the codec alone.
  auto k = codecs::ParseCodec(ns.codec_k.substr(0, ns.codec_k.find('#')));
  auto v = codecs::ParseCodec(ns.codec_v.substr(0, ns.codec_v.find('#')));
  if (!k.ok() || !v.ok()) {
    return DataLoss("saved cache: unknown codec " + ns.codec_k + "/" + ns.codec_v);
  }
  l.codec_k = *k;
  l.codec_v = *v;
  return l;
}

size_t DataBytes(const KvLayout& l, bool codec_page) {
  return codec_page ? l.codec_k_bytes() + l.codec_v_bytes() : l.raw_data_bytes();
}

struct Header {
  SequenceFileInfo info;
  SequenceImage image;
  int32_t seq_tokens = 0;  // tokens committed to the sequence
  uint32_t n_tables = 0, n_cold = 0;
};

// Checks the whole file and reads everything up to the tables.
Result<Header> ParseHeader(ByteReader& r, std::span<const uint8_t> bytes) {
  const uint8_t* magic = r.Take(4, "magic");
  if (!r.ok() || std::memcmp(magic, kMagic, 4) != 0) {
    return DataLoss("saved cache: not a Cachet cache file (no CKVC magic)");
  }
  // A .kvcal's magic, "CKVCAL\n\0", starts with a cache's: its "AL\n\0" read as a version.
  if (bytes.size() >= 8 && std::memcmp(bytes.data() + 4, "AL\n\0", 4) == 0) {
    return DataLoss(
        "saved cache: this is a KV calibration (.kvcal, from cachet calibrate), not a saved "
        "cache; give it as --kv-calibration");
  }
  // The checksum first: a damaged version field is damage, an intact one another format.
  if (bytes.size() < 16) return DataLoss("saved cache: truncated");
  uint64_t sum;
  std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
  if (XXH3_64bits(bytes.data(), bytes.size() - 8) != sum) {
    return DataLoss("saved cache: checksum mismatch (the file is damaged or truncated)");
  }
  const uint32_t version = r.Get<uint32_t>("version");
  if (r.ok() && (version < 1 || version > kSequenceFileVersion)) {
    return FailedPrecondition("saved cache: format version " + std::to_string(version) +
                              ", this build reads versions 1 to " +
                              std::to_string(kSequenceFileVersion));
  }
  Header h;
  h.info.ns = GetNamespace(r);
  h.info.cold_codec = r.GetString("cold codec");
  h.info.cold_fetch = r.Get<double>("cold fetch");
  if (version >= 2) h.info.age_out = r.Get<int32_t>("age out");
  if (r.ok() && h.info.age_out < 0) r.Fail("age out", std::to_string(h.info.age_out));
  h.info.quest_pages = r.Get<int32_t>("quest pages");
  h.info.quest_keep = r.Get<double>("quest keep");
  h.image.compression = h.info.compression = r.GetString("compression");
  h.image.tokens = r.GetVector<int32_t>(kMaxTokens, "tokens");
  h.image.pending = r.GetVector<int32_t>(kMaxTokens, "pending tokens");
  h.image.logits = r.GetVector<float>(kMaxLogits, "logits");
  h.info.n_tokens = static_cast<int32_t>(h.image.tokens.size());
  h.seq_tokens = r.Get<int32_t>("sequence tokens");
  if (r.ok() && (h.seq_tokens < 0 || uint32_t(h.seq_tokens) > kMaxTokens)) {
    r.Fail("sequence tokens", std::to_string(h.seq_tokens));
  }
  h.n_tables = r.Get<uint32_t>("tables");
  h.n_cold = r.Get<uint32_t>("cold tables");
  if (!r.ok()) return r.status();
  return h;
}

// Walks the tables, checking their sizes and page kinds: fn.table(index, cold, tokens) for each,
// fn.page(index, cold, codec, data, bytes, positions, bytes, rows) for each of its pages (rows:
// those it holds, each at a position checked to be in the sequence).
template <class Fn>
Status WalkTables(ByteReader& r, const Header& h, const KvLayout& hot, const KvLayout* cold,
                  Fn& fn) {
  const uint32_t heads = static_cast<uint32_t>(hot.heads_total());
  if (h.n_tables != heads || (h.n_cold != 0 && h.n_cold != heads) || (h.n_cold != 0) != !!cold) {
    return DataLoss("saved cache: " + std::to_string(h.n_tables) + " tables and " +
                    std::to_string(h.n_cold) + " cold ones for " + std::to_string(heads) +
                    " (layer, KV head) pairs");
  }
  const size_t pos_bytes = hot.page_tokens * sizeof(int32_t);
  for (uint32_t t = 0; t < h.n_tables + h.n_cold; ++t) {
    const bool is_cold = t >= h.n_tables;
    const KvLayout& l = is_cold ? *cold : hot;
    const int32_t n_tokens = r.Get<int32_t>("table tokens");
    const uint32_t n_pages = r.Get<uint32_t>("table pages");
    if (!r.ok()) return r.status();
    if (n_tokens < 0 || n_pages != (uint32_t(n_tokens) + l.page_tokens - 1) / l.page_tokens) {
      return DataLoss("saved cache: table " + std::to_string(t) + " holds " +
                      std::to_string(n_pages) + " pages for " + std::to_string(n_tokens) +
                      " tokens");
    }
    fn.table(t, is_cold, n_tokens);
    for (uint32_t p = 0; p < n_pages; ++p) {
      const uint8_t kind = r.Get<uint8_t>("page kind");
      if (r.ok() && (kind > kCodecPage || (kind == kCodecPage && l.plain()))) {
        return DataLoss("saved cache: page " + std::to_string(p) + " of table " +
                        std::to_string(t) + " has an impossible kind");
      }
      const size_t n = DataBytes(l, kind == kCodecPage);
      const uint8_t* data = r.Take(n, "page data");
      const uint8_t* pos = r.Take(pos_bytes, "page positions");
      if (!r.ok()) return r.status();
      // The rows a page holds are at positions of the sequence (the rest of a last page unused).
      const int rows =
          std::min<int64_t>(l.page_tokens, int64_t{n_tokens} - int64_t{p} * l.page_tokens);
      for (int i = 0; i < rows; ++i) {
        int32_t at;
        std::memcpy(&at, pos + size_t(i) * sizeof(int32_t), sizeof at);
        if (at < 0 || at >= h.seq_tokens) {
          return DataLoss("saved cache: row " + std::to_string(i) + " of page " +
                          std::to_string(p) + " of table " + std::to_string(t) +
                          " is at position " + std::to_string(at) + ", outside the sequence's " +
                          std::to_string(h.seq_tokens) + " tokens");
        }
      }
      fn.page(t, is_cold, kind == kCodecPage, data, n, pos, pos_bytes, rows);
    }
  }
  return r.status();
}

// Explains why a file's namespace is not the engine's, naming the flags that decide it.
std::string Mismatch(const tiers::TierNamespace& file, const tiers::TierNamespace& engine) {
  auto diff = [](const std::string& what, const std::string& a, const std::string& b) {
    return a == b ? std::string() : "; " + what + " " + a + " (this engine: " + b + ")";
  };
  std::string d;
  if (file.model_hash != engine.model_hash) {
    d += "; another model (its weights differ from -m's)";
  }
  // A calibrated engine's codec names end in "#<calibration hash>": the two are told apart.
  auto codec = [](const std::string& c) { return c.substr(0, c.find('#')); };
  auto calibration = [](const std::string& c) {
    return c.find('#') == std::string::npos ? std::string("none") : c.substr(c.find('#') + 1);
  };
  d += diff("K/V codecs (--ctk/--ctv)", codec(file.codec_k) + "/" + codec(file.codec_v),
            codec(engine.codec_k) + "/" + codec(engine.codec_v));
  d += diff("KV calibration (--kv-calibration)", calibration(file.codec_k),
            calibration(engine.codec_k));
  d += diff("--page-tokens", std::to_string(file.page_tokens), std::to_string(engine.page_tokens));
  d += diff("--kv-sinks", std::to_string(file.sinks), std::to_string(engine.sinks));
  d += diff("--kv-window", std::to_string(file.window), std::to_string(engine.window));
  d += diff("layers x KV heads x head dim",
            std::to_string(file.n_layers) + "x" + std::to_string(file.n_kv_heads) + "x" +
                std::to_string(file.head_dim),
            std::to_string(engine.n_layers) + "x" + std::to_string(engine.n_kv_heads) + "x" +
                std::to_string(engine.head_dim));
  if (d.empty()) d = "; RoPE parameters or format details differ";
  return "saved cache: made for another model or KV layout" + d;
}

}  // namespace

std::string SaveSequence(const PagedSequence& seq, const tiers::TierNamespace& ns,
                         const SequenceImage& image) {
  ByteWriter w;
  w.Bytes(kMagic, 4);
  w.Put<uint32_t>(kSequenceFileVersion);
  PutNamespace(w, ns);
  PagePool* cold = seq.cold_tables().empty() ? nullptr : seq.cold_pool();
  w.PutString(cold ? codecs::PairName({cold->layout().codec_k, cold->layout().codec_v}) : "");
  w.Put<double>(seq.cold_fetch());
  w.Put<int32_t>(cold ? seq.age_out() : 0);
  w.Put<int32_t>(seq.quest_pages());
  w.Put<double>(seq.quest_keep());
  w.PutString(image.compression);
  w.PutVector(image.tokens);
  w.PutVector(image.pending);
  w.PutVector(image.logits);
  w.Put<int32_t>(seq.n_tokens());
  w.Put<uint32_t>(static_cast<uint32_t>(seq.tables().size()));
  w.Put<uint32_t>(cold ? static_cast<uint32_t>(seq.cold_tables().size()) : 0);
  std::vector<int32_t> pos(seq.pool().layout().page_tokens);
  auto put_table = [&](const BlockTable& t, const PagePool& pool) {
    w.Put<int32_t>(t.n_tokens);
    const size_t n_pages =
        (size_t(t.n_tokens) + pool.layout().page_tokens - 1) / pool.layout().page_tokens;
    w.Put<uint32_t>(static_cast<uint32_t>(n_pages));
    for (size_t p = 0; p < n_pages; ++p) {
      const int32_t page = t.pages[p];
      const bool codec = IsCodecPage(page);
      w.Put<uint8_t>(codec ? kCodecPage : kRawPage);
      w.Bytes(pool.data(page), pool.data_bytes(codec));
      // Positions are written as int32 whatever the pool stores them in.
      pool.ReadPositions(page, pool.layout().page_tokens, pos.data());
      w.Bytes(pos.data(), pos.size() * sizeof(int32_t));
    }
  };
  // The sequence's pool is the one its tables' pages live in.
  const PagePool& hot = seq.pool();
  for (const BlockTable& t : seq.tables()) put_table(t, hot);
  if (cold) {
    for (const BlockTable& t : seq.cold_tables()) put_table(t, *cold);
  }
  w.Put<uint64_t>(XXH3_64bits(w.out().data(), w.out().size()));
  return std::move(w.out());
}

namespace {

// A file checked whole (header, checksum, every table, no trailing bytes) and its pages counted.
struct Parsed {
  Header h;
  size_t tables_at = 0;         // where the tables start
  int pages[4] = {0, 0, 0, 0};  // hot raw, hot codec, cold raw, cold codec
};

Result<Parsed> Parse(std::span<const uint8_t> bytes) {
  Parsed p;
  ByteReader r(bytes, "saved cache");
  CACHET_ASSIGN_OR_RETURN(p.h, ParseHeader(r, bytes));
  CACHET_ASSIGN_OR_RETURN(KvLayout hot, LayoutOf(p.h.info.ns));
  KvLayout cold_layout;
  if (!p.h.info.cold_codec.empty()) {
    CACHET_ASSIGN_OR_RETURN(const codecs::CodecPair c, codecs::ParseCodecPair(p.h.info.cold_codec));
    cold_layout = hot.Cold(c);
  }
  p.tables_at = r.at();
  struct {
    Parsed* p;
    void table(uint32_t, bool, int32_t n) { p->h.info.held_rows += n; }
    void page(uint32_t, bool is_cold, bool is_codec, const uint8_t*, size_t n, const uint8_t*,
              size_t pn, int) {
      p->h.info.page_bytes += static_cast<int64_t>(n + pn);
      ++p->pages[(is_cold ? 2 : 0) + (is_codec ? 1 : 0)];
    }
  } count{&p};
  CACHET_RETURN_IF_ERROR(
      WalkTables(r, p.h, hot, p.h.info.cold_codec.empty() ? nullptr : &cold_layout, count));
  if (r.at() + 8 != bytes.size()) return DataLoss("saved cache: trailing bytes after the tables");
  return p;
}

}  // namespace

Result<SequenceFileInfo> ReadSequenceInfo(std::span<const uint8_t> bytes) {
  CACHET_ASSIGN_OR_RETURN(Parsed p, Parse(bytes));
  return p.h.info;
}

Status LoadSequence(std::span<const uint8_t> bytes, const tiers::TierNamespace& ns,
                    const std::function<Result<PagePool*>(std::string_view codec)>& cold_pool_for,
                    PagedSequence* seq, SequenceImage* image) {
  if (seq->n_tokens() != 0 || seq->pages_held() != 0) {
    return FailedPrecondition("a saved cache loads into an empty session only");
  }
  // Everything is checked, and pages counted, before one is allocated. With the namespace the
  // engine's, the file's layout (page sizes) is the pools'.
  CACHET_ASSIGN_OR_RETURN(Parsed p, Parse(bytes));
  const Header& h = p.h;
  if (tiers::NamespaceKey(h.info.ns) != tiers::NamespaceKey(ns)) {
    return FailedPrecondition(Mismatch(h.info.ns, ns));
  }
  PagePool& hot = seq->pool();
  if (hot.layout().max_tokens > 0 && h.seq_tokens > hot.layout().max_tokens) {
    return OutOfRange("saved cache: it holds " + std::to_string(h.seq_tokens) +
                      " tokens, more than the context of " +
                      std::to_string(hot.layout().max_tokens));
  }
  PagePool* cold = nullptr;
  if (!h.info.cold_codec.empty()) {
    CACHET_ASSIGN_OR_RETURN(cold, cold_pool_for(h.info.cold_codec));
  }
  std::vector<int32_t> raw, codec, cold_raw, cold_codec;
  CACHET_RETURN_IF_ERROR(hot.Alloc(p.pages[0], p.pages[1], &raw, &codec));
  if (cold) {
    if (Status s = cold->Alloc(p.pages[2], p.pages[3], &cold_raw, &cold_codec); !s.ok()) {
      for (int32_t pg : raw) hot.Unref(pg);
      for (int32_t pg : codec) hot.Unref(pg);
      return s;
    }
  }
  // Pass 2: copy the pages in.
  std::vector<BlockTable> tables(h.n_tables), cold_tables(h.n_cold);
  struct Fill {
    PagePool* pools[2];
    std::vector<BlockTable>* tables[2];
    std::vector<int32_t>* pages[4];
    size_t next[4] = {0, 0, 0, 0};
    std::vector<int32_t> p = {};  // a page's positions
    BlockTable& Table(uint32_t t, bool is_cold) {
      return (*tables[is_cold])[is_cold ? t - tables[0]->size() : t];
    }
    void table(uint32_t t, bool is_cold, int32_t n) { Table(t, is_cold).n_tokens = n; }
    void page(uint32_t t, bool is_cold, bool is_codec, const uint8_t* data, size_t n,
              const uint8_t* pos, size_t pn, int rows) {
      const int which = (is_cold ? 2 : 0) + (is_codec ? 1 : 0);
      const int32_t page = (*pages[which])[next[which]++];
      std::memcpy(pools[is_cold]->data(page), data, n);
      p.assign(pn / sizeof(int32_t), 0);  // a last page's unused rows: 0
      std::memcpy(p.data(), pos, rows * sizeof(int32_t));
      pools[is_cold]->SetPositions(page, 0, p.data(), static_cast<int>(p.size()));
      Table(t, is_cold).pages.push_back(page);
    }
  } fill{{&hot, cold}, {&tables, &cold_tables}, {&raw, &codec, &cold_raw, &cold_codec}};
  ByteReader r(bytes, "saved cache", p.tables_at);
  CACHET_RETURN_IF_ERROR(WalkTables(r, h, hot.layout(), cold ? &cold->layout() : nullptr, fill));
  seq->Adopt(std::move(tables), std::move(cold_tables), h.seq_tokens);
  if (cold) {
    seq->set_cold_pool(cold, h.info.cold_fetch);
    seq->set_age_out(h.info.age_out);  // ages on as the saving session did
  }
  seq->set_quest(h.info.quest_pages, h.info.quest_keep);
  *image = std::move(p.h.image);
  return OkStatus();
}

}  // namespace cachet
