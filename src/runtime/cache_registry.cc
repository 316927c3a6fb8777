#include "runtime/cache_registry.h"

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "runtime/engine_access.h"

namespace cachet {
namespace {

using json = nlohmann::json;

// 128 bits from the OS's generator: ids are bearer capabilities, so they must not be guessable
// from other ids or from the content.
std::string NewId() {
  std::random_device rd;
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return std::string("kvc-") + hex;
}

std::string SaltHex(uint64_t salt) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(salt));
  return hex;
}

Status Unknown(const std::string& id) {
  return NotFound("cache_id: no cache '" + id + "' (it was never made, was deleted, or has " +
                  "another cache_salt)");
}

int64_t HeldRows(const Session& s) {
  int64_t rows = 0;
  const PagedSequence& seq = EngineAccess::kv(s);
  for (const auto* tables : {&seq.tables(), &seq.cold_tables()}) {
    for (const BlockTable& t : *tables) rows += t.n_tokens;
  }
  return rows;
}

KvCacheInfo Describe(const Session& s, std::string id, int64_t created, std::string compression,
                     std::string note) {
  KvCacheInfo info;
  info.id = std::move(id);
  info.created = created;
  info.tokens = s.n_tokens();
  info.held_rows = HeldRows(s);
  info.bytes = static_cast<int64_t>(s.kv_bytes());
  info.compression = std::move(compression);
  info.note = std::move(note);
  return info;
}

}  // namespace

bool IsCacheId(std::string_view id) {
  if (id.size() != 36 || !id.starts_with("kvc-")) return false;
  for (char c : id.substr(4)) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string CacheRegistry::PathOf(const std::string& id, std::string_view ext) const {
  return dir_ + "/" + id + std::string(ext);
}

Result<KvCacheInfo> CacheRegistry::Add(std::unique_ptr<Session> session,
                                       std::string_view cache_salt, std::string compression,
                                       std::string note) {
  Entry e;
  e.salt = EngineAccess::SaltOf(cache_salt);
  e.info = Describe(*session, NewId(), std::time(nullptr), std::move(compression), std::move(note));
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return Internal("cannot create the cache directory " + dir_ + ": " + ec.message());
    // The sidecar first: a .ckv without one is never loaded (a crash between the two leaves
    // nothing a lookup would take).
    const json side = {{"version", 1},
                       {"salt", SaltHex(e.salt)},
                       {"created", e.info.created},
                       {"compression", e.info.compression},
                       {"note", e.info.note}};
    const std::string side_path = PathOf(e.info.id, ".json");
    {
      std::ofstream out(side_path, std::ios::trunc);
      out << side.dump();
      if (!out.flush()) return Internal("cannot write " + side_path);
    }
    if (Status s = session->Save(PathOf(e.info.id, ".ckv"), e.info.compression); !s.ok()) {
      std::remove(side_path.c_str());
      return s;
    }
  }
  e.session = std::move(session);
  const KvCacheInfo info = e.info;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.emplace(info.id, std::move(e));
  return info;
}

Result<std::shared_ptr<Session>> CacheRegistry::Get(Engine& engine, const std::string& id,
                                                    std::string_view cache_salt) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(id); it != entries_.end()) {
      if (it->second.salt != EngineAccess::SaltOf(cache_salt)) return Unknown(id);
      return it->second.session;
    }
  }
  return Load(engine, id, cache_salt);
}

Result<std::shared_ptr<Session>> CacheRegistry::Load(Engine& engine, const std::string& id,
                                                     std::string_view cache_salt) {
  if (dir_.empty() || !IsCacheId(id)) return Unknown(id);
  std::ifstream in(PathOf(id, ".json"));
  if (!in) return Unknown(id);
  std::stringstream text;
  text << in.rdbuf();
  const json side = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!side.is_object() || !side.contains("salt") || !side["salt"].is_string() ||
      side["salt"].get<std::string>() != SaltHex(EngineAccess::SaltOf(cache_salt))) {
    return Unknown(id);
  }
  Result<std::unique_ptr<Session>> s = engine.LoadSession(PathOf(id, ".ckv"), cache_salt);
  if (!s.ok()) {
    // No room in the pool is worth a retry; anything else (another model or layout, a damaged
    // file) makes the cache unusable here.
    if (s.status().code() == StatusCode::kResourceExhausted) return s.status();
    return NotFound("cache_id: the cache '" + id + "' cannot be loaded: " + s.status().message());
  }
  Entry e;
  e.salt = EngineAccess::SaltOf(cache_salt);
  e.info = Describe(**s, id, side.value("created", int64_t{0}), side.value("compression", ""),
                    side.value("note", ""));
  e.session = std::move(s).value();
  std::shared_ptr<Session> session = e.session;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.emplace(id, std::move(e));
  return session;
}

Status CacheRegistry::Remove(const std::string& id, std::string_view cache_salt) {
  const uint64_t salt = EngineAccess::SaltOf(cache_salt);
  std::shared_ptr<Session> dropped;  // freed after the lock, still on this thread
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(id); it != entries_.end()) {
      if (it->second.salt != salt) return Unknown(id);
      dropped = std::move(it->second.session);
      entries_.erase(it);
      found = true;
    }
  }
  if (!dir_.empty() && IsCacheId(id)) {
    std::ifstream in(PathOf(id, ".json"));
    std::stringstream text;
    text << in.rdbuf();
    const json side = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    const bool ours = side.is_object() && side.value("salt", "") == SaltHex(salt);
    if (ours) {
      std::remove(PathOf(id, ".ckv").c_str());
      std::remove(PathOf(id, ".json").c_str());
      found = true;
    }
  }
  return found ? OkStatus() : Unknown(id);
}

std::optional<KvCacheInfo> CacheRegistry::Resident(const std::string& id,
                                                   std::string_view cache_salt) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.salt != EngineAccess::SaltOf(cache_salt)) {
    return std::nullopt;
  }
  return it->second.info;
}

std::vector<KvCacheInfo> CacheRegistry::List(std::string_view cache_salt) const {
  const uint64_t salt = EngineAccess::SaltOf(cache_salt);
  std::vector<KvCacheInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, e] : entries_) {
    if (e.salt == salt) out.push_back(e.info);
  }
  return out;
}

int CacheRegistry::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(entries_.size());
}

int64_t CacheRegistry::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [id, e] : entries_) total += e.info.bytes;
  return total;
}

}  // namespace cachet
