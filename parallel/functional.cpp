#include "parallel/functional.h"

#include "autograd/ops.h"
#include "autograd/tape.h"

namespace sg::parallel {

namespace {
int64_t wrap(int64_t dim, const Tensor& x, const char* op) {
  const int64_t n = x.dim();
  SG_CHECK(dim >= -n && dim < n, op, ": dimension ", dim, " out of range for ", x.describe());
  return dim < 0 ? dim + n : dim;
}

// Records y = op(x) with the given backward, when x needs it.
void record_mirror(const char* name, const Tensor& x, const Tensor& y, comm::ProcessGroup& group,
                   Tensor (*mirror)(const Tensor&, comm::ProcessGroup&)) {
  if (!autograd::needs_grad({x})) return;
  comm::ProcessGroup* g = &group;
  autograd::record(name, {x}, {y}, [g, mirror](const autograd::TensorList& dy) {
    return autograd::TensorList{mirror(dy[0], *g)};
  });
}

Tensor reduced(const Tensor& x, comm::ProcessGroup& g) {
  Tensor y = clone(contiguous(x));
  g.all_reduce(y, comm::ReduceOp::sum, comm::Sync::blocking);
  return y;
}
Tensor same(const Tensor& x, comm::ProcessGroup&) { return x; }
Tensor gathered_last(const Tensor& x, comm::ProcessGroup& g) { return all_gather_along(x, -1, g); }
Tensor split_last(const Tensor& x, comm::ProcessGroup& g) { return contiguous(split_along(x, -1, g)); }
Tensor gathered_seq(const Tensor& x, comm::ProcessGroup& g) { return all_gather_along(x, 1, g); }
Tensor scattered_seq(const Tensor& x, comm::ProcessGroup& g) { return reduce_scatter_along(x, 1, g); }

// y = f(x) computed without recording, then y's node mirrors f.
Tensor mirrored(const char* name, const Tensor& x, comm::ProcessGroup& group,
                Tensor (*forward)(const Tensor&, comm::ProcessGroup&),
                Tensor (*backward)(const Tensor&, comm::ProcessGroup&)) {
  Tensor y;
  {
    autograd::NoGradGuard ng;
    y = forward(x, group);
    // A fresh handle, so the node's output is never x itself (identity forward).
    y = autograd::detach(y);
  }
  record_mirror(name, x, y, group, backward);
  return y;
}
}  // namespace

Tensor all_gather_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group) {
  autograd::NoGradGuard ng;
  dim = wrap(dim, x, "all_gather_along");
  const int64_t p = group.size();
  Tensor in = contiguous(x);
  Shape parts = x.shape();
  parts.insert(parts.begin(), p);  // [p, ...x]
  Tensor out = empty(parts, x.dtype(), x.device());
  group.all_gather(out, in, comm::Sync::blocking);
  // [p, s0 .. s_dim ..] -> [s0 .., p, s_dim, ..] -> merge p into dim
  std::vector<int64_t> order;
  for (int64_t d = 1; d <= dim; ++d) order.push_back(d);
  order.push_back(0);
  for (int64_t d = dim + 1; d <= x.dim(); ++d) order.push_back(d);
  Shape full = x.shape();
  full[size_t(dim)] *= p;
  return contiguous(reshape(permute(out, order), full));
}

Tensor reduce_scatter_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group) {
  autograd::NoGradGuard ng;
  dim = wrap(dim, x, "reduce_scatter_along");
  const int64_t p = group.size(), n = x.size(dim);
  SG_CHECK(n % p == 0, "reduce_scatter_along: dim ", dim, " of ", x.describe(), " does not split ", p, " ways");
  Shape split = x.shape();
  split[size_t(dim)] = n / p;
  split.insert(split.begin() + dim, p);  // [s0 .., p, n/p, ..]
  std::vector<int64_t> order{dim};
  for (int64_t d = 0; d < int64_t(split.size()); ++d)
    if (d != dim) order.push_back(d);
  Tensor in = contiguous(permute(reshape(x, split), order));  // [p, s0 .., n/p, ..]
  Shape mine = x.shape();
  mine[size_t(dim)] = n / p;
  Tensor out = empty(mine, x.dtype(), x.device());
  group.reduce_scatter(out, in, comm::ReduceOp::sum, comm::Sync::blocking);
  return out;
}

Tensor split_along(const Tensor& x, int64_t dim, comm::ProcessGroup& group) {
  dim = wrap(dim, x, "split_along");
  const int64_t p = group.size(), n = x.size(dim);
  SG_CHECK(n % p == 0, "split_along: dim ", dim, " of ", x.describe(), " does not split ", p, " ways");
  return narrow(x, dim, group.rank() * (n / p), n / p);
}

Tensor all_reduce_sum(const Tensor& x, comm::ProcessGroup& group) {
  return mirrored("all_reduce_sum", x, group, reduced, reduced);
}
Tensor copy_to_region(const Tensor& x, comm::ProcessGroup& group) {
  return mirrored("copy_to_region", x, group, same, reduced);
}
Tensor reduce_from_region(const Tensor& x, comm::ProcessGroup& group) {
  return mirrored("reduce_from_region", x, group, reduced, same);
}
Tensor scatter_to_region(const Tensor& x, comm::ProcessGroup& group) {
  return mirrored("scatter_to_region", x, group, split_last, gathered_last);
}
Tensor gather_from_region(const Tensor& x, comm::ProcessGroup& group) {
  return mirrored("gather_from_region", x, group, gathered_last, split_last);
}
Tensor all_gather_seq(const Tensor& x, comm::ProcessGroup& group) {
  SG_CHECK(x.dim() >= 2, "all_gather_seq: expected [B, T, ...], got ", x.describe());
  return mirrored("all_gather_seq", x, group, gathered_seq, scattered_seq);
}
Tensor reduce_scatter_seq(const Tensor& x, comm::ProcessGroup& group) {
  SG_CHECK(x.dim() >= 2, "reduce_scatter_seq: expected [B, T, ...], got ", x.describe());
  return mirrored("reduce_scatter_seq", x, group, scattered_seq, gathered_seq);
}

}  // namespace sg::parallel
