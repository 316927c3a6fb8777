#include "util/mmap_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace cachet {

Result<HugePageBuffer> HugePageBuffer::Allocate(size_t bytes, std::string_view what) {
  HugePageBuffer b;
  if (bytes == 0) return b;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhausted(std::string(what) + ": cannot map " + std::to_string(bytes) +
                             " bytes of memory: " + std::strerror(errno));
  }
  ::madvise(p, bytes, MADV_HUGEPAGE);  // advice: without THP the memory still works
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  return b;
}

HugePageBuffer::HugePageBuffer(HugePageBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

HugePageBuffer& HugePageBuffer::operator=(HugePageBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(data_, size_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

HugePageBuffer::~HugePageBuffer() {
  if (data_) ::munmap(data_, size_);
}

void HugePageBuffer::MakeReadOnly() {
  if (data_) ::mprotect(data_, size_, PROT_READ);
}

uint8_t* HugePageBuffer::Release() {
  size_ = 0;
  return std::exchange(data_, nullptr);
}

namespace {

// The file's bytes in a huge-page buffer, made read-only (`--no-mmap`).
Result<HugePageBuffer> ReadIntoMemory(int fd, const std::string& path, size_t size) {
  CACHET_ASSIGN_OR_RETURN(HugePageBuffer b, HugePageBuffer::Allocate(size, path));
  size_t done = 0;
  while (done < size) {
    const ssize_t r = ::pread(fd, b.data() + done, size - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string why = r < 0 ? std::strerror(errno) : "the file shrank while read";
      return Internal(path + ": reading it into memory failed at byte " + std::to_string(done) +
                      ": " + why);
    }
    done += static_cast<size_t>(r);
  }
  b.MakeReadOnly();
  return b;
}

// Mapped files this large are worth 2 MiB pages: decode streams them whole, far past what 4 KiB
// TLB entries reach (Zen 4's 3072 second-level ones: 12 MiB).
constexpr size_t kHugePageFileBytes = size_t{64} << 20;
constexpr size_t kHugePage = size_t{2} << 20;

void* MapAdvised(int fd, size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  // Advice: faults that read the file from disk fill 2 MiB folios, which map as huge pages.
  if (p != MAP_FAILED) ::madvise(p, size, MADV_HUGEPAGE);
  return p;
}

// Of up to 16 of a fresh mapping's 2 MiB pages, spread over it, those already in the page cache
// (mincore: reading the others would read the disk), and how many of these map as one 2 MiB page
// when read. Kernels that restrict mincore tell of unmapped pages only for files the process owns
// or may write (6.18 here tells a process as nobody too): where it finds none cached, all 16 are
// read, which costs a cold file 32 MiB of its reads ahead of time (into 2 MiB folios) and finds a
// file cached in 4 KiB folios where mincore cannot see it.
struct CachedSample {
  int cached = 0, huge = 0;
};
CachedSample SampleCachedPages(const uint8_t* p, size_t size) {
  CachedSample s;
  if (reinterpret_cast<uintptr_t>(p) % kHugePage != 0) return s;  // cannot map 2 MiB pages
  const size_t pages = size / kHugePage;
  auto spot = [&](size_t i) { return p + pages * (2 * i + 1) / 32 * kHugePage; };
  bool cached[16] = {};
  for (size_t i = 0; i < 16; ++i) {
    unsigned char in_cache = 0;
    cached[i] = ::mincore(const_cast<uint8_t*>(spot(i)), 4096, &in_cache) == 0 && (in_cache & 1);
    s.cached += cached[i];
  }
  for (size_t i = 0; i < 16; ++i) {
    if (cached[i] || s.cached == 0) (void)*reinterpret_cast<const volatile uint8_t*>(spot(i));
  }
  if (s.cached == 0) s.cached = 16;
  s.huge = static_cast<int>(ResidencyOf({{p, size}}).huge_page_bytes / kHugePage);
  return s;
}

}  // namespace

bool PageCacheFillsHugeFolios(int fd) {
  struct statfs fs {};
  struct utsname u {};
  int major = 0, minor = 0;
  if (::fstatfs(fd, &fs) != 0 || ::uname(&u) != 0 ||
      std::sscanf(u.release, "%d.%d", &major, &minor) != 2) {
    return false;
  }
  const int version = major * 1000 + minor;
  if (fs.f_type == 0xEF53) return version >= 6016;      // EXT4_SUPER_MAGIC
  if (fs.f_type == 0x58465342) return version >= 5018;  // XFS_SUPER_MAGIC
  return false;
}

Result<MappedFile> MappedFile::Open(const std::string& path, bool copy) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(path + ": not a regular file");
  }
  MappedFile f;
  f.path_ = path;
  f.size_ = static_cast<size_t>(st.st_size);
  if (f.size_ > 0 && copy) {
    Result<HugePageBuffer> b = ReadIntoMemory(fd, path, f.size_);
    ::close(fd);
    if (!b.ok()) return b.status();
    f.data_ = b->Release();
  } else if (f.size_ > 0) {
    void* p = MapAdvised(fd, f.size_);
    if (p != MAP_FAILED && f.size_ >= kHugePageFileBytes && PageCacheFillsHugeFolios(fd)) {
      const CachedSample s = SampleCachedPages(static_cast<const uint8_t*>(p), f.size_);
      if (s.cached >= 4 && 4 * s.huge < 3 * s.cached) {
        // Cached in 4 KiB folios, all (written or read a few KiB at a time) or in part (a file
        // partly evicted and read again around what stayed: 42% in 2 MiB pages seen): drop the
        // pages no process maps, so that this mapping's faults read the file again, into 2 MiB
        // folios.
        ::munmap(p, f.size_);
        (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        p = MapAdvised(fd, f.size_);
      }
    }
    ::close(fd);
    if (p == MAP_FAILED) return Internal(path + ": mmap failed: " + std::strerror(errno));
    f.data_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
  return f;
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      path_(std::move(o.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    path_ = std::move(o.path_);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Residency ResidencyOf(const std::vector<MemoryRange>& ranges) {
  Residency r;
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool counted = false;  // whether the mapping whose fields follow overlaps a range
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    // A mapping's header ("7f..-7f.. r--p ..."); its fields are "Name:   N kB".
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR, &begin, &end) == 2) {
      counted = false;
      for (const MemoryRange& m : ranges) {
        const auto lo = reinterpret_cast<uintptr_t>(m.data);
        if (m.size > 0 && lo < end && lo + m.size > begin) counted = true;
      }
      continue;
    }
    if (!counted) continue;
    long long kb = 0;
    char name[64];
    if (std::sscanf(line.c_str(), "%63[^:]: %lld kB", name, &kb) != 2) continue;
    const std::string_view n = name;
    if (n == "Rss") r.resident_bytes += kb << 10;
    if (n == "FilePmdMapped" || n == "AnonHugePages" || n == "ShmemPmdMapped") {
      r.huge_page_bytes += kb << 10;
    }
  }
  return r;
}

void DropFromPageCache(int fd) {
  // Dirty pages cannot be dropped: write them first.
  if (::fdatasync(fd) == 0) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

Result<std::string> OutputTarget(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string target = path;
  if (fs::is_symlink(path, ec)) {
    const fs::path resolved = fs::weakly_canonical(path, ec);
    if (ec) return InvalidArgument(path + ": cannot follow the link: " + ec.message());
    target = resolved.string();
  }
  const fs::file_status st = fs::status(target, ec);
  if (fs::is_directory(st)) return InvalidArgument(path + " is a directory: give a file path");
  if (fs::exists(st) && !fs::is_regular_file(st)) {
    return InvalidArgument(path +
                           " is not a regular file (a device, pipe or socket): outputs are "
                           "written beside their path and renamed over it; give a file path");
  }
  return target;
}

Status WriteFileAtomically(const std::string& given, std::string_view bytes) {
  CACHET_ASSIGN_OR_RETURN(const std::string path, OutputTarget(given));
  const std::string temp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(temp.c_str());
      return Internal("cannot write " + temp);
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return Internal("cannot rename " + temp + " to " + path);
  }
  return OkStatus();
}

Result<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace cachet
