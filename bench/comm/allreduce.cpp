// All-reduce bus bandwidth: a blocking ProcessGroup all-reduce (`all_reduce(t, sum, Sync::blocking)`:
// through the group's queue, run by the caller when the communication thread is idle) vs raw
// MPI_Allreduce on the calling thread, f32 sum; then how much of an async all-reduce (run by the
// communication thread) hides behind compute.
//
//   mpirun -np N sg_bench_allreduce [iterations=30]
//
// Per iteration every rank times one all-reduce after a barrier; the iteration's time is the
// slowest rank's, and the table shows the median over iterations. Raw and ProcessGroup iterations
// alternate so drift on a shared box hits both alike. busbw = bytes * 2(n-1)/n / time (the ring
// volume per rank, as nccl-tests reports it).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"

using namespace sg;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double slowest(double s) {
  double worst = 0;
  MPI_Allreduce(&s, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Both paths must produce sum over ranks of (rank + 1) before anything is timed.
bool validate(comm::ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  const float want = float(n * (n + 1) / 2);
  Tensor a = full({numel}, pg.rank() + 1), b = full({numel}, pg.rank() + 1);
  pg.all_reduce(a)->wait();
  MPI_Allreduce(MPI_IN_PLACE, b.data<float>(), int(numel), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  auto va = to_vector<float>(a), vb = to_vector<float>(b);
  return std::all_of(va.begin(), va.end(), [&](float x) { return x == want; }) &&
         std::all_of(vb.begin(), vb.end(), [&](float x) { return x == want; });
}

// A fixed chunk of the caller's own work: GEMMs on one thread (OMP_NUM_THREADS=1 in the command).
void compute(const Tensor& a, int reps) {
  Tensor acc = zeros(a.shape());
  for (int i = 0; i < reps; ++i) add_(acc, matmul(a, a));
}

}  // namespace

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  const int iters = argc > 1 ? std::stoi(argv[1]) : 30, warmup = 3;
  auto pg = comm::MpiProcessGroup::world();
  const int n = pg->size(), rank = pg->rank();
  if (rank == 0)
    std::printf("%d ranks, %d iterations (median), comm thread: %s\n\n"
                "| size | raw MPI time | raw busbw | ProcessGroup time | PG busbw | PG / raw |\n"
                "|---|---|---|---|---|---|\n",
                n, iters, comm::threaded() ? "yes" : "no (inline)");

  // 4 KiB shows the fixed cost of going through the group (validation, counters, the queue); the
  // rest is bandwidth.
  for (int64_t bytes : {int64_t(4) << 10, int64_t(1) << 20, int64_t(16) << 20, int64_t(64) << 20}) {
    const int64_t numel = bytes / 4;
    const std::string size = bytes < (1 << 20) ? std::to_string(bytes >> 10) + " KiB" : std::to_string(bytes >> 20) + " MiB";
    if (!validate(*pg, numel)) {
      std::fprintf(stderr, "rank %d: all-reduce results differ from n(n+1)/2 at %s\n", rank, size.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    Tensor t = zeros({numel});  // zeros stay zeros: no overflow, no denormals over iterations
    std::vector<double> raw, pgt;
    for (int it = 0; it < warmup + iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      MPI_Allreduce(MPI_IN_PLACE, t.data<float>(), int(numel), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double r = slowest(seconds_since(t0));
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      pg->all_reduce(t, comm::ReduceOp::sum, comm::Sync::blocking);
      double p = slowest(seconds_since(t0));
      if (it >= warmup) raw.push_back(r), pgt.push_back(p);
    }
    const double r = median(raw), p = median(pgt), algo = double(bytes) * 2 * (n - 1) / n;
    if (rank == 0)
      std::printf("| %s | %.3f ms | %.2f GB/s | %.3f ms | %.2f GB/s | %.3f |\n", size.c_str(), r * 1e3, algo / r / 1e9,
                  p * 1e3, algo / p / 1e9, r / p);
  }

  // Overlap: a 64 MiB all-reduce launched async while this thread runs a fixed chunk of GEMMs.
  const int64_t numel = int64_t(64) << 18;
  Tensor t = zeros({numel}), a = randn({256, 256}, 1, uint64_t(rank));
  int reps = 1;  // grow the chunk until alone it takes about as long as the all-reduce
  MPI_Barrier(MPI_COMM_WORLD);
  auto t0 = Clock::now();
  pg->all_reduce(t)->wait();
  const double comm_probe = slowest(seconds_since(t0));
  for (;;) {
    t0 = Clock::now();
    compute(a, reps);
    if (slowest(seconds_since(t0)) >= comm_probe || reps > 4096) break;
    reps *= 2;
  }
  std::vector<double> comm_only, compute_only, both;
  for (int it = 0; it < warmup + iters / 3; ++it) {
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = Clock::now();
    pg->all_reduce(t)->wait();
    double c = slowest(seconds_since(t0));
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = Clock::now();
    compute(a, reps);
    double k = slowest(seconds_since(t0));
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = Clock::now();
    auto work = pg->all_reduce(t);
    compute(a, reps);
    work->wait();
    double b = slowest(seconds_since(t0));
    if (it >= warmup) comm_only.push_back(c), compute_only.push_back(k), both.push_back(b);
  }
  const double c = median(comm_only), k = median(compute_only), b = median(both);
  if (rank == 0)
    std::printf("\noverlap, 64 MiB all-reduce + %d GEMMs 256^3: comm %.1f ms, compute %.1f ms, sum %.1f ms, "
                "overlapped %.1f ms (%.0f%% of the shorter one hidden)\n",
                reps, c * 1e3, k * 1e3, (c + k) * 1e3, b * 1e3, 100 * std::clamp((c + k - b) / std::min(c, k), 0.0, 1.0));
  pg.reset();
  comm::finalize();
  return 0;
}
