// Elementwise family on the CPU: strided copy/cast, fill, broadcasting binary ops, unary ops and
// their derivatives, axis reductions, Philox fills and dropout.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/philox.h"
#include "kernels/binary_op.h"
#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

namespace {

// Load/store any dtype through double (exact for every type we hold).
inline double load(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return double(static_cast<const int64_t*>(p)[i]);
  }
  return 0;
}
// Integer to integer: exact (i32 -> i64) or wrapping (i64 -> i32, as PyTorch), never through double.
inline bool is_integer(DType t) { return t == DType::i32 || t == DType::i64; }
inline void convert_integer(DType dt, void* dst, int64_t di, DType st, const void* src, int64_t si) {
  const int64_t v = st == DType::i32 ? int64_t(static_cast<const int32_t*>(src)[si]) : static_cast<const int64_t*>(src)[si];
  if (dt == DType::i32) static_cast<int32_t*>(dst)[di] = int32_t(uint32_t(uint64_t(v)));
  else static_cast<int64_t*>(dst)[di] = v;
}
inline void store(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = float(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(float(v)); break;
    case DType::f16: static_cast<uint16_t*>(p)[i] = f32_to_f16(float(v)); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = int32_t(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = int64_t(v); break;
  }
}

// Calls f(out_index, offset_of_each_operand) over a shape, innermost dimension fastest.
// Row-parallel over the outermost dimensions: every row of the last dim is independent.
template <int NOps, class F>
void for_each_strided(const Dims& shape, const Dims* strides[NOps], F f) {
  const int64_t nd = int64_t(shape.size());
  if (nd == 0) {
    int64_t offs[NOps] = {};
    f(0, offs);
    return;
  }
  const int64_t inner = shape[size_t(nd - 1)];
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < nd; ++d) rows *= shape[size_t(d)];
  if (inner == 0 || rows == 0) return;
#pragma omp parallel for schedule(static) if (rows * inner > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t offs[NOps] = {};
    int64_t rem = r;
    for (int64_t d = nd - 2; d >= 0; --d) {
      int64_t i = rem % shape[size_t(d)];
      rem /= shape[size_t(d)];
      for (int k = 0; k < NOps; ++k) offs[k] += i * (*strides[k])[size_t(d)];
    }
    f(r * inner, offs);
  }
}

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2/pi)

template <class T>
inline T apply_unary(Unary op, T x, T alpha) {
  switch (op) {
    case Unary::neg: return -x;
    case Unary::exp: return std::exp(x);
    case Unary::log: return std::log(x);
    case Unary::sqrt: return std::sqrt(x);
    case Unary::rsqrt: return T(1) / std::sqrt(x);
    case Unary::tanh: return std::tanh(x);
    case Unary::relu: return x > T(0) || x != x ? x : T(0);  // NaN stays NaN (PyTorch)
    case Unary::gelu: return T(0.5) * x * (T(1) + std::tanh(T(kGeluK) * (x + T(0.044715) * x * x * x)));
    case Unary::silu: return x / (T(1) + std::exp(-x));
    case Unary::abs: return std::abs(x);
    case Unary::scale: return x * alpha;
    case Unary::add_scalar: return x + alpha;
    case Unary::pow: return std::pow(x, alpha);
    case Unary::square: return x * x;
  }
  return 0;
}

template <class T>
inline T unary_derivative(Unary op, T x) {
  switch (op) {
    case Unary::relu: return x > T(0) ? T(1) : T(0);
    case Unary::gelu: {
      T x3 = T(0.044715) * x * x * x;
      T t = std::tanh(T(kGeluK) * (x + x3));
      return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kGeluK) * (T(1) + T(3) * T(0.044715) * x * x);
    }
    case Unary::silu: {
      T s = T(1) / (T(1) + std::exp(-x));
      return s * (T(1) + x * (T(1) - s));
    }
    case Unary::tanh: return T(1) - x * x;  // x holds y = tanh(input)
    case Unary::exp: return x;              // x holds y = exp(input)
    default: return T(0);
  }
}

// Splits [0, n) into cache-sized chunks spread over the OpenMP threads: f(first, length).
template <class F>
void for_each_chunk(int64_t n, F f) {
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t c = 0; c < chunks; ++c) f(c * kChunk, std::min(kChunk, n - c * kChunk));
}

