#include "runtime/cache_registry.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "runtime/engine_access.h"
#include "util/mmap_file.h"

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

// Redis names: the hash tag keeps a cache's two values on one cluster node.
std::string RedisName(const std::string& id, std::string_view part) {
  return "cache:{" + id + "}:" + std::string(part);
}

// The salt a cache's description names; none when it is damaged (descriptions are written
// whole, by rename): such a cache is no namespace's, so no lookup takes it and any DELETE of its
// id removes it.
std::optional<std::string> SaltOf(const std::string& meta) {
  const json side = json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (!side.is_object() || !side.contains("salt") || !side["salt"].is_string()) return {};
  return side["salt"].get<std::string>();
}

bool SaltMatches(const std::string& meta, uint64_t salt) { return SaltOf(meta) == SaltHex(salt); }

// DELETE removes a cache of its salt, or a damaged one.
bool Deletable(const std::string& meta, uint64_t salt) {
  const std::optional<std::string> s = SaltOf(meta);
  return !s || *s == SaltHex(salt);
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

CacheRegistry::CacheRegistry(std::string dir, std::unique_ptr<tiers::RedisTier> redis,
                             int64_t max_resident_bytes)
    : dir_(std::move(dir)), redis_(std::move(redis)), max_resident_bytes_(max_resident_bytes) {
  RemoveOrphans();
}

// A cache's pages without its description are a writer's that crashed between the two (Store
// writes the pages first), or one whose description was lost: no lookup can take them, and no
// DELETE reaches them (it starts from the description, whose salt it checks). Ten minutes old,
// they are no writer's in progress, in this process or another sharing the directory. A damaged
// description goes with its pages.
void CacheRegistry::RemoveOrphans() {
  if (dir_.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const fs::path& p = e.path();
    if (p.extension() != ".ckv" || !IsCacheId(p.stem().string())) continue;
    const fs::path meta = fs::path(p).replace_extension(".json");
    if (fs::exists(meta, ec)) {
      const Result<std::string> text = ReadTextFile(meta.string());
      if (!text.ok() || SaltOf(text.value())) continue;  // intact
    }
    const auto written = fs::last_write_time(p, ec);
    if (!ec && now - written > std::chrono::minutes(10)) {
      fs::remove(p, ec);
      fs::remove(meta, ec);
    }
  }
}

std::string CacheRegistry::PathOf(const std::string& id, std::string_view ext) const {
  return dir_ + "/" + id + std::string(ext);
}

Status CacheRegistry::Store(const std::string& id, const Stored& stored) {
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return Internal("cannot create the cache directory " + dir_ + ": " + ec.message());
    // The pages first: a lookup starts from the sidecar, so a crash between the two leaves
    // nothing it would take.
    CACHET_RETURN_IF_ERROR(WriteFileAtomically(PathOf(id, ".ckv"), stored.kv));
    if (Status s = WriteFileAtomically(PathOf(id, ".json"), stored.meta); !s.ok()) {
      std::remove(PathOf(id, ".ckv").c_str());
      return s;
    }
  }
  if (redis_) {
    Status s = redis_->SetValue(RedisName(id, "kv"), stored.kv);
    if (s.ok()) s = redis_->SetValue(RedisName(id, "meta"), stored.meta);
    if (!s.ok()) {
      (void)redis_->DeleteValue(RedisName(id, "kv"));
      if (!dir_.empty()) {
        std::remove(PathOf(id, ".json").c_str());
        std::remove(PathOf(id, ".ckv").c_str());
      }
      return s;
    }
  }
  return OkStatus();
}

Result<KvCacheInfo> CacheRegistry::Add(std::unique_ptr<Session> session,
                                       std::string_view cache_salt, std::string compression,
                                       std::string note) {
  Entry e;
  e.salt = EngineAccess::SaltOf(cache_salt);
  e.info = Describe(*session, NewId(), std::time(nullptr), std::move(compression), std::move(note));
  if (!has_store() && bytes() + e.info.bytes > max_resident_bytes_) {
    auto mib = [](int64_t b) {
      char s[32];
      std::snprintf(s, sizeof(s), "%.1f MiB", double(b) / (1 << 20));
      return std::string(s);
    };
    return ResourceExhausted(
        "kept caches: " + mib(bytes() + e.info.bytes) + " with this one, over the " +
        mib(max_resident_bytes_) + " they may hold in RAM " +
        "(--cache-mem-mib); delete one, or give --disk-cache or --redis so that caches can leave " +
        "RAM and come back");
  }
  if (has_store()) {
    Stored stored;
    stored.meta = json{
        {"version", 1},
        {"salt", SaltHex(e.salt)},
        {"created", e.info.created},
        {"compression", e.info.compression},
        {"note",
         e.info.note}}.dump();
    stored.kv = EngineAccess::SaveBytes(*session, e.info.compression);
    CACHET_RETURN_IF_ERROR(Store(e.info.id, stored));
  }
  e.session = std::move(session);
  const KvCacheInfo info = e.info;
  Keep(std::move(e));
  return info;
}

