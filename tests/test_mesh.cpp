// DeviceMesh arithmetic, layout validation and the simulated world (its ranks are threads): no MPI
// ranks needed, so these run in the plain test binary.
#include "tests/catch.h"

#include <chrono>
#include <thread>

#include "parallel/comm/mesh.h"
#include "parallel/comm/sim_backend.h"

using namespace sg;
using comm::DeviceMesh;
using comm::validate_mesh;

TEST_CASE("mesh ranks: tp innermost, rank = (dp*pp + pp_idx)*tp + tp_idx", "[mesh]") {
  DeviceMesh m(2, 3, 4);  // 24 ranks
  CHECK(m.world() == 24);
  for (int r = 0; r < m.world(); ++r) CHECK(m.rank_of(m.coord_of(r)) == r);
  CHECK(m.coord_of(17) == comm::MeshCoord{1, 1, 1});  // (1*3 + 1)*4 + 1
  CHECK(m.tp_ranks(17) == std::vector<int>{16, 17, 18, 19});
  CHECK(m.pp_ranks(17) == std::vector<int>{13, 17, 21});
  CHECK(m.dp_ranks(17) == std::vector<int>{5, 17});
  CHECK_THROWS_WITH(m.coord_of(24), "DeviceMesh: rank 24 is outside a mesh of 24 ranks");
  CHECK_THROWS_WITH(DeviceMesh(2, 0, 1), "DeviceMesh: dp 2, pp 0, tp 1 must all be at least 1");
}

TEST_CASE("validate_mesh accepts a layout that divides evenly and says what each rank holds", "[mesh]") {
  // GPT-2 small on 16 ranks: tp 2, pp 2 -> dp 4; batch 32 -> 8 per dp rank -> 4 micro-batches of 2.
  auto p = validate_mesh(16, 2, 2, 12, 12, 50304, 32, 2);
  CHECK(p.mesh.dp() == 4);
  CHECK(p.mesh.pp() == 2);
  CHECK(p.mesh.tp() == 2);
  CHECK(p.heads_per_rank == 6);
  CHECK(p.vocab_rows_per_rank == 25152);
  CHECK(p.layers_per_stage == 6);
  CHECK(p.batch_per_rank == 8);
  CHECK(p.micro_batches == 4);
}

TEST_CASE("validate_mesh refuses, before any work, a layout that does not fit, with the reason", "[mesh]") {
  CHECK_THROWS_WITH(validate_mesh(4, 0, 1, 4, 4, 64, 8, 1), "--tp 0: tensor-parallel size must be at least 1");
  CHECK_THROWS_WITH(validate_mesh(4, 1, -1, 4, 4, 64, 8, 1), "--pp -1: pipeline stages must be at least 1");
  CHECK_THROWS_WITH(validate_mesh(4, 3, 1, 4, 4, 64, 8, 1),
                    "--tp 3 --pp 1: world size 4 is not divisible by tp x pp = 3");
  CHECK_THROWS_WITH(validate_mesh(3, 3, 1, 4, 4, 63, 9, 1), "--tp 3: 4 heads cannot be split 3 ways");
  CHECK_THROWS_WITH(validate_mesh(4, 4, 1, 8, 4, 50257, 8, 1),
                    "--tp 4: 50257 vocabulary rows cannot be split 4 ways (pad the vocabulary to a multiple of 4)");
  CHECK_THROWS_WITH(validate_mesh(8, 1, 8, 4, 4, 64, 8, 1), "--pp 8: 4 layers are fewer than 8 stages");
  CHECK_THROWS_WITH(validate_mesh(3, 1, 3, 4, 4, 64, 9, 1), "--pp 3: 4 layers cannot be split evenly into 3 stages");
  CHECK_THROWS_WITH(validate_mesh(8, 2, 1, 4, 4, 64, 6, 1),
                    "--batch-size 6: cannot be split across 4 data-parallel ranks (world 8 / tp 2 / pp 1)");
  CHECK_THROWS_WITH(validate_mesh(4, 1, 1, 4, 4, 64, 8, 3),
                    "--micro-batch-size 3: does not divide the per-rank batch 2 (--batch-size 8 / dp 4)");
  CHECK_THROWS_WITH(validate_mesh(4, 1, 1, 4, 4, 64, 8, 0), "--micro-batch-size 0: must be at least 1");
}

// The simulated world of `train --simulate`: ranks as threads whose split is a real rendezvous.
namespace {
template <class F>
void on_every_rank(const std::vector<std::shared_ptr<comm::SimProcessGroup>>& world, F f) {
  std::vector<std::thread> threads;
  for (auto& g : world) threads.emplace_back([&f, g] { f(*g); });
  for (auto& t : threads) t.join();
}
}  // namespace

TEST_CASE("a simulated world splits as MPI_Comm_split does: by key, ties by rank, and color -1 gets no group", "[mesh]") {
  auto world = comm::simulated_world(6);
  std::vector<int> new_rank(6, -2), new_size(6, -2);
  on_every_rank(world, [&](comm::ProcessGroup& g) {
    const int r = g.rank();
    // colour 0: ranks 0, 2, 4 with keys 0, -2, -4 (reversed); colour 1: ranks 1 and 5 with key 7
    // (a tie: by rank); rank 3 joins none.
    auto sub = g.split(r == 3 ? -1 : r % 2, r % 2 == 0 ? -r : 7);
    new_rank[size_t(r)] = sub ? sub->rank() : -1;
    new_size[size_t(r)] = sub ? sub->size() : -1;
  });
  CHECK(new_rank == std::vector<int>{2, 0, 1, -1, 0, 1});
  CHECK(new_size == std::vector<int>{3, 2, 3, -1, 3, 2});
}

TEST_CASE("mesh groups over a simulated world: every rank gets its coordinates' groups", "[mesh]") {
  DeviceMesh mesh(2, 3, 4);
  auto world = comm::simulated_world(mesh.world());
  std::vector<comm::MeshGroups> got(size_t(mesh.world()));
  on_every_rank(world, [&](comm::ProcessGroup& g) { got[size_t(g.rank())] = comm::create_mesh_groups(mesh, g); });
  for (int r = 0; r < mesh.world(); ++r) {
    INFO("rank " << r);
    const comm::MeshCoord c = mesh.coord_of(r);
    CHECK(got[size_t(r)].coord == c);
    CHECK(got[size_t(r)].tp->rank() == c.tp);
    CHECK(got[size_t(r)].tp->size() == 4);
    CHECK(got[size_t(r)].pp->rank() == c.pp);
    CHECK(got[size_t(r)].pp->size() == 3);
    CHECK(got[size_t(r)].dp->rank() == c.dp);
    CHECK(got[size_t(r)].dp->size() == 2);
    CHECK(got[size_t(r)].tp->backend_name() == "sim");
  }
}

TEST_CASE("a simulated rank that fails ends the others' rendezvous with an error, not a hang", "[mesh]") {
  auto world = comm::simulated_world(3);
  std::vector<std::string> error(3);
  const auto t0 = std::chrono::steady_clock::now();
  on_every_rank(world, [&](comm::SimProcessGroup& g) {
    try {
      if (g.rank() == 1) {
        g.abort();  // what train --simulate does for a rank whose setup threw
        return;
      }
      g.split(0, 0);
    } catch (const Error& e) {
      error[size_t(g.rank())] = e.what();
    }
  });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  CHECK(error[0].find("another rank of the simulated world failed") != std::string::npos);
  CHECK(error[2].find("another rank of the simulated world failed") != std::string::npos);
}
