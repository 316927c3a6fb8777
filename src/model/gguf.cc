#include "model/gguf.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "util/mmap_file.h"

namespace cachet {

const char* GgufTypeName(GgufType t) {
  static const char* const kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                       "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < 13 ? kNames[i] : "unknown";
}

const char* GgmlTypeName(uint32_t t) {
  static const char* const kNames[] = {"f32",
                                       "f16",
                                       "q4_0",
                                       "q4_1",
                                       "q4_2 (removed)",
                                       "q4_3 (removed)",
                                       "q5_0",
                                       "q5_1",
                                       "q8_0",
                                       "q8_1",
                                       "q2_K",
                                       "q3_K",
                                       "q4_K",
                                       "q5_K",
                                       "q6_K",
                                       "q8_K",
                                       "iq2_xxs",
                                       "iq2_xs",
                                       "iq3_xxs",
                                       "iq1_s",
                                       "iq4_nl",
                                       "iq3_s",
                                       "iq2_s",
                                       "iq4_xs",
                                       "i8",
                                       "i16",
                                       "i32",
                                       "i64",
                                       "f64",
                                       "iq1_m",
                                       "bf16"};
  return t < sizeof(kNames) / sizeof(kNames[0]) ? kNames[t] : "unknown";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kBool:
      return true;
    default:
      return false;
  }
}

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxDims = 4;
constexpr uint64_t kMaxElems = uint64_t{1} << 48;

bool ToDType(uint32_t ggml, DType* out) {
  for (const DTypeInfo& i : kDTypes) {
    if (i.ggml_type == ggml) {
      *out = i.type;
      return true;
    }
  }
  return false;
}

// In GGML's order of type ids.
std::string SupportedTypes() {
  std::string s;
  for (uint32_t id = 0; id < 64; ++id) {
    DType t;
    if (ToDType(id, &t)) s += std::string(s.empty() ? "" : ", ") + GgmlTypeName(id);
  }
  return s;
}

