// The HTTP connection under a handler, where httplib 0.11 leaves it out: the socket (to see a
// client leave while its request runs) and a POST's body read with a limit.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <optional>
#include <string>

#include "response.h"

namespace cachet::server {

// A body over the limit is read and dropped up to this many times the limit, so that a client
// still sending gets the 413 rather than a failed connection; past it the connection is closed.
constexpr size_t kDrainFactor = 4;

// The socket of the connection that handler's request came on (the server listening on
// local_port), or -1 when there is none.
int ConnectionSocket(const httplib::Request& req, int local_port);

// Whether the peer closed its side of the connection (or reset it). Data it sent (a pipelined
// request) is not a close.
bool PeerClosed(int fd);

// The 413 of a body over max_bytes.
ApiError TooLarge(size_t max_bytes);

// Reads a POST's body into *body (nothing for a request with neither a Content-Length nor
// chunks); the client's error when it is over max_bytes, has a bad length or ends early.
std::optional<ApiError> ReadBody(const httplib::Request& req, const httplib::ContentReader& read,
                                 size_t max_bytes, std::string* body);

}  // namespace cachet::server
