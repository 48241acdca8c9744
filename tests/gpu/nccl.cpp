// The NCCL backend at world size 1 on a real GPU: every collective runs and gives the local
// result. Exits 77 (CTest: skipped) on a machine without a CUDA device or without NCCL.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/comm/nccl_backend.h"

using namespace sg;

TEST_CASE("every NCCL collective runs on one GPU and gives the local result", "[gpu][nccl]") {
  auto mpi = comm::MpiProcessGroup::world();
  auto g = comm::nccl_world(*mpi, 0);
  REQUIRE(g->size() == 1);
  Device gpu = Device::cuda(0);
  std::vector<float> v = {1, 2, 3, 4, 5, 6, 7};
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    INFO(dtype_name(dt));
    Tensor t = to(to(from_vector(v, {7}), dt), gpu);
    g->all_reduce(t, comm::ReduceOp::sum)->wait();
    REQUIRE(to_vector<float>(t) == v);
    g->all_reduce(t, comm::ReduceOp::avg)->wait();
    g->all_reduce(t, comm::ReduceOp::max)->wait();
    REQUIRE(to_vector<float>(t) == v);
  }
  Tensor in = to(from_vector(v, {7}), gpu), out = to(zeros({7}), gpu);
  g->reduce_scatter(out, in)->wait();
  REQUIRE(to_vector<float>(out) == v);
  Tensor gathered = to(zeros({7}), gpu);
  g->all_gather(gathered, in)->wait();
  REQUIRE(to_vector<float>(gathered) == v);
  g->broadcast(in, 0)->wait();
  g->reduce(in, 0)->wait();
  REQUIRE(to_vector<float>(in) == v);
  g->barrier()->wait();
  auto sub = g->split(0, 0);
  REQUIRE(sub->size() == 1);
  sub->all_reduce(in)->wait();
  REQUIRE(to_vector<float>(in) == v);
  // 4 dtypes x (sum, avg, max) on the world group; the subgroup counts its own.
  REQUIRE(g->counters()[comm::CommKind::all_reduce].calls == 12);
  REQUIRE(sub->counters()[comm::CommKind::all_reduce].calls == 1);
}

int main(int argc, char** argv) {
  comm::init(&argc, &argv);
  if (!comm::nccl_available()) {
    std::printf("no CUDA device (or a build without NCCL): the NCCL test is skipped\n");
    comm::finalize();
    return 77;
  }
  int rc = Catch::Session().run(argc, argv);
  comm::finalize();
  return rc;
}
