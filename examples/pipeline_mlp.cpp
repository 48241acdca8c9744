// Pipeline parallelism on one page: an 8-layer MLP (Linear + GELU) learns y = tanh(x w) with its
// layers split into stages over the ranks mpirun starts, each global batch cut into 8 micro-batches.
// The schedule is data (parallel/pp/schedule.h): for each rank, the ordered (stage, micro-batch,
// forward | backward) actions. A forward records its stage on a tape of its own (one per
// micro-batch in flight), takes its input from the previous stage's rank and sends its output on;
// a backward receives the output's gradient from the next stage's rank, runs that tape and sends
// the input's gradient back. Weights add up their gradients over the micro-batches, and one AdamW
// step per rank updates its own stages after a global-norm clip (one all-reduce of the squares).
//
// The arithmetic is the one process's, micro-batch by micro-batch, so every layout prints the same
// losses. What differs is memory and idle time: under gpipe a rank holds every micro-batch's
// activations until the backwards start, under 1f1b at most (ranks - its rank) of them;
// interleaved (2 stages per rank) shortens the bubble from (p-1)/m to (p-1)/(2m).
//   ./build/examples/sg_example_pipeline_mlp                         one process, one stage
//   mpirun -np 4 ./build/examples/sg_example_pipeline_mlp 1f1b       gpipe | 1f1b | interleaved
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "models/module.h"
#include "optim/optim.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/pp/schedule.h"