// Bounds-checked little-endian cursor over the file; every read reports what it was reading.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name)
      : p_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  Status Truncated(const std::string& what) const {
    return DataLoss(name_ + ": truncated file: " + what + " at byte " + std::to_string(pos_) +
                    " runs past the end (" + std::to_string(size_) + " bytes)");
  }

  template <class T>
  Status Read(T* out, const std::string& what) {
    if (remaining() < sizeof(T)) return Truncated(what);
    std::memcpy(out, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return OkStatus();
  }

  Status ReadString(std::string* out, const std::string& what) {
    uint64_t len = 0;
    CACHET_RETURN_IF_ERROR(Read(&len, what + " (length)"));
    if (len > remaining()) {
      return DataLoss(name_ + ": " + what + ": string length " + std::to_string(len) +
                      " exceeds the " + std::to_string(remaining()) + " bytes left in the file");
    }
    out->assign(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return OkStatus();
  }

 private:
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

size_t ScalarSize(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    default:
      return 0;
  }
}

// Reads one scalar of type t (not string/array) into v's i/u/f fields.
Status ReadScalar(Reader& r, GgufType t, GgufValue* v, double* num, const std::string& what) {
  switch (t) {
#define CACHET_GGUF_CASE(tag, ctype, field)   \
  case GgufType::tag: {                       \
    ctype x{};                                \
    CACHET_RETURN_IF_ERROR(r.Read(&x, what)); \
    if (v) v->field = x;                      \
    if (num) *num = static_cast<double>(x);   \
    return OkStatus();                        \
  }
    CACHET_GGUF_CASE(kU8, uint8_t, u)
    CACHET_GGUF_CASE(kI8, int8_t, i)
    CACHET_GGUF_CASE(kU16, uint16_t, u)
    CACHET_GGUF_CASE(kI16, int16_t, i)
    CACHET_GGUF_CASE(kU32, uint32_t, u)
    CACHET_GGUF_CASE(kI32, int32_t, i)
    CACHET_GGUF_CASE(kU64, uint64_t, u)
    CACHET_GGUF_CASE(kI64, int64_t, i)
    CACHET_GGUF_CASE(kF32, float, f)
    CACHET_GGUF_CASE(kF64, double, f)
#undef CACHET_GGUF_CASE
    case GgufType::kBool: {
      uint8_t x = 0;
      CACHET_RETURN_IF_ERROR(r.Read(&x, what));
      if (x > 1) return DataLoss(what + ": bool value " + std::to_string(x) + " is not 0 or 1");
      if (v) v->i = x;
      if (num) *num = x;
      return OkStatus();
    }
    default:
      return DataLoss(what + ": unknown value type " + std::to_string(static_cast<uint32_t>(t)));
  }
}

// A metadata value of the given type (its key and the error prefix what name it).
Status ReadValue(Reader& r, uint32_t type, const std::string& key, const std::string& what,
                 GgufValue* v) {
  v->type = static_cast<GgufType>(type);
  if (v->type == GgufType::kString) return r.ReadString(&v->str, "metadata '" + key + "'");
  if (v->type != GgufType::kArray) {
    if (ScalarSize(v->type) == 0) {
      return DataLoss(what + ": unknown value type " + std::to_string(type));
    }
    return ReadScalar(r, v->type, v, nullptr, what);
  }
  uint32_t et = 0;
  uint64_t count = 0;
  CACHET_RETURN_IF_ERROR(r.Read(&et, "element type of metadata '" + key + "'"));
  CACHET_RETURN_IF_ERROR(r.Read(&count, "element count of metadata '" + key + "'"));
  v->elem_type = static_cast<GgufType>(et);
  if (v->elem_type == GgufType::kArray) {
    return Unimplemented(what + ": arrays of arrays are not supported");
  }
  const size_t min_size = v->elem_type == GgufType::kString ? 8 : ScalarSize(v->elem_type);
  if (min_size == 0) return DataLoss(what + ": unknown array element type " + std::to_string(et));
  if (count > r.remaining() / min_size) {
    return DataLoss(what + ": array count " + std::to_string(count) + " of " +
                    GgufTypeName(v->elem_type) + " exceeds the " + std::to_string(r.remaining()) +
                    " bytes left in the file");
  }
  if (v->elem_type == GgufType::kString) {
    v->strs.resize(count);
    for (uint64_t i = 0; i < count; ++i) {
      CACHET_RETURN_IF_ERROR(
          r.ReadString(&v->strs[i], "metadata '" + key + "'[" + std::to_string(i) + "]"));
    }
  } else {
    v->nums.resize(count);
    for (uint64_t i = 0; i < count; ++i) {
      CACHET_RETURN_IF_ERROR(ReadScalar(r, v->elem_type, nullptr, &v->nums[i], what));
    }
  }
  return OkStatus();
}

// Tensor info #k of file `name`: its name, shape, type, offset (a multiple of alignment) and
// byte count.
Status ReadTensorInfo(Reader& r, uint64_t k, const std::string& name, uint64_t alignment,
                      GgufTensor* t) {
  CACHET_RETURN_IF_ERROR(r.ReadString(&t->name, "name of tensor #" + std::to_string(k)));
  const std::string what = name + ": tensor '" + t->name + "'";
  uint32_t n_dims = 0;
  CACHET_RETURN_IF_ERROR(r.Read(&n_dims, "dimension count of tensor '" + t->name + "'"));
  if (n_dims == 0 || n_dims > kMaxDims) {
    return DataLoss(what + ": " + std::to_string(n_dims) + " dimensions (expected 1 to 4)");
  }
  uint64_t numel = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    uint64_t ne = 0;
    CACHET_RETURN_IF_ERROR(r.Read(&ne, "dimensions of tensor '" + t->name + "'"));
    if (ne == 0 || ne > kMaxElems || numel > kMaxElems / ne) {
      return DataLoss(what + ": dimension " + std::to_string(ne) +
                      " is zero or makes the element count overflow");
    }
    numel *= ne;
    t->ne.push_back(static_cast<int64_t>(ne));
  }
  t->shape.assign(t->ne.rbegin(), t->ne.rend());
  CACHET_RETURN_IF_ERROR(r.Read(&t->ggml_type, "type of tensor '" + t->name + "'"));
  CACHET_RETURN_IF_ERROR(r.Read(&t->offset, "offset of tensor '" + t->name + "'"));
  if (!ToDType(t->ggml_type, &t->dtype)) {
    return Unimplemented(what + ": tensor type " + std::to_string(t->ggml_type) + " (" +
                         GgmlTypeName(t->ggml_type) +
                         ") is not supported (supported: " + SupportedTypes() + ")");
  }
  const int64_t row_bytes = DTypeRowBytes(t->dtype, t->ne[0]);
  if (row_bytes < 0) {
    return DataLoss(what + ": row length " + std::to_string(t->ne[0]) +
                    " is not a multiple of the " + DTypeName(t->dtype) + " block size " +
                    std::to_string(DTypeBlockElems(t->dtype)));
  }
  t->n_bytes = static_cast<uint64_t>(row_bytes) * (numel / static_cast<uint64_t>(t->ne[0]));
  if (t->offset % alignment != 0) {
    return DataLoss(what + ": offset " + std::to_string(t->offset) +
                    " is not a multiple of the alignment " + std::to_string(alignment));
  }
  return OkStatus();
}

}  // namespace

