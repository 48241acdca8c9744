// Shared by the multi-rank tests: the world group, summing a scalar over a group, and the
// contract check "same losses as the single-process run".
#pragma once
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <vector>

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"

namespace sg::testing {

// One world group for the whole test executable (creating it is collective).
inline std::shared_ptr<comm::ProcessGroup> world() {
  static std::shared_ptr<comm::ProcessGroup> w = comm::MpiProcessGroup::world();
  return w;
}

inline double sum_over(comm::ProcessGroup& group, double x) {
  Tensor t = from_vector<double>({x}, {1});
  group.all_reduce(t)->wait();
  return item(t);
}

// f32 contract: every step's loss within relative 1e-5 of the single-process one (got may be a
// shorter run than the reference: its steps are compared).
inline void require_same_losses(const std::vector<double>& got, const std::vector<double>& reference) {
  REQUIRE(!got.empty());
  REQUIRE(got.size() <= reference.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i);
    REQUIRE(std::abs(got[i] - reference[i]) <= 1e-5 * std::abs(reference[i]));
  }
}

}  // namespace sg::testing
