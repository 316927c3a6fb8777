// libFuzzer target for the safetensors reader: the input is a whole file (8-byte header length,
// JSON header, data section) that goes through ParseSafetensors, the parser and tensor table
// validation TensorStore::AddFile runs on its mapping. When it parses, every tensor must lie
// inside the input with a size that matches its shape and dtype (a violation aborts), and its
// first and last bytes are read so that ASan sees any out-of-bounds pointer.
// Build and run: scripts/fuzz.sh [seconds] safetensors.
//
// With CACHET_FUZZ_SEED_DIR set, LLVMFuzzerInitialize first writes seed files there: handmade
// ones, and when run from the repository root (as scripts/fuzz.sh does), the header of a real
// kvtiny shard, whole with a short data section and shrunk to a valid file of tiny tensors.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace {

using nlohmann::json;

constexpr char kModelDir[] = "models/kvtiny";  // relative to the repository root

// A file of header's tensors laid out back to back (data_offsets rewritten), their bytes zero;
// header_pad spaces after the JSON.
std::string Encode(json header, uint64_t header_pad = 0) {
  std::string data;
  for (auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    uint64_t numel = 1;
    for (const json& d : t["shape"]) numel *= d.get<uint64_t>();
    const std::string dtype = t["dtype"].get<std::string>();
    const uint64_t bytes = numel * (dtype == "F32" ? 4 : 2);
    t["data_offsets"] = {data.size(), data.size() + bytes};
    data.append(bytes, '\0');
  }
  std::string h = header.dump();
  h.append(header_pad, ' ');
  while (h.size() % 8) h += ' ';
  const uint64_t n = h.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + h + data;
}

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void WriteSeeds(const std::string& dir) {
  json a = json::object();
  a["__metadata__"] = {{"format", "pt"}};
  a["model.embed_tokens.weight"] = {{"dtype", "BF16"}, {"shape", {4, 3}}};
  a["model.norm.weight"] = {{"dtype", "F32"}, {"shape", {3}}};
  a["scalar"] = {{"dtype", "F16"}, {"shape", json::array()}};
  a["empty"] = {{"dtype", "F32"}, {"shape", {0, 5}}};
  Write(dir + "/seed-handmade", Encode(a));
  json b = json::object();
  b["lm_head.weight"] = {{"dtype", "F16"}, {"shape", {2, 2, 2}}};
  Write(dir + "/seed-small", Encode(b, 5));

  // The first real shard found: its header as written (the data cut short: the table still
  // parses up to the first tensor past the end), and its tensors shrunk to at most 2 per dim.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(kModelDir, ec)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream f(entry.path(), std::ios::binary);
    uint64_t n = 0;
    if (!f.read(reinterpret_cast<char*>(&n), 8) || n > (1u << 20)) continue;
    std::string head(8 + n + 1024, '\0');
    std::memcpy(head.data(), &n, 8);
    f.read(head.data() + 8, static_cast<std::streamsize>(n + 1024));
    head.resize(8 + static_cast<size_t>(f.gcount()));
    Write(dir + "/seed-real-header", head);
    json real = json::parse(head.substr(8, n), nullptr, /*allow_exceptions=*/false);
    if (real.is_object()) {
      for (auto& [name, t] : real.items()) {
        if (name == "__metadata__" || !t.is_object() || !t.contains("shape")) continue;
        for (json& d : t["shape"]) d = std::min<uint64_t>(d.get<uint64_t>(), 2);
      }
      Write(dir + "/seed-real-shrunk", Encode(real));
    }
    break;
  }
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("CACHET_FUZZ_SEED_DIR")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors = cachet::ParseSafetensors(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  if (!tensors.ok()) {
    if (tensors.status().message().find("fuzz.safetensors") == std::string::npos) {
      Fail("an error that does not name the file: " + tensors.status().ToString());
    }
    return 0;
  }
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : *tensors) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (p < data || p > data + size || t.n_bytes > static_cast<size_t>(data + size - p)) {
      Fail("tensor '" + name + "' lies outside the input");
    }
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) Fail("tensor '" + name + "' has a negative dimension");
      numel *= d;
    }
    if (numel != t.numel() ||
        static_cast<uint64_t>(numel) * cachet::DTypeSize(t.dtype) != t.n_bytes) {
      Fail("tensor '" + name + "': its byte size does not match its shape");
    }
    if (t.n_bytes > 0) sink = sink ^ p[0] ^ p[t.n_bytes - 1];
  }
  return 0;
}
