// The engine as a library, in one page: a two-layer MLP (nn::Linear, GELU) learns y = tanh(3x) by
// regression, with AdamW sharded by ZeRO-2 over the ranks mpirun starts. Every rank takes its rows
// of each global batch; the reduce-scatter averages the gradients, so the losses are the same on
// any number of ranks. At the end, what each rank holds is read off the memory ledger: the whole
// parameters (4Ψ bytes), a 1/N shard of the gradients (4Ψp/N) and of AdamW's m and v (8Ψp/N).
//   ./build/examples/sg_example_zero2_mlp                       one process
//   mpirun -np 4 ./build/examples/sg_example_zero2_mlp          four ranks, the same losses
#include <cstdio>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/module.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/zero.h"

using namespace sg;

struct MLP : nn::Module {
  std::shared_ptr<nn::Linear> fc1 = register_module("fc1", std::make_shared<nn::Linear>(1, 64, true));
  std::shared_ptr<nn::Linear> fc2 = register_module("fc2", std::make_shared<nn::Linear>(64, 1, true));
  Tensor forward(const Tensor& x) const { return fc2->forward(fc1->forward_gelu(x)); }
};

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  int status = 0;
  {
    auto world = comm::MpiProcessGroup::world();
    const int N = world->size(), rank = world->rank();
    constexpr int64_t B = 64;  // the global batch: B / N rows per rank
    SG_CHECK(B % N == 0, "zero2_mlp: the batch of ", B, " rows does not split over ", N, " ranks");

    MLP model;
    {
      autograd::NoGradGuard no_grad;
      uint64_t stream = 0;
      for (auto& [name, p] : model.named_parameters())  // the same seeded values on every rank
        copy_(p, randn(p.shape(), /*seed=*/1, stream++, 0.0, name.find("bias") != std::string::npos ? 0.0 : 0.5));
    }
    parallel::ZeroOptions options;
    options.stage = 2;  // gradients sharded as well as AdamW's state
    optim::AdamWConfig adam;
    adam.weight_decay = 0;
    parallel::ZeroOptimizer zero(model.named_parameters(), world, adam, options);
    zero.broadcast_parameters();

    double first = 0, loss = 0;
    for (int step = 0; step < 300; ++step) {
      // The global batch, x uniform in [-1, 1]; this rank's rows of it.
      const Tensor x = rand({B, 1}, /*seed=*/7, uint64_t(step), -1.0, 1.0);
      const Tensor xr = narrow(x, 0, rank * (B / N), B / N), yr = tanh(mul(xr, 3.0));
      autograd::Tape tape;
      Tensor mse;
      {
        autograd::TapeScope record(tape);
        mse = mean(square(sub(model.forward(xr), yr)));  // this rank's rows; ZeRO averages over ranks
      }
      tape.backward(mse);
      zero.finish_gradients();  // the last stripes' reduce-scatters (the others ran during backward)
      zero.step(3e-2, optim::clip_coefficient(zero.grad_norm(), 1.0));
      zero.zero_grad();
      Tensor global = from_vector<double>({item(mse)}, {1});  // the global batch's loss
      world->all_reduce(global, comm::ReduceOp::avg)->wait();
      loss = item(global);
      if (step == 0) first = loss;
      if (rank == 0 && (step % 50 == 0 || step == 299)) std::printf("step %3d | loss %.6f\n", step + 1, loss);
      std::fflush(stdout);
    }

    const MemStats mem = Ledger::global().stats(Device::cpu());
    const int64_t psi = zero.numel(), psi_p = zero.padded_numel();
    for (int r = 0; r < N; ++r, world->barrier()->wait()) {  // one rank at a time, in order
      if (r != rank) continue;
      std::printf("rank %d of %d | params %lld B (4Ψ = %lld) | gradient shard %lld B (4Ψp/N = %lld) | AdamW m, v "
                "%lld B (8Ψp/N = %lld)\n",
                rank, N, (long long)mem.cur(MemCategory::param), (long long)(4 * psi),
                (long long)mem.cur(MemCategory::grad), (long long)(4 * psi_p / N),
                (long long)mem.cur(MemCategory::optim_state), (long long)(8 * psi_p / N));
      std::fflush(stdout);
    }
    if (loss > first / 20) {
      std::fprintf(stderr, "zero2_mlp: the loss went from %g to %g only: it did not learn\n", first, loss);
      status = 1;
    }
  }
  comm::finalize();
  return status;
}
