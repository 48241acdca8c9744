// Sharded checkpoints on real ranks: every rank writes its pieces collectively, rank 0 commits the
// index, and every rank reads back its part of another layout (and the whole tensors).
#include <unistd.h>

#include <filesystem>
#include <numeric>

#include "parallel/sharded_checkpoint.h"
#include "tests/mpi/mpi_support.h"

using namespace sg;
using namespace sg::ckpt;
namespace fs = std::filesystem;

namespace {

Tensor numbered(const Shape& s, float base) {
  const int64_t n = std::accumulate(s.begin(), s.end(), int64_t(1), std::multiplies<>());
  return reshape(add(to(arange(n), DType::f32), full({n}, base)), s);
}
bool same(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && to_vector<float>(a) == to_vector<float>(b); }

// Global state whose split dims divide by 2 and 4.
std::map<std::string, Tensor> global_state(float base) {
  return {{"h.0.attn.c_attn.weight", numbered({24, 4}, base)},
          {"h.0.mlp.c_proj.weight", numbered({4, 8}, base + 100)},
          {"h.0.ln_1.bias", numbered({4}, base + 200)},
          {"h.0.attn.c_attn.weight.exp_avg", numbered({24, 4}, base + 300)}};
}

LocalView tp_view(const std::string& name, const Shape& g, int rank, int size) {
  if (name.rfind("h.0.attn.c_attn.weight", 0) == 0) return split_view(name, g, 0, 3, rank, size);
  if (name == "h.0.mlp.c_proj.weight") return split_view(name, g, 1, 1, rank, size);
  return whole_view(name, g);
}

// This rank's flat run [lo, lo + n) of each tensor, as ZeRO-3 would hold it.
std::pair<int64_t, int64_t> flat_run(int64_t numel, int rank, int size) {
  const int64_t chunk = (numel + size - 1) / size, lo = std::min(numel, rank * chunk);
  return {lo, std::min(chunk, numel - lo)};
}

}  // namespace

TEST_CASE("ranks save tensor-parallel pieces collectively and read back flat shards and whole tensors", "[ckpt]") {
  auto world = testing::world();
  const int rank = world->rank(), size = world->size();
  Tensor pid = from_vector<int64_t>({int64_t(::getpid())}, {1});
  world->broadcast(pid, 0)->wait();  // one directory per run, named by rank 0's pid
  const fs::path run = fs::temp_directory_path() / ("sg_mpi_ckpt_sharded_" + std::to_string(int64_t(item(pid))));
  auto g = global_state(0);
  std::vector<Piece> mine;
  MemorySource src(g);
  for (const auto& [name, t] : g) {
    LocalView v = tp_view(name, t.shape(), rank, size);
    if (v.local_shape == t.shape() && rank != 0) continue;  // replicated: rank 0's copy
    Tensor local = zeros(v.local_shape);
    read_local(src, v, local);
    for (auto& p : pieces_of(v, local)) mine.push_back(p);
  }
  const std::string where = save_sharded(run.string(), 5, mine, {{"step", 5}}, {{"n_head", "2"}}, *world, 1);
  REQUIRE(where == (run / "step_00000005").string());
  REQUIRE(fs::exists(run / "step_00000005" / ("rank_0000" + std::to_string(size - 1) + ".safetensors")));
  auto c = open_checkpoint("auto:" + run.string());
  REQUIRE(c->state()["step"] == 5);
  for (const auto& [name, t] : g) {
    INFO(name << " on rank " << rank);
    auto [lo, n] = flat_run(t.numel(), rank, size);
    Tensor got = zeros({n});
    read_local(*c, whole_view(name, t.shape()), lo, got);
    CHECK(same(got, contiguous(narrow(reshape(t, {t.numel()}), 0, lo, n))));
    CHECK(same(c->tensor(name), t));
  }
  // A second save from flat shards, read back under tensor parallelism; keep 1 drops step 5.
  auto g2 = global_state(1000);
  mine.clear();
  for (const auto& [name, t] : g2) {
    auto [lo, n] = flat_run(t.numel(), rank, size);
    if (n > 0)
      for (auto& p : pieces_of(whole_view(name, t.shape()), lo, contiguous(narrow(reshape(t, {t.numel()}), 0, lo, n))))
        mine.push_back(p);
  }
  save_sharded(run.string(), 6, mine, {{"step", 6}}, {}, *world, 1);
  c = open_checkpoint(run.string());
  REQUIRE(c->state()["step"] == 6);
  REQUIRE_FALSE(fs::exists(run / "step_00000005"));
  MemorySource want(g2);
  for (const auto& [name, t] : g2) {
    LocalView v = tp_view(name, t.shape(), rank, size);
    Tensor got = zeros(v.local_shape), expect = zeros(v.local_shape);
    read_local(*c, v, got);
    read_local(want, v, expect);
    CHECK(same(got, expect));
  }
  world->barrier()->wait();
  if (rank == 0) fs::remove_all(run);
}

TEST_CASE("a save that one rank's commit refuses fails on every rank, and the previous checkpoint stays", "[ckpt]") {
  auto world = testing::world();
  const int rank = world->rank();
  Tensor pid = from_vector<int64_t>({int64_t(::getpid())}, {1});
  world->broadcast(pid, 0)->wait();
  const fs::path run = fs::temp_directory_path() / ("sg_mpi_ckpt_refused_" + std::to_string(int64_t(item(pid))));
  const Tensor w = reshape(to(arange(12), DType::f32), {3, 4});
  // Rank 0's copy alone: a good checkpoint at step 1.
  std::vector<Piece> mine;
  if (rank == 0) mine = pieces_of(whole_view("w", w.shape()), w);
  save_sharded(run.string(), 1, mine, {{"step", 1}}, {}, *world);
  // Every rank's copy of the replicated tensor: the commit on rank 0 finds the pieces overlapping.
  // Every rank throws (before, the others waited in the last barrier, or returned a step
  // directory that does not exist).
  const std::vector<Piece> all = pieces_of(whole_view("w", w.shape()), w);
  if (world->size() > 1) {
    REQUIRE_THROWS_WITH(save_sharded(run.string(), 2, all, {{"step", 2}}, {}, *world),
                        Catch::Contains(rank == 0 ? "overlaps another piece" : "another rank failed"));
    CHECK_FALSE(fs::exists(run / "step_00000002"));
    CHECK(open_checkpoint("auto:" + run.string())->state()["step"] == 1);
  }
  world->barrier()->wait();  // the group is still in step: the next collective goes through
  if (rank == 0) fs::remove_all(run);
}