Result<GgufFile> GgufFile::Open(const std::string& path, bool copy) {
  CACHET_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path, copy));
  CACHET_ASSIGN_OR_RETURN(GgufFile g, Parse(file.data(), file.size(), path));
  g.file_ = std::move(file);
  return g;
}

Result<GgufFile> GgufFile::Parse(const uint8_t* data, size_t size, const std::string& name) {
  GgufFile g;
  g.name_ = name;
  Reader r(data, size, g.name_);
  uint32_t magic = 0;
  if (size < 4)
    return DataLoss(name + ": file too small for a GGUF header (" + std::to_string(size) +
                    " bytes)");
  CACHET_RETURN_IF_ERROR(r.Read(&magic, "magic"));
  if (magic != kMagic) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "0x%08x", magic);
    return DataLoss(name + ": bad magic " + buf + ": not a GGUF file");
  }
  CACHET_RETURN_IF_ERROR(r.Read(&g.version_, "version"));
  if (g.version_ != 2 && g.version_ != 3) {
    return Unimplemented(name + ": GGUF version " + std::to_string(g.version_) +
                         " is not supported (supported: 2, 3)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  CACHET_RETURN_IF_ERROR(r.Read(&n_tensors, "tensor count"));
  CACHET_RETURN_IF_ERROR(r.Read(&n_kv, "metadata count"));
  // Each tensor info takes at least 8 + 4 + 4 + 8 bytes, each pair at least 8 + 4 + 1.
  if (n_tensors > r.remaining() / 24) {
    return DataLoss(name + ": tensor count " + std::to_string(n_tensors) +
                    " cannot fit in the file's " + std::to_string(size) + " bytes");
  }
  if (n_kv > r.remaining() / 13) {
    return DataLoss(name + ": metadata count " + std::to_string(n_kv) +
                    " cannot fit in the file's " + std::to_string(size) + " bytes");
  }

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    CACHET_RETURN_IF_ERROR(r.ReadString(&key, "metadata key #" + std::to_string(k)));
    const std::string what = name + ": metadata '" + key + "'";
    uint32_t type = 0;
    CACHET_RETURN_IF_ERROR(r.Read(&type, "type of metadata '" + key + "'"));
    GgufValue v;
    CACHET_RETURN_IF_ERROR(ReadValue(r, type, key, what, &v));
    if (!g.kv_.emplace(key, std::move(v)).second) {
      return DataLoss(what + ": duplicate key");
    }
  }

  if (const GgufValue* a = g.Find("general.alignment")) {
    if (!a->is_integer() || a->type == GgufType::kBool || a->u == 0 || (a->u & (a->u - 1)) != 0 ||
        a->u > (1u << 20)) {
      return DataLoss(name + ": metadata 'general.alignment' must be an unsigned power of two");
    }
    g.alignment_ = a->u;
  }

  g.tensors_.resize(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor& t = g.tensors_[k];
    CACHET_RETURN_IF_ERROR(ReadTensorInfo(r, k, name, g.alignment_, &t));
    const std::string what = name + ": tensor '" + t.name + "'";
    if (!g.tensor_index_.emplace(t.name, k).second) return DataLoss(what + ": duplicate name");
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t data_start = (r.pos() + g.alignment_ - 1) / g.alignment_ * g.alignment_;
  if (n_tensors > 0 && data_start > size) {
    return DataLoss(name + ": truncated file: the data section would start at byte " +
                    std::to_string(data_start) + " of " + std::to_string(size));
  }
  const uint64_t data_size = data_start <= size ? size - data_start : 0;
  for (GgufTensor& t : g.tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
      return DataLoss(name + ": tensor '" + t.name + "': data [" + std::to_string(t.offset) + ", " +
                      std::to_string(t.offset + t.n_bytes) + ") lies outside the " +
                      std::to_string(data_size) + "-byte data section (truncated file?)");
    }
    t.data = data + data_start + t.offset;
    if (!DTypeIsQuantized(t.dtype) &&
        reinterpret_cast<uintptr_t>(t.data) % DTypeSize(t.dtype) != 0) {
      return DataLoss(name + ": tensor '" + t.name + "': data is not aligned to its element size");
    }
  }
  return g;
}