// GELU (tanh form) on f32 through Eigen's vectorised tanh (a rational approximation within a
// few ulp of tanhf): with libm's scalar tanhf, GELU and its backward were ~30% of a GPT-2 step.
void gelu_f32(float* y, const float* x, int64_t n) {
  for_each_chunk(n, [&](int64_t i0, int64_t len) {
    Eigen::Map<const Eigen::ArrayXf> a(x + i0, len);
    Eigen::Map<Eigen::ArrayXf> out(y + i0, len);
    out = 0.5f * a * (1.0f + (float(kGeluK) * (a + 0.044715f * a.cube())).tanh());
  });
}

// dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)),  t = tanh(k (x + c x^3))
void gelu_backward_f32(float* dx, const float* dy, const float* x, int64_t n) {
  for_each_chunk(n, [&](int64_t i0, int64_t len) {
    alignas(64) float tbuf[4096];
    Eigen::Map<const Eigen::ArrayXf> a(x + i0, len), g(dy + i0, len);
    Eigen::Map<Eigen::ArrayXf> t(tbuf, len), out(dx + i0, len);
    const float k = float(kGeluK), c = 0.044715f;
    t = (k * (a + c * a.cube())).tanh();
    out = g * (0.5f * (1.0f + t) + 0.5f * a * (1.0f - t.square()) * k * (1.0f + 3.0f * c * a.square()));
  });
}

}  // namespace

// dst[i] = src[i] for n contiguous elements, converting the element type.
static void convert_contiguous(void* dst, DType dt, const void* src, DType st, int64_t n) {
  for_each_chunk(n, [&](int64_t i0, int64_t len) {
    if (dt == st) {
      std::memcpy(static_cast<char*>(dst) + i0 * int64_t(dtype_size(dt)),
                  static_cast<const char*>(src) + i0 * int64_t(dtype_size(st)), size_t(len) * dtype_size(dt));
    } else if (dt == DType::f64 && st == DType::f32) {
      auto* d = static_cast<double*>(dst) + i0;
      auto* s = static_cast<const float*>(src) + i0;
      for (int64_t i = 0; i < len; ++i) d[i] = double(s[i]);
    } else if (dt == DType::f32 && st == DType::f64) {
      auto* d = static_cast<float*>(dst) + i0;
      auto* s = static_cast<const double*>(src) + i0;
      for (int64_t i = 0; i < len; ++i) d[i] = float(s[i]);
    } else if (is_integer(dt) && is_integer(st)) {
      for (int64_t i = i0; i < i0 + len; ++i) convert_integer(dt, dst, i, st, src, i);
    } else {
      for (int64_t i = i0; i < i0 + len; ++i) store(dt, dst, i, load(st, src, i));
    }
  });
}

// Row by row of the innermost dim: one memcpy per row when it is unit-strided.
void scatter_strided(void* dst, const Dims& dst_strides, const void* src, DType dtype, const Dims& shape) {
  const Dims* strides[1] = {&dst_strides};
  const int64_t es = int64_t(dtype_size(dtype)), inner = shape.empty() ? 1 : shape.back();
  const int64_t dinner = shape.empty() ? 0 : dst_strides.back();
  char* base = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
  for_each_strided<1>(shape, strides, [&](int64_t o, const int64_t* offs) {
    if (dinner == 1 || inner == 1) return (void)std::memcpy(base + offs[0] * es, from + o * es, size_t(inner * es));
    for (int64_t i = 0; i < inner; ++i) std::memcpy(base + (offs[0] + i * dinner) * es, from + (o + i) * es, size_t(es));
  });
}

