// Dropout: the mask is never stored. Forward and backward draw it from the same Philox
// (seed, stream), so backward (and a recomputed forward) sees exactly the same mask.
#include "autograd/ops/common.h"

namespace sg {

using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

DropoutGenerator& dropout_generator() {
  static thread_local DropoutGenerator g;
  return g;
}

static Tensor apply_mask(const Tensor& x, double p, uint64_t seed, uint64_t stream) {
  Tensor X = detail::operand(x);
  Tensor out = empty(X.shape(), X.dtype(), X.device());
  SG_KERNEL(X.device(), dropout)(X.dtype(), out.data_ptr(), X.data_ptr(), X.numel(), p, seed, stream);
  return detail::narrow_result(out, x.dtype());
}

Tensor dropout(const Tensor& x, double p) {
  SG_CHECK(p >= 0 && p < 1, "dropout: probability ", p, " is outside [0, 1)");
  if (p == 0) return x;
  auto& gen = dropout_generator();
  const uint64_t seed = gen.seed, stream = gen.next_stream++;
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = apply_mask(x, p, seed, stream);
  }
  if (needs_grad({x}))
    record("dropout", {x}, {out}, [p, seed, stream](const TensorList& g) { return TensorList{apply_mask(g[0], p, seed, stream)}; });
  return out;
}

}  // namespace sg
