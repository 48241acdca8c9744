// The MPI backend: CPU tensors directly, CUDA tensors through a host copy (so several ranks can
// share one GPU in tests, which NCCL refuses).
//
// Overlap: each group owns a communication thread that runs its collectives one after another, in
// the order they were issued, with blocking MPI calls on the group's own communicator (a dup, so
// user traffic on MPI_COMM_WORLD never matches ours). Every rank issues a group's collectives in
// the same order, so FIFO on each rank keeps them matched. The caller's thread returns at once and
// keeps computing; Work completes when the operation has run. A blocking operation (Sync::blocking)
// does not wake the thread: the caller runs it itself, as does a caller that wait()s for an
// operation the idle thread has not started (work_queue.h). That is still queue order, never
// alongside the thread, and it saves the wake-up of a sleeping thread and back, which is what a
// blocking collective of a few hundred microseconds mostly paid. send/recv are posted
// at once from the caller's thread (MPI_Isend/MPI_Irecv) instead of queued: a ring of blocking
// sends on one queue per rank would deadlock, and MPI does not match point-to-point messages with
// collectives, so they need no ordering against the queue.
//
// This needs MPI_THREAD_MULTIPLE. When MPI provides less, operations run on the caller's thread
// when issued and their Work is already complete (correct, without overlap).
//
// bf16/f16 reductions use a custom MPI_Op on 2-byte datatypes that widens each pair to f32, reduces,
// and rounds back: the wire carries 2 bytes per element, as the counters say (and as NCCL does);
// the result is rounded once per reduction step, not once overall.
#pragma once
#include <mpi.h>

#include <functional>
#include <memory>

#include "parallel/comm/process_group.h"
#include "parallel/comm/work_queue.h"

namespace sg::comm {

// Initialises MPI asking for MPI_THREAD_MULTIPLE, unless MPI already is initialised (by the test
// main, or a launcher), and returns the thread level MPI provides. Idempotent.
int init(int* argc = nullptr, char*** argv = nullptr);
// Stops every live MPI group (its queue drained, its thread joined, its communicator freed) and
// finalizes MPI if init() was what initialised it. Idempotent; groups used afterwards refuse.
void finalize();
// Whether groups get a communication thread (MPI provided MPI_THREAD_MULTIPLE).
bool threaded();

class MpiProcessGroup : public ProcessGroup {
 public:
  // A new group over a duplicate of MPI_COMM_WORLD. Collective over the world; needs init().
  static std::shared_ptr<MpiProcessGroup> world();
  // Takes ownership of `comm` (freed with the group).
  explicit MpiProcessGroup(MPI_Comm comm);
  ~MpiProcessGroup() override;

  std::string backend_name() const override { return "mpi"; }
  MPI_Comm comm() const { return comm_; }
  // Runs queued operations, joins the thread, frees the communicator. Idempotent.
  void shutdown();

 protected:
  std::shared_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override;
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override;
  std::shared_ptr<Work> do_all_gather(const Tensor& out, const Tensor& in) override;
  std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) override;
  std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) override;
  std::shared_ptr<Work> do_send(const Tensor& t, int dst, int tag) override;
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int tag) override;
  std::string closed_reason() const override;
  int backend_max_tag() const override;  // MPI_TAG_UB
  std::shared_ptr<Work> do_barrier() override;
  std::shared_ptr<ProcessGroup> do_split(int color, int key) override;

 private:
  // Queues `body` (run on the communication thread, or right here without one).
  std::shared_ptr<Work> enqueue(const char* op, std::function<void()> body);

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::unique_ptr<WorkQueue> queue_;  // null without MPI_THREAD_MULTIPLE
};

}  // namespace sg::comm