void CacheRegistry::Keep(Entry e) {
  e.last_used = ++clock_;
  const std::string id = e.info.id;
  std::vector<std::shared_ptr<Session>> dropped;  // freed after the lock, still on this thread
  std::lock_guard<std::mutex> lock(mu_);
  entries_.insert_or_assign(id, std::move(e));
  if (!has_store()) return;  // Add refused what would not fit
  int64_t total = 0;
  for (const auto& [key, entry] : entries_) total += entry.info.bytes;
  while (total > max_resident_bytes_ && entries_.size() > 1) {
    auto oldest = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first != id &&
          (oldest == entries_.end() || it->second.last_used < oldest->second.last_used)) {
        oldest = it;
      }
    }
    total -= oldest->second.info.bytes;
    dropped.push_back(std::move(oldest->second.session));
    entries_.erase(oldest);
    ++unloaded_;
  }
}

Result<std::shared_ptr<Session>> CacheRegistry::Get(Engine& engine, const std::string& id,
                                                    std::string_view cache_salt) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(id); it != entries_.end()) {
      if (it->second.salt != EngineAccess::SaltOf(cache_salt)) return Unknown(id);
      it->second.last_used = ++clock_;
      return it->second.session;
    }
  }
  return Load(engine, id, cache_salt);
}

Result<CacheRegistry::Stored> CacheRegistry::Fetch(const std::string& id, bool kv_too,
                                                   std::string* from) {
  if (!IsCacheId(id)) return Unknown(id);
  if (!dir_.empty()) {
    if (Result<std::string> meta = ReadTextFile(PathOf(id, ".json")); meta.ok()) {
      Stored s;
      s.meta = std::move(meta).value();
      if (kv_too) {
        CACHET_ASSIGN_OR_RETURN(s.kv, ReadTextFile(PathOf(id, ".ckv")));
      }
      *from = PathOf(id, ".ckv");
      return s;
    }
  }
  if (redis_) {
    CACHET_ASSIGN_OR_RETURN(std::optional<std::string> meta,
                            redis_->GetValue(RedisName(id, "meta")));
    if (meta) {
      Stored s;
      s.meta = std::move(*meta);
      if (kv_too) {
        CACHET_ASSIGN_OR_RETURN(std::optional<std::string> kv,
                                redis_->GetValue(RedisName(id, "kv")));
        if (!kv) return DataLoss("Redis holds the description but not the pages (expired?)");
        s.kv = std::move(*kv);
      }
      *from = "redis " + RedisName(id, "kv");
      return s;
    }
  }
  return Unknown(id);
}

Result<std::shared_ptr<Session>> CacheRegistry::Load(Engine& engine, const std::string& id,
                                                     std::string_view cache_salt) {
  const uint64_t salt = EngineAccess::SaltOf(cache_salt);
  // Why a stored cache is unusable goes to the client without the server's paths.
  auto unusable = [&](const Status& s) {
    std::string why = s.message();
    for (size_t at; !dir_.empty() && (at = why.find(dir_ + "/")) != std::string::npos;) {
      why.erase(at, dir_.size() + 1);
    }
    return NotFound("cache_id: the cache '" + id + "' cannot be loaded: " + why);
  };
  std::string from;
  Result<Stored> stored = Fetch(id, /*kv_too=*/false, &from);
  if (!stored.ok() && stored.status().code() != StatusCode::kNotFound) {
    if (stored.status().code() == StatusCode::kUnavailable) return stored.status();
    return unusable(stored.status());
  }
  if (!stored.ok() || !SaltMatches(stored->meta, salt)) return Unknown(id);
  stored = Fetch(id, /*kv_too=*/true, &from);
  if (!stored.ok()) {
    if (stored.status().code() == StatusCode::kUnavailable) return stored.status();
    return unusable(stored.status());
  }
  const json side = json::parse(stored->meta, nullptr, /*allow_exceptions=*/false);
  Result<std::unique_ptr<Session>> s = EngineAccess::LoadBytes(
      engine, std::span(reinterpret_cast<const uint8_t*>(stored->kv.data()), stored->kv.size()),
      cache_salt, from);
  if (!s.ok()) {
    // No room in the pool is worth a retry; anything else (another model or layout, damaged
    // bytes) makes the cache unusable here.
    if (s.status().code() == StatusCode::kResourceExhausted) return s.status();
    return unusable(s.status());
  }
  Entry e;
  e.salt = salt;
  e.info = Describe(**s, id, side.value("created", int64_t{0}), side.value("compression", ""),
                    side.value("note", ""));
  e.session = std::move(s).value();
  std::shared_ptr<Session> session = e.session;
  Keep(std::move(e));
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
  if (!IsCacheId(id)) return found ? OkStatus() : Unknown(id);
  if (!dir_.empty()) {
    Result<std::string> meta = ReadTextFile(PathOf(id, ".json"));
    if (meta.ok() && Deletable(*meta, salt)) {
      std::remove(PathOf(id, ".json").c_str());
      std::remove(PathOf(id, ".ckv").c_str());
      found = true;
    }
  }
  if (redis_) {
    CACHET_ASSIGN_OR_RETURN(std::optional<std::string> meta,
                            redis_->GetValue(RedisName(id, "meta")));
    if (meta && Deletable(*meta, salt)) {
      CACHET_RETURN_IF_ERROR(redis_->DeleteValue(RedisName(id, "meta")));
      CACHET_RETURN_IF_ERROR(redis_->DeleteValue(RedisName(id, "kv")));
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

int64_t CacheRegistry::unloaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unloaded_;
}

}  // namespace cachet