using namespace sg;
namespace pp = sg::parallel::pp;

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  int status = 0;
  auto group = comm::MpiProcessGroup::world();
  const int p = group->size(), rank = group->rank();
  try {
    const std::string kind = argc > 1 ? argv[1] : "1f1b";
    constexpr int L = 8, W = 32, B = 64, m = 8, R = B / m;  // layers, width, global batch, micro-batches, rows each
    const pp::Schedule schedule = pp::make_schedule(kind, p, m, kind == "interleaved" ? 2 : 1);
    const int S = schedule.stages(), per_stage = L / S;
    SG_CHECK(L % S == 0, L, " layers do not split into ", S, " stages");

    // Every rank builds only its own stages' layers, each seeded by its place in the whole model,
    // so that any split holds the same weights as one process.
    std::vector<std::unique_ptr<nn::Linear>> layers(L);
    optim::NamedTensors mine;
    for (int l = 0; l < L; ++l) {
      if (schedule.rank_of(l / per_stage) != rank) continue;
      layers[l] = std::make_unique<nn::Linear>(l == 0 ? 4 : W, l == L - 1 ? 1 : W, true);
      autograd::NoGradGuard no_grad;
      copy_(layers[l]->weight, randn(layers[l]->weight.shape(), /*seed=*/1, uint64_t(l), 0.0, l == 0 ? 0.5 : 0.18));
      for (auto& [name, t] : layers[l]->named_parameters()) mine.emplace_back("layer" + std::to_string(l) + "." + name, t);
    }
    optim::AdamWConfig adam;
    optim::AdamW optimizer(mine, adam);
    const Tensor w = from_vector<float>({1.5f, -2.0f, 0.5f, 1.0f}, {4, 1});

    const auto stage_forward = [&](int s, Tensor h) {
      for (int l = s * per_stage; l < (s + 1) * per_stage; ++l)
        h = l == L - 1 ? layers[l]->forward(h) : layers[l]->forward_gelu(h);
      return h;
    };
    // Tags tell apart the stages and micro-batches a pair of ranks exchanges (MPI keeps each
    // pair's messages of one tag in order, so steps need none of their own).
    const auto tag = [&](int s, int micro) { return s * m + micro; };

    double first = 0, loss = 0;
    int64_t activation_peak = 0;
    for (int step = 0; step < 200; ++step) {
      const Tensor x = rand({B, 4}, /*seed=*/7, uint64_t(step), -1.0, 1.0), y = tanh(matmul(x, w));
      Ledger::global().reset_peaks(Device::cpu());
      // Per stage and micro-batch in flight: its tape, its input (a leaf whose gradient goes back)
      // and its output (kept until its backward). Sends are waited for at the end of the step.
      std::vector<std::unique_ptr<autograd::Tape>> tapes(S * m);
      std::vector<Tensor> inputs(S * m), outputs(S * m);
      std::vector<std::shared_ptr<comm::Work>> sends;
      double loss_sum = 0;
      for (const pp::Action& a : schedule.per_rank[rank]) {
        const int s = a.stage, i = s * m + a.micro;
        if (a.phase == pp::Phase::forward) {
          Tensor in = narrow(x, 0, a.micro * R, R);
          if (s > 0) {  // the previous stage's output
            in = empty({R, W});
            group->recv(in, schedule.rank_of(s - 1), tag(s, a.micro))->wait();
            in.set_requires_grad(true);
          }
          inputs[i] = in;
          tapes[i] = std::make_unique<autograd::Tape>();
          {
            autograd::TapeScope record(*tapes[i]);
            outputs[i] = stage_forward(s, in);
            // The last stage ends in the loss: the micro-batch's share of the global batch's MSE.
            if (s == S - 1) outputs[i] = mul(sum(square(sub(outputs[i], narrow(y, 0, a.micro * R, R)))), 1.0 / B);
          }
          if (s == S - 1) loss_sum += item(outputs[i]);
          else sends.push_back(group->send(outputs[i], schedule.rank_of(s + 1), tag(s + 1, a.micro)));
        } else {
          if (s == S - 1) {
            tapes[i]->backward(outputs[i]);
          } else {  // the next stage's gradient of this output
            Tensor grad = empty({R, W});
            group->recv(grad, schedule.rank_of(s + 1), tag(s, a.micro))->wait();
            tapes[i]->backward({outputs[i]}, {grad});
          }
          if (s > 0) sends.push_back(group->send(inputs[i].grad(), schedule.rank_of(s - 1), tag(s - 1, a.micro)));
          tapes[i].reset();  // the stage's activations go with its tape (what was sent stays until the step ends)
        }
      }
      for (auto& work : sends) work->wait();
      activation_peak = std::max(activation_peak, Ledger::global().stats(Device::cpu()).pk(MemCategory::activation));

      // The global gradient norm needs every stage's squares; then each rank steps its own layers.
      std::vector<Tensor> grads;
      for (auto& [name, t] : mine) grads.push_back(t.grad());
      Tensor norm2 = from_vector<double>({sum_squares(grads)}, {1});
      group->all_reduce(norm2)->wait();
      optimizer.step(3e-3, optim::clip_coefficient(std::sqrt(item(norm2)), 1.0));
      for (auto& [name, t] : mine) t.set_grad(Tensor());

      Tensor global = from_vector<double>({loss_sum}, {1});  // only the last stage's rank has it
      group->broadcast(global, schedule.rank_of(S - 1))->wait();
      loss = item(global);
      if (step == 0) first = loss;
      if (rank == 0 && (step % 25 == 0 || step == 199)) std::printf("step %3d | loss %.9g\n", step + 1, loss);
      std::fflush(stdout);
    }

    // What each rank ran and held: its actions in order, its weights' bytes, its activation peak.
    for (int r = 0; r < p; ++r, group->barrier()->wait()) {
      if (r != rank) continue;
      std::string actions;
      for (const pp::Action& a : schedule.per_rank[rank])
        actions += str(a.phase == pp::Phase::forward ? " F" : " B", a.micro, schedule.chunks > 1 ? str(".", a.stage / p) : "");
      int64_t numel = 0;
      for (auto& [name, t] : mine) numel += t.numel();
      std::printf("rank %d of %d | %s | stages", rank, p, schedule.name.c_str());
      for (int s = rank; s < S; s += p) std::printf(" %d (layers %d-%d)", s, s * per_stage, (s + 1) * per_stage - 1);
      std::printf(" | params %lld B (4 x %lld) | activation peak %lld B |%s\n",
                  (long long)Ledger::global().stats(Device::cpu()).cur(MemCategory::param), (long long)numel,
                  (long long)activation_peak, actions.c_str());
      std::fflush(stdout);
    }
    if (rank == 0)
      std::printf("bubble of the schedule with equal stage times (backward = 2 x forward): %.1f%% of busy time\n",
                  100 * pp::simulate(schedule, 1.0, 2.0).bubble_fraction());
    if (loss > first / 20) {
      std::fprintf(stderr, "pipeline_mlp: the loss went from %g to %g only: it did not learn\n", first, loss);
      status = 1;
    }
  } catch (const Error& e) {  // a layout or schedule that cannot be: the same on every rank, before any message
    if (rank == 0) std::fprintf(stderr, "pipeline_mlp: %s\n", e.what());
    status = 2;
  }
  group.reset();
  comm::finalize();
  return status;
}
