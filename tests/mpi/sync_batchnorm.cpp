// SyncBatchNorm on each rank's slice equals BatchNorm over the whole batch: outputs, input
// gradients, parameter gradients (summed over ranks) and running statistics.
#include "tests/catch.h"
#include <cmath>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "autograd/tape.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/sync_batchnorm.h"

using namespace sg;

namespace {
double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}
}  // namespace

TEST_CASE("SyncBatchNorm over ranks equals BatchNorm over the whole batch, forward and backward", "[syncbn]") {
  auto world = comm::MpiProcessGroup::world();
  const int n = world->size(), r = world->rank();
  for (Shape shape : {Shape{6, 3}, Shape{4, 3, 5}}) {
    INFO("per-rank shape " << shape_str(shape));
    Shape full_shape = shape;
    full_shape[0] *= n;
    Tensor x_full = randn(full_shape, 3, 1, 0.5, 2.0), probe = randn(full_shape, 3, 2);
    // reference: one BatchNorm over everything
    nn::BatchNorm ref(3);
    Tensor xr = clone(x_full);
    xr.set_requires_grad(true);
    autograd::Tape t1;
    Tensor lr;
    {
      autograd::TapeScope s(t1);
      lr = sum(mul(ref.forward(xr), probe));
    }
    t1.backward(lr);
    // synced: each rank its rows
    parallel::SyncBatchNorm sbn(3, world);
    const int64_t rows = shape[0];
    Tensor xs = clone(narrow(x_full, 0, r * rows, rows));
    xs.set_requires_grad(true);
    autograd::Tape t2;
    Tensor ys, ls;
    {
      autograd::TapeScope s(t2);
      ys = sbn.forward(xs);
      ls = sum(mul(ys, narrow(probe, 0, r * rows, rows)));
    }
    t2.backward(ls);
    Tensor y_ref;
    {
      autograd::NoGradGuard ng;
      nn::BatchNorm again(3);
      y_ref = narrow(again.forward(x_full), 0, r * rows, rows);
    }
    REQUIRE(max_abs(to_vector<float>(ys), to_vector<float>(y_ref)) < 1e-5);
    REQUIRE(max_abs(to_vector<float>(xs.grad()), to_vector<float>(narrow(xr.grad(), 0, r * rows, rows))) < 1e-5);
    for (auto [mine, theirs] : {std::pair{sbn.weight, ref.weight}, std::pair{sbn.bias, ref.bias}}) {
      Tensor g = clone(mine.grad());
      world->all_reduce(g)->wait();  // what DDP's gradient sum would produce
      REQUIRE(max_abs(to_vector<float>(g), to_vector<float>(theirs.grad())) < 1e-4);
    }
    REQUIRE(max_abs(to_vector<float>(sbn.running_mean), to_vector<float>(ref.running_mean)) < 1e-6);
    REQUIRE(max_abs(to_vector<float>(sbn.running_var), to_vector<float>(ref.running_var)) < 1e-5);
  }
}

TEST_CASE("BatchNorm's gradients pass an f64 finite-difference check", "[syncbn]") {
  auto fn = [](const autograd::TensorList& in) {
    nn::BatchNorm bn(3, 1e-5, 0.1, DType::f64);
    return bn.forward(in[0]);
  };
  auto res = autograd::gradcheck(fn, {randn({5, 3}, 1, 1, 0, 1, DType::f64)});
  INFO(res.message);
  REQUIRE(res.ok);
}
