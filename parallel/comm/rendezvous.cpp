#include "parallel/comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "core/error.h"

namespace sg::comm {

namespace {

// The variable as a non-negative integer; -1 when it is not set.
int env_int(const char* name, const std::string& how) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  SG_CHECK(*end == 0 && x >= 0 && x <= (1L << 30), "--rendezvous ", how, " ", name, "='", v,
           "' is not a non-negative integer");
  return int(x);
}

const char* kind_label(const Rendezvous& r) { return r.kind == Rendezvous::Kind::tcp ? "tcp:" : "file:"; }

}  // namespace

Rendezvous parse_rendezvous(const std::string& spec) {
  Rendezvous r;
  r.spec = spec;
  if (spec == "mpi") return r;
  if (spec.rfind("file:", 0) == 0) {
    r.kind = Rendezvous::Kind::file;
    r.path = spec.substr(5);
    SG_CHECK(!r.path.empty(), "--rendezvous file: needs a path (file:PATH)");
    return r;
  }
  if (spec.rfind("tcp:", 0) == 0) {
    r.kind = Rendezvous::Kind::tcp;
    const std::string rest = spec.substr(4);
    const size_t colon = rest.rfind(':');  // the last one: HOST may be an IPv6 address in brackets
    SG_CHECK(colon != std::string::npos && colon > 0, "--rendezvous ", spec, ": expected tcp:HOST:PORT (rank 0's host "
             "as the other ranks reach it, and a free port there)");
    r.host = rest.substr(0, colon);
    if (r.host.size() > 2 && r.host.front() == '[' && r.host.back() == ']') r.host = r.host.substr(1, r.host.size() - 2);
    const std::string port = rest.substr(colon + 1);
    char* end = nullptr;
    const long p = std::strtol(port.c_str(), &end, 10);
    SG_CHECK(!port.empty() && *end == 0 && p >= 1 && p <= 65535, "--rendezvous ", spec, ": the port '", port,
             "' is not a number in 1..65535");
    r.port = int(p);
    return r;
  }
  throw Error(str("--rendezvous must be mpi, file:PATH or tcp:HOST:PORT, got '", spec, "'"));
}

LaunchEnv launch_env(const Rendezvous& how) {
  const std::string label = kind_label(how);
  LaunchEnv e;
  e.rank = env_int("RANK", label);
  e.world_size = env_int("WORLD_SIZE", label);
  e.local_rank = env_int("LOCAL_RANK", label);
  for (auto [name, v] : {std::pair{"RANK", e.rank}, std::pair{"WORLD_SIZE", e.world_size}})
    SG_CHECK(v >= 0, "--rendezvous ", label, " needs ", name, " in the environment (set by the launcher: torchrun, "
             "or by hand for each process)");
  SG_CHECK(e.world_size >= 1, "--rendezvous ", label, " WORLD_SIZE must be >= 1, got 0");
  SG_CHECK(e.rank < e.world_size, "--rendezvous ", label, " RANK ", e.rank, " is not below WORLD_SIZE ", e.world_size);
  return e;
}

// ---------------------------------------------------------------- the TCP exchange

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'s', 'g', 'r', 'd', 'v', '0', '0', '1'};
enum Status : uint32_t { kOk = 0, kOtherWorld = 1, kBadRank = 2 };

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Socket() { reset(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Waits until fd is ready for `events` or the deadline passes; false on the deadline.
bool ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const double left = seconds_left(deadline);
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, int(std::min(left * 1000.0, 1000.0)) + 1);
    if (n > 0) return true;
    SG_CHECK(n == 0 || errno == EINTR, "tcp rendezvous: poll failed: ", std::strerror(errno));
  }
}

// All n bytes, or false on the deadline or a closed connection.
bool send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLOUT, deadline)) return false;
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}
bool recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!ready(fd, POLLIN, deadline)) return false;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

struct Hello {
  char magic[8];
  uint32_t world_size, rank;  // network byte order
};
static_assert(sizeof(Hello) == 16);

