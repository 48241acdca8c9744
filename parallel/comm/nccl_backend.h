// The NCCL backend: collectives on a communication stream of the group's device.
//
// Ordering: each operation first makes the communication stream wait on an event recorded on the
// device's compute stream (so it sees every kernel issued before it), then issues the NCCL call
// on the communication stream and records a completion event there. Work::wait() makes the host
// wait for that event; test() polls it. Compute issued later on the compute stream is free to run
// alongside the collective: that is the overlap.
//
// CPU tensors ride through the device, the mirror of the MPI backend's host staging: each is
// copied to the group's GPU (ledger: comm_buffer), the collective runs there on the communication
// stream, and wait() (or a test() that sees it done) copies the result back. That is what lets a
// job without MPI keep its CPU-side metrics (losses, norms, barriers) on the NCCL world. Byte
// counters count the tensor as usual, wherever it lives.
//
// Bootstrap: rank 0's ncclUniqueId reaches the others over an existing ProcessGroup (MPI), or
// for launchers without MPI through a file or a TCP connection to rank 0 (`--rendezvous
// file:PATH | tcp:HOST:PORT` with RANK and WORLD_SIZE in the environment). Subgroups come from ncclCommSplit. One rank per GPU: NCCL refuses two ranks
// on one device (use the MPI backend, which stages through the host, for that).
#pragma once
#include <memory>
#include <string>

#include "parallel/comm/process_group.h"
#include "parallel/comm/rendezvous.h"

namespace sg::comm {

// Every rank of `bootstrap` calls this; rank r uses cuda:device.
std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup& bootstrap, int device);

// Every process of a job launched without MPI calls this, placed by launch_env(how) (RANK,
// WORLD_SIZE); this one uses cuda:device. Rank 0's unique id reaches the others through `how`
// (rendezvous.h), waiting up to timeout_s:
//   file:PATH  rank 0 writes it to PATH atomically (a temporary name, then rename), the others
//              poll for it; once every rank has joined, rank 0 removes the file. Rank 0 refuses a
//              path that already exists: a file left by an earlier job would hand the others a dead id.
//   tcp:H:P    rank 0 serves it on port P to the ranks that connect to H:P (tcp_share).
std::shared_ptr<ProcessGroup> nccl_world_from_rendezvous(const Rendezvous& how, int device, double timeout_s = 300);
// Whether this build has NCCL and the machine a CUDA device.
bool nccl_available();

}  // namespace sg::comm
