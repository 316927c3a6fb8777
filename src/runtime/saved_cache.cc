// Session::Save, Engine::LoadSession and ReadSavedCacheInfo: a session's KV cache as a file
// (kv/sequence_file.h holds the format).

#include <cstdio>

#include "cachet/engine.h"
#include "kv/codecs/codec.h"
#include "kv/sequence_file.h"
#include "runtime/engine_access.h"
#include "util/mmap_file.h"

namespace cachet {
namespace {

Status Prefixed(const std::string& path, const Status& s) {
  return Status(s.code(), path + ": " + s.message());
}

}  // namespace

// An engine that ages pages (--kv-cold) continues a cache only if the cache's cold pages are its
// cold pool's and went cold at the same age; a cache whose cold pages are a press's demoted
// tokens does not age at all.
Status EngineAccess::CheckAging(Engine& e, const PagedSequence& seq, const std::string& what) {
  const EngineOptions& o = e.options_;
  if (!e.ages() || seq.cold_pool() == nullptr) return OkStatus();
  auto fail = [&](const std::string& why) { return FailedPrecondition(what + ": " + why); };
  const KvLayout& cold = seq.cold_pool()->layout();
  const std::string file_cold = codecs::PairName({cold.codec_k, cold.codec_v});
  if (seq.age_out() == 0) {
    return fail("its cold tokens were demoted by a press (" + file_cold +
                "), which does not combine with --kv-cold");
  }
  if (seq.cold_pool() != e.ColdPool(o.kv_cold).value()) {
    return fail("its old pages are coded " + file_cold + ", not --kv-cold " + o.kv_cold);
  }
  if (seq.age_out() != o.kv_cold_after) {
    return fail("its pages went cold after " + std::to_string(seq.age_out()) +
                " tokens, not --kv-cold-after " + std::to_string(o.kv_cold_after));
  }
  return OkStatus();
}

std::string EngineAccess::SaveBytes(const Session& s, std::string_view compression) {
  // The pages due to go cold are saved cold (the loading session's first step would move them):
  // a smaller file, the same continuation.
  s.seq_->AgeOut();
  SequenceImage image;
  image.tokens = s.tokens_;
  image.pending = s.pending_;
  image.logits = s.last_logits_;
  image.compression = std::string(compression);
  return SaveSequence(*s.seq_, *s.engine_.kv_namespace_, image);
}

Result<std::unique_ptr<Session>> EngineAccess::LoadBytes(Engine& e, std::span<const uint8_t> bytes,
                                                         std::string_view cache_salt,
                                                         const std::string& what) {
  // A context longer than this engine's is said as such, not as a pool without room for it.
  if (auto info = ReadSequenceInfo(bytes); info.ok() && info->n_tokens > e.n_ctx()) {
    return OutOfRange(what + ": the cache holds " + std::to_string(info->n_tokens) +
                      " tokens, more than the context of " + std::to_string(e.n_ctx()) + " (-c)");
  }
  std::unique_ptr<Session> s = e.NewSession(cache_salt);
  SequenceImage image;
  const Status st = LoadSequence(
      bytes, *e.kv_namespace_, [&e](std::string_view codec) { return e.ColdPool(codec); },
      s->seq_.get(), &image);
  if (!st.ok()) return Prefixed(what, st);
  CACHET_RETURN_IF_ERROR(CheckAging(e, *s->seq_, what));
  const int vocab = e.config().vocab_size;
  for (const auto* ids : {&image.tokens, &image.pending}) {
    for (int32_t t : *ids) {
      if (t < 0 || t >= vocab) {
        return DataLoss(what + ": token id " + std::to_string(t) + " is outside the vocabulary");
      }
    }
  }
  if (!image.logits.empty() && static_cast<int>(image.logits.size()) != vocab) {
    return DataLoss(what + ": " + std::to_string(image.logits.size()) +
                    " logits for a vocabulary of " + std::to_string(vocab));
  }
  s->tokens_ = std::move(image.tokens);
  s->pending_ = std::move(image.pending);
  s->last_logits_ = std::move(image.logits);
  return s;
}

Status Session::Save(const std::string& path, std::string_view compression) const {
  const Status s = WriteFileAtomically(path, EngineAccess::SaveBytes(*this, compression));
  return s.ok() ? s : Status(s.code(), "saving the cache to " + path + ": " + s.message());
}

Result<std::unique_ptr<Session>> Engine::LoadSession(const std::string& path,
                                                     std::string_view cache_salt) {
  CACHET_ASSIGN_OR_RETURN(const std::string file, ReadTextFile(path));
  return EngineAccess::LoadBytes(
      *this, std::span(reinterpret_cast<const uint8_t*>(file.data()), file.size()), cache_salt,
      path);
}

Result<SavedCacheInfo> ReadSavedCacheInfo(const std::string& path) {
  CACHET_ASSIGN_OR_RETURN(const std::string file, ReadTextFile(path));
  auto r = ReadSequenceInfo(std::span(reinterpret_cast<const uint8_t*>(file.data()), file.size()));
  if (!r.ok()) return Prefixed(path, r.status());
  SavedCacheInfo info;
  // An engine with a calibration tags its codec names "<codec>#<calibration hash>".
  const size_t tag = r->ns.codec_k.find('#');
  info.codec_k = r->ns.codec_k.substr(0, tag);
  info.codec_v = r->ns.codec_v.substr(0, r->ns.codec_v.find('#'));
  if (tag != std::string::npos) info.calibration = r->ns.codec_k.substr(tag + 1);
  info.page_tokens = r->ns.page_tokens;
  info.sinks = r->ns.sinks;
  info.window = r->ns.window;
  info.cold_codec = r->cold_codec;
  info.cold_after = r->age_out;
  info.compression = r->compression;
  info.n_tokens = r->n_tokens;
  info.held_rows = r->held_rows;
  info.page_bytes = r->page_bytes;
  info.model_hash = r->ns.model_hash;
  return info;
}

}  // namespace cachet
