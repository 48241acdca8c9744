// --on-nonfinite: the first NaN/Inf among the loss and the named gradients, found by name.
#include "tests/catch.h"
#include <cmath>
#include <limits>

#include "autograd/ops.h"
#include "optim/nonfinite.h"

using namespace sg;

TEST_CASE("the first non-finite gradient is named with its element, finite ones pass", "[optim]") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  optim::NamedTensors g = {{"a", full({2, 3}, 1.0)}, {"b", from_vector<float>({1, 2, float(inf), float(nan)}, {4})},
                           {"c", full({3}, nan)}, {"d", Tensor()}};
  optim::NonFinite f = optim::first_nonfinite(1.5, g);
  REQUIRE(f.found());
  CHECK(f.name == "b");
  CHECK(f.index == 2);
  CHECK(std::isinf(f.value));
  CHECK(optim::nonfinite_message(f, 12) == "step 12: the gradient of 'b' is not finite (element 2 is inf)");
  // the loss comes first
  f = optim::first_nonfinite(nan, g);
  CHECK(f.name == "loss");
  CHECK_THAT(optim::nonfinite_message(f, 3), Catch::Contains("step 3: the loss is not finite"));
  // half precision gradients; finite values near the f32 limit are not flagged
  g = {{"big", full({4}, 3e38)}, {"h", to(from_vector<float>({0, -float(inf)}, {2}), DType::bf16)}};
  f = optim::first_nonfinite(g);
  CHECK(f.name == "h");
  CHECK(f.index == 1);
  CHECK(f.value < 0);
  CHECK_FALSE(optim::first_nonfinite(0.5, {{"a", full({2}, 1.0)}, {"big", full({4}, 3e38)}}).found());
}

TEST_CASE("the on-nonfinite policy is stop or skip", "[optim]") {
  CHECK(optim::parse_nonfinite_policy("stop") == optim::NonFinitePolicy::stop);
  CHECK(optim::parse_nonfinite_policy("skip") == optim::NonFinitePolicy::skip);
  CHECK_THROWS_WITH(optim::parse_nonfinite_policy("ignore"), Catch::Contains("--on-nonfinite: 'ignore'"));
}
