// Megatron's tensor-parallel MLP on one page: Y = GELU(X A^T) B^T with A split by rows over the
// tp ranks (ColumnParallelLinear: each computes its slice of the hidden layer, no communication)
// and B split by columns (RowParallelLinear: each multiplies its slice, then one all-reduce sums
// the partial outputs). The backward mirrors it: one all-reduce of dX where X entered the region.
// Every rank builds the same unsharded MLP from one seed, takes its slices (load_full), and checks
// the sharded output and weight gradients against the unsharded ones; the bytes sent are ring
// all-reduce volumes, 2(p-1)/p of the [B, C] activation each, two per step.
//   mpirun -np 2 ./build/examples/sg_example_tensor_parallel_mlp      (or -np 4: 4 heads' worth)
#include <cmath>
#include <cstdio>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/module.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/tp/layers.h"

using namespace sg;

namespace {

// max |a - b| / max |b|: the sums run in another order over the shards, so a few f32 roundings apart.
double max_relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = to_vector<float>(a), y = to_vector<float>(b);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::abs(double(y[i])));
  }
  return diff / scale;
}

}  // namespace

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  int status = 0;
  {
    auto group = comm::MpiProcessGroup::world();
    const int p = group->size(), rank = group->rank();
    constexpr int64_t B = 16, C = 32, H = 4 * C;  // rows, width, hidden width (split p ways)
    if (H % p != 0) {  // the same on every rank, before any message: each says so and leaves
      if (rank == 0) std::fprintf(stderr, "tensor_parallel_mlp: the hidden width %lld does not split over %d ranks\n",
                                  (long long)H, p);
      group.reset();
      comm::finalize();
      return 2;
    }

    // The unsharded MLP, the same on every rank (seeded), and its sharded twin.
    nn::Linear fc(C, H, true), proj(H, C, true);
    {
      autograd::NoGradGuard no_grad;
      uint64_t stream = 0;
      for (const Tensor& t : {fc.weight, fc.bias, proj.weight, proj.bias})
        copy_(t, randn(t.shape(), /*seed=*/3, stream++, 0.0, 0.2));
    }
    parallel::tp::ColumnParallelLinear fc_p(C, H, true, group);  // weight [H/p, C]: rows of A
    parallel::tp::RowParallelLinear proj_p(H, C, true, group);   // weight [C, H/p]: columns of B
    fc_p.load_full(fc);
    proj_p.load_full(proj);

    Tensor x = randn({B, C}, /*seed=*/4, 0);
    x.set_requires_grad(true);  // its gradient is what the backward all-reduces
    const Tensor dy = randn({B, C}, /*seed=*/5, 0);
    const auto run = [&](auto& first, auto& second) {  // y, and the weights' gradients from dY
      autograd::Tape tape;
      Tensor y;
      {
        autograd::TapeScope record(tape);
        y = second.forward(first.forward_gelu(x));
      }
      tape.backward({y}, {dy});
      return y;
    };
    const Tensor y = run(fc, proj), dx = x.grad();
    x.set_grad(Tensor());
    group->reset_counters();
    const Tensor y_p = run(fc_p, proj_p), dx_p = x.grad();
    const comm::CommCounters sent = group->counters();

    // This rank's slices of the unsharded gradients: rows of dA, columns of dB.
    const Tensor dA = narrow(fc.weight.grad(), 0, rank * (H / p), H / p);
    const Tensor dB = narrow(proj.weight.grad(), 1, rank * (H / p), H / p);
    const double worst = std::max({max_relative_difference(y_p, y), max_relative_difference(dx_p, dx),
                                   max_relative_difference(fc_p.weight.grad(), dA),
                                   max_relative_difference(proj_p.weight.grad(), dB)});
    const comm::KindCount ar = sent[comm::CommKind::all_reduce];
    const int64_t expected = 2 * comm::all_reduce_bytes(B * C * 4, p);  // Y forward, dX backward
    for (int r = 0; r < p; ++r, group->barrier()->wait()) {  // one rank at a time, in order
      if (r != rank) continue;
      std::printf("rank %d of %d | hidden units %lld of %lld | worst relative difference from the unsharded MLP "
                  "%.1e | all-reduces %lld, %lld bytes (2 x 2(p-1)/p x %lld = %lld)\n",
                  rank, p, (long long)(H / p), (long long)H, worst, (long long)ar.calls, (long long)ar.bytes,
                  (long long)(B * C * 4), (long long)expected);
      std::fflush(stdout);
    }
    if (worst > 1e-5 || ar.calls != 2 || ar.bytes != expected) {
      std::fprintf(stderr, "tensor_parallel_mlp: rank %d: the sharded MLP does not match the unsharded one\n", rank);
      status = 1;
    }
  }
  comm::finalize();
  return status;
}
