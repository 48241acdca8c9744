// DistributedDataParallel: every rank holds the whole model and a disjoint slice of the global
// batch; gradients are averaged over the group so every rank takes the same optimizer step.
//
// Gradients are packed into buckets of about `bucket_bytes`, filled in reverse registration order
// (roughly the order backward produces them). Each parameter's grad-ready hook marks it; when the
// last parameter of a bucket is ready, the bucket's gradients move into a flat buffer (their own
// .grad tensors freed) and its all-reduce is launched at once, so communication overlaps the rest
// of backward. finish_gradients() waits for every bucket and makes each .grad a view of its slot in
// the averaged buffer (PyTorch's gradient_as_bucket_view): a gradient is never held twice, so ddp
// holds 4Ψ of gradient at most, as a single process does, not 4Ψ of gradients and 4Ψ of buckets.
// Under no_sync (gradient accumulation) the hooks only accumulate locally: only the last
// micro-batch of a step communicates.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/process_group.h"

namespace sg::parallel {

struct DdpOptions {
  int64_t bucket_bytes = 25ll << 20;  // --bucket-mb
  bool find_unused_parameters = false;
};

class DistributedDataParallel {
 public:
  using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
  DistributedDataParallel(NamedTensors params, std::shared_ptr<comm::ProcessGroup> group, DdpOptions opt);
  ~DistributedDataParallel();

  // Makes every rank start from rank 0's parameters.
  void broadcast_parameters();
  // false: backward only accumulates locally (PyTorch's no_sync); true: the next backward syncs.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // Waits for every bucket's all-reduce and writes the averaged gradients back. Parameters that
  // got no gradient: an error naming them, or with find_unused_parameters their .grad stays
  // undefined where no rank used them (one more all-reduce, of a flag per parameter, as PyTorch's
  // usage map; the optimizer then skips them), and is the average where some rank did. A second
  // backward with sync on before this call (a parameter ready twice) is an error, as it is in
  // PyTorch: accumulate under set_sync(false). Either error abandons the step (its launched
  // buckets are waited for and dropped, every .grad cleared) so that the next step starts clean.
  void finish_gradients();
  // After backward(s) run under no_sync: all-reduces every bucket now and writes the averages
  // back. The pipeline uses this: its micro-batch backwards interleave, so gradients are complete
  // only when the schedule ends.
  void reduce_now();

  int num_buckets() const { return int(buckets_.size()); }
  // Parameter names in bucket b (in the order they were packed).
  std::vector<std::string> bucket_names(int b) const;
  comm::ProcessGroup& group() { return *group_; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    Tensor buffer;               // from launch to finish_gradients: flat, the params' dtype, comm_buffer
    int ready = 0;
    std::shared_ptr<comm::Work> work;
  };
  void on_grad_ready(size_t param);
  void launch(Bucket& b);
  void abandon_step();  // after an error: waits for launched buckets, drops them, unmarks all

  NamedTensors params_;
  std::shared_ptr<comm::ProcessGroup> group_;
  DdpOptions opt_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<char> marked_;
  std::vector<char> had_grad_;  // per parameter, at its bucket's launch: whether it had a gradient
  std::vector<std::weak_ptr<Storage>> handed_;  // the storage of each .grad the last finish_gradients set
  bool sync_ = true;
  std::shared_ptr<bool> alive_;  // hooks outlive us on the parameters: they check this first
};

}  // namespace sg::parallel
