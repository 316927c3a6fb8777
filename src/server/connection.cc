// The connection under a handler (connection.h).
#include "connection.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <exception>
#include <filesystem>
#include <system_error>

namespace cachet::server {

// The socket of the connection a handler serves: httplib 0.11 does not hand it to handlers, so
// it is the open socket whose peer is the request's remote address and port on the server's
// port (a TCP connection's addresses are unique while it is open, and httplib closes it only
// after the handler returns). -1 when there is none.
int ConnectionSocket(const httplib::Request& req, int local_port) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
      continue;
    }
    char ip[INET6_ADDRSTRLEN] = "";
    int local_p = -1, peer_p = -1;
    if (peer.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&peer);
      inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
      peer_p = ntohs(a->sin_port);
      local_p = ntohs(reinterpret_cast<const sockaddr_in*>(&local)->sin_port);
    } else if (peer.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&peer);
      inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof(ip));
      peer_p = ntohs(a->sin6_port);
      local_p = ntohs(reinterpret_cast<const sockaddr_in6*>(&local)->sin6_port);
    }
    if (local_p == local_port && peer_p == req.remote_port && req.remote_addr == ip) return fd;
  }
  return -1;
}

bool PeerClosed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

ApiError TooLarge(size_t max_bytes) {
  ApiError e;
  e.http_status = 413;
  e.message = "the request body is larger than " + std::to_string(max_bytes) + " bytes";
  return e;
}

// A POST's body, read here rather than by httplib 0.11, whose reader caps only bodies sent with a
// Content-Length (a chunked one grew without limit) and, for a request with neither a length nor
// chunks, waits for the connection to close (RFC 7230 3.3.3: such a body is empty). The error is
// the client's answer; the connection is then closed, its unread bytes with it.
std::optional<ApiError> ReadBody(const httplib::Request& req, const httplib::ContentReader& read,
                                 size_t max_bytes, std::string* body) {
  ApiError e;
  const bool chunked = req.has_header("Transfer-Encoding");
  if (!chunked && !req.has_header("Content-Length")) return std::nullopt;
  if (!chunked) {
    const std::string length = req.get_header_value("Content-Length");
    if (length.empty() || length.size() > 19 ||
        length.find_first_not_of("0123456789") != std::string::npos) {
      e.message = "Content-Length '" + length + "' is not a byte count";
      return e;
    }
    if (std::stoull(length) > kDrainFactor * max_bytes) return TooLarge(max_bytes);
  }
  // A body over the limit is read to its end (up to kDrainFactor times the limit) and dropped:
  // a client still sending when the answer comes would see its connection fail, not the 413.
  size_t total = 0;
  const bool ok = read([&](const char* data, size_t n) {
    total += n;
    if (total <= max_bytes) body->append(data, n);
    return total <= kDrainFactor * max_bytes;
  });
  if (total > max_bytes) {
    body->clear();
    return TooLarge(max_bytes);
  }
  if (!ok) {
    e.message = "the request body could not be read (the connection ended before it did)";
    return e;
  }
  return std::nullopt;
}

}  // namespace cachet::server
