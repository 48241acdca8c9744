// ZeRO-3 (FSDP full_shard) over a model of one's own, on one page: an MLP of four hidden layers
// learns y = tanh(x w), each hidden layer and the head a unit of FullyShardedDataParallel, the
// input layer in the root unit. Every rank keeps a 1/N shard of each unit's flat parameters,
// gradients and AdamW state; a unit is all-gathered just before its forward and released right
// after, gathered again when the backward reaches it, and its gradients are reduce-scattered (the
// average) as soon as they are all ready. The model's forward and each unit's run through
// Module::hooked, where FSDP's gather and release hooks sit.
// At the end each rank prints what the ledger held against ZeRO-3's formulas: 4Ψp/N of
// parameters between steps, the root and one layer on top of that at the peak, and per step
// 2·(N-1)/N·4Ψp bytes all-gathered and (N-1)/N·4Ψp reduce-scattered (3Ψ in all; Ψp: every unit
// padded to a multiple of N).
//   ./build/examples/sg_example_zero3_mlp                       one process
//   mpirun -np 4 ./build/examples/sg_example_zero3_mlp          four ranks, the same losses
#include <cstdio>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/module.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/fsdp.h"

using namespace sg;

struct MLP : nn::Module {
  std::shared_ptr<nn::Linear> in = register_module("in", std::make_shared<nn::Linear>(4, 64, true));
  std::vector<std::shared_ptr<nn::Linear>> hidden;
  std::shared_ptr<nn::Linear> head;
  MLP() {
    for (int i = 0; i < 4; ++i) hidden.push_back(register_module(str("h", i), std::make_shared<nn::Linear>(64, 64, true)));
    head = register_module("head", std::make_shared<nn::Linear>(64, 1, true));
  }
  Tensor forward(const Tensor& x) const {
    return hooked([&] {  // the root unit: gathered for the whole forward
      Tensor h = in->forward_gelu(x);
      for (const auto& l : hidden) h = l->hooked([&] { return l->forward_gelu(h); });
      return head->hooked([&] { return head->forward(h); });
    });
  }
};

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  int status = 0;
  {
    auto world = comm::MpiProcessGroup::world();
    const int N = world->size(), rank = world->rank();
    constexpr int64_t B = 64;  // the global batch: B / N rows per rank
    SG_CHECK(B % N == 0, "zero3_mlp: the batch of ", B, " rows does not split over ", N, " ranks");

    MLP model;
    {
      autograd::NoGradGuard no_grad;
      uint64_t stream = 0;
      for (auto& [name, p] : model.named_parameters())  // the same seeded values on every rank
        if (name.find("bias") == std::string::npos) copy_(p, randn(p.shape(), /*seed=*/1, stream++, 0.0, 0.3));
    }
    std::vector<nn::Module*> units;
    for (auto& l : model.hidden) units.push_back(l.get());
    units.push_back(model.head.get());
    optim::AdamWConfig adam;
    parallel::FullyShardedDataParallel fsdp(model, units, world, adam);  // full_shard: ZeRO-3
    const Tensor w = from_vector<float>({1.5f, -2.0f, 0.5f, 1.0f}, {4, 1});

    double first = 0, loss = 0;
    MemStats mem;
    comm::CommCounters sent;
    for (int step = 0; step < 300; ++step) {
      const Tensor x = rand({B, 4}, /*seed=*/7, uint64_t(step), -1.0, 1.0);
      const Tensor xr = narrow(x, 0, rank * (B / N), B / N), yr = tanh(matmul(xr, w));
      world->reset_counters();
      Ledger::global().reset_peaks(Device::cpu());
      autograd::Tape tape;
      Tensor mse;
      {
        autograd::TapeScope record(tape);
        mse = mean(square(sub(model.forward(xr), yr)));  // this rank's rows; the reduce-scatter averages
      }
      tape.backward(mse);        // gathers each unit again as it is reached, reduce-scatters its gradients
      fsdp.finish_gradients();   // waits for the last reductions
      fsdp.step(3e-3, optim::clip_coefficient(fsdp.grad_norm(), 1.0));
      mem = Ledger::global().stats(Device::cpu());
      sent = world->counters();
      fsdp.zero_grad();
      Tensor global = from_vector<double>({item(mse)}, {1});  // the global batch's loss
      world->all_reduce(global, comm::ReduceOp::avg)->wait();
      loss = item(global);
      if (step == 0) first = loss;
      if (rank == 0 && (step % 50 == 0 || step == 299)) std::printf("step %3d | loss %.6g\n", step + 1, loss);
      std::fflush(stdout);
    }

    // Ψp: each unit padded to a multiple of N; the root (in) is unit 0, the first hidden layer unit 1.
    // (One process shards nothing, so nothing is gathered on top.)
    const int64_t psi_p = fsdp.padded_numel(), root = fsdp.unit_padded_numel(0), layer = fsdp.unit_padded_numel(1);
    const int64_t gathered = N > 1 ? 4 * (root + layer) : 0;
    for (int r = 0; r < N; ++r, world->barrier()->wait()) {  // one rank at a time, in order
      if (r != rank) continue;
      std::printf("rank %d of %d | %d units, Ψ %lld, Ψp %lld | params %lld B (4Ψp/N = %lld), peak %lld B (+ root and "
                  "one layer = %lld) | gradient shard %lld B | AdamW m, v %lld B (8Ψp/N = %lld) | all-gathered %lld B "
                  "(2(N-1)/N·4Ψp = %lld), reduce-scattered %lld B ((N-1)/N·4Ψp = %lld)\n",
                  rank, N, fsdp.num_units(), (long long)fsdp.numel(), (long long)psi_p,
                  (long long)mem.cur(MemCategory::param), (long long)(4 * psi_p / N),
                  (long long)mem.pk(MemCategory::param), (long long)(4 * psi_p / N + gathered),
                  (long long)mem.cur(MemCategory::grad), (long long)mem.cur(MemCategory::optim_state),
                  (long long)(8 * psi_p / N), (long long)sent[comm::CommKind::all_gather].bytes,
                  (long long)(2 * (N - 1) * 4 * psi_p / N), (long long)sent[comm::CommKind::reduce_scatter].bytes,
                  (long long)((N - 1) * 4 * psi_p / N));
      std::fflush(stdout);
    }
    if (loss > first / 20) {
      std::fprintf(stderr, "zero3_mlp: the loss went from %g to %g only: it did not learn\n", first, loss);
      status = 1;
    }
  }
  comm::finalize();
  return status;
}
