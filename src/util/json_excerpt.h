// A JSON value shown in an error message: short, and safe on any parsed input. json::dump()
// recurses once per nesting level, so dumping a value nested a few hundred thousand levels deep
// (a few MB of "[[[[...") overflows the stack; it also copies a value of any size into the message.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

namespace cachet {
namespace json_excerpt_internal {

inline constexpr int kMaxDepth = 3;

inline void Append(const nlohmann::json& j, int depth, size_t limit, std::string* out) {
  if (!j.is_array() && !j.is_object()) {
    *out += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return;
  }
  const bool array = j.is_array();
  if (depth >= kMaxDepth && !j.empty()) {
    *out += array ? "[...]" : "{...}";
    return;
  }
  *out += array ? '[' : '{';
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!first) *out += ',';
    first = false;
    if (out->size() >= limit) {
      *out += "...";
      break;
    }
    if (!array) {
      *out +=
          nlohmann::json(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      *out += ':';
    }
    Append(*it, depth + 1, limit, out);
  }
  *out += array ? ']' : '}';
}

}  // namespace json_excerpt_internal

// j as compact JSON (what j.dump() gives) when that is at most about max_chars long; longer or
// deeper values are cut ("[...]", "...").
inline std::string JsonExcerpt(const nlohmann::json& j, size_t max_chars = 120) {
  std::string s;
  json_excerpt_internal::Append(j, 0, max_chars, &s);
  if (s.size() > max_chars + 3) {
    s.resize(max_chars);
    s += "...";
  }
  return s;
}

}  // namespace cachet
