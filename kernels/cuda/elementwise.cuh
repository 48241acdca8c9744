// Elementwise family on the device: fill, strided copy/cast, broadcasting binary ops, unary ops
// and their derivatives. The op-table signatures plus a stream; f32 / bf16 / f16 storage, f32 math.
// Contiguous operands take 128-bit packs (map.cuh); broadcasting and strided views walk the shape.
#pragma once
#include "kernels/binary_op.h"
#include "kernels/cuda/gelu.cuh"

namespace sg::cuda {

using kernels::Binary;
using kernels::Dims;
using kernels::Unary;

SG_DEVICE float unary_value(Unary op, float x, float alpha) {
  switch (op) {
    case Unary::neg: return -x;
    case Unary::exp: return expf(x);
    case Unary::log: return logf(x);
    case Unary::sqrt: return sqrtf(x);
    case Unary::rsqrt: return rsqrtf(x);
    case Unary::tanh: return tanhf(x);
    case Unary::relu: return x > 0.0f || x != x ? x : 0.0f;  // NaN stays NaN
    case Unary::gelu: return gelu_value(x);
    case Unary::silu: return x / (1.0f + expf(-x));
    case Unary::abs: return fabsf(x);
    case Unary::scale: return x * alpha;
    case Unary::add_scalar: return x + alpha;
    case Unary::pow: return powf(x, alpha);
    case Unary::square: return x * x;
  }
  return 0.0f;
}

// f'(x) for relu/gelu/silu; for tanh and exp, x holds y = f(input) (as the CPU table).
SG_DEVICE float unary_derivative(Unary op, float x) {
  switch (op) {
    case Unary::relu: return x > 0.0f ? 1.0f : 0.0f;
    case Unary::gelu: return gelu_grad(x);
    case Unary::silu: {
      const float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f + x * (1.0f - s));
    }
    case Unary::tanh: return 1.0f - x * x;
    case Unary::exp: return x;
    default: return 0.0f;
  }
}

SG_DEVICE float binary_value(Binary op, float a, float b) { return kernels::apply_binary<float>(op, a, b); }

struct UnaryFn {
  Unary op;
  float alpha;
  SG_DEVICE float operator()(float x) const { return unary_value(op, x, alpha); }
};
struct UnaryBackwardFn {
  Unary op;
  SG_DEVICE float operator()(float dy, float x) const { return dy * unary_derivative(op, x); }
};
struct BinaryFn {
  Binary op;
  SG_DEVICE float operator()(float a, float b) const { return binary_value(op, a, b); }
};

// A shape with the element strides of up to two operands, passed to kernels by value.
constexpr int kMaxDims = 8;
struct StridedShape {
  int nd = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[2][kMaxDims] = {};
};

inline StridedShape strided_shape(const Dims& shape, const Dims& s0, const Dims* s1 = nullptr) {
  SG_CHECK(shape.size() <= size_t(kMaxDims), "cuda: ", shape.size(), "-d tensors exceed the ", kMaxDims,
           " dims the strided kernels take");
  StridedShape s;
  s.nd = int(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    s.shape[d] = shape[d];
    s.stride[0][d] = s0[d];
    s.stride[1][d] = s1 ? (*s1)[d] : 0;
  }
  return s;
}

// Element offsets of the two operands for the row-major flat index i.
SG_DEVICE void strided_offsets(const StridedShape& s, int64_t i, int64_t& o0, int64_t& o1) {
  o0 = o1 = 0;
  for (int d = s.nd - 1; d >= 0; --d) {
    const int64_t k = i % s.shape[d];
    i /= s.shape[d];
    o0 += k * s.stride[0][d];
    o1 += k * s.stride[1][d];
  }
}

template <class T>
__global__ void binary_strided_kernel(Binary op, T* out, const T* a, const T* b, StridedShape s, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t oa, ob;
    strided_offsets(s, i, oa, ob);
    out[i] = from_f32<T>(binary_value(op, to_f32(a[oa]), to_f32(b[ob])));
  }
}

// dst (contiguous, D) = src (strided, S). D == S copies the bits.
template <class D, class S>
__global__ void copy_strided_kernel(D* dst, const S* src, StridedShape s, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t o, unused;
    strided_offsets(s, i, o, unused);
    if constexpr (std::is_same_v<D, S>) dst[i] = src[o];
    else dst[i] = from_f32<D>(to_f32(src[o]));
  }
}

// dst (strided) = src (contiguous), the same bits.
template <class B>
__global__ void scatter_strided_kernel(B* dst, const B* src, StridedShape s, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t o, unused;
    strided_offsets(s, i, o, unused);
    dst[o] = src[i];
  }
}

template <class T>
__global__ void fill_kernel(T* out, T value, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = value;
}

