// Dropout: the mask is never stored. Forward and backward draw it from the same Philox
// (seed, stream, index), so backward (and a recomputed forward) sees exactly the same mask.
#include "autograd/ops/common.h"

namespace sg {

using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

DropoutGenerator& dropout_generator() {
  static thread_local DropoutGenerator g;
  return g;
}

namespace {

// One draw: rows of row_len elements, row r on stream + r, element j at index first + j.
struct Draw {
  double p;
  uint64_t seed, stream;
  int64_t row_len;
  uint64_t first;
};

Tensor apply_mask(const Tensor& x, const Draw& d) {
  Tensor X = detail::operand(x);
  Tensor out = empty(X.shape(), X.dtype(), X.device());
  SG_KERNEL(X.device(), dropout)(X.dtype(), out.data_ptr(), X.data_ptr(), X.numel(), d.p, d.seed, d.stream, d.row_len,
                                 d.first);
  return detail::narrow_result(out, x.dtype());
}

Tensor masked(const Tensor& x, const Draw& d) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = apply_mask(x, d);
  }
  if (needs_grad({x})) record("dropout", {x}, {out}, [d](const TensorList& g) { return TensorList{apply_mask(g[0], d)}; });
  return out;
}

// Site streams: bit 63 set (plain dropout's counter never reaches it), then the step, the site and
// the global row, each in its own bits.
constexpr int kRowBits = 24, kSiteBits = 16, kStepBits = 23;

}  // namespace

Tensor dropout(const Tensor& x, double p) {
  SG_CHECK(p >= 0 && p < 1, "dropout: probability ", p, " is outside [0, 1)");
  auto& gen = dropout_generator();
  if (p == 0 || !gen.active) return x;
  return masked(x, Draw{p, gen.seed, gen.next_stream++, std::max<int64_t>(1, x.numel()), 0});
}

Tensor dropout(const Tensor& x, double p, int64_t site) {
  SG_CHECK(p >= 0 && p < 1, "dropout: probability ", p, " is outside [0, 1)");
  const auto& gen = dropout_generator();
  if (p == 0 || !gen.active) return x;
  SG_CHECK(x.dim() == 3, "dropout at site ", site, ": expected an activation [rows, T, C], got ", shape_str(x.shape()));
  const DropoutPlace& at = gen.place;
  const int64_t rows = x.size(0);
  SG_CHECK(site >= 0 && site < (int64_t(1) << kSiteBits), "dropout: site ", site, " outside [0, 2^16)");
  SG_CHECK(at.step >= 0 && at.step < (int64_t(1) << kStepBits), "dropout: step ", at.step, " outside [0, 2^23)");
  SG_CHECK(at.row0 >= 0 && at.row0 + rows <= (int64_t(1) << kRowBits), "dropout: global rows ", at.row0, "..",
           at.row0 + rows, " outside [0, 2^24)");
  SG_CHECK(at.t0 >= 0, "dropout: first position ", at.t0, " is negative");
  const uint64_t stream = (uint64_t(1) << 63) | (uint64_t(at.step) << (kSiteBits + kRowBits)) |
                          (uint64_t(site) << kRowBits) | uint64_t(at.row0);
  if (x.numel() == 0) return x;  // no rows, or rows of nothing
  return masked(x, Draw{p, gen.seed, stream, x.numel() / rows, uint64_t(at.t0 * x.size(2))});
}

}  // namespace sg
