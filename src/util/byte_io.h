// Little binary files' fields in and out (saved caches, calibrations): a writer that appends
// plain values, and a reader that checks every bound and names the first field that fails.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cachet/status.h"

namespace cachet {

class ByteWriter {
 public:
  template <class T>
  void Put(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutString(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  template <class T>
  void PutVector(const std::vector<T>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    Bytes(v.data(), v.size() * sizeof(T));
  }
  void Bytes(const void* p, size_t n) {
    if (n > 0) out_.append(static_cast<const char*>(p), n);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

// Errors read "<kind>: <field>: <why>" (DataLoss): a corrupt or forged file must not make the
// reader allocate more than max_string bytes per string or `max` entries per vector.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> b, std::string kind, size_t at = 0,
             uint32_t max_string = 4096)
      : b_(b), kind_(std::move(kind)), at_(at), max_string_(max_string) {}
  template <class T>
  T Get(const char* what) {
    T v{};
    if (Need(sizeof(T), what)) std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += ok() ? sizeof(T) : 0;
    return v;
  }
  std::string GetString(const char* what) {
    const uint32_t n = Get<uint32_t>(what);
    if (ok() && n > max_string_) {
      Fail(what, "longer than " + std::to_string(max_string_) + " bytes");
    }
    if (!Need(n, what)) return {};
    std::string s(reinterpret_cast<const char*>(b_.data() + at_), n);
    at_ += n;
    return s;
  }
  template <class T>
  std::vector<T> GetVector(uint32_t max, const char* what) {
    const uint32_t n = Get<uint32_t>(what);
    if (ok() && n > max) {
      Fail(what, std::to_string(n) + " entries, more than " + std::to_string(max));
    }
    if (!Need(size_t{n} * sizeof(T), what)) return {};
    std::vector<T> v(n);
    if (n > 0) std::memcpy(v.data(), b_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return v;
  }
  const uint8_t* Take(size_t n, const char* what) {
    if (!Need(n, what)) return nullptr;
    const uint8_t* p = b_.data() + at_;
    at_ += n;
    return p;
  }
  bool Need(size_t n, const char* what) {
    if (!ok()) return false;
    if (b_.size() - at_ < n) Fail(what, "the file ends first (truncated)");
    return ok();
  }
  void Fail(const char* what, const std::string& why) {
    if (ok()) status_ = DataLoss(kind_ + ": " + what + ": " + why);
  }
  bool ok() const { return status_.ok(); }
  size_t at() const { return at_; }
  const Status& status() const { return status_; }

 private:
  std::span<const uint8_t> b_;
  std::string kind_;
  size_t at_ = 0;
  uint32_t max_string_;
  Status status_;
};

}  // namespace cachet
