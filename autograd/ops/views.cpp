// Views: new layouts over the same storage. Each records a node whose backward maps the
// gradient back to the input's shape (reshape back, transpose back, pad a slice, sum a broadcast).
#include <numeric>

#include <algorithm>

#include "autograd/ops/common.h"

namespace sg {

using detail::TensorList;
using detail::wrap_dim;

static Tensor make_view(const Tensor& t, Layout layout) { return t.with_layout(layout); }

static Shape infer_shape(const Tensor& t, Shape shape, const char* op) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      SG_CHECK(infer < 0, op, ": only one -1 allowed in ", shape_str(shape));
      infer = int64_t(i);
    } else {
      SG_CHECK(shape[i] >= 0, op, ": negative size in ", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    SG_CHECK(known > 0 && t.numel() % known == 0, op, ": cannot reshape ", shape_str(t.shape()), " into ",
             shape_str(shape));
    shape[size_t(infer)] = t.numel() / known;
  }
  SG_CHECK(shape_numel(shape) == t.numel(), op, ": cannot reshape ", shape_str(t.shape()), " (", t.numel(),
           " elements) into ", shape_str(shape));
  return shape;
}

// Strides for viewing t with a new shape without copying, if its layout allows (PyTorch's rule:
// each group of merged/split dims must be contiguous among themselves).
static bool view_strides(const Tensor& t, const Shape& shape, Shape& out) {
  if (t.is_contiguous()) {
    out = contiguous_strides(shape);
    return true;
  }
  const Shape& os = t.shape();
  const Shape& ost = t.strides();
  out.assign(shape.size(), 0);
  int64_t view_d = int64_t(shape.size()) - 1;
  int64_t chunk_base_stride = ost.empty() ? 1 : ost.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(os.size()) - 1; d >= 0; --d) {
    tensor_numel *= os[size_t(d)];
    if (d == 0 || (os[size_t(d - 1)] != 1 && ost[size_t(d - 1)] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[size_t(view_d)] == 1)) {
        out[size_t(view_d)] = view_numel * chunk_base_stride;
        view_numel *= shape[size_t(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = ost[size_t(d - 1)];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

static Tensor reshape_impl(const Tensor& t, Shape shape, bool allow_copy, const char* op) {
  shape = infer_shape(t, std::move(shape), op);
  Shape strides;
  Tensor out;
  if (view_strides(t, shape, strides)) {
    out = make_view(t, Layout{shape, strides, t.offset()});
  } else {
    SG_CHECK(allow_copy, op, ": a tensor with shape ", shape_str(t.shape()), " and strides ",
             shape_str(t.strides()), " cannot be viewed as ", shape_str(shape), " without a copy");
    return reshape_impl(clone(t), shape, false, op);  // clone records its own node
  }
  if (autograd::needs_grad({t})) {
    Shape in_shape = t.shape();
    autograd::record(op, {t}, {out}, [in_shape](const TensorList& g) { return TensorList{reshape(g[0], in_shape)}; });
  }
  return out;
}

Tensor reshape(const Tensor& t, Shape shape) { return reshape_impl(t, std::move(shape), true, "reshape"); }
Tensor view(const Tensor& t, Shape shape) { return reshape_impl(t, std::move(shape), false, "view"); }
Tensor flatten(const Tensor& t) { return reshape(t, {-1}); }

Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) {
  const int64_t n = t.dim();
  SG_CHECK(int64_t(dims.size()) == n, "permute: ", dims.size(), " dims given for a ", n, "-d tensor");
  std::vector<int64_t> d(dims.size());
  std::vector<bool> seen(size_t(n), false);
  Layout l{Shape(size_t(n)), Shape(size_t(n)), t.offset()};
  for (int64_t i = 0; i < n; ++i) {
    d[size_t(i)] = wrap_dim(dims[size_t(i)], n, "permute");
    SG_CHECK(!seen[size_t(d[size_t(i)])], "permute: repeated dim in ", shape_str(dims));
    seen[size_t(d[size_t(i)])] = true;
    l.shape[size_t(i)] = t.shape()[size_t(d[size_t(i)])];
    l.strides[size_t(i)] = t.strides()[size_t(d[size_t(i)])];
  }
  Tensor out = make_view(t, l);
  if (autograd::needs_grad({t})) {
    std::vector<int64_t> inv(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) inv[size_t(d[size_t(i)])] = i;
    autograd::record("permute", {t}, {out}, [inv](const TensorList& g) { return TensorList{permute(g[0], inv)}; });
  }
  return out;
}

Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) {
  const int64_t n = t.dim();
  std::vector<int64_t> dims(static_cast<size_t>(n));
  std::iota(dims.begin(), dims.end(), 0);
  const int64_t m = std::max<int64_t>(n, 1);  // a 0-d tensor's dim 0 (or -1) swapped with itself
  const int64_t a = wrap_dim(d0, m, "transpose"), b = wrap_dim(d1, m, "transpose");
  if (n > 0) std::swap(dims[size_t(a)], dims[size_t(b)]);
  return permute(t, dims);
}

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, t.dim(), "narrow");
  const int64_t size = t.shape()[size_t(dim)];
  SG_CHECK(start >= 0 && length >= 0 && start + length <= size, "narrow: [", start, ", ", start + length,
           ") out of range for dim ", dim, " of size ", size, " in ", shape_str(t.shape()));
  Layout l = t.layout();
  l.shape[size_t(dim)] = length;
  l.offset += start * l.strides[size_t(dim)];
  Tensor out = make_view(t, l);
  if (autograd::needs_grad({t})) {
    Shape in_shape = t.shape();
    autograd::record("narrow", {t}, {out}, [in_shape, dim, start, length](const TensorList& g) {
      if (length == in_shape[size_t(dim)]) return TensorList{g[0]};  // the whole of t: nothing to pad
      Tensor full = zeros(in_shape, g[0].dtype(), g[0].device());
      copy_(narrow(full, dim, start, length), g[0]);
      return TensorList{full};
    });
  }
  return out;
}

