// HF safetensors reader: single file or shards listed in model.safetensors.index.json.
// Files are memory-mapped; every header field is validated before any tensor byte is touched.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "cachet/status.h"
#include "util/dtype.h"
#include "util/mmap_file.h"

namespace cachet {

class GgufFile;

struct TensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t n_bytes = 0;
  int file = 0;  // index into TensorStore::files()

  int64_t numel() const;
};

// The tensor table of one safetensors file held in memory: an 8-byte little-endian header length,
// the JSON header, then the data section. Every entry is validated (dtype, shape, data_offsets
// inside the data section and matching the shape, element alignment) before any tensor byte is
// touched; each TensorInfo::data points into `bytes` (file 0). `name` names the file in errors
// (DataLoss for a corrupt header, Unimplemented for an unsupported dtype). TensorStore::AddFile
// parses its mapping with it; tests/fuzz/safetensors_fuzz.cc fuzzes it.
Result<std::map<std::string, TensorInfo>> ParseSafetensors(std::span<const uint8_t> bytes,
                                                           const std::string& name);

class TensorStore {
 public:
  // <dir>/model.safetensors, or the shards named by <dir>/model.safetensors.index.json.
  // copy: read the files into memory instead of mapping them (MappedFile::Open).
  static Result<TensorStore> OpenDir(const std::string& model_dir, bool copy = false);
  // Adds one safetensors file; tensors already present are an error (duplicate name).
  Status AddFile(const std::string& path);
  // The tensors of a GGUF file under their GGUF names (token_embd.weight, blk.0.attn_q.weight...),
  // shapes in row-major order; the store takes over the file's mapping (model/gguf_model.cc).
  static Result<TensorStore> FromGguf(GgufFile file);
  bool gguf() const { return gguf_; }

  bool Has(const std::string& name) const { return tensors_.count(name) != 0; }
  // The tensor, checked to have exactly this shape; the error names tensor, file and shapes.
  Result<const TensorInfo*> Get(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& file_path(int i) const { return files_[i].path(); }
  size_t mapped_bytes() const;
  std::vector<MemoryRange> ranges() const;  // of the files, mapped or read into memory

 private:
  std::string origin_;  // the model directory or file, for error messages
  std::vector<MappedFile> files_;
  std::map<std::string, TensorInfo> tensors_;
  bool gguf_ = false;
  bool copy_ = false;  // AddFile reads files into memory (OpenDir's copy)
};

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace cachet
