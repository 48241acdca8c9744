// Collectives as autograd ops: the building blocks of SyncBatchNorm and of tensor parallelism.
// Each op's backward is the mirrored collective (Megatron's pairs): the gradient of a sum over
// ranks, taken on every rank, is the sum over ranks of the gradients.
#pragma once
#include "parallel/comm/process_group.h"

namespace sg::parallel {

// y = sum over the group of x (on every rank); backward: dx = sum over the group of dy.
Tensor all_reduce_sum(const Tensor& x, comm::ProcessGroup& group);

}  // namespace sg::parallel
