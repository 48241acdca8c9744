// The rendezvous of a job launched without MPI (parallel/comm/rendezvous.h): the flag's forms, and
// the TCP exchange that hands rank 0's bytes (NCCL's unique id, in train) to the other ranks, run
// here with the ranks as threads of one process on this machine's loopback.
#include "tests/catch.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "parallel/comm/rendezvous.h"

using namespace sg;
using comm::Rendezvous;

namespace {

// An IPv4 address: host (INADDR_LOOPBACK, INADDR_ANY) and port.
sockaddr_in ipv4(uint32_t host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(host);
  a.sin_port = htons(uint16_t(port));
  return a;
}

// A port nobody listens on now: the kernel's choice for port 0 (the test then uses it at once).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a = ipv4(INADDR_LOOPBACK, 0);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Each rank's outcome: the bytes it got, or its error's message.
struct Outcome {
  std::vector<uint8_t> bytes;
  std::string error;
};

// Rank r of the world runs share(r) on its own thread, started start_ms[r] ms after the first.
std::vector<Outcome> run_ranks(int n, const std::function<std::vector<uint8_t>(int)>& share,
                               const std::vector<int>& start_ms = {}) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      if (size_t(r) < start_ms.size()) std::this_thread::sleep_for(std::chrono::milliseconds(start_ms[size_t(r)]));
      try {
        out[size_t(r)].bytes = share(r);
      } catch (const std::exception& e) {
        out[size_t(r)].error = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

const std::vector<uint8_t> kId = [] {
  std::vector<uint8_t> v(128);
  for (size_t i = 0; i < v.size(); ++i) v[i] = uint8_t(i * 37 + 11);
  return v;
}();

}  // namespace

TEST_CASE("train's rendezvous flag takes mpi, file:PATH and tcp:HOST:PORT and refuses the rest by name", "[comm]") {
  CHECK(comm::parse_rendezvous("mpi").kind == Rendezvous::Kind::mpi);
  const Rendezvous f = comm::parse_rendezvous("file:/shared/job/id");
  CHECK(f.kind == Rendezvous::Kind::file);
  CHECK(f.path == "/shared/job/id");
  const Rendezvous t = comm::parse_rendezvous("tcp:node-0.cluster:29500");
  CHECK(t.kind == Rendezvous::Kind::tcp);
  CHECK(t.host == "node-0.cluster");
  CHECK(t.port == 29500);
  const Rendezvous v6 = comm::parse_rendezvous("tcp:[fe80::1]:80");
  CHECK(v6.host == "fe80::1");
  CHECK(v6.port == 80);
  CHECK(v6.spec == "tcp:[fe80::1]:80");
  CHECK_THROWS_WITH(comm::parse_rendezvous("file:"), Catch::Contains("--rendezvous file: needs a path (file:PATH)"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp:node0"), Catch::Contains("--rendezvous tcp:node0: expected tcp:HOST:PORT"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp::29500"), Catch::Contains("expected tcp:HOST:PORT"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp:node0:0"), Catch::Contains("the port '0' is not a number in 1..65535"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp:node0:65536"), Catch::Contains("the port '65536'"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp:node0:29x"), Catch::Contains("the port '29x'"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("tcp://node0"), Catch::Contains("expected tcp:HOST:PORT"));
  CHECK_THROWS_WITH(comm::parse_rendezvous("env://"),
                    Catch::Contains("--rendezvous must be mpi, file:PATH or tcp:HOST:PORT, got 'env://'"));
}

TEST_CASE("tcp rendezvous: every rank gets rank 0's bytes, whoever starts first", "[comm]") {
  for (bool rank0_last : {false, true}) {
    INFO("rank 0 starts last: " << rank0_last);
    const int port = free_port(), n = 5;
    // rank 0 late: the others retry their connection until it listens
    const std::vector<int> start = rank0_last ? std::vector<int>{400, 0, 0, 50, 0} : std::vector<int>{0, 100, 0, 200, 30};
    auto out = run_ranks(n, [&](int r) {
      return comm::tcp_share("127.0.0.1", port, r, n, r == 0 ? kId : std::vector<uint8_t>{}, kId.size(), 20);
    }, start);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      CHECK(out[size_t(r)].error.empty());
      CHECK(out[size_t(r)].bytes == kId);
    }
  }
  // a host name resolved for the connection; a world of one needs no network
  const int port = free_port();
  auto out = run_ranks(2, [&](int r) {
    return comm::tcp_share("localhost", port, r, 2, r == 0 ? kId : std::vector<uint8_t>{}, kId.size(), 20);
  });
  CHECK(out[1].bytes == kId);
  CHECK(comm::tcp_share("unused", 1, 0, 1, kId, kId.size(), 1) == kId);
}

TEST_CASE("tcp rendezvous: a stray connection is ignored, a rank that never comes is named", "[comm]") {
  const int port = free_port();
  auto out = run_ranks(3, [&](int r) -> std::vector<uint8_t> {
    if (r == 0) return comm::tcp_share("127.0.0.1", port, 0, 3, kId, kId.size(), 20);
    if (r == 1) {  // not a rank: a probe that connects, writes something else and hangs up
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a = ipv4(INADDR_LOOPBACK, port);
      REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
      const char junk[] = "GET / HTTP/1.0\r\n\r\n";
      REQUIRE(::send(fd, junk, sizeof junk, 0) > 0);
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return comm::tcp_share("127.0.0.1", port, 1, 3, {}, kId.size(), 20);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    return comm::tcp_share("127.0.0.1", port, 2, 3, {}, kId.size(), 20);
  });
  CHECK(out[0].error.empty());
  CHECK(out[1].bytes == kId);
  CHECK(out[2].bytes == kId);

  // rank 2 of 3 never starts: rank 0 gives up after its timeout, naming it
  const int port2 = free_port();
  auto lonely = run_ranks(2, [&](int r) {
    return comm::tcp_share("127.0.0.1", port2, r, 3, r == 0 ? kId : std::vector<uint8_t>{}, kId.size(), 1.0);
  });
  CHECK(lonely[1].bytes == kId);
  CHECK_THAT(lonely[0].error, Catch::Contains("--rendezvous tcp:127.0.0.1:" + std::to_string(port2) +
                                              ": rank 0 waited 1 s on port " + std::to_string(port2) +
                                              "; 1 of 2 ranks never came (rank 2)"));
  // and a rank whose rank 0 never listens gives up too, naming the address and the last error
  const int port3 = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(comm::tcp_share("127.0.0.1", port3, 2, 3, {}, kId.size(), 0.5),
                    Catch::Contains("rank 2 could not reach rank 0 at 127.0.0.1:" + std::to_string(port3) +
                                    " within 0.5 s (last error: Connection refused)"));
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 5);
  CHECK_THROWS_WITH(comm::tcp_share("no.such.host.invalid", port3, 1, 2, {}, kId.size(), 0.5),
                    Catch::Contains("rank 1") && Catch::Contains("no.such.host.invalid"));
}

TEST_CASE("tcp rendezvous: ranks of another world size, a rank twice, a port in use are refused on both sides", "[comm]") {
  {
    const int port = free_port();
    auto out = run_ranks(2, [&](int r) {  // rank 1 thinks the world has 3 ranks
      return comm::tcp_share("127.0.0.1", port, r, r == 0 ? 2 : 3, r == 0 ? kId : std::vector<uint8_t>{}, kId.size(), 20);
    });
    CHECK_THAT(out[0].error, Catch::Contains("a rank 1 started with WORLD_SIZE 3 reached rank 0 of a world of 2"));
    CHECK_THAT(out[1].error, Catch::Contains("is not of this job's world (WORLD_SIZE 3 here, another there)"));
  }
  {
    const int port = free_port();
    // two processes started as rank 1 of 3 (the second 300 ms later); rank 2 never comes
    auto out = run_ranks(3, [&](int r) {
      return comm::tcp_share("127.0.0.1", port, r == 0 ? 0 : 1, 3, r == 0 ? kId : std::vector<uint8_t>{}, kId.size(), 20);
    }, {0, 0, 300});
    CHECK_THAT(out[0].error, Catch::Contains("rank 1 reached rank 0 twice, or is not in 1..2 (two processes started "
                                             "with the same RANK?)"));
    CHECK(out[1].bytes == kId);
    CHECK_THAT(out[2].error, Catch::Contains("refused rank 1 (another process joined with the same RANK)"));
  }
  {
    const int port = free_port();
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);  // someone else's server on the port
    sockaddr_in a = ipv4(INADDR_ANY, port);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    CHECK_THROWS_WITH(comm::tcp_share("127.0.0.1", port, 0, 2, kId, kId.size(), 5),
                      Catch::Contains("rank 0 cannot listen on port " + std::to_string(port) +
                                      ": Address already in use (another job's rendezvous, or a server, holds it"));
    ::close(fd);
  }
  CHECK_THROWS_WITH(comm::tcp_share("h", 1, 3, 3, {}, 4, 1), Catch::Contains("rank 3 is not in a world of 3"));
  CHECK_THROWS_WITH(comm::tcp_share("h", 1, 0, 2, kId, 4, 1), Catch::Contains("rank 0 has 128 bytes to share, not 4"));
}
