// The library's own view inside an Engine and its Sessions: what include/cachet/engine.h keeps
// opaque. For the layers built on the engine (the serving scheduler, the eval harness) and for
// tests; the CLI and the server never include it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/engine.h"
#include "kv/chunk_cache.h"
#include "kv/page_pool.h"
#include "kv/paged_sequence.h"
#include "kv/prefix_tree.h"
#include "kv/tiers/format.h"
#include "model/transformer.h"
#include "util/thread_pool.h"

namespace cachet {

class EngineAccess {
 public:
  static Transformer& model(Engine& e) { return *e.model_; }
  static ThreadPool& threads(Engine& e) { return *e.pool_; }
  static PagePool& kv_pool(Engine& e) { return *e.kv_pool_; }
  static const PagePool& kv_pool(const Engine& e) { return *e.kv_pool_; }
  static PrefixTree* prefix(Engine& e) { return e.prefix_.get(); }
  // The model's weights by content (WeightsHash, taken when the engine was made).
  static uint64_t model_hash(const Engine& e) { return e.kv_namespace_->model_hash; }
  static ChunkCache& chunks(Engine& e) { return *e.chunks_; }
  // What sessions of that salt share the prefix cache under (Engine::NewSession's key).
  static uint64_t SaltOf(std::string_view cache_salt) { return Engine::SaltKey(cache_salt); }
  // A session under a salt already hashed (SaltOf), as NewSession(cache_salt) makes it.
  static std::unique_ptr<Session> NewSession(Engine& e, uint64_t salt) {
    return std::unique_ptr<Session>(
        new Session(e, std::make_unique<PagedSequence>(*e.kv_pool_), salt));
  }

  static PagedSequence& kv(Session& s) { return *s.seq_; }
  static const PagedSequence& kv(const Session& s) { return *s.seq_; }
  static std::vector<int32_t>& tokens(Session& s) { return s.tokens_; }
  static std::vector<float>& last_logits(Session& s) { return s.last_logits_; }
  static uint64_t salt(const Session& s) { return s.salt_; }

  // A session as a saved cache's bytes and back (Session::Save and Engine::LoadSession without
  // the file; saved_cache.cc). what names the source in LoadBytes's errors.
  static std::string SaveBytes(const Session& s, std::string_view compression);
  static Result<std::unique_ptr<Session>> LoadBytes(Engine& e, std::span<const uint8_t> bytes,
                                                    std::string_view cache_salt,
                                                    const std::string& what);
  static Status CheckAging(Engine& e, const PagedSequence& seq, const std::string& what);
};

}  // namespace cachet
