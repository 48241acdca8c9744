// Elementwise ops with broadcasting, scalar ops, unary activations and reductions, each with its
// backward next to it.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "autograd/ops/common.h"

namespace sg {

using autograd::detach;
using autograd::needs_grad;
using autograd::record;
using detail::TensorList;
using detail::wrap_dim;

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    SG_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
             " do not broadcast (", da, " vs ", db, " at dim ", i, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// Strides that read t as if expanded to shape (0 on broadcast dims).
static kernels::Dims broadcast_strides(const Tensor& t, const Shape& shape) {
  kernels::Dims s(shape.size(), 0);
  size_t off = shape.size() - size_t(t.dim());
  for (size_t i = 0; i < size_t(t.dim()); ++i) s[i + off] = t.shape()[i] == 1 ? 0 : t.strides()[i];
  return s;
}

static Tensor binary_forward(kernels::Binary op, const Tensor& a, const Tensor& b, const char* name) {
  detail::check_same_device(name, a, b);
  SG_CHECK(a.dtype() == b.dtype(), name, ": dtypes ", dtype_name(a.dtype()), " and ", dtype_name(b.dtype()),
           " differ (cast one with to())");
  detail::check_floating(name, a);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  DType cd = detail::compute_dtype(a);
  Tensor x = cd == a.dtype() ? a : to(a, cd);
  Tensor y = cd == b.dtype() ? b : to(b, cd);
  Tensor out = empty(shape, cd, a.device());
  SG_KERNEL(a.device(), binary)(op, cd, out.data_ptr(), x.data_ptr(), broadcast_strides(x, shape), y.data_ptr(),
                                broadcast_strides(y, shape), shape);
  return detail::narrow_result(out, a.dtype());
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = binary_forward(kernels::Binary::add, a, b, "add");
  }
  if (needs_grad({a, b})) {
    Shape sa = a.shape(), sb = b.shape();
    record("add", {a, b}, {out}, [sa, sb](const TensorList& g) { return TensorList{sum_to(g[0], sa), sum_to(g[0], sb)}; });
  }
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = binary_forward(kernels::Binary::sub, a, b, "sub");
  }
  if (needs_grad({a, b})) {
    Shape sa = a.shape(), sb = b.shape();
    record("sub", {a, b}, {out},
           [sa, sb](const TensorList& g) { return TensorList{sum_to(g[0], sa), sum_to(neg(g[0]), sb)}; });
  }
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = binary_forward(kernels::Binary::mul, a, b, "mul");
  }
  if (needs_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    Tensor keep_a = gb ? detach(a) : Tensor(), keep_b = ga ? detach(b) : Tensor();
    Shape sha = a.shape(), shb = b.shape();
    record("mul", {a, b}, {out}, [keep_a, keep_b, sha, shb](const TensorList& g) {
      return TensorList{keep_b.defined() ? sum_to(mul(g[0], keep_b), sha) : Tensor(),
                        keep_a.defined() ? sum_to(mul(g[0], keep_a), shb) : Tensor()};
    });
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = binary_forward(kernels::Binary::div, a, b, "div");
  }
  if (needs_grad({a, b})) {
    Tensor keep_a = detach(a), keep_b = detach(b);
    record("div", {a, b}, {out}, [keep_a, keep_b](const TensorList& g) {
      Tensor ga = sum_to(div(g[0], keep_b), keep_a.shape());
      Tensor gb = sum_to(neg(div(mul(g[0], keep_a), mul(keep_b, keep_b))), keep_b.shape());
      return TensorList{ga, gb};
    });
  }
  return out;
}

namespace {

// The ops without a backward refuse inputs that would need one, rather than cut the gradient off.
void refuse_grad(const char* op, const TensorList& inputs) {
  SG_CHECK(!autograd::needs_grad(inputs), op, ": has no gradient, and an input requires one while a tape records; "
           "detach() it, or compute under autograd::NoGradGuard");
}

}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) {
  refuse_grad("maximum", {a, b});
  autograd::NoGradGuard ng;
  return binary_forward(kernels::Binary::max, a, b, "maximum");
}

