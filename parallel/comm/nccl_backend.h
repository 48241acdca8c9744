// The NCCL backend: CUDA tensors, collectives on a communication stream of the group's device.
//
// Ordering: each operation first makes the communication stream wait on an event recorded on the
// device's compute stream (so it sees every kernel issued before it), then issues the NCCL call
// on the communication stream and records a completion event there. Work::wait() makes the host
// wait for that event; test() polls it. Compute issued later on the compute stream is free to run
// alongside the collective: that is the overlap.
//
// Bootstrap: rank 0's ncclUniqueId reaches the others over an existing ProcessGroup (MPI), or
// through a file for launchers without MPI (`--rendezvous file:PATH` with RANK, WORLD_SIZE and
// LOCAL_RANK in the environment). Subgroups come from ncclCommSplit. One rank per GPU: NCCL
// refuses two ranks on one device (use the MPI backend, which stages through the host, for that).
#pragma once
#include <memory>
#include <string>

#include "parallel/comm/process_group.h"

namespace sg::comm {


// Every rank of `bootstrap` calls this; rank r uses cuda:device.
std::shared_ptr<ProcessGroup> nccl_world(ProcessGroup& bootstrap, int device);
// RANK / WORLD_SIZE / LOCAL_RANK from the environment; rank 0 writes the id to `path`
// atomically, the others wait for it (up to timeout_s). The device is LOCAL_RANK.
std::shared_ptr<ProcessGroup> nccl_world_from_file(const std::string& path, double timeout_s = 300);
// Whether this build has NCCL and the machine a CUDA device.
bool nccl_available();

}  // namespace sg::comm
