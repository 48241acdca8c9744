#include "parallel/sync_batchnorm.h"

#include "autograd/ops.h"
#include "parallel/functional.h"

namespace sg::parallel {

SyncBatchNorm::SyncBatchNorm(int64_t channels, std::shared_ptr<comm::ProcessGroup> group, double eps, double momentum)
    : nn::BatchNorm(channels, eps, momentum), group_(std::move(group)) {}

void SyncBatchNorm::reduce_statistics(Tensor& sum_x, Tensor& sum_x2, double& count) {
  // One collective for both sums: [sum_x | sum_x2] as one buffer.
  const int64_t C = sum_x.numel();
  Tensor both = all_reduce_sum(cat({sum_x, sum_x2}, 0), *group_);
  sum_x = narrow(both, 0, 0, C);
  sum_x2 = narrow(both, 0, C, C);
  Tensor n = from_vector<double>({count}, {1});
  group_->all_reduce(n, comm::ReduceOp::sum, comm::Sync::blocking);
  count = item(n);
}

}  // namespace sg::parallel