// Runs a unary kernel; the op's node is recorded by the caller.
static Tensor unary_forward(kernels::Unary op, const Tensor& a, double alpha, const char* name) {
  detail::check_floating(name, a);
  autograd::NoGradGuard ng;
  Tensor x = detail::operand(a);
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  SG_KERNEL(a.device(), unary)(op, x.dtype(), out.data_ptr(), x.data_ptr(), x.numel(), alpha);
  return detail::narrow_result(out, a.dtype());
}

// dx = dy * f'(saved) through the kernel's derivative table.
static Tensor unary_grad(kernels::Unary op, const Tensor& dy, const Tensor& saved) {
  Tensor g = detail::operand(dy), s = detail::operand(saved);
  Tensor dx = empty(g.shape(), g.dtype(), g.device());
  SG_KERNEL(g.device(), unary_backward)(op, g.dtype(), dx.data_ptr(), g.data_ptr(), s.data_ptr(), g.numel());
  return detail::narrow_result(dx, dy.dtype());
}

Tensor add(const Tensor& a, double s) {
  Tensor out = unary_forward(kernels::Unary::add_scalar, a, s, "add");
  if (needs_grad({a})) record("add_scalar", {a}, {out}, [](const TensorList& g) { return TensorList{g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double s) {
  Tensor out = unary_forward(kernels::Unary::scale, a, s, "mul");
  if (needs_grad({a})) record("mul_scalar", {a}, {out}, [s](const TensorList& g) { return TensorList{mul(g[0], s)}; });
  return out;
}

Tensor neg(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::neg, a, 0, "neg");
  if (needs_grad({a})) record("neg", {a}, {out}, [](const TensorList& g) { return TensorList{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::exp, a, 0, "exp");
  if (needs_grad({a})) {
    Tensor y = detach(out);
    record("exp", {a}, {out}, [y](const TensorList& g) { return TensorList{unary_grad(kernels::Unary::exp, g[0], y)}; });
  }
  return out;
}

Tensor log(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::log, a, 0, "log");
  if (needs_grad({a})) {
    Tensor x = detach(a);
    record("log", {a}, {out}, [x](const TensorList& g) { return TensorList{div(g[0], x)}; });
  }
  return out;
}

Tensor sqrt(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::sqrt, a, 0, "sqrt");
  if (needs_grad({a})) {
    Tensor y = detach(out);
    record("sqrt", {a}, {out}, [y](const TensorList& g) { return TensorList{div(mul(g[0], 0.5), y)}; });
  }
  return out;
}

Tensor tanh(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::tanh, a, 0, "tanh");
  if (needs_grad({a})) {
    Tensor y = detach(out);  // tanh' = 1 - y^2: the output is all backward needs
    record("tanh", {a}, {out}, [y](const TensorList& g) { return TensorList{unary_grad(kernels::Unary::tanh, g[0], y)}; });
  }
  return out;
}

Tensor square(const Tensor& a) {
  Tensor out = unary_forward(kernels::Unary::square, a, 0, "square");
  if (needs_grad({a})) {
    Tensor x = detach(a);
    record("square", {a}, {out}, [x](const TensorList& g) { return TensorList{mul(mul(g[0], x), 2.0)}; });
  }
  return out;
}

Tensor pow(const Tensor& a, double p) {
  Tensor out = unary_forward(kernels::Unary::pow, a, p, "pow");
  if (needs_grad({a})) {
    Tensor x = detach(a);
    record("pow", {a}, {out}, [x, p](const TensorList& g) {
      autograd::NoGradGuard ng;
      if (p == 0) return TensorList{zeros_like(g[0])};  // a constant (0 * x^-1 would be NaN at 0)
      return TensorList{mul(g[0], mul(unary_forward(kernels::Unary::pow, x, p - 1, "pow"), p))};
    });
  }
  return out;
}

#define SG_ACTIVATION(fn, op)                                                                        \
  Tensor fn(const Tensor& a) {                                                                       \
    Tensor out = unary_forward(kernels::Unary::op, a, 0, #fn);                                       \
    if (needs_grad({a})) {                                                                           \
      Tensor x = detach(a);                                                                          \
      record(#fn, {a}, {out}, [x](const TensorList& g) { return TensorList{unary_grad(kernels::Unary::op, g[0], x)}; }); \
    }                                                                                                \
    return out;                                                                                      \
  }
SG_ACTIVATION(relu, relu)
SG_ACTIVATION(gelu, gelu)
SG_ACTIVATION(silu, silu)
#undef SG_ACTIVATION

// ---- reductions ----

// Reduces one dim of a contiguous tensor, keeping it as size 1.
static Tensor reduce_dim(kernels::Reduce op, const Tensor& x, int64_t dim) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.shape()[size_t(d)];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.shape()[size_t(d)];
  Shape s = x.shape();
  s[size_t(dim)] = 1;
  Tensor out = empty(s, x.dtype(), x.device());
  SG_KERNEL(x.device(), reduce)(op, x.dtype(), out.data_ptr(), x.data_ptr(), outer, x.shape()[size_t(dim)], inner);
  return out;
}

// The dims a reduction names, wrapped and sorted; each at most once. A 0-d tensor's dim 0 (or -1)
// is itself, as in PyTorch: nothing to reduce.
static std::vector<int64_t> reduction_dims(const Tensor& a, std::vector<int64_t> dims, const char* name) {
  for (auto& d : dims) d = wrap_dim(d, std::max<int64_t>(a.dim(), 1), name);
  std::sort(dims.begin(), dims.end());
  SG_CHECK(std::adjacent_find(dims.begin(), dims.end()) == dims.end(), name, ": a dim appears more than once in the ",
           "dims of ", shape_str(a.shape()));
  if (a.dim() == 0) dims.clear();
  return dims;
}

// Reduces dims (reduction_dims) in the op's compute dtype and multiplies by scale there, before
// the result is rounded back to a's dtype (an f16 mean never holds its sum in f16).
static Tensor reduce_dims(kernels::Reduce op, const Tensor& a, std::vector<int64_t> dims, bool keepdim, const char* name,
                          double scale = 1.0) {
  detail::check_floating(name, a);
  dims = reduction_dims(a, std::move(dims), name);
  Tensor x = detail::operand(a);
  if (dims.empty()) x = clone(x);  // nothing to reduce: still a new tensor, never the input's own handle
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) x = reduce_dim(op, x, *it);
  if (scale != 1.0) x = mul(x, scale);
  if (!keepdim) {
    Shape s;
    for (int64_t d = 0; d < a.dim(); ++d)
      if (!std::binary_search(dims.begin(), dims.end(), d)) s.push_back(a.shape()[size_t(d)]);
    x = x.with_layout(Layout{s, contiguous_strides(s), x.offset()});
  }
  return detail::narrow_result(x, a.dtype());
}

// sum (scale 1) and mean (scale 1/n): the reduction and its gradient, g * scale spread back over
// the reduced dims.
static Tensor scaled_sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim, bool average,
                         const char* name) {
  const std::vector<int64_t> reduced = reduction_dims(a, dims, name);
  Shape kept = a.shape();
  int64_t n = 1;
  for (auto d : reduced) n *= std::exchange(kept[size_t(d)], 1);
  const double scale = average ? 1.0 / double(n) : 1.0;
  Tensor out;
  {
    autograd::NoGradGuard ng;
    out = reduce_dims(kernels::Reduce::sum, a, reduced, keepdim, name, scale);
  }
  if (needs_grad({a})) {
    record(name, {a}, {out}, [in_shape = a.shape(), kept, scale](const TensorList& g) {
      const Tensor g0 = scale == 1.0 ? g[0] : mul(g[0], scale);  // scaled while it is small
      return TensorList{contiguous(expand(reshape(g0, kept), in_shape))};
    });
  }
  return out;
}

