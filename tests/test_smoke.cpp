#include <catch2/catch.hpp>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"

using namespace sg;

TEST_CASE("matmul of known matrices and its gradient in f64", "[ops]") {
  Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector<float>({1, 0, 0, 1, 1, 1}, {3, 2});
  auto c = to_vector<float>(matmul(a, b));
  REQUIRE(c == std::vector<float>{4, 5, 10, 11});
  Tensor x = randn({3, 4}, 1, 1, 0, 1, DType::f64), w = randn({4, 5}, 1, 2, 0, 1, DType::f64);
  auto r = autograd::gradcheck([](const autograd::TensorList& in) { return matmul(in[0], in[1]); }, {x, w});
  INFO(r.message);
  REQUIRE(r.ok);
}
