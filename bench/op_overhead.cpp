// The engine's own host cost per op: `add` of two 8-element f32 CPU tensors, repeated, so the
// arithmetic is negligible and what is timed is dispatch, allocation, the ledger and (on a tape)
// recording. On a GPU each op pays this plus its launch; multiply by the ops per step to see how
// much of a step is the engine rather than the kernels.
//
//   OMP_NUM_THREADS=1 ./build/bench/sg_bench_op_overhead [ops]
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "autograd/ops.h"
#include "autograd/tape.h"

using namespace sg;

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  using clock = std::chrono::steady_clock;
  auto us_per_op = [](clock::time_point from, clock::time_point to, int ops) {
    return std::chrono::duration<double, std::micro>(to - from).count() / ops;
  };
  Tensor a = randn({8}, 1, 1), b = randn({8}, 2, 1);
  for (int i = 0; i < 1000; ++i) a = add(a, b);  // warm the allocator
  const auto t0 = clock::now();
  for (int i = 0; i < n; ++i) a = add(a, b);
  const auto t1 = clock::now();

  a.set_requires_grad(true);
  autograd::Tape tape;
  autograd::TapeScope scope(tape);
  const int taped = n / 10;  // the tape keeps every node: fewer ops
  Tensor x = a;
  const auto t2 = clock::now();
  for (int i = 0; i < taped; ++i) x = add(x, b);
  const auto t3 = clock::now();
  std::printf("{\"ops\": %d, \"us_per_op_no_grad\": %.3f, \"us_per_op_on_tape\": %.3f}\n", n,
              us_per_op(t0, t1, n), us_per_op(t2, t3, taped));
}
