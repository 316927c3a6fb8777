// GGUF (v2/v3) reader and writer. The reader validates every count, length and offset against the
// bytes it has before touching them: a corrupt or truncated file gives a DataLoss error that names
// the file and the key or tensor, never an out-of-bounds read or an allocation driven by a count.
// Tensor data is not copied: GgufTensor::data points into the mapping (or the parsed buffer).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cachet/status.h"
#include "util/dtype.h"
#include "util/mmap_file.h"

namespace cachet {

// GGUF metadata value types (gguf_type).
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* GgufTypeName(GgufType t);

const char* GgmlTypeName(uint32_t t);  // "q5_K", ... or "unknown"

struct GgufValue {
  GgufType type = GgufType::kU8;
  GgufType elem_type = GgufType::kU8;  // arrays only
  // Scalars: integers in i (signed types, bool) or u (unsigned types), floats in f.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string str;
  // Arrays: strings in strs, numbers (any numeric or bool type) in nums.
  std::vector<std::string> strs;
  std::vector<double> nums;

  bool is_integer() const;
  bool is_number() const {
    return is_integer() || type == GgufType::kF32 || type == GgufType::kF64;
  }
  size_t array_size() const { return elem_type == GgufType::kString ? strs.size() : nums.size(); }
};

struct GgufTensor {
  std::string name;
  uint32_t ggml_type = 0;
  DType dtype = DType::kF32;
  std::vector<int64_t> ne;     // GGML order: ne[0] is the contiguous (column) dimension
  std::vector<int64_t> shape;  // row-major (PyTorch) order: ne reversed
  uint64_t offset = 0;         // from the start of the data section
  const uint8_t* data = nullptr;
  uint64_t n_bytes = 0;
};

class GgufFile {
 public:
  // Maps and parses the file.
  static Result<GgufFile> Open(const std::string& path, bool copy = false);  // MappedFile::Open
  // Parses size bytes at data (not copied: they must outlive the result); name is used in errors.
  static Result<GgufFile> Parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return name_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* FindTensor(const std::string& name) const;
  const GgufValue* Find(const std::string& key) const;

  // Typed metadata accessors; errors name the file and the key.
  Result<int64_t> GetInt(const std::string& key) const;
  Result<double> GetFloat(const std::string& key) const;  // any numeric type
  Result<std::string> GetString(const std::string& key) const;
  Result<bool> GetBool(const std::string& key) const;
  Result<const GgufValue*> GetArray(const std::string& key, GgufType elem) const;
  // The mapping, for a caller that keeps the tensors alive after this object (TensorStore).
  MappedFile TakeFile() { return std::move(file_); }

 private:
  std::string name_;
  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Writes a GGUF v3 file: metadata then tensor infos then the aligned data. Tensor bytes are made
// by a callback when the file is written, one tensor at a time.
class GgufWriter {
 public:
  void SetString(const std::string& key, const std::string& v);
  void SetU32(const std::string& key, uint32_t v);
  void SetI32(const std::string& key, int32_t v);
  void SetF32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetF32Array(const std::string& key, const std::vector<float>& v);
  void SetI32Array(const std::string& key, const std::vector<int32_t>& v);
  // shape is row-major ([rows, cols] or [n]); fill writes exactly n_bytes.
  void AddTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                 std::function<void(uint8_t* out)> fill);
  Status Write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t n_bytes;
    std::function<void(uint8_t*)> fill;
  };
  std::string kv_;  // serialized key-value pairs
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace cachet
