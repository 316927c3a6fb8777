#include "redis_fixture.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

extern char** environ;

namespace cachet::testing {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::string FindInPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(std::string(path ? path : "") + ":/usr/bin:/usr/sbin:/usr/local/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// A socket bound to 127.0.0.1:port (0: any free port), kept open while ports are being chosen so
// that two servers never get the same one.
int BindLoopback(int port, int* bound) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *bound = ntohs(a.sin_port);
  return fd;
}

std::string Text(const redisReply* r) {
  if (r == nullptr) return "(no reply)";
  if (r->str != nullptr) return std::string(r->str, r->len);
  if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  return "(reply type " + std::to_string(r->type) + ")";
}

}  // namespace

RedisServers::~RedisServers() {
  for (Server& s : servers_) {
    if (s.pid > 0) {
      ::kill(s.pid, SIGKILL);  // even a paused server dies at once
      ::waitpid(s.pid, nullptr, 0);
      s.pid = -1;
    }
  }
}

std::string RedisServers::Url(int i) const {
  return "redis://127.0.0.1:" + std::to_string(servers_[i].port);
}

std::string RedisServers::ClusterUrl() const {
  std::string out;
  for (int i = 0; i < size(); ++i) {
    if (i > 0) out += ',';
    out += Url(i);
  }
  return out;
}

std::string RedisServers::Start(int n, bool cluster) {
  // CACHET_REDIS_SERVER names another build (a newer Redis, a compatible server) to test against.
  const char* chosen = std::getenv("CACHET_REDIS_SERVER");
  binary_ = chosen != nullptr && *chosen ? chosen : FindInPath("redis-server");
  if (binary_.empty() || ::access(binary_.c_str(), X_OK) != 0) {
    return (binary_.empty() ? std::string("redis-server is not installed (not in PATH)")
                            : "CACHET_REDIS_SERVER=" + binary_ + " is not an executable") +
           ": the Redis tier is tested against a real server; scripts/install-deps.sh installs "
           "Debian's redis-server";
  }
  if (dir_.path().empty()) return "cannot create a temporary directory";
  std::vector<int> held;
  for (int i = 0; i < n; ++i) {
    Server s;
    // A cluster node also listens on port + 10000 (the cluster bus): both must be free.
    for (int attempt = 0; attempt < 50 && s.port == 0; ++attempt) {
      int port = 0, bus = 0;
      const int fd = BindLoopback(0, &port);
      if (fd < 0) continue;
      int bus_fd = -1;
      if (cluster && (port > 55535 || (bus_fd = BindLoopback(port + 10000, &bus)) < 0)) {
        ::close(fd);
        continue;
      }
      held.push_back(fd);
      if (bus_fd >= 0) held.push_back(bus_fd);
      s.port = port;
    }
    if (s.port == 0) return "no free loopback port found";
    s.dir = dir_.path() + "/node" + std::to_string(i);
    std::filesystem::create_directories(s.dir);
    s.args = {binary_,  "--port",       std::to_string(s.port),
              "--bind", "127.0.0.1",    "--save",
              "",       "--appendonly", "no",
              "--dir",  s.dir,          "--daemonize",
              "no",     "--logfile",    s.dir + "/redis.log"};
    if (!password_.empty()) {
      s.args.insert(s.args.end(), {"--requirepass", password_, "--masterauth", password_});
    }
    if (cluster) {
      s.args.insert(s.args.end(),
                    {"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"});
    }
    servers_.push_back(std::move(s));
  }
  for (const int fd : held) ::close(fd);
  for (Server& s : servers_) {
    if (std::string why = Spawn(s); !why.empty()) return why;
  }
  for (const Server& s : servers_) {
    if (std::string why = WaitReady(s); !why.empty()) return why;
  }
  return cluster ? FormCluster() : "";
}

