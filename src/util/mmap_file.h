// Read-only memory-mapped file: weights are mapped, never copied whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet {

class MappedFile {
 public:
  // The file mapped read-only, or with copy its bytes read into anonymous memory (`--no-mmap`),
  // for a longer load and no page-cache sharing between processes. Either is advised for
  // transparent huge pages: decode streams the weights with a TLB miss per 2 MiB instead of per
  // 4 KiB. A mapping gets them where the page cache holds the file in 2 MiB folios, which the
  // advice asks for when a fault reads it from disk (PageCacheFillsHugeFolios). A file of 64 MiB
  // or more that the cache holds in 4 KiB folios for more than a quarter of it (written or read
  // a few KiB at a time, as a download is, or partly evicted) is dropped from the cache first, so
  // that decode reads it from disk once, into 2 MiB folios; pages another process maps stay.
  static Result<MappedFile> Open(const std::string& path, bool copy = false);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

// Anonymous read-write memory advised for transparent huge pages (THP "madvise", Debian's default,
// gives them on request only): the `--no-mmap` copy of a file, which decode streams as it does a
// mapping. Zero-filled; unmapped with the object.
class HugePageBuffer {
 public:
  // what names the contents in the error.
  static Result<HugePageBuffer> Allocate(size_t bytes, std::string_view what);

  HugePageBuffer() = default;
  HugePageBuffer(HugePageBuffer&& other) noexcept;
  HugePageBuffer& operator=(HugePageBuffer&& other) noexcept;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;
  ~HugePageBuffer();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Once written: read-only from then on, and a mapping of its own in smaps (ResidencyOf) that
  // the kernel does not merge with the writable memory around it.
  void MakeReadOnly();
  // Hands the mapping over (to a MappedFile): the caller munmaps it.
  uint8_t* Release();

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Bytes of the mappings overlapping any of the ranges that are resident, and of those how many in
// 2 MiB pages (FilePmdMapped + AnonHugePages + ShmemPmdMapped), summed over /proc/self/smaps;
// each mapping counts once and whole. Zeros where smaps cannot be read.
struct Residency {
  int64_t resident_bytes = 0;
  int64_t huge_page_bytes = 0;
};
struct MemoryRange {
  const void* data;
  size_t size;
};
Residency ResidencyOf(const std::vector<MemoryRange>& ranges);

// Whether the page cache of fd's filesystem reads a file into 2 MiB folios for a mapping advised
// MADV_HUGEPAGE: ext4 from Linux 6.16, XFS from 5.18 (large folios).
bool PageCacheFillsHugeFolios(int fd);

// Writes a just-written file's pages to disk and drops them from the page cache (advice: errors
// are ignored). Linux 6.18 on a KVM guest kept a freshly written GGUF in 2 MiB folios that,
// mapped, decoded 25-40% slower and erratically until re-read (docs/BENCHMARKS.md, "A freshly
// written model file"); the next load reads it from disk once instead, into 2 MiB folios
// (MappedFile).
void DropFromPageCache(int fd);

// Reads a whole file into memory (config.json, a saved KV cache); NotFound if it cannot be opened.
Result<std::string> ReadTextFile(const std::string& path);
// Writes bytes to a temporary file beside path, then renames it over path: a reader sees the old
// file or the whole new one, never a part. Internal naming what failed.
Status WriteFileAtomically(const std::string& path, std::string_view bytes);
// The file an output written so (beside it, then renamed over it) replaces: path, or the file a
// symbolic link names (the link stays). InvalidArgument when what is there is not a regular file:
// a directory, or a device or pipe, which the rename would replace instead of writing to.
Result<std::string> OutputTarget(const std::string& path);

}  // namespace cachet