inline int64_t numel(const Dims& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// A same-dtype strided copy whose innermost dim is unit-strided and a whole number of 16-byte
// units long, with every other stride and both pointers 16-byte aligned (a head split or merge of
// attention, a narrow() of the last dim), moves 16-byte units instead: one index computation and
// one 16-byte access per unit instead of per element. Rewrites shape and strides in units.
struct alignas(16) Bytes16 {
  uint32_t w[4];
};
inline bool as_16_byte_units(size_t element_size, const void* a, const void* b, Dims& shape, Dims& strides) {
  const int64_t per = int64_t(16 / element_size);
  if (shape.empty() || strides.back() != 1 || shape.back() % per != 0) return false;
  if (reinterpret_cast<uintptr_t>(a) % 16 != 0 || reinterpret_cast<uintptr_t>(b) % 16 != 0) return false;
  for (size_t d = 0; d + 1 < shape.size(); ++d)
    if (strides[d] % per != 0) return false;
  shape.back() /= per;
  for (size_t d = 0; d + 1 < shape.size(); ++d) strides[d] /= per;
  return true;
}

// Bit-copy type of an element size (same-dtype copies never convert).
template <class Body>
void dispatch_bits(DType t, Body&& body) {
  switch (dtype_size(t)) {
    case 2: body(uint16_t{}); break;
    case 4: body(uint32_t{}); break;
    default: body(uint64_t{}); break;
  }
}

inline void fill(void* dst, DType dtype, int64_t n, double value, Stream stream) {
  const dim3 grid(grid_for(n, kMapThreads)), block(kMapThreads);
  auto go = [&](auto v) { launch(fill_kernel<decltype(v)>, grid, block, 0, stream, static_cast<decltype(v)*>(dst), v, n); };
  switch (dtype) {
    case DType::f32: go(float(value)); break;
    case DType::f64: go(value); break;
    case DType::bf16: go(from_f32<bf16>(float(value))); break;
    case DType::f16: go(from_f32<f16>(float(value))); break;
    case DType::i32: go(int32_t(value)); break;
    case DType::i64: go(int64_t(value)); break;
  }
}

inline void copy_strided(void* dst, DType dt, const void* src, DType st, const Dims& shape, const Dims& src_strides,
                         Stream stream) {
  const int64_t n = numel(shape);
  if (n == 0) return;
  const StridedShape s = strided_shape(shape, src_strides);
  const dim3 grid(grid_for(n, kMapThreads)), block(kMapThreads);
  if (dt == st) {
    Dims units = shape, unit_strides = src_strides;
    if (as_16_byte_units(dtype_size(dt), dst, src, units, unit_strides)) {
      const int64_t m = numel(units);
      return launch(copy_strided_kernel<Bytes16, Bytes16>, dim3(grid_for(m, kMapThreads)), block, 0, stream,
                    static_cast<Bytes16*>(dst), static_cast<const Bytes16*>(src), strided_shape(units, unit_strides), m);
    }
    return dispatch_bits(dt, [&](auto tag) {
      using B = decltype(tag);
      launch(copy_strided_kernel<B, B>, grid, block, 0, stream, static_cast<B*>(dst), static_cast<const B*>(src), s, n);
    });
  }
  dispatch_storage(dt, "copy_strided", [&](auto dtag) {
    dispatch_storage(st, "copy_strided", [&](auto stag) {
      using D = decltype(dtag);
      using S = decltype(stag);
      launch(copy_strided_kernel<D, S>, grid, block, 0, stream, static_cast<D*>(dst), static_cast<const S*>(src), s, n);
    });
  });
}

inline void scatter_strided(void* dst, const Dims& dst_strides, const void* src, DType dtype, const Dims& shape,
                            Stream stream) {
  const int64_t n = numel(shape);
  if (n == 0) return;
  Dims units = shape, unit_strides = dst_strides;
  if (as_16_byte_units(dtype_size(dtype), dst, src, units, unit_strides)) {
    const int64_t m = numel(units);
    return launch(scatter_strided_kernel<Bytes16>, dim3(grid_for(m, kMapThreads)), dim3(kMapThreads), 0, stream,
                  static_cast<Bytes16*>(dst), static_cast<const Bytes16*>(src), strided_shape(units, unit_strides), m);
  }
  const StridedShape s = strided_shape(shape, dst_strides);
  dispatch_bits(dtype, [&](auto tag) {
    using B = decltype(tag);
    launch(scatter_strided_kernel<B>, dim3(grid_for(n, kMapThreads)), dim3(kMapThreads), 0, stream,
           static_cast<B*>(dst), static_cast<const B*>(src), s, n);
  });
}

inline bool is_contiguous(const Dims& shape, const Dims& strides) {
  int64_t expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

inline void binary(Binary op, DType dtype, void* out, const void* a, const Dims& as, const void* b, const Dims& bs,
                   const Dims& shape, Stream stream) {
  const int64_t n = numel(shape);
  if (n == 0) return;
  dispatch_storage(dtype, "binary", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto *pa = static_cast<const T*>(a), *pb = static_cast<const T*>(b);
    if (is_contiguous(shape, as) && is_contiguous(shape, bs)) return map<2>(BinaryFn{op}, o, pa, pb, n, stream);
    launch(binary_strided_kernel<T>, dim3(grid_for(n, kMapThreads)), dim3(kMapThreads), 0, stream, op, o, pa, pb,
           strided_shape(shape, as, &bs), n);
  });
}

inline void unary(Unary op, DType dtype, void* out, const void* x, int64_t n, double alpha, Stream stream) {
  dispatch_storage(dtype, "unary", [&](auto tag) {
    using T = decltype(tag);
    map<1>(UnaryFn{op, float(alpha)}, static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(nullptr),
           n, stream);
  });
}

// dx = dy * f'(x)  ('=')
inline void unary_backward(Unary op, DType dtype, void* dx, const void* dy, const void* x, int64_t n, Stream stream) {
  dispatch_storage(dtype, "unary_backward", [&](auto tag) {
    using T = decltype(tag);
    map<2>(UnaryBackwardFn{op}, static_cast<T*>(dx), static_cast<const T*>(dy), static_cast<const T*>(x), n, stream);
  });
}

}  // namespace sg::cuda