Tensor expand(const Tensor& t, const Shape& shape) {
  const int64_t n = int64_t(shape.size()), k = t.dim();
  SG_CHECK(n >= k, "expand: cannot expand ", shape_str(t.shape()), " to fewer dims ", shape_str(shape));
  Layout l{shape, Shape(size_t(n), 0), t.offset()};
  for (int64_t i = 0; i < n; ++i) {
    int64_t j = i - (n - k);
    if (j < 0) {
      SG_CHECK(shape[size_t(i)] >= 0, "expand: cannot expand ", shape_str(t.shape()), " to ", shape_str(shape),
               " (a new dim of size ", shape[size_t(i)], ")");
      continue;
    }
    const int64_t have = t.shape()[size_t(j)];
    int64_t& want = l.shape[size_t(i)];
    if (want == -1) want = have;  // -1: this dim as it is (PyTorch)
    SG_CHECK(have == want || have == 1, "expand: cannot expand ", shape_str(t.shape()), " to ", shape_str(shape));
    l.strides[size_t(i)] = have == 1 && want != 1 ? 0 : t.strides()[size_t(j)];
  }
  Tensor out = make_view(t, l);
  if (autograd::needs_grad({t})) {
    Shape in_shape = t.shape();
    autograd::record("expand", {t}, {out}, [in_shape](const TensorList& g) { return TensorList{sum_to(g[0], in_shape)}; });
  }
  return out;
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  dim = wrap_dim(dim, t.dim() + 1, "unsqueeze");
  Shape s = t.shape();
  s.insert(s.begin() + dim, 1);
  return reshape(t, s);
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  if (t.dim() == 0) {  // PyTorch's 0-d squeeze: itself
    wrap_dim(dim, 1, "squeeze");
    return reshape(t, {});
  }
  dim = wrap_dim(dim, t.dim(), "squeeze");
  SG_CHECK(t.shape()[size_t(dim)] == 1, "squeeze: dim ", dim, " of ", shape_str(t.shape()), " is not 1");
  Shape s = t.shape();
  s.erase(s.begin() + dim);
  return reshape(t, s);
}

Tensor cat(const std::vector<Tensor>& ts, int64_t dim) {
  SG_CHECK(!ts.empty(), "cat: no tensors");
  dim = wrap_dim(dim, ts[0].dim(), "cat");
  Shape shape = ts[0].shape();
  int64_t total = 0;
  for (const auto& t : ts) {
    SG_CHECK(t.dim() == ts[0].dim() && t.dtype() == ts[0].dtype(), "cat: tensor ", t.describe(),
             " does not match ", ts[0].describe());
    for (int64_t d = 0; d < t.dim(); ++d)
      SG_CHECK(d == dim || t.shape()[size_t(d)] == shape[size_t(d)], "cat: shapes ", shape_str(t.shape()), " and ",
               shape_str(shape), " differ outside dim ", dim);
    total += t.shape()[size_t(dim)];
  }
  shape[size_t(dim)] = total;
  Tensor out = empty(shape, ts[0].dtype(), ts[0].device());
  std::vector<int64_t> sizes;
  int64_t at = 0;
  for (const auto& t : ts) {
    int64_t len = t.shape()[size_t(dim)];
    Layout l = out.layout();
    l.shape[size_t(dim)] = len;
    l.offset += at * l.strides[size_t(dim)];
    copy_(out.with_layout(l), t);
    sizes.push_back(len);
    at += len;
  }
  if (autograd::needs_grad(ts)) {
    autograd::record("cat", ts, {out}, [sizes, dim](const TensorList& g) {
      TensorList r;
      int64_t a = 0;
      for (int64_t s : sizes) {
        r.push_back(contiguous(narrow(g[0], dim, a, s)));
        a += s;
      }
      return r;
    });
  }
  return out;
}

std::vector<Tensor> chunk(const Tensor& t, int64_t n, int64_t dim) {
  dim = wrap_dim(dim, t.dim(), "chunk");
  const int64_t size = t.shape()[size_t(dim)];
  SG_CHECK(n > 0 && size % n == 0, "chunk: dim ", dim, " of size ", size, " does not split into ", n, " equal parts");
  const int64_t part = size / n;
  std::vector<Tensor> out;
  {
    autograd::NoGradGuard ng;  // one node below for all the parts, not one narrow node each
    for (int64_t i = 0; i < n; ++i) out.push_back(narrow(t, dim, i * part, part));
  }
  if (autograd::needs_grad({t})) {
    // The parts tile the input: their gradients go straight into one buffer (a part without a
    // gradient gets zeros), not into n zero-filled full-size tensors that the tape then adds.
    Shape in_shape = t.shape();
    autograd::record("chunk", {t}, out, [in_shape, dim, part](const TensorList& g) {
      const Tensor& any = *std::find_if(g.begin(), g.end(), [](const Tensor& x) { return x.defined(); });
      Tensor full = empty(in_shape, any.dtype(), any.device());
      for (size_t i = 0; i < g.size(); ++i) {
        Tensor slice = narrow(full, dim, int64_t(i) * part, part);
        if (g[i].defined()) copy_(slice, g[i]);
        else copy_(slice, zeros(slice.shape(), full.dtype(), full.device()));
      }
      return TensorList{full};
    });
  }
  return out;
}

}  // namespace sg
