// SyncBatchNorm: BatchNorm whose batch statistics are those of the whole data-parallel batch.
// The per-channel sums of x and x^2 (and the count) are all-reduced over the group, through an
// autograd all-reduce, so backward also sums the statistics' gradients over the group: the
// result equals BatchNorm over the concatenated batch, forward and gradients.
#pragma once
#include <memory>

#include "models/module.h"
#include "parallel/comm/process_group.h"

namespace sg::parallel {

class SyncBatchNorm : public nn::BatchNorm {
 public:
  SyncBatchNorm(int64_t channels, std::shared_ptr<comm::ProcessGroup> group, double eps = 1e-5, double momentum = 0.1);
  const char* type_name() const override { return "SyncBatchNorm"; }

 protected:
  void reduce_statistics(Tensor& sum_x, Tensor& sum_x2, double& count) override;

 private:
  std::shared_ptr<comm::ProcessGroup> group_;
};

}  // namespace sg::parallel
