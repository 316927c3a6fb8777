// Status and Result<T>: errors cross module boundaries as values that say what and where.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace cachet {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kDataLoss,  // corrupt or truncated file
  kOutOfRange,
  kResourceExhausted,  // KV pool full: callers may queue and retry
  kUnimplemented,
  kFailedPrecondition,  // the operation needs a state the object is not in
  kInternal,
  kUnavailable,  // a service it needs (Redis) did not answer: retry later
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace cachet

#define CACHET_CONCAT_INNER(a, b) a##b
#define CACHET_CONCAT(a, b) CACHET_CONCAT_INNER(a, b)

#define CACHET_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::cachet::Status cachet_status_ = (expr);        \
    if (!cachet_status_.ok()) return cachet_status_; \
  } while (0)

#define CACHET_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

#define CACHET_ASSIGN_OR_RETURN(lhs, expr) \
  CACHET_ASSIGN_OR_RETURN_IMPL(CACHET_CONCAT(cachet_result_, __LINE__), lhs, expr)