std::string RedisServers::Spawn(Server& s) {
  std::vector<char*> argv;
  for (std::string& a : s.args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string out = s.dir + "/stdout.log";
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, binary_.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return "cannot start " + binary_ + ": " + std::strerror(rc);
  s.pid = pid;
  return "";
}

std::string RedisServers::WaitReady(const Server& s) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(s.pid, &status, WNOHANG) == s.pid) {
      return "redis-server on port " + std::to_string(s.port) +
             " exited at start: " + ReadFile(s.dir + "/redis.log") +
             ReadFile(s.dir + "/stdout.log");
    }
    redisContext* c = redisConnectWithTimeout("127.0.0.1", s.port, timeval{0, 200000});
    if (c != nullptr && c->err == 0) {
      redisSetTimeout(c, timeval{1, 0});
      const std::string auth = Auth(c);
      RedisReply r(auth.empty() ? static_cast<redisReply*>(redisCommand(c, "PING")) : nullptr);
      redisFree(c);
      if (r && r->type == REDIS_REPLY_STATUS) return "";
    } else if (c != nullptr) {
      redisFree(c);
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  return "redis-server on port " + std::to_string(s.port) +
         " did not answer PING in 10 s: " + ReadFile(s.dir + "/redis.log");
}

std::string RedisServers::FormCluster() {
  // What `redis-cli --cluster create --cluster-replicas 0` does, minus its prompts: slots split
  // evenly, distinct config epochs, every node introduced to the first.
  const int n = size();
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> args = {"CLUSTER", "ADDSLOTS"};
    for (int slot = 16384 * i / n; slot < 16384 * (i + 1) / n; ++slot) {
      args.push_back(std::to_string(slot));
    }
    RedisReply r = Command(i, args);
    if (!r || r->type == REDIS_REPLY_ERROR)
      return "CLUSTER ADDSLOTS on node " + Url(i) + ": " + Text(r.get());
    r = Command(i, {"CLUSTER", "SET-CONFIG-EPOCH", std::to_string(i + 1)});
    if (!r || r->type == REDIS_REPLY_ERROR) return "CLUSTER SET-CONFIG-EPOCH: " + Text(r.get());
  }
  for (int i = 1; i < n; ++i) {
    RedisReply r = Command(0, {"CLUSTER", "MEET", "127.0.0.1", std::to_string(port(i))});
    if (!r || r->type == REDIS_REPLY_ERROR) return "CLUSTER MEET: " + Text(r.get());
  }
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  std::string last;
  while (Clock::now() < deadline) {
    bool ready = true;
    for (int i = 0; i < n && ready; ++i) {
      RedisReply r = Command(i, {"CLUSTER", "INFO"});
      last = Text(r.get());
      ready = last.find("cluster_state:ok") != std::string::npos &&
              last.find("cluster_known_nodes:" + std::to_string(n)) != std::string::npos &&
              last.find("cluster_slots_ok:16384") != std::string::npos;
    }
    if (ready) return "";
    std::this_thread::sleep_for(milliseconds(50));
  }
  return "the cluster did not reach cluster_state:ok in 20 s; last CLUSTER INFO: " + last;
}

void RedisServers::Kill(int i) {
  Server& s = servers_[i];
  if (s.pid <= 0) return;
  ::kill(s.pid, SIGKILL);
  ::waitpid(s.pid, nullptr, 0);
  s.pid = -1;
}

void RedisServers::Pause(int i) {
  if (servers_[i].pid > 0) ::kill(servers_[i].pid, SIGSTOP);
}

void RedisServers::Resume(int i) {
  if (servers_[i].pid > 0) ::kill(servers_[i].pid, SIGCONT);
}

std::string RedisServers::Restart(int i) {
  Kill(i);
  if (std::string why = Spawn(servers_[i]); !why.empty()) return why;
  return WaitReady(servers_[i]);
}

RedisReply RedisServers::Command(int i, const std::vector<std::string>& args) const {
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port(i), timeval{1, 0});
  if (c == nullptr || c->err != 0) {
    if (c != nullptr) redisFree(c);
    return nullptr;
  }
  redisSetTimeout(c, timeval{1, 0});
  if (!Auth(c).empty()) {
    redisFree(c);
    return nullptr;
  }
  std::vector<const char*> argv;
  std::vector<size_t> argl;
  for (const std::string& a : args) {
    argv.push_back(a.data());
    argl.push_back(a.size());
  }
  RedisReply r(static_cast<redisReply*>(
      redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), argl.data())));
  redisFree(c);
  return r;
}

std::string RedisServers::Auth(redisContext* c) const {
  if (password_.empty()) return "";
  RedisReply r(
      static_cast<redisReply*>(redisCommand(c, "AUTH %b", password_.data(), password_.size())));
  if (r && r->type == REDIS_REPLY_STATUS) return "";
  return r ? std::string(r->str, r->len) : std::string(c->errstr);
}

std::string RedisServers::Log(int i) const { return ReadFile(servers_[i].dir + "/redis.log"); }

}  // namespace cachet::testing
