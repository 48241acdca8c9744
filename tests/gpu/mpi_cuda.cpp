// The MPI backend with CUDA tensors, at 2 ranks sharing cuda:0 (host staging: NCCL refuses two
// ranks on one GPU, MPI does not). Every rank fills its inputs from its rank with one formula, so
// each can compute locally what a collective must return. Exits 77 (skipped) without a device.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include "tests/catch.h"
#include <algorithm>
#include <cstdio>

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"
#ifdef SG_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

using namespace sg;
using comm::ReduceOp;

namespace {

const Device gpu = Device::cuda(0);

// Rank r's element i: multiples of 0.25 below 8, exact in f32 and bf16, so sums are exact.
std::vector<float> values(int rank, int64_t n, int64_t first = 0) {
  std::vector<float> v(size_t(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float((rank + 1) * 0.5 + double((first + i) % 13) * 0.25 - 1.5);
  return v;
}
Tensor on_gpu(const std::vector<float>& v, DType dt) { return to(to(from_vector(v, {int64_t(v.size())}), dt), gpu); }

}  // namespace

TEST_CASE("MPI collectives on CUDA tensors of 2 ranks sharing one GPU equal the local computation", "[gpu][comm]") {
  auto pg = comm::MpiProcessGroup::world();
  const int n = pg->size(), r = pg->rank();
  const int64_t len = 1000003;  // odd, and large enough to cross several staging chunks
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dt));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      Tensor t = on_gpu(values(r, len), dt);
      pg->all_reduce(t, op)->wait();
      REQUIRE(t.device() == gpu);
      std::vector<float> want(size_t(len), op == ReduceOp::max ? -1e30f : 0.0f);
      for (int q = 0; q < n; ++q) {
        auto v = values(q, len);
        for (size_t i = 0; i < v.size(); ++i) want[i] = op == ReduceOp::max ? std::max(want[i], v[i]) : want[i] + v[i];
      }
      if (op == ReduceOp::avg)
        for (auto& w : want) w /= float(n);
      CHECK(to_vector<float>(t) == want);
    }
    // reduce_scatter: rank r keeps the sum of everybody's chunk r; all_gather puts the chunks back.
    const int64_t chunk = 4099;
    Tensor in = on_gpu(values(r, chunk * n), dt), out = zeros({chunk}, dt, gpu);
    pg->reduce_scatter(out, in)->wait();
    std::vector<float> want(size_t(chunk), 0.0f);
    for (int q = 0; q < n; ++q) {
      auto v = values(q, chunk, int64_t(r) * chunk);
      for (size_t i = 0; i < v.size(); ++i) want[i] += v[i];
    }
    CHECK(to_vector<float>(out) == want);
    Tensor all = zeros({chunk * n}, dt, gpu);
    pg->all_gather(all, on_gpu(values(r, chunk), dt))->wait();
    for (int q = 0; q < n; ++q) CHECK(to_vector<float>(narrow(all, 0, q * chunk, chunk)) == values(q, chunk));
    Tensor b = on_gpu(values(r, 777), dt);
    pg->broadcast(b, n - 1)->wait();
    CHECK(to_vector<float>(b) == values(n - 1, 777));
    // A ring of sends: each rank receives its left neighbour's values.
    Tensor s = on_gpu(values(r, 513), dt), got = zeros({513}, dt, gpu);
    auto send = pg->send(s, (r + 1) % n, 7);
    pg->recv(got, (r + n - 1) % n, 7)->wait();
    send->wait();
    CHECK(to_vector<float>(got) == values((r + n - 1) % n, 513));
  }
}

TEST_CASE("a dropped recv into a CUDA tensor is copied there once a later barrier reaps it", "[gpu][comm]") {
  auto pg = comm::MpiProcessGroup::world();
  const int n = pg->size(), r = pg->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t len = 300007;
  Tensor in = on_gpu(std::vector<float>(size_t(len), 0.0f), DType::f32);
  pg->recv(in, prev, 11);  // dropped: staged through the host, copied to the device when reaped
  pg->send(on_gpu(values(r, len), DType::f32), next, 11)->wait();
  pg->barrier()->wait();  // past it, every rank's send has been posted and completed
  pg->barrier()->wait();  // this call's start reaps the dropped recv, whose message is there
  CHECK(to_vector<float>(in) == values(prev, len));
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  comm::init();
  int rank = 0, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#ifdef SG_WITH_CUDA
  devices = cuda::device_count();
#endif
  int rc = 77;
  if (devices == 0) {
    if (rank == 0) std::printf("no CUDA device: the MPI-with-CUDA-tensors test is skipped\n");
  } else {
    rc = rank == 0 ? sg::testing::run_catch(argc, argv, {"--order", "decl"})
                   : sg::testing::run_catch(argc, argv, {"--order", "decl", "--reporter", "compact"});
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  comm::finalize();
  MPI_Finalize();
  return worst;
}