// Rank 0: a listening socket on port, on every interface (IPv6 with IPv4 mapped where the host has
// IPv6, else IPv4).
Socket listen_on(int port, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(nullptr, std::to_string(port).c_str(), &hints, &list);
  SG_CHECK(rc == 0, what, ": rank 0 cannot listen on port ", port, ": ", ::gai_strerror(rc));
  std::string last = "no address to listen on";
  Socket s;
  for (addrinfo* a = list; a; a = a->ai_next) {
    Socket t(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!t) {
      last = std::strerror(errno);
      continue;
    }
    const int one = 1, zero = 0;
    ::setsockopt(t.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // a restarted job rebinds at once
    if (a->ai_family == AF_INET6) ::setsockopt(t.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (::bind(t.fd(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(t.fd(), 128) == 0) {
      s = std::move(t);
      break;
    }
    last = std::strerror(errno);
  }
  ::freeaddrinfo(list);
  SG_CHECK(bool(s), what, ": rank 0 cannot listen on port ", port, ": ", last,
           " (another job's rendezvous, or a server, holds it: pick a free port)");
  return s;
}

std::vector<uint8_t> serve(int port, int world_size, const std::vector<uint8_t>& bytes, Clock::time_point deadline,
                           double timeout_s, const std::string& what) {
  Socket server = listen_on(port, what);
  std::vector<bool> joined(size_t(world_size), false);
  joined[0] = true;
  int waiting = world_size - 1;
  while (waiting > 0) {
    if (!ready(server.fd(), POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < world_size; ++r)
        if (!joined[size_t(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw Error(str(what, ": rank 0 waited ", timeout_s, " s on port ", port, "; ", waiting, " of ", world_size - 1,
                      " ranks never came (rank", waiting > 1 ? "s " : " ", missing, ")"));
    }
    Socket c(::accept4(server.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c) continue;  // the peer gave up between poll and accept
    // A stray connection gets a second at most to say hello; one that does not is dropped.
    Hello h{};
    if (!recv_all(c.fd(), &h, sizeof h, std::min(deadline, Clock::now() + std::chrono::seconds(1))) ||
        std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
      continue;
    const int ws = int(ntohl(h.world_size)), r = int(ntohl(h.rank));
    uint32_t status = htonl(kOk);
    if (ws != world_size) status = htonl(kOtherWorld);
    else if (r < 1 || r >= world_size || joined[size_t(r)]) status = htonl(kBadRank);
    if (status != htonl(kOk)) {
      send_all(c.fd(), &status, sizeof status, deadline);
      throw Error(ws != world_size
                      ? str(what, ": a rank ", r, " started with WORLD_SIZE ", ws, " reached rank 0 of a world of ",
                            world_size, " (another job on this port, or the ranks were started with different sizes)")
                      : str(what, ": rank ", r, " reached rank 0 twice, or is not in 1..", world_size - 1,
                            " (two processes started with the same RANK?)"));
    }
    const uint32_t n = htonl(uint32_t(bytes.size()));
    if (send_all(c.fd(), &status, sizeof status, deadline) && send_all(c.fd(), &n, sizeof n, deadline) &&
        send_all(c.fd(), bytes.data(), bytes.size(), deadline)) {
      joined[size_t(r)] = true;
      --waiting;
    }
  }
  return bytes;
}

// A connected socket to host:port, retrying every 50 ms (rank 0 may not listen yet) until the deadline.
Socket connect_to(const std::string& host, int port, int rank, Clock::time_point deadline, double timeout_s,
                  const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last = "no address";
  for (;;) {
    addrinfo* list = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (rc == 0) {
      for (addrinfo* a = list; a; a = a->ai_next) {
        Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
        if (s && ::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) {
          ::freeaddrinfo(list);
          return s;
        }
        last = std::strerror(errno);
      }
      ::freeaddrinfo(list);
    } else {
      // EAI_AGAIN (a resolver not up yet) retries; a name that does not exist does not.
      SG_CHECK(rc == EAI_AGAIN, what, ": rank ", rank, " cannot resolve host '", host, "': ", ::gai_strerror(rc));
      last = ::gai_strerror(rc);
    }
    SG_CHECK(seconds_left(deadline) > 0, what, ": rank ", rank, " could not reach rank 0 at ", host, ":", port,
             " within ", timeout_s, " s (last error: ", last, ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::vector<uint8_t> join(const std::string& host, int port, int rank, int world_size, size_t n,
                          Clock::time_point deadline, double timeout_s, const std::string& what) {
  Socket s = connect_to(host, port, rank, deadline, timeout_s, what);
  Hello h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.world_size = htonl(uint32_t(world_size));
  h.rank = htonl(uint32_t(rank));
  uint32_t status = 0, len = 0;
  const auto lost = [&] {
    return Error(str(what, ": rank ", rank, " lost rank 0 at ", host, ":", port,
                     seconds_left(deadline) > 0 ? " (the connection closed before the id came)"
                                                : str(" (no answer within ", timeout_s, " s)")));
  };
  if (!send_all(s.fd(), &h, sizeof h, deadline) || !recv_all(s.fd(), &status, sizeof status, deadline)) throw lost();
  status = ntohl(status);
  SG_CHECK(status != kOtherWorld, what, ": rank 0 at ", host, ":", port, " is not of this job's world (WORLD_SIZE ",
           world_size, " here, another there)");
  SG_CHECK(status != kBadRank, what, ": rank 0 at ", host, ":", port, " refused rank ", rank,
           " (another process joined with the same RANK)");
  SG_CHECK(status == kOk, what, ": rank 0 at ", host, ":", port, " answered with unknown status ", status);
  if (!recv_all(s.fd(), &len, sizeof len, deadline)) throw lost();
  len = ntohl(len);
  SG_CHECK(len == n, what, ": rank 0 sent ", len, " bytes, expected ", n, " (another shardgrad build?)");
  std::vector<uint8_t> bytes(n);
  if (!recv_all(s.fd(), bytes.data(), n, deadline)) throw lost();
  return bytes;
}

}  // namespace

std::vector<uint8_t> tcp_share(const std::string& host, int port, int rank, int world_size,
                               const std::vector<uint8_t>& bytes, size_t n, double timeout_s) {
  const std::string what = str("--rendezvous tcp:", host, ":", port);
  SG_CHECK(rank >= 0 && rank < world_size, what, ": rank ", rank, " is not in a world of ", world_size);
  SG_CHECK(rank != 0 || bytes.size() == n, what, ": rank 0 has ", bytes.size(), " bytes to share, not ", n);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  if (world_size == 1) return bytes;
  return rank == 0 ? serve(port, world_size, bytes, deadline, timeout_s, what)
                   : join(host, port, rank, world_size, n, deadline, timeout_s, what);
}

}  // namespace sg::comm
