// DeviceMesh arithmetic and layout validation: no ranks needed, so these run in the plain test binary.
#include <catch2/catch.hpp>

#include "parallel/comm/mesh.h"

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