static std::vector<int64_t> all_dims(const Tensor& a) {
  std::vector<int64_t> all(size_t(a.dim()));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

Tensor sum(const Tensor& a, std::vector<int64_t> dims, bool keepdim) { return scaled_sum(a, dims, keepdim, false, "sum"); }
Tensor sum(const Tensor& a) { return sum(a, all_dims(a), false); }
Tensor mean(const Tensor& a, std::vector<int64_t> dims, bool keepdim) {
  return scaled_sum(a, dims, keepdim, true, "mean");
}
Tensor mean(const Tensor& a) { return mean(a, all_dims(a), false); }

Tensor amax(const Tensor& a, int64_t dim, bool keepdim) {
  refuse_grad("amax", {a});
  autograd::NoGradGuard ng;
  if (a.dim() > 0) {
    const int64_t d = wrap_dim(dim, a.dim(), "amax");
    SG_CHECK(a.shape()[size_t(d)] > 0, "amax: dim ", d, " of ", shape_str(a.shape()), " is empty (no maximum)");
  }
  return reduce_dims(kernels::Reduce::max, a, {dim}, keepdim, "amax");
}

Tensor sum_to(const Tensor& a, const Shape& shape) {
  if (a.shape() == shape) return a;
  SG_CHECK(a.dim() >= int64_t(shape.size()), "sum_to: cannot reduce ", shape_str(a.shape()), " to ", shape_str(shape));
  std::vector<int64_t> dims;
  const int64_t lead = a.dim() - int64_t(shape.size());
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (d < lead) dims.push_back(d);
    else if (shape[size_t(d - lead)] == 1 && a.shape()[size_t(d)] != 1) dims.push_back(d);
    else
      SG_CHECK(shape[size_t(d - lead)] == a.shape()[size_t(d)], "sum_to: cannot reduce ", shape_str(a.shape()), " to ",
               shape_str(shape));
  }
  Tensor s = dims.empty() ? a : sum(a, dims, true);
  return reshape(s, shape);
}