const GgufTensor* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

Result<int64_t> GgufFile::GetInt(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound(name_ + ": metadata '" + key + "' is missing");
  if (!v->is_integer() || v->type == GgufType::kBool) {
    return InvalidArgument(name_ + ": metadata '" + key + "' is " + GgufTypeName(v->type) +
                           ", expected an integer");
  }
  if (v->type == GgufType::kU64 && v->u > static_cast<uint64_t>(INT64_MAX)) {
    return InvalidArgument(name_ + ": metadata '" + key + "' is out of range");
  }
  const bool is_unsigned = v->type == GgufType::kU8 || v->type == GgufType::kU16 ||
                           v->type == GgufType::kU32 || v->type == GgufType::kU64;
  return is_unsigned ? static_cast<int64_t>(v->u) : v->i;
}

Result<double> GgufFile::GetFloat(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound(name_ + ": metadata '" + key + "' is missing");
  if (v->type == GgufType::kF32 || v->type == GgufType::kF64) return v->f;
  if (v->is_integer() && v->type != GgufType::kBool) {
    CACHET_ASSIGN_OR_RETURN(int64_t i, GetInt(key));
    return static_cast<double>(i);
  }
  return InvalidArgument(name_ + ": metadata '" + key + "' is " + GgufTypeName(v->type) +
                         ", expected a number");
}

Result<std::string> GgufFile::GetString(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound(name_ + ": metadata '" + key + "' is missing");
  if (v->type != GgufType::kString) {
    return InvalidArgument(name_ + ": metadata '" + key + "' is " + GgufTypeName(v->type) +
                           ", expected a string");
  }
  return v->str;
}

Result<bool> GgufFile::GetBool(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound(name_ + ": metadata '" + key + "' is missing");
  if (v->type != GgufType::kBool) {
    return InvalidArgument(name_ + ": metadata '" + key + "' is " + GgufTypeName(v->type) +
                           ", expected a bool");
  }
  return v->i != 0;
}

Result<const GgufValue*> GgufFile::GetArray(const std::string& key, GgufType elem) const {
  const GgufValue* v = Find(key);
  if (!v) return NotFound(name_ + ": metadata '" + key + "' is missing");
  const bool want_string = elem == GgufType::kString;
  if (v->type != GgufType::kArray || (v->elem_type == GgufType::kString) != want_string) {
    return InvalidArgument(name_ + ": metadata '" + key + "' is not an array of " +
                           (want_string ? "strings" : "numbers"));
  }
  return v;
}

// ------------------------------------------------------------------------------------------------
// Writer