void copy_strided(void* dst, DType dt, const void* src, DType st, const Dims& shape, const Dims& src_strides) {
  bool contiguous = true;
  int64_t expect = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && src_strides[d] != expect) contiguous = false;
    expect *= shape[d];
  }
  if (contiguous) return convert_contiguous(dst, dt, src, st, expect);
  const Dims* strides[1] = {&src_strides};
  const int64_t inner = shape.empty() ? 1 : shape.back();
  const int64_t sinner = shape.empty() ? 0 : src_strides.back();
  const size_t es = dtype_size(st);
  for_each_strided<1>(shape, strides, [&](int64_t o, const int64_t* offs) {
    if (dt == st && (sinner == 1 || inner == 1)) {
      std::memcpy(static_cast<char*>(dst) + o * int64_t(es), static_cast<const char*>(src) + offs[0] * int64_t(es),
                  size_t(inner) * es);
    } else if (dt == DType::f32 && st == DType::f32) {
      auto* d = static_cast<float*>(dst) + o;
      auto* s = static_cast<const float*>(src) + offs[0];
      for (int64_t i = 0; i < inner; ++i) d[i] = s[i * sinner];
    } else if (is_integer(dt) && is_integer(st)) {
      for (int64_t i = 0; i < inner; ++i) convert_integer(dt, dst, o + i, st, src, offs[0] + i * sinner);
    } else {
      for (int64_t i = 0; i < inner; ++i) store(dt, dst, o + i, load(st, src, offs[0] + i * sinner));
    }
  });
}

void fill(void* dst, DType dtype, int64_t n, double value) {
  if (dtype == DType::f32) {
    float v = float(value);
    auto* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = v;
    return;
  }
  for (int64_t i = 0; i < n; ++i) store(dtype, dst, i, value);
}

void binary(Binary op, DType dtype, void* out, const void* a, const Dims& as, const void* b, const Dims& bs,
            const Dims& shape) {
  dispatch_float(dtype, "binary", [&](auto tag) {
    using T = decltype(tag);
    const Dims* strides[2] = {&as, &bs};
    const int64_t inner = shape.empty() ? 1 : shape.back();
    const int64_t sa = shape.empty() ? 0 : as.back(), sb = shape.empty() ? 0 : bs.back();
    auto* o = static_cast<T*>(out);
    auto* pa = static_cast<const T*>(a);
    auto* pb = static_cast<const T*>(b);
    for_each_strided<2>(shape, strides, [&](int64_t oi, const int64_t* offs) {
      const T* x = pa + offs[0];
      const T* y = pb + offs[1];
      T* z = o + oi;
      if (sa == 1 && sb == 1 && op == Binary::add) {
        for (int64_t i = 0; i < inner; ++i) z[i] = x[i] + y[i];
      } else if (sa == 1 && sb == 1 && op == Binary::mul) {
        for (int64_t i = 0; i < inner; ++i) z[i] = x[i] * y[i];
      } else {
        for (int64_t i = 0; i < inner; ++i) z[i] = apply_binary<T>(op, x[i * sa], y[i * sb]);
      }
    });
  });
}

void unary(Unary op, DType dtype, void* out, const void* x, int64_t n, double alpha) {
  dispatch_float(dtype, "unary", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto* p = static_cast<const T*>(x);
    T al = T(alpha);
    if constexpr (std::is_same_v<T, float>) {
      if (op == Unary::gelu) return gelu_f32(o, p, n);
    }
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) o[i] = apply_unary<T>(op, p[i], al);
  });
}

void unary_backward(Unary op, DType dtype, void* dx, const void* dy, const void* x, int64_t n) {
  dispatch_float(dtype, "unary_backward", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(dx);
    auto* g = static_cast<const T*>(dy);
    auto* p = static_cast<const T*>(x);
    if constexpr (std::is_same_v<T, float>) {
      if (op == Unary::gelu) return gelu_backward_f32(o, g, p, n);
    }
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * unary_derivative<T>(op, p[i]);
  });
}

