// A simulated world: the ranks of one job as threads of one process, for `train --simulate`,
// which runs the real engine on the meta device (core/device.h) to count a layout's bytes per
// rank. Its groups carry no data: nothing has values on the meta device, and the collectives
// complete at once, leaving every tensor as it was. What they do keep is everything that decides
// memory and traffic without values: the group sizes and ranks (split is a real rendezvous of
// the rank threads, with MPI_Comm_split's ordering), the argument checks and the byte counters of
// ProcessGroup, which counts every backend the same way. A rank thread that fails ends every
// rendezvous with an error instead of leaving the others waiting.
#pragma once
#include <memory>
#include <vector>

#include "parallel/comm/process_group.h"

namespace sg::comm {

struct SimWorld;

// What a rank waiting in a rendezvous throws when another rank of its world failed: the other
// rank's own error is the one to report.
struct SimWorldAborted : Error {
  using Error::Error;
};

class SimProcessGroup : public ProcessGroup {
 public:
  SimProcessGroup(std::shared_ptr<SimWorld> world, int group_id, int rank, int size);
  std::string backend_name() const override { return "sim"; }
  // Marks the world failed: every rank waiting in a split, now or later, throws instead.
  void abort() const;

 protected:
  std::shared_ptr<Work> do_all_reduce(const Tensor& t, ReduceOp op) override;
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override;
  std::shared_ptr<Work> do_all_gather(const Tensor& out, const Tensor& in) override;
  std::shared_ptr<Work> do_broadcast(const Tensor& t, int root) override;
  std::shared_ptr<Work> do_reduce(const Tensor& t, int root, ReduceOp op) override;
  std::shared_ptr<Work> do_send(const Tensor& t, int dst, int tag) override;
  std::shared_ptr<Work> do_recv(const Tensor& t, int src, int tag) override;
  std::shared_ptr<Work> do_barrier() override;
  std::shared_ptr<ProcessGroup> do_split(int color, int key) override;

 private:
  std::shared_ptr<SimWorld> world_;
  int group_id_;
  int splits_ = 0;  // this rank's split calls on this group so far: the rendezvous they meet in
};

// The world group of each of n ranks (index = rank), to be handed one per thread.
std::vector<std::shared_ptr<SimProcessGroup>> simulated_world(int n);

}  // namespace sg::comm
