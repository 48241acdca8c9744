// Collectives as autograd ops: the building blocks of SyncBatchNorm and of tensor parallelism.
// Each op's backward is the mirrored collective (Megatron's pairs): the gradient of a sum over
// ranks, taken on every rank, is the sum over ranks of the gradients.
//
// Tensor-parallel regions (p = group size, rank i; Megatron's f / g operators):
//   copy_to_region      y = x                       dx = sum_ranks dy        (f: enters a region)
//   reduce_from_region  y = sum_ranks x             dx = dy                  (g: leaves a region)
//   scatter_to_region   y = x[..., i-th of p]       dx = all_gather_last(dy)
//   gather_from_region  y = [x_0 | ... | x_{p-1}]   dx = dy[..., i-th of p]  (last dim)
//   all_gather_seq      y = [x_0; ...; x_{p-1}]     dx = reduce_scatter_seq(dy)   (dim 1, sequence)
//   reduce_scatter_seq  y = (sum_ranks x)[:, i-th of p]   dx = all_gather_seq(dy)
#pragma once
#include "parallel/comm/process_group.h"

namespace sg::parallel {

// y = sum over the group of x (on every rank); backward: dx = sum over the group of dy.
Tensor all_reduce_sum(const Tensor& x, comm::ProcessGroup& group);

// Identity forward, all-reduce backward: x replicated on every rank feeds rank-local math whose
// gradients are partial sums.
Tensor copy_to_region(const Tensor& x, comm::ProcessGroup& group);
// All-reduce forward, identity backward: partial sums become the replicated result.
Tensor reduce_from_region(const Tensor& x, comm::ProcessGroup& group);
// Keeps this rank's 1/p of the last dim; backward all-gathers along it.
Tensor scatter_to_region(const Tensor& x, comm::ProcessGroup& group);
// Concatenates every rank's x along the last dim (rank order); backward keeps this rank's part.
Tensor gather_from_region(const Tensor& x, comm::ProcessGroup& group);
// Sequence parallelism on [B, T, ...]: concatenates the ranks' T-slices along dim 1; backward
// reduce-scatters (each rank's slice got gradient from every rank's tensor-parallel math).
Tensor all_gather_seq(const Tensor& x, comm::ProcessGroup& group);
// Sums x over the group and keeps this rank's 1/p of dim 1; backward all-gathers along dim 1.
Tensor reduce_scatter_seq(const Tensor& x, comm::ProcessGroup& group);

// Not recorded: the collectives themselves along one dim (rank order), and this rank's slice.
Tensor all_gather_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group);
Tensor reduce_scatter_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group);
Tensor split_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group);

}  // namespace sg::parallel
