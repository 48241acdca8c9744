// Creation, data movement, casts and in-place updates.
#include <cstring>

#include "autograd/ops/common.h"

namespace sg {

using detail::TensorList;

Tensor empty(const Shape& shape, DType dtype, Device device) {
  kernels::table(device);  // a device's backend registers its allocator on first use
  return Tensor::empty(shape, dtype, device);
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_(t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }

Tensor arange(int64_t n, DType dtype, Device device) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i;
  return to(to(from_vector(v, {n}), dtype), device);
}

// Draws into t (contiguous): element i takes counter first + i. A half tensor computed in f32 (the
// CPU) is drawn a piece at a time, so no temporary is the size of t.
static void random_into(const Tensor& t, bool normal, double a, double b, uint64_t seed, uint64_t stream,
                        uint64_t first) {
  const int64_t n = t.numel();
  const DType cd = detail::compute_dtype(t);
  kernels::table(t.device());
  if (cd == t.dtype()) {
    if (n > 0) SG_KERNEL(t.device(), random)(cd, t.data_ptr(), n, normal, a, b, seed, stream, first);
    return;
  }
  constexpr int64_t kPiece = int64_t(1) << 20;
  const Tensor flat = reshape(t, {n});
  const Tensor buf = empty({std::min(kPiece, n)}, cd, t.device());
  for (int64_t at = 0; at < n; at += kPiece) {
    const int64_t len = std::min(kPiece, n - at);
    SG_KERNEL(t.device(), random)(cd, buf.data_ptr(), len, normal, a, b, seed, stream, first + uint64_t(at));
    copy_(narrow(flat, 0, at, len), narrow(buf, 0, 0, len));
  }
}
static Tensor random_fill(const Shape& shape, bool normal, double a, double b, uint64_t seed, uint64_t stream,
                          DType dtype, Device device, uint64_t first) {
  Tensor t = empty(shape, dtype, device);
  random_into(t, normal, a, b, seed, stream, first);
  return t;
}
Tensor randn(const Shape& shape, uint64_t seed, uint64_t stream, double mean, double std, DType dtype, Device device,
             uint64_t first) {
  return random_fill(shape, true, mean, std, seed, stream, dtype, device, first);
}
Tensor rand(const Shape& shape, uint64_t seed, uint64_t stream, double lo, double hi, DType dtype, Device device,
            uint64_t first) {
  return random_fill(shape, false, lo, hi, seed, stream, dtype, device, first);
}
void normal_(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std, uint64_t first) {
  SG_CHECK(t.is_contiguous(), "normal_: the tensor must be contiguous, got ", t.describe());
  autograd::NoGradGuard ng;
  random_into(t, true, mean, std, seed, stream, first);
}

template <class T>
static DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::i64;
  else return DType::bf16;  // uint16_t: raw half bits are not supported through from_vector
}

template <class T>
Tensor from_vector(const std::vector<T>& v, const Shape& shape, Device device) {
  SG_CHECK(int64_t(v.size()) == shape_numel(shape), "from_vector: ", v.size(), " values for shape ",
           shape_str(shape));
  Tensor host = empty(shape, dtype_of<T>(), Device::cpu());
  if (!v.empty()) std::memcpy(host.data_ptr(), v.data(), v.size() * sizeof(T));
  return device.is_cpu() ? host : to(host, device);
}

template <class T>
std::vector<T> to_vector(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : to(t, Device::cpu());
  Tensor c = empty(h.shape(), dtype_of<T>(), Device::cpu());
  copy_(c, h);
  std::vector<T> out(size_t(c.numel()));
  if (!out.empty()) std::memcpy(out.data(), c.data_ptr(), out.size() * sizeof(T));
  return out;
}

template Tensor from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, const Shape&, Device);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, Device);
template std::vector<float> to_vector<float>(const Tensor&);
template std::vector<double> to_vector<double>(const Tensor&);
template std::vector<int32_t> to_vector<int32_t>(const Tensor&);
template std::vector<int64_t> to_vector<int64_t>(const Tensor&);

double item(const Tensor& t) {
  SG_CHECK(t.numel() == 1, "item: tensor has ", t.numel(), " elements (", t.describe(), "), expected 1");
  return to_vector<double>(t)[0];
}

// In-place ops are never recorded: one on a tensor that requires grad, while a tape records, would
// change what the tape's nodes saved behind their back (and a leaf's value under its gradient).
static void check_not_recorded(const char* op, const Tensor& t) {
  SG_CHECK(!autograd::needs_grad({t}), op, ": in place on ", t.describe(), ", which requires grad, while a tape ",
           "records: the tape would not see the change (use the out-of-place op, or write under a NoGradGuard)");
}

