// How the processes of a job find each other when no mpirun started them (a launcher such as
// torchrun, a Slurm script, or a shell loop starting each process with RANK and WORLD_SIZE in its
// environment): `train --rendezvous file:PATH | tcp:HOST:PORT`. Either way rank 0 hands the
// others a few bytes (NCCL's unique id), after which NCCL connects the ranks itself.
//
//   file:PATH      rank 0 writes the bytes to PATH (a file system every process sees), the others
//                  poll for it (nccl_backend.h: nccl_world_from_rendezvous).
//   tcp:HOST:PORT  rank 0 listens on PORT (every interface of its host), the others connect to
//                  HOST:PORT, retrying until rank 0 is up; no shared file system needed.
//
// The TCP exchange is plain POSIX sockets: each rank sends a 16-byte hello (a magic, the world
// size it was started with, its rank), rank 0 checks it and answers with a status word and the
// bytes. A connection that does not start with the magic (a port scanner, a health check) is
// closed and ignored; a rank of another world size, a rank out of range or one that connects
// twice is refused on both sides, by name.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sg::comm {

struct Rendezvous {
  enum class Kind { mpi, file, tcp };
  Kind kind = Kind::mpi;
  std::string spec;  // as given: "mpi", "file:PATH", "tcp:HOST:PORT"
  std::string path;  // file
  std::string host;  // tcp
  int port = 0;      // tcp, 1..65535
};

// The flag's value parsed; anything else refused naming --rendezvous and what it takes.
Rendezvous parse_rendezvous(const std::string& spec);

// Where a launcher without MPI (torchrun and the like) puts this process: RANK and WORLD_SIZE,
// and LOCAL_RANK (this process's place on its node; -1 when the variable is not set). A missing
// or malformed RANK/WORLD_SIZE, or RANK >= WORLD_SIZE, is refused naming the variable and the
// rendezvous's kind ("--rendezvous tcp: needs RANK ...").
struct LaunchEnv {
  int rank = 0, world_size = 1, local_rank = -1;
};
LaunchEnv launch_env(const Rendezvous& how);

// Rank 0 of a world of world_size hands `bytes` (given on rank 0 only; n of them) to every other
// rank over TCP and returns them on every rank. Rank 0 listens on port; the others connect to
// host:port, retrying while rank 0 is not up yet. Each side gives up after timeout_s, naming the
// address and (on rank 0) the ranks that never came.
std::vector<uint8_t> tcp_share(const std::string& host, int port, int rank, int world_size,
                               const std::vector<uint8_t>& bytes, size_t n, double timeout_s);

}  // namespace sg::comm
