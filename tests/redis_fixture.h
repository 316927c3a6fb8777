// Real redis-server processes for the Redis tier's tests: started on 127.0.0.1 with free ports,
// without persistence, in a temporary directory; a standalone server or a cluster of masters
// (slots split evenly). Every server is killed by the destructor, so a failing test leaves none.
// A missing redis-server is an error the test reports, never a skip. CACHET_REDIS_SERVER overrides
// which binary is started (default: redis-server from PATH).
#pragma once

#include <hiredis/hiredis.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "test_util.h"

namespace cachet::testing {

struct FreeRedisReply {
  void operator()(redisReply* r) const {
    if (r != nullptr) freeReplyObject(r);
  }
};
using RedisReply = std::unique_ptr<redisReply, FreeRedisReply>;

class RedisServers {
 public:
  RedisServers() = default;
  ~RedisServers();  // kills every server
  RedisServers(const RedisServers&) = delete;
  RedisServers& operator=(const RedisServers&) = delete;

  // Starts n servers, standalone or as one cluster (then waits for cluster_state:ok on every
  // node), each answering PING before it returns. "" on success, else why not.
  std::string Start(int n, bool cluster);
  // Before Start: the servers require this password (requirepass; the fixture's own commands
  // send AUTH).
  void RequirePassword(std::string password) { password_ = std::move(password); }

  int size() const { return static_cast<int>(servers_.size()); }
  int port(int i) const { return servers_[i].port; }
  std::string Url(int i = 0) const;  // redis://127.0.0.1:port
  std::string ClusterUrl() const;    // every node's URL, comma-separated

  void Kill(int i);            // SIGKILL: a crash
  void Pause(int i);           // SIGSTOP: a server that accepts nothing and answers nothing
  void Resume(int i);          // SIGCONT
  std::string Restart(int i);  // a killed server again, on its port (empty: no persistence)

  // One command on server i over a fresh connection (1 s timeouts); null if it failed.
  RedisReply Command(int i, const std::vector<std::string>& args) const;
  std::string Log(int i) const;  // the server's log, for failure messages

 private:
  struct Server {
    int port = 0;
    pid_t pid = -1;
    std::string dir;
    std::vector<std::string> args;
  };
  std::string Spawn(Server& s);
  std::string WaitReady(const Server& s);
  std::string FormCluster();

  // AUTH on c when the servers require a password: "" or why it failed.
  std::string Auth(redisContext* c) const;

  TempDir dir_;
  std::string binary_;
  std::string password_;
  std::vector<Server> servers_;
};

}  // namespace cachet::testing