void copy_(const Tensor& dst, const Tensor& src) {
  check_not_recorded("copy_", dst);
  SG_CHECK(dst.shape() == src.shape(), "copy_: destination ", shape_str(dst.shape()), " and source ",
           shape_str(src.shape()), " differ");
  if (dst.numel() == 0) return;
  if (dst.device().is_meta() && src.device().is_meta()) return;  // no values to move, on any meta:N
  if (dst.device() != src.device() && !(dst.device().is_cpu() && src.device().is_cpu())) {  // cpu:N are all host memory
    // Cross-device: make the source contiguous in the destination dtype on its own device, then move bytes.
    Tensor s = contiguous(src);
    if (s.dtype() != dst.dtype()) s = to(s, dst.dtype());
    Tensor d = dst.is_contiguous() ? dst : empty(dst.shape(), dst.dtype(), dst.device());
    if (src.device().is_cpu()) {
      SG_KERNEL(dst.device(), copy_from_host)(d.data_ptr(), s.data_ptr(), d.nbytes(), dst.device());
    } else if (dst.device().is_cpu()) {
      SG_KERNEL(src.device(), copy_to_host)(d.data_ptr(), s.data_ptr(), d.nbytes(), src.device());
    } else {
      Tensor h = empty(s.shape(), s.dtype(), Device::cpu());
      SG_KERNEL(src.device(), copy_to_host)(h.data_ptr(), s.data_ptr(), h.nbytes(), src.device());
      SG_KERNEL(dst.device(), copy_from_host)(d.data_ptr(), h.data_ptr(), d.nbytes(), dst.device());
    }
    if (d.impl() != dst.impl()) copy_(dst, d);
    return;
  }
  if (src.storage() == dst.storage() && src.dtype() == dst.dtype() && src.offset() == dst.offset() &&
      src.strides() == dst.strides())
    return;  // the same elements
  if (dst.is_contiguous() && src.storage() == dst.storage()) {  // overlapping bytes: read them all before writing
    autograd::NoGradGuard ng;
    copy_(dst, clone(src));
    return;
  }
  if (dst.is_contiguous()) {
    SG_KERNEL(dst.device(), copy_strided)(dst.data_ptr(), dst.dtype(), src.data_ptr(), src.dtype(), src.shape(),
                                          src.strides());
    return;
  }
  // Strided destination (narrow() slices of gradients and parameters): bring the source to a
  // contiguous buffer in the destination dtype, then scatter it into the view.
  Tensor tmp = src;
  if (!src.is_contiguous() || src.dtype() != dst.dtype() || src.storage() == dst.storage()) {
    tmp = empty(src.shape(), dst.dtype(), dst.device());
    SG_KERNEL(dst.device(), copy_strided)(tmp.data_ptr(), dst.dtype(), src.data_ptr(), src.dtype(), src.shape(),
                                          src.strides());
  }
  SG_KERNEL(dst.device(), scatter_strided)(dst.data_ptr(), dst.strides(), tmp.data_ptr(), dst.dtype(), dst.shape());
}

void fill_(const Tensor& t, double value) {
  check_not_recorded("fill_", t);
  SG_CHECK(t.is_contiguous(), "fill_: tensor must be contiguous, got strides ", shape_str(t.strides()));
  SG_KERNEL(t.device(), fill)(t.data_ptr(), t.dtype(), t.numel(), value);
}
void zero_(const Tensor& t) { fill_(t, 0.0); }

void add_(const Tensor& t, const Tensor& other, double alpha) {
  check_not_recorded("add_", t);
  SG_CHECK(t.shape() == other.shape(), "add_: shapes ", shape_str(t.shape()), " and ", shape_str(other.shape()),
           " differ");
  SG_CHECK(t.is_contiguous(), "add_: destination must be contiguous");
  autograd::NoGradGuard ng;
  if (alpha == 1.0 && other.dtype() == t.dtype() && other.device() == t.device() &&
      other.storage() != t.storage() && detail::compute_dtype(t) == t.dtype()) {
    // One pass, t = t + other in place (each element read before it is written), instead of a sum
    // into a new tensor and a copy back: gradient accumulation's common case. The same bits.
    SG_KERNEL(t.device(), binary)(kernels::Binary::add, t.dtype(), t.data_ptr(), t.data_ptr(), t.strides(),
                                  other.data_ptr(), other.strides(), t.shape());
    return;
  }
  Tensor o = alpha == 1.0 ? other : mul(other, alpha);
  Tensor r = add(t, o);
  copy_(t, r);
}

void mul_(const Tensor& t, double s) {
  check_not_recorded("mul_", t);
  autograd::NoGradGuard ng;
  copy_(t, mul(t, s));
}

Tensor to(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = empty(t.shape(), dtype, t.device());
  copy_(out, t);
  if (autograd::needs_grad({t}) && is_floating(dtype)) {
    DType from = t.dtype();
    autograd::record("to_dtype", {t}, {out}, [from](const TensorList& g) { return TensorList{to(g[0], from)}; });
  }
  return out;
}

Tensor to(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  Tensor out = empty(t.shape(), t.dtype(), device);
  copy_(out, t);
  if (autograd::needs_grad({t})) {
    Device from = t.device();
    autograd::record("to_device", {t}, {out}, [from](const TensorList& g) { return TensorList{to(g[0], from)}; });
  }
  return out;
}

Tensor clone(const Tensor& t) {
  Tensor out = empty(t.shape(), t.dtype(), t.device());
  copy_(out, t);
  if (autograd::needs_grad({t}))
    autograd::record("clone", {t}, {out}, [](const TensorList& g) { return TensorList{g[0]}; });
  return out;
}

Tensor contiguous(const Tensor& t) { return t.is_contiguous() ? t : clone(t); }

}  // namespace sg