namespace {
// The f64 sum (or sum of squares) of n contiguous values in index order; above 2 * kBlock values,
// fixed blocks whose partials are added in block order, so the bits do not depend on the thread
// count.
template <class T>
double sum_f64(const T* p, int64_t n, bool squares) {
  constexpr int64_t kBlock = 65536;
  auto run = [&](const T* q, int64_t len) {
    double acc = 0;
    if (squares)
      for (int64_t k = 0; k < len; ++k) acc += double(q[k]) * double(q[k]);
    else
      for (int64_t k = 0; k < len; ++k) acc += double(q[k]);
    return acc;
  };
  if (n <= 2 * kBlock) return run(p, n);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(size_t(blocks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) partial[size_t(b)] = run(p + b * kBlock, std::min(kBlock, n - b * kBlock));
  double acc = 0;
  for (double v : partial) acc += v;
  return acc;
}
}  // namespace

// Every output accumulates its n inputs in index order (in f64 for sums), whatever the thread
// count; threads split the outputs (column chunks of x[outer, n, inner]). A single full reduction
// (outer = inner = 1) is split as sum_f64 does, so it too is independent of the thread count.
void reduce(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner) {
  dispatch_float(dtype, "reduce", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto* p = static_cast<const T*>(x);
    const bool big = outer * n * inner > 32768;
    if (outer == 1 && inner == 1 && op != Reduce::max) {
      o[0] = T(sum_f64(p, n, op == Reduce::sum_squares));
      return;
    }
    if (inner == 1) {  // one row of x[outer, n] per output
#pragma omp parallel for schedule(static) if (big)
      for (int64_t r = 0; r < outer; ++r) {
        const T* row = p + r * n;
        if (op == Reduce::max) {
          T m = n ? row[0] : T(-INFINITY);
          for (int64_t k = 1; k < n; ++k) m = (row[k] > m || row[k] != row[k]) ? row[k] : m;  // NaN is kept
          o[r] = m;
        } else {
          double acc = 0;
          if (op == Reduce::sum)
            for (int64_t k = 0; k < n; ++k) acc += double(row[k]);
          else
            for (int64_t k = 0; k < n; ++k) acc += double(row[k]) * double(row[k]);
          o[r] = T(acc);
        }
      }
      return;
    }
    // Columns: walk the n rows once, accumulating a chunk of contiguous outputs (vectorises).
    constexpr int64_t kCols = 128;
    const int64_t col_chunks = (inner + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (big)
    for (int64_t task = 0; task < outer * col_chunks; ++task) {
      const int64_t r = task / col_chunks, c0 = (task % col_chunks) * kCols;
      const int64_t w = std::min(kCols, inner - c0);
      const T* base = p + r * n * inner + c0;
      T* dst = o + r * inner + c0;
      if (op == Reduce::max) {
        T m[kCols];
        for (int64_t i = 0; i < w; ++i) m[i] = n ? base[i] : T(-INFINITY);
        for (int64_t k = 1; k < n; ++k)
          for (int64_t i = 0; i < w; ++i) {
            const T v = base[k * inner + i];
            m[i] = (v > m[i] || v != v) ? v : m[i];  // NaN is kept
          }
        for (int64_t i = 0; i < w; ++i) dst[i] = m[i];
      } else {
        double acc[kCols] = {};
        if (op == Reduce::sum)
          for (int64_t k = 0; k < n; ++k)
            for (int64_t i = 0; i < w; ++i) acc[i] += double(base[k * inner + i]);
        else
          for (int64_t k = 0; k < n; ++k)
            for (int64_t i = 0; i < w; ++i) acc[i] += double(base[k * inner + i]) * double(base[k * inner + i]);
        for (int64_t i = 0; i < w; ++i) dst[i] = T(acc[i]);
      }
    }
  });
}

void random(DType dtype, void* out, int64_t n, bool normal, double a, double b, uint64_t seed, uint64_t stream,
            uint64_t first) {
  dispatch_float(dtype, "random", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
#pragma omp parallel for schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; ++i) {
      uint64_t idx = first + uint64_t(i);
      o[i] = normal ? T(a + b * double(Philox::normal(seed, stream, idx)))
                    : T(a + (b - a) * double(Philox::uniform(seed, stream, idx)));
    }
  });
}

void dropout(DType dtype, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t stream,
             int64_t row_len, uint64_t first) {
  SG_CHECK(row_len > 0 && n % row_len == 0, "dropout: ", n, " elements are not rows of ", row_len);
  dispatch_float(dtype, "dropout", [&](auto tag) {
    using T = decltype(tag);
    auto* o = static_cast<T*>(out);
    auto* in = static_cast<const T*>(x);
    const T scale = T(1.0 / (1.0 - p));
    const float pf = float(p);
#pragma omp parallel for schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t r = uint64_t(i / row_len), j = uint64_t(i % row_len);
      o[i] = Philox::uniform(seed, stream + r, first + j) >= pf ? in[i] * scale : T(0);
    }
  });
}

double sum_squares_many(DType dtype, const void* const* xs, const int64_t* ns, const double* weights, int64_t count) {
  double total = 0;
  dispatch_float(dtype, "sum_squares_many", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < count; ++i)
      if (weights[i] != 0) total += weights[i] * sum_f64(static_cast<const T*>(xs[i]), ns[i], true);
  });
  return total;
}

}  // namespace sg::kernels::cpu
