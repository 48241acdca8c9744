// The NCCL backend at world size 1 on a real GPU: every collective runs and gives the local
// result, on CUDA tensors and on CPU tensors staged through the device; the world also comes from
// a file and a tcp rendezvous. Exits 77 (CTest: skipped) on a machine without a CUDA device or without NCCL.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "autograd/ops.h"
#include "core/ledger.h"
#include "kernels/cuda/runtime.h"
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
  REQUIRE(g->counters()[comm::CommKind::all_reduce].calls == 12);  // 4 dtypes x 3; the subgroup counts its own
  REQUIRE(sub->counters()[comm::CommKind::all_reduce].calls == 1);
}

TEST_CASE("CPU tensors ride through the device: every collective gives the local result on the host", "[gpu][nccl]") {
  auto mpi = comm::MpiProcessGroup::world();
  auto g = comm::nccl_world(*mpi, 0);
  const Device gpu = Device::cuda(0);
  const int64_t staged_before = Ledger::global().stats(gpu).cur(MemCategory::comm_buffer);
  std::vector<double> v = {1, 2, 3, 4, 5, 6, 7};
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::i64, DType::i32}) {
    INFO(dtype_name(dt));
    Tensor t = to(from_vector(v, {7}), dt);
    REQUIRE(t.device().is_cpu());
    g->all_reduce(t, comm::ReduceOp::sum)->wait();
    REQUIRE(to_vector<double>(t) == v);
    g->all_reduce(t, comm::ReduceOp::max)->wait();
    REQUIRE(to_vector<double>(t) == v);
  }
  // test() that sees the collective done copies the result back too, without a wait()
  Tensor polled = from_vector(v, {7});
  auto w = g->all_reduce(polled, comm::ReduceOp::avg);
  while (!w->test()) {
  }
  REQUIRE(to_vector<double>(polled) == v);
  Tensor in = from_vector(v, {7}), out = zeros({7}, DType::f64);
  g->reduce_scatter(out, in)->wait();
  REQUIRE(to_vector<double>(out) == v);
  Tensor gathered = zeros({7}, DType::f64);
  g->all_gather(gathered, in)->wait();
  REQUIRE(to_vector<double>(gathered) == v);
  g->all_gather(gathered, gathered)->wait();  // in place: the input is this rank's (only) chunk
  REQUIRE(to_vector<double>(gathered) == v);
  g->broadcast(in, 0)->wait();
  g->reduce(in, 0)->wait();
  REQUIRE(to_vector<double>(in) == v);
  g->barrier()->wait();
  // counted like any other tensor (world size 1: the calls, no bytes), and no staging left behind
  REQUIRE(g->counters()[comm::CommKind::all_reduce].calls == 11);
  REQUIRE(g->counters()[comm::CommKind::all_reduce].bytes == 0);
  REQUIRE(Ledger::global().stats(gpu).cur(MemCategory::comm_buffer) == staged_before);
  // a tensor on another device than the group's is refused by name
  if (cuda::device_count() > 1)
    REQUIRE_THROWS_WITH(g->all_reduce(to(from_vector(v, {7}), Device::cuda(1))),
                        Catch::Contains("is neither on the CPU nor on this group's device cuda:0"));
}

TEST_CASE("the file and tcp rendezvous at world size 1: RANK/WORLD_SIZE from the environment, the file removed", "[gpu][nccl]") {
  const std::filesystem::path id = std::filesystem::temp_directory_path() / ("sg_nccl_id_" + std::to_string(::getpid()));
  std::filesystem::remove(id);
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  for (const std::string& spec : {"file:" + id.string(), std::string("tcp:localhost:29531")}) {
    INFO(spec);
    auto g = comm::nccl_world_from_rendezvous(comm::parse_rendezvous(spec), 0, 30);
    REQUIRE(g->backend_name() == "nccl");
    REQUIRE(g->rank() == 0);
    REQUIRE(g->size() == 1);
    REQUIRE_FALSE(std::filesystem::exists(id));  // every rank joined: rank 0 removed it
    std::vector<float> v = {1, 2, 3};
    Tensor dev = to(from_vector(v, {3}), Device::cuda(0)), host = from_vector(v, {3});
    g->all_reduce(dev)->wait();
    g->all_reduce(host)->wait();
    REQUIRE(to_vector<float>(dev) == v);
    REQUIRE(to_vector<float>(host) == v);
    auto metrics = g->split(0, 0);  // what train makes of it for its metrics
    REQUIRE(metrics->size() == 1);
    metrics->barrier()->wait();
  }
  // a file left by an earlier job is refused, not trusted
  const comm::Rendezvous file = comm::parse_rendezvous("file:" + id.string());
  std::ofstream(id) << "stale";
  REQUIRE_THROWS_WITH(comm::nccl_world_from_rendezvous(file, 0, 30), Catch::Contains("already exists"));
  std::filesystem::remove(id);
  ::unsetenv("WORLD_SIZE");
  REQUIRE_THROWS_WITH(comm::nccl_world_from_rendezvous(file, 0, 30),
                      Catch::Contains("--rendezvous file: needs WORLD_SIZE in the environment"));
  ::unsetenv("RANK");
  ::unsetenv("LOCAL_RANK");
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
