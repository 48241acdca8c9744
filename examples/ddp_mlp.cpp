// DistributedDataParallel on one page: every rank holds the whole MLP and trains on its rows of each
// global batch; DDP averages the gradients so that every rank takes the same AdamW step. Two ideas
// are shown with the process group's counters:
//   - buckets: the gradients are packed into buckets (here 8 KiB, so the MLP spans several), each
//     all-reduced from the grad-ready hooks as soon as backward has produced all of it, while the
//     rest of backward runs: every bucket's all-reduce is issued before finish_gradients() is called;
//   - no_sync: with 2 micro-batches per step, the first backward only accumulates locally
//     (set_sync(false)) and the second communicates: the bytes of one step, 2(N-1)/N·4Ψ in all,
//     whatever the number of micro-batches.
//   ./build/examples/sg_example_ddp_mlp                       one process
//   mpirun -np 4 ./build/examples/sg_example_ddp_mlp          four ranks, the same losses
#include <cstdio>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "models/module.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/ddp.h"

using namespace sg;

struct MLP : nn::Module {
  std::vector<std::shared_ptr<nn::Linear>> layers;
  MLP() {
    for (int i = 0; i < 4; ++i)
      layers.push_back(register_module(str("fc", i), std::make_shared<nn::Linear>(i == 0 ? 4 : 48, i == 3 ? 1 : 48, true)));
  }
  Tensor forward(Tensor h) const {
    for (size_t i = 0; i < layers.size(); ++i) h = i + 1 < layers.size() ? layers[i]->forward_gelu(h) : layers[i]->forward(h);
    return h;
  }
};

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  int status = 0;
  {
    auto world = comm::MpiProcessGroup::world();
    const int N = world->size(), rank = world->rank();
    constexpr int64_t B = 64, micro = 2;  // the global batch: B / N rows per rank, in 2 micro-batches
    SG_CHECK(B % (N * micro) == 0, "ddp_mlp: the batch of ", B, " rows does not split over ", N, " ranks x ", micro,
             " micro-batches");
    const int64_t rows = B / N / micro;

    MLP model;
    {
      autograd::NoGradGuard no_grad;
      uint64_t stream = 0;
      for (auto& [name, p] : model.named_parameters())  // the same seeded values on every rank
        if (name.find("bias") == std::string::npos) copy_(p, randn(p.shape(), /*seed=*/1, stream++, 0.0, 0.3));
    }
    parallel::DdpOptions options;
    options.bucket_bytes = 8 << 10;
    parallel::DistributedDataParallel ddp(model.named_parameters(), world, options);
    ddp.broadcast_parameters();
    optim::AdamW adam(model.named_parameters(), optim::AdamWConfig{});
    const Tensor w = from_vector<float>({1.5f, -2.0f, 0.5f, 1.0f}, {4, 1});

    double first = 0, loss = 0;
    int64_t during_backward = 0;
    comm::CommCounters sent;
    for (int step = 0; step < 300; ++step) {
      const Tensor x = rand({B, 4}, /*seed=*/7, uint64_t(step), -1.0, 1.0), y = tanh(matmul(x, w));
      world->reset_counters();
      double mine = 0;
      for (int m = 0; m < micro; ++m) {
        ddp.set_sync(m == micro - 1);  // only the last micro-batch's backward all-reduces
        const int64_t at = (rank * micro + m) * rows;
        autograd::Tape tape;
        Tensor mse;
        {
          autograd::TapeScope record(tape);
          // this micro-batch's share of the rank's mean; DDP averages the ranks
          mse = mul(mean(square(sub(model.forward(narrow(x, 0, at, rows)), narrow(y, 0, at, rows)))), 1.0 / micro);
        }
        tape.backward(mse);
        mine += item(mse);
      }
      during_backward = world->counters()[comm::CommKind::all_reduce].calls;  // issued by the hooks
      ddp.finish_gradients();
      sent = world->counters();
      adam.step(3e-3, optim::clip_coefficient(optim::global_grad_norm(model.parameters()), 1.0));
      model.zero_grad();
      Tensor global = from_vector<double>({mine}, {1});  // the global batch's loss
      world->all_reduce(global, comm::ReduceOp::avg)->wait();
      loss = item(global);
      if (step == 0) first = loss;
      if (rank == 0 && (step % 50 == 0 || step == 299)) std::printf("step %3d | loss %.6g\n", step + 1, loss);
      std::fflush(stdout);
    }

    const int64_t psi = model.num_parameters();
    for (int r = 0; r < N; ++r, world->barrier()->wait()) {  // one rank at a time, in order
      if (r != rank) continue;
      std::printf("rank %d of %d | Ψ %lld in %d buckets | all-reduces a step of %lld micro-batches %lld, %lld issued "
                  "during backward | bytes %lld (2(N-1)/N·4Ψ = %lld)\n",
                  rank, N, (long long)psi, ddp.num_buckets(), (long long)micro,
                  (long long)sent[comm::CommKind::all_reduce].calls,
                  (long long)during_backward, (long long)sent[comm::CommKind::all_reduce].bytes,
                  (long long)(2 * (N - 1) * 4 * psi / N));
      std::fflush(stdout);
    }
    if (loss > first / 20) {
      std::fprintf(stderr, "ddp_mlp: the loss went from %g to %g only: it did not learn\n", first, loss);
      status = 1;
    }
  }
  comm::finalize();
  return status;
}