double sum_squares(const Tensor& a) {
  SG_CHECK(a.defined(), "sum_squares: undefined tensor");
  return sum_squares(std::vector<Tensor>{a});
}

double sum_squares(const std::vector<Tensor>& xs, const std::vector<double>& weights) {
  SG_CHECK(weights.empty() || weights.size() == xs.size(), "sum_squares: ", weights.size(), " weights for ", xs.size(),
           " tensors");
  autograd::NoGradGuard ng;
  // One sum_squares_many call per (device, dtype), in order of first appearance. The CPU entry
  // accumulates in f64 (order-insensitive enough to compare layouts); a device in its kernel's f32
  // (deterministic: one fixed tree).
  struct Group {
    Device device;
    DType dtype;
    std::vector<Tensor> keep;  // the contiguous operands, alive until the call
    std::vector<const void*> ptrs;
    std::vector<int64_t> ns;
    std::vector<double> weights;
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double w = weights.empty() ? 1.0 : weights[i];
    if (!xs[i].defined() || w == 0 || xs[i].numel() == 0) continue;
    Tensor x = detail::operand(xs[i]);
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const Group& g) { return g.device == x.device() && g.dtype == x.dtype(); });
    if (g == groups.end()) g = groups.insert(groups.end(), Group{x.device(), x.dtype(), {}, {}, {}, {}});
    g->ptrs.push_back(x.data_ptr());
    g->ns.push_back(x.numel());
    g->weights.push_back(w);
    g->keep.push_back(std::move(x));
  }
  double total = 0;
  for (const Group& g : groups)
    total += SG_KERNEL(g.device, sum_squares_many)(g.dtype, g.ptrs.data(), g.ns.data(), g.weights.data(),
                                                   int64_t(g.ptrs.size()));
  return total;
}

}  // namespace sg
