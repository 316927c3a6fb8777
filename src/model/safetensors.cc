#include "model/safetensors.h"

#include <sys/stat.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace cachet {

using nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

Result<DType> ParseDType(const std::string& s, const std::string& where) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  return Unimplemented(where + ": unsupported dtype " + s + " (supported: F32, F16, BF16)");
}

bool FileExists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

}  // namespace

Result<std::map<std::string, TensorInfo>> ParseSafetensors(std::span<const uint8_t> bytes,
                                                           const std::string& path) {
  const uint8_t* base = bytes.data();
  const size_t size = bytes.size();
  if (size < 8) return DataLoss(path + ": file too small for a safetensors header");
  uint64_t header_len;
  std::memcpy(&header_len, base, 8);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return DataLoss(path + ": header length " + std::to_string(header_len) +
                    " exceeds the file size " + std::to_string(size));
  }
  const char* hdr = reinterpret_cast<const char*>(base + 8);
  json j = json::parse(hdr, hdr + header_len, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return DataLoss(path + ": header is not a JSON object");

  const uint8_t* data_start = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::map<std::string, TensorInfo> tensors;
  for (auto& [name, t] : j.items()) {
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor '" + name + "'";
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() || !t.contains("shape") ||
        !t["shape"].is_array() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      return DataLoss(where + ": malformed entry (needs dtype, shape, data_offsets)");
    }
    TensorInfo info;
    CACHET_ASSIGN_OR_RETURN(info.dtype, ParseDType(t["dtype"].get<std::string>(), where));
    uint64_t numel = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned()) return DataLoss(where + ": shape holds a non-integer");
      uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > (uint64_t{1} << 48) / v) return DataLoss(where + ": shape overflows");
      numel *= v;
      info.shape.push_back(static_cast<int64_t>(v));
    }
    const json& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return DataLoss(where + ": data_offsets must be non-negative integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return DataLoss(where + ": data_offsets [" + std::to_string(begin) + ", " +
                      std::to_string(end) + ") lie outside the " + std::to_string(data_size) +
                      "-byte data section (truncated file?)");
    }
    if (end - begin != numel * DTypeSize(info.dtype)) {
      return DataLoss(where + ": " + std::to_string(end - begin) + " bytes do not hold shape " +
                      ShapeString(info.shape) + " of " + DTypeName(info.dtype));
    }
    info.data = data_start + begin;
    if (reinterpret_cast<uintptr_t>(info.data) % DTypeSize(info.dtype) != 0) {
      return DataLoss(where + ": data is not aligned to its element size");
    }
    info.n_bytes = end - begin;
    tensors.emplace(name, std::move(info));
  }
  return tensors;
}

Status TensorStore::AddFile(const std::string& path) {
  if (origin_.empty()) origin_ = path;
  CACHET_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path, copy_));
  using Table = std::map<std::string, TensorInfo>;
  CACHET_ASSIGN_OR_RETURN(Table added, ParseSafetensors(std::span(file.data(), file.size()), path));
  const int file_index = static_cast<int>(files_.size());
  for (auto& [name, info] : added) {
    if (tensors_.count(name)) {
      return InvalidArgument(path + ": tensor '" + name +
                             "': tensor appears in more than one file");
    }
    info.file = file_index;
  }
  files_.push_back(std::move(file));
  tensors_.merge(added);
  return OkStatus();
}

Result<TensorStore> TensorStore::OpenDir(const std::string& dir, bool copy) {
  TensorStore store;
  store.origin_ = dir;
  store.copy_ = copy;
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  if (FileExists(index)) {
    CACHET_ASSIGN_OR_RETURN(std::string text, ReadTextFile(index));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return InvalidArgument(index + ": expected an object with a 'weight_map' object");
    }
    std::set<std::string> shards;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        return InvalidArgument(index + ": weight_map['" + name + "'] is not a string");
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos) {
        return InvalidArgument(index + ": weight_map['" + name +
                               "'] names a path outside the model directory");
      }
      shards.insert(f);
    }
    for (const std::string& f : shards) CACHET_RETURN_IF_ERROR(store.AddFile(dir + "/" + f));
    for (auto& [name, file] : j["weight_map"].items()) {
      auto it = store.tensors_.find(name);
      if (it == store.tensors_.end()) {
        return DataLoss(index + ": tensor '" + name + "' is not in its shard " +
                        file.get<std::string>());
      }
    }
  } else if (FileExists(single)) {
    CACHET_RETURN_IF_ERROR(store.AddFile(single));
  } else {
    return NotFound(dir + ": neither model.safetensors nor model.safetensors.index.json found");
  }
  return store;
}

Result<const TensorInfo*> TensorStore::Get(const std::string& name,
                                           const std::vector<int64_t>& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return NotFound(origin_ + ": tensor '" + name + "' is missing");
  const TensorInfo& t = it->second;
  if (t.shape != shape) {
    return InvalidArgument(file_path(t.file) + ": tensor '" + name + "' has shape " +
                           ShapeString(t.shape) + ", expected " + ShapeString(shape));
  }
  return &t;
}

size_t TensorStore::mapped_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += f.size();
  return n;
}

std::vector<MemoryRange> TensorStore::ranges() const {
  std::vector<MemoryRange> r;
  for (const auto& f : files_) r.push_back({f.data(), f.size()});
  return r;
}

}  // namespace cachet
