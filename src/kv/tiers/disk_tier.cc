#include "kv/tiers/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <system_error>
#include <tuple>
#include <unordered_set>

namespace cachet::tiers {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxHeaderRead = 4096;  // any format version's header fits
constexpr std::string_view kTempPrefix = ".tmp-";

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

int64_t MtimeNs(const struct stat& st) {
  return int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec;
}

std::optional<RunKey> ParseKeyName(std::string_view name) {
  if (name.size() != 32) return std::nullopt;
  uint64_t half[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = name[i];
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else {
      return std::nullopt;  // upper case too: Hex() never writes it, so it is not ours
    }
    half[i / 16] = half[i / 16] << 4 | static_cast<uint64_t>(v);
  }
  return RunKey{half[1], half[0]};
}

// Reads up to n bytes at offset; fewer only at end of file. -1 on an I/O error.
ssize_t ReadAt(int fd, char* buf, size_t n, off_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, buf + got, n - got, offset + static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

bool WriteAll(int fd, const char* buf, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, buf, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    buf += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// futimens / utimensat times that set the mtime to stamp_ns and leave the atime alone.
void StampTimes(int64_t stamp_ns, struct timespec (&times)[2]) {
  times[0].tv_sec = 0;
  times[0].tv_nsec = UTIME_OMIT;
  times[1].tv_sec = stamp_ns / 1'000'000'000;
  times[1].tv_nsec = stamp_ns % 1'000'000'000;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

DiskTier::DiskTier(const DiskTierOptions& options) : options_(options) {
  std::random_device rd;
  writer_id_ = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
}

DiskTier::~DiskTier() = default;

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& options) {
  if (options.dir.empty()) return InvalidArgument("disk cache: no directory given");
  if (options.capacity_bytes == 0) {
    return InvalidArgument("disk cache " + options.dir + ": a size cap of 0 bytes holds nothing");
  }
  std::error_code ec;
  fs::create_directories(options.dir, ec);
  if (ec || !fs::is_directory(options.dir)) {
    return InvalidArgument("disk cache " + options.dir + ": cannot create the directory: " +
                           (ec ? ec.message() : "a file is in the way"));
  }
  if (::access(options.dir.c_str(), R_OK | W_OK | X_OK) != 0) {
    return InvalidArgument("disk cache " + options.dir + ": " + ErrnoText(errno));
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(options));
  CACHET_RETURN_IF_ERROR(tier->Scan());
  return tier;
}

std::string DiskTier::PathOf(const RunKey& key) const {
  const std::string hex = key.Hex();
  return options_.dir + "/" + hex.substr(0, 2) + "/" + hex;
}

int64_t DiskTier::NextStamp() {
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  // Strictly increasing, so two accesses in one clock tick still have an order after a restart.
  last_stamp_ = std::max(int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec, last_stamp_ + 1);
  return last_stamp_;
}

Status DiskTier::Scan() {
  struct Found {
    int64_t mtime;
    RunKey key;
    uint64_t bytes;
    RunKey parent;
  };
  std::vector<Found> found;
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  const int64_t stale_before =
      (int64_t{now.tv_sec} - options_.stale_temp_seconds) * 1'000'000'000 + now.tv_nsec;
  char header[kMaxHeaderRead];
  for (int s = 0; s < 256; ++s) {
    char shard_name[3];
    std::snprintf(shard_name, sizeof(shard_name), "%02x", s);
    const std::string shard = options_.dir + "/" + shard_name;
    std::error_code ec;  // a shard is created by its first write: a missing one holds nothing
    for (fs::directory_iterator it(shard, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const std::string path = shard + "/" + name;
      struct stat st;
      if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      if (name.starts_with(kTempPrefix)) {
        if (MtimeNs(st) < stale_before) ::unlink(path.c_str());
        continue;
      }
      const std::optional<RunKey> key = ParseKeyName(name);
      if (!key || name.compare(0, 2, shard_name) != 0) continue;  // not a run's name: not ours
      Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (fd.get() < 0) {
        if (errno != ENOENT) ++stats_.errors;  // unreadable: left alone
        continue;
      }
      // The file opened, not the name listed: a writer may have renamed a new one over it.
      const ssize_t n = ReadAt(fd.get(), header, sizeof(header), 0);
      if (n < 0 || ::fstat(fd.get(), &st) != 0) {
        ++stats_.errors;
        continue;
      }
      const Result<RunHeader> h = ParseRunHeader(std::string_view(header, size_t(n)));
      if (!h.ok() && TierErrorOf(h.status()) == TierError::kVersionMismatch) continue;
      if (!h.ok() || h->key != *key || h->total_bytes() != uint64_t(st.st_size)) {
        ::unlink(path.c_str());
        ++stats_.corrupt;
        continue;
      }
      found.push_back({MtimeNs(st), *key, uint64_t(st.st_size), h->parent});
    }
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
      return InvalidArgument("disk cache " + options_.dir + ": cannot list " + shard + ": " +
                             ec.message());
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return std::tie(a.mtime, a.key.hi, a.key.lo) < std::tie(b.mtime, b.key.hi, b.key.lo);
  });
  for (const Found& f : found) {
    Index(f.key, f.bytes, f.parent);
    last_stamp_ = std::max(last_stamp_, f.mtime);
  }
  EvictFor(0);  // the cap may have shrunk since these were written
  return OkStatus();
}

template <class Fn>
void DiskTier::ForChain(const RunKey& from, Fn fn) {
  // Bounded by the index, so a cycle of forged parents cannot loop.
  size_t steps = 0;
  for (auto p = index_.find(from); p != index_.end() && steps++ < index_.size();
       p = index_.find(p->second.parent)) {
    fn(p->first, p->second);
  }
}

void DiskTier::Index(const RunKey& key, uint64_t bytes, const RunKey& parent) {
  auto it = index_.find(key);
  if (it == index_.end()) {
    lru_.push_back(key);
    index_.emplace(key, Entry{bytes, std::prev(lru_.end()), parent});
  } else {
    lru_.splice(lru_.end(), lru_, it->second.lru);
    bytes_held_ -= it->second.bytes;
    it->second.bytes = bytes;
    it->second.parent = parent;
  }
  bytes_held_ += bytes;
  // A chain is evicted from its end, as a prefix cache's blocks are: the runs before this one
  // (it is useless without them) become more recent than it, the first run the most recent.
  ForChain(parent, [&](const RunKey&, Entry& e) { lru_.splice(lru_.end(), lru_, e.lru); });
}

void DiskTier::Drop(const RunKey& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  bytes_held_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
}

bool DiskTier::EvictFor(uint64_t incoming, const RunKey* parent) {
  std::unordered_set<RunKey, RunKeyHash> keep;
  uint64_t kept_bytes = 0;
  if (parent != nullptr) {
    ForChain(*parent, [&](const RunKey& key, const Entry& e) {
      if (keep.insert(key).second) kept_bytes += e.bytes;
    });
  }
  if (kept_bytes + incoming > options_.capacity_bytes) return false;
  for (auto it = lru_.begin();
       it != lru_.end() && bytes_held_ + incoming > options_.capacity_bytes;) {
    const RunKey victim = *it++;
    if (keep.count(victim)) continue;
    if (::unlink(PathOf(victim).c_str()) != 0 && errno != ENOENT) ++stats_.errors;
    Drop(victim);
    ++stats_.evicted;
  }
  return true;
}

std::optional<std::string> DiskTier::ReadRun(const RunKey& key) {
  const std::string path = PathOf(key);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    // Gone (another process evicted it, or a person deleted it): a miss, and no longer held.
    if (errno != ENOENT) ++stats_.errors;
    Drop(key);
    return std::nullopt;
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    ++stats_.errors;
    return std::nullopt;
  }
  auto corrupt = [&]() -> std::optional<std::string> {
    // Delete only the file that was read: a writer may have renamed a fresh run over it since.
    struct stat now;
    if (::stat(path.c_str(), &now) == 0 && now.st_ino == st.st_ino && now.st_dev == st.st_dev) {
      ::unlink(path.c_str());
    }
    ++stats_.corrupt;
    Drop(key);
    return std::nullopt;
  };
  // The header first: its declared size must match the file's before the rest is read, so a
  // damaged header never makes us read (or allocate) a huge file.
  char header[kMaxHeaderRead];
  const ssize_t n = ReadAt(fd.get(), header, sizeof(header), 0);
  if (n < 0) {
    ++stats_.errors;
    return std::nullopt;
  }
  const Result<RunHeader> h = ParseRunHeader(std::string_view(header, size_t(n)));
  if (!h.ok() && TierErrorOf(h.status()) == TierError::kVersionMismatch) {
    Drop(key);  // another version's run: not ours to use or delete
    return std::nullopt;
  }
  if (!h.ok() || h->key != key || h->total_bytes() != uint64_t(st.st_size)) return corrupt();
  std::string bytes(size_t(st.st_size), '\0');
  if (ReadAt(fd.get(), bytes.data(), bytes.size(), 0) != ssize_t(bytes.size())) return corrupt();
  if (!CheckRun(bytes).ok()) return corrupt();
  struct timespec times[2];
  StampTimes(NextStamp(), times);
  ::futimens(fd.get(), times);  // best effort: the order is a hint for eviction
  // A run another process wrote becomes ours too, when it fits beside its chain.
  if (index_.count(key) || EvictFor(bytes.size(), &h->parent)) Index(key, bytes.size(), h->parent);
  return bytes;
}

std::vector<std::optional<std::string>> DiskTier::Get(std::span<const RunKey> keys) {
  std::vector<std::optional<std::string>> out;
  out.reserve(keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (const RunKey& key : keys) {
    out.push_back(ReadRun(key));
    if (out.back()) {
      ++stats_.hits;
      stats_.bytes_read += static_cast<int64_t>(out.back()->size());
    } else {
      ++stats_.misses;
    }
  }
  return out;
}

Status DiskTier::WriteRun(const RunKey& key, const std::string& bytes) {
  const std::string path = PathOf(key);
  const std::string shard = path.substr(0, path.size() - 33);
  char suffix[48];
  std::snprintf(suffix, sizeof(suffix), "%016llx-%llu", static_cast<unsigned long long>(writer_id_),
                static_cast<unsigned long long>(++temp_counter_));
  const std::string temp = shard + "/" + std::string(kTempPrefix) + suffix;
  int raw = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (raw < 0 && errno == ENOENT) {  // the shard's first run (or it was removed under us)
    std::error_code ec;
    fs::create_directories(shard, ec);
    raw = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  }
  if (raw < 0) {
    return Internal("disk cache: cannot create " + temp + ": " + ErrnoText(errno));
  }
  // No fsync: after a power loss a renamed file may hold garbage, which its checksum catches;
  // a cache does not need durability, and fsync would cost every spill a disk flush.
  bool ok = WriteAll(raw, bytes.data(), bytes.size());
  int err = ok ? 0 : errno;
  struct timespec times[2];
  StampTimes(NextStamp(), times);
  if (ok) ::futimens(raw, times);
  if (::close(raw) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (ok && ::rename(temp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(temp.c_str());
    return Internal("disk cache: cannot write " + path + ": " + ErrnoText(err));
  }
  return OkStatus();
}

Status DiskTier::Put(std::span<const std::pair<RunKey, std::string>> runs) {
  // Checked before anything is stored, and outside the lock: a checksum over megabytes must not
  // hold up other callers.
  std::vector<RunKey> parents(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& [key, bytes] = runs[i];
    const Result<RunHeader> h = CheckRun(bytes);
    if (!h.ok() || h->key != key) {
      return InvalidArgument("disk cache " + options_.dir + ": Put run " + std::to_string(i) +
                             " of " + std::to_string(runs.size()) + " (key " + key.Hex() + "): " +
                             (h.ok() ? "the bytes are run " + h->key.Hex() : h.status().message()));
    }
    parents[i] = h->parent;
  }
  std::lock_guard<std::mutex> lock(mu_);
  Status first_error;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& [key, bytes] = runs[i];
    if (index_.count(key)) {
      struct timespec times[2];
      StampTimes(NextStamp(), times);
      if (::utimensat(AT_FDCWD, PathOf(key).c_str(), times, 0) == 0) {
        Index(key, index_.at(key).bytes, parents[i]);
        continue;
      }
      Drop(key);  // the file went away: write it again
    }
    if (bytes.size() > options_.capacity_bytes) {
      ++stats_.dropped;
      if (first_error.ok()) {
        first_error =
            ResourceExhausted("disk cache " + options_.dir + ": run " + key.Hex() + " of " +
                              std::to_string(bytes.size()) + " bytes exceeds the cap of " +
                              std::to_string(options_.capacity_bytes));
      }
      continue;
    }
    // Not stored when only its own chain could make room: it would evict what it needs.
    if (!EvictFor(bytes.size(), &parents[i])) {
      ++stats_.dropped;
      continue;
    }
    Status s = WriteRun(key, bytes);
    if (!s.ok()) {
      ++stats_.errors;
      if (first_error.ok()) first_error = std::move(s);
      continue;
    }
    Index(key, bytes.size(), parents[i]);
    stats_.bytes_written += static_cast<int64_t>(bytes.size());
  }
  return first_error;
}

std::vector<bool> DiskTier::Exists(std::span<const RunKey> keys) {
  std::vector<bool> out(keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    out[i] = index_.count(keys[i]) > 0 || ::access(PathOf(keys[i]).c_str(), F_OK) == 0;
  }
  return out;
}

void DiskTier::Erase(const RunKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (::unlink(PathOf(key).c_str()) != 0 && errno != ENOENT) ++stats_.errors;
  Drop(key);
}

TierStats DiskTier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  TierStats s = stats_;
  s.entries = static_cast<int64_t>(index_.size());
  s.bytes_held = static_cast<int64_t>(bytes_held_);
  return s;
}

}  // namespace cachet::tiers