namespace {

template <class T>
void Put(std::string* s, T v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void PutString(std::string* s, const std::string& v) {
  Put<uint64_t>(s, v.size());
  s->append(v);
}

}  // namespace

void GgufWriter::SetString(const std::string& key, const std::string& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kString));
  PutString(&kv_, v);
  ++n_kv_;
}
void GgufWriter::SetU32(const std::string& key, uint32_t v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kU32));
  Put(&kv_, v);
  ++n_kv_;
}
void GgufWriter::SetI32(const std::string& key, int32_t v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kI32));
  Put(&kv_, v);
  ++n_kv_;
}
void GgufWriter::SetF32(const std::string& key, float v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kF32));
  Put(&kv_, v);
  ++n_kv_;
}
void GgufWriter::SetBool(const std::string& key, bool v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kBool));
  Put<uint8_t>(&kv_, v ? 1 : 0);
  ++n_kv_;
}
void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kString));
  Put<uint64_t>(&kv_, v.size());
  for (const auto& s : v) PutString(&kv_, s);
  ++n_kv_;
}
void GgufWriter::SetF32Array(const std::string& key, const std::vector<float>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kF32));
  Put<uint64_t>(&kv_, v.size());
  for (float f : v) Put(&kv_, f);
  ++n_kv_;
}
void GgufWriter::SetI32Array(const std::string& key, const std::vector<int32_t>& v) {
  PutString(&kv_, key);
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(&kv_, static_cast<uint32_t>(GgufType::kI32));
  Put<uint64_t>(&kv_, v.size());
  for (int32_t i : v) Put(&kv_, i);
  ++n_kv_;
}

void GgufWriter::AddTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                           std::function<void(uint8_t* out)> fill) {
  uint64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= static_cast<uint64_t>(shape[i]);
  const uint64_t n_bytes = rows * static_cast<uint64_t>(DTypeRowBytes(dtype, shape.back()));
  tensors_.push_back({name, dtype, std::move(shape), n_bytes, std::move(fill)});
}

Status GgufWriter::Write(const std::string& path) const {
  constexpr uint64_t kAlign = 32;
  std::string head;
  Put<uint32_t>(&head, kMagic);
  Put<uint32_t>(&head, 3);
  Put<uint64_t>(&head, tensors_.size());
  Put<uint64_t>(&head, n_kv_);
  head += kv_;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(&head, t.name);
    Put<uint32_t>(&head, static_cast<uint32_t>(t.shape.size()));
    for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) Put<uint64_t>(&head, *it);
    Put<uint32_t>(&head, Info(t.dtype).ggml_type);
    Put<uint64_t>(&head, offset);
    offset += (t.n_bytes + kAlign - 1) / kAlign * kAlign;
  }
  head.resize((head.size() + kAlign - 1) / kAlign * kAlign, '\0');
  // Written beside the target, then renamed over it: an interrupted or failed write leaves any
  // file already there as it was (and a model being read, mapped, is never written into).
  CACHET_ASSIGN_OR_RETURN(const std::string target, OutputTarget(path));
  const std::string temp = target + ".tmp" + std::to_string(::getpid());
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(temp.c_str(), "wb"), &std::fclose);
  if (!f) return NotFound(path + ": cannot create");
  bool ok = std::fwrite(head.data(), 1, head.size(), f.get()) == head.size();
  std::vector<uint8_t> buf;
  for (const Tensor& t : tensors_) {
    const uint64_t padded = (t.n_bytes + kAlign - 1) / kAlign * kAlign;
    buf.assign(padded, 0);
    t.fill(buf.data());
    ok = ok && std::fwrite(buf.data(), 1, buf.size(), f.get()) == buf.size();
  }
  ok = std::fflush(f.get()) == 0 && ok;
  if (ok) DropFromPageCache(::fileno(f.get()));
  ok = std::fclose(f.release()) == 0 && ok;
  if (!ok || std::rename(temp.c_str(), target.c_str()) != 0) {
    std::remove(temp.c_str());
    return DataLoss(path + ": write failed");
  }
  return OkStatus();
}

}  // namespace cachet
