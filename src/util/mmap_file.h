// Read-only memory-mapped file: weights are mapped, never copied whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cachet/status.h"

namespace cachet {

class MappedFile {
 public:
  // The file mapped read-only, or with copy its bytes read into anonymous memory advised for
  // transparent huge pages (`--no-mmap`): decode streams the weights with a TLB miss per 2 MiB
  // instead of per 4 KiB (ext4 gives file mappings none), for a longer load and no page-cache
  // sharing between processes. Read-only either way.
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

// Drops the whole pages inside [p, p + n) of a file mapping from this process's resident set
// (they stay in the page cache; reading them again faults them back in). For tensors copied out
// of the mapping, so that RSS does not count them twice.
void ReleaseMappedRange(const void* p, size_t n);

// Writes a just-written file's pages to disk and drops them from the page cache (advice: errors
// are ignored). Linux 6.18 on a KVM guest kept a freshly written GGUF in 2 MiB folios that,
// mapped, decoded 25-40% slower and erratically until re-read (docs/BENCHMARKS.md, "A freshly
// written model file"); the next load reads it from disk once instead.
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
