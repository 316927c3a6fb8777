// --redis URLs and the "host:port" of a cluster's redirects.
#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>

#include "kv/tiers/redis_tier.h"

namespace cachet::tiers {
namespace {

bool ParseInt(std::string_view s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty()) return false;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX escapes decoded (a password may hold '@', ':' or '/' written so); false on a bad escape.
bool PercentDecode(std::string_view s, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out->push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) return false;
    const int hi = HexDigit(s[i + 1]), lo = HexDigit(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return true;
}

// The item as an error message shows it: its password masked.
std::string Masked(std::string_view item) {
  const size_t at = item.rfind('@');
  const size_t colon = item.find(':', std::string_view("redis://").size());
  if (at == std::string_view::npos || colon == std::string_view::npos || colon > at) {
    return std::string(item);
  }
  return std::string(item.substr(0, colon + 1)) + "***" + std::string(item.substr(at));
}

}  // namespace

bool ParseHostPort(std::string_view s, const RedisNode& from, RedisNode* out) {
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos) return false;
  int64_t port = 0;
  if (!ParseInt(s.substr(colon + 1), 1, 65535, &port)) return false;
  std::string_view host = s.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  out->host = host.empty() ? from.host : std::string(host);
  out->port = static_cast<int>(port);
  return true;
}

std::string RedisNode::Address() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<RedisUrl> ParseRedisUrl(std::string_view text) {
  const std::string expected =
      "expected redis://[[user]:password@]host[:port][/db], comma-separated for a cluster";
  if (text.empty()) return InvalidArgument("--redis: empty URL; " + expected);
  RedisUrl url;
  bool have_db = false;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(start, comma - start);
    start = comma + 1;
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    const std::string where = "--redis \"" + Masked(item) + "\": ";
    if (item.empty()) return InvalidArgument("--redis: an empty node in the list");
    constexpr std::string_view kScheme = "redis://";
    if (!item.starts_with(kScheme)) {
      const size_t sep = item.find("://");
      return InvalidArgument(where + (sep == std::string_view::npos
                                          ? "no scheme; " + expected
                                          : "scheme \"" + std::string(item.substr(0, sep)) +
                                                "\" is not supported (TLS and "
                                                "unix sockets are not); " +
                                                expected));
    }
    std::string_view rest = item.substr(kScheme.size());
    std::string user, password;
    const size_t slash_at = rest.find('/');
    if (const size_t at = rest.substr(0, slash_at).rfind('@'); at != std::string_view::npos) {
      const std::string_view info = rest.substr(0, at);
      rest.remove_prefix(at + 1);
      const size_t colon = info.find(':');
      if (colon == std::string_view::npos) {
        return InvalidArgument(where + "credentials must be user:password@ or :password@");
      }
      if (!PercentDecode(info.substr(0, colon), &user) ||
          !PercentDecode(info.substr(colon + 1), &password)) {
        return InvalidArgument(where + "a bad %-escape in the credentials");
      }
      if (password.empty()) return InvalidArgument(where + "an empty password");
    }
    if (!password.empty()) {
      if (!url.password.empty() && (user != url.user || password != url.password)) {
        return InvalidArgument(
            "--redis: the nodes name different credentials (give them once, "
            "or the same on every node)");
      }
      url.user = std::move(user);
      url.password = std::move(password);
    }
    if (rest.find('?') != std::string_view::npos || rest.find('#') != std::string_view::npos) {
      return InvalidArgument(where + "URL options (?...) are not supported");
    }
    std::string_view hostport = rest, db_text;
    bool has_db = false;
    if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
      hostport = rest.substr(0, slash);
      db_text = rest.substr(slash + 1);
      has_db = true;
    }
    RedisNode node;
    std::string_view port_text;
    bool has_port = false;
    if (hostport.starts_with('[')) {
      const size_t close = hostport.find(']');
      if (close == std::string_view::npos) {
        return InvalidArgument(where + "IPv6 host without its closing ']'");
      }
      node.host = std::string(hostport.substr(1, close - 1));
      std::string_view after = hostport.substr(close + 1);
      if (!after.empty()) {
        if (after.front() != ':') {
          return InvalidArgument(where + "unexpected \"" + std::string(after) +
                                 "\" after the host");
        }
        port_text = after.substr(1);
        has_port = true;
      }
    } else {
      const size_t colon = hostport.find(':');
      if (colon != std::string_view::npos && hostport.find(':', colon + 1) != std::string::npos) {
        return InvalidArgument(where + "an IPv6 host must be in brackets: redis://[::1]:6379");
      }
      node.host = std::string(hostport.substr(0, colon));
      if (colon != std::string_view::npos) {
        port_text = hostport.substr(colon + 1);
        has_port = true;
      }
    }
    if (node.host.empty()) return InvalidArgument(where + "no host");
    if (has_port) {
      int64_t port = 0;
      if (!ParseInt(port_text, 1, 65535, &port)) {
        return InvalidArgument(where + "port \"" + std::string(port_text) +
                               "\" is not a number from 1 to 65535");
      }
      node.port = static_cast<int>(port);
    }
    int64_t db = 0;
    if (has_db && !db_text.empty() && !ParseInt(db_text, 0, INT_MAX, &db)) {
      return InvalidArgument(where + "database \"" + std::string(db_text) +
                             "\" is not a non-negative number");
    }
    if (have_db && db != url.db) {
      return InvalidArgument("--redis: the nodes name different databases (" +
                             std::to_string(url.db) + " and " + std::to_string(db) + ")");
    }
    url.db = static_cast<int>(db);
    have_db = true;
    if (std::find(url.nodes.begin(), url.nodes.end(), node) == url.nodes.end()) {
      url.nodes.push_back(std::move(node));
    }
    if (comma == text.size()) break;
  }
  return url;
}

Result<RedisTierOptions> RedisOptionsFromUrl(std::string_view text) {
  CACHET_ASSIGN_OR_RETURN(RedisUrl url, ParseRedisUrl(text));
  RedisTierOptions o;
  o.nodes = std::move(url.nodes);
  o.db = url.db;
  o.user = std::move(url.user);
  o.password = std::move(url.password);
  if (o.password.empty()) {
    if (const char* env = std::getenv("CACHET_REDIS_PASSWORD"); env != nullptr) o.password = env;
  }
  return o;
}

}  // namespace cachet::tiers
