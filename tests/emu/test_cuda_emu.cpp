// The hand-written CUDA kernels (kernels/cuda/*.cuh), compiled by the host compiler against the
// emulation layer (kernels/emu) and run on CPU threads, against the CPU op table. Sizes are small
// and irregular (odd tails, rows that are not a multiple of a warp, padded vocabularies) and every
// kernel runs in f32 and bf16 (f16 where the kernel takes it). Inputs for half types are rounded
// first, so the CPU reference sees exactly what the kernel sees; tolerances then cover the f32
// math (f32) or the rounding of the output (half types).
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/cpu.h"
#include "kernels/cuda/elementwise.cuh"

using namespace sg;
namespace cu = sg::cuda;
namespace cpu = sg::kernels::cpu;
using kernels::Binary;
using kernels::Dims;
using kernels::Unary;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(shift, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, cu::bf16>) return DType::bf16;
  else return DType::f16;
}

template <class T>
std::vector<T> to_storage(const std::vector<float>& v) {
  std::vector<T> out;
  out.reserve(v.size());
  for (float x : v) out.push_back(cu::from_f32<T>(x));
  return out;
}
template <class T>
std::vector<float> to_float(const std::vector<T>& v) {
  std::vector<float> out;
  out.reserve(v.size());
  for (const T& x : v) out.push_back(cu::to_f32(x));
  return out;
}
// The values a kernel of storage type T actually reads.
template <class T>
std::vector<float> rounded(const std::vector<float>& v) {
  return to_float(to_storage<T>(v));
}

// Relative tolerance of results stored as T.
template <class T>
double tol() {
  if constexpr (std::is_same_v<T, float>) return 2e-5;
  else if constexpr (std::is_same_v<T, cu::bf16>) return 1.6e-2;
  else return 2e-3;
}

// |got - want| <= atol + rtol |want| everywhere; reports the first element that is not.
void check_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::abs(double(got[i]) - double(want[i])) <= atol + rtol * std::abs(double(want[i])) ||
                    (std::isnan(got[i]) && std::isnan(want[i]));
    if (!ok && bad++ == 0) first = i;
  }
  INFO("mismatches: " << bad << " of " << got.size() << "; first at " << first << ": got "
                      << (bad ? got[first] : 0.f) << ", want " << (bad ? want[first] : 0.f));
  REQUIRE(bad == 0);
}
template <class T>
void check_close(const std::vector<T>& got, const std::vector<float>& want, double scale = 1.0) {
  check_close(to_float(got), want, tol<T>(), tol<T>() * scale);
}

}  // namespace

// ---------------------------------------------------------------- elementwise, gelu

TEMPLATE_TEST_CASE("emu unary ops and their derivatives match the CPU table", "[emu]", float, cu::bf16, cu::f16) {
  using T = TestType;
  const int64_t n = 1029;  // 128 packs of 8 halves (or 257 of 4 floats) and a tail
  const auto x = rounded<T>(randn(size_t(n), 1, 1.5f));
  const auto pos = rounded<T>(randn(size_t(n), 2, 0.3f, 2.0f));  // for log/sqrt/rsqrt/pow
  const auto dy = rounded<T>(randn(size_t(n), 3));
  for (Unary op : {Unary::neg, Unary::exp, Unary::log, Unary::sqrt, Unary::rsqrt, Unary::tanh, Unary::relu,
                   Unary::gelu, Unary::silu, Unary::abs, Unary::scale, Unary::add_scalar, Unary::pow, Unary::square}) {
    const bool needs_positive = op == Unary::log || op == Unary::sqrt || op == Unary::rsqrt || op == Unary::pow;
    const auto& in = needs_positive ? pos : x;
    INFO("unary op " << int(op));
    for (int64_t offset : {0, 1}) {  // 16-byte aligned (packs + tail) and misaligned (scalar path)
      std::vector<float> want(static_cast<size_t>(n - offset));
      cpu::unary(op, DType::f32, want.data(), in.data() + offset, n - offset, 1.7);
      const auto xs = to_storage<T>(in);
      std::vector<T> got(static_cast<size_t>(n));
      cu::unary(op, dtype_of<T>(), got.data() + offset, xs.data() + offset, n - offset, 1.7, nullptr);
      check_close(std::vector<T>(got.begin() + offset, got.end()), want);
    }
    if (op == Unary::relu || op == Unary::gelu || op == Unary::silu || op == Unary::tanh || op == Unary::exp) {
      std::vector<float> want(static_cast<size_t>(n));
      cpu::unary_backward(op, DType::f32, want.data(), dy.data(), x.data(), n);
      const auto dys = to_storage<T>(dy), xs = to_storage<T>(x);
      std::vector<T> got(static_cast<size_t>(n));
      cu::unary_backward(op, dtype_of<T>(), got.data(), dys.data(), xs.data(), n, nullptr);
      check_close(got, want, 4.0);
    }
  }
}

TEMPLATE_TEST_CASE("emu gelu forward and backward launchers match the CPU table", "[emu]", float, cu::bf16) {
  using T = TestType;
  const int64_t n = 1003;
  const auto x = rounded<T>(randn(size_t(n), 4, 2.0f)), dy = rounded<T>(randn(size_t(n), 5));
  std::vector<float> y_ref(static_cast<size_t>(n)), dx_ref(static_cast<size_t>(n));
  cpu::unary(Unary::gelu, DType::f32, y_ref.data(), x.data(), n, 0);
  cpu::unary_backward(Unary::gelu, DType::f32, dx_ref.data(), dy.data(), x.data(), n);
  const auto xs = to_storage<T>(x), dys = to_storage<T>(dy);
  std::vector<T> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
  cu::gelu_forward(y.data(), xs.data(), n, nullptr);
  cu::gelu_backward(dx.data(), dys.data(), xs.data(), n, nullptr);
  check_close(y, y_ref);
  check_close(dx, dx_ref, 4.0);
}

TEMPLATE_TEST_CASE("emu binary ops broadcast like the CPU table", "[emu]", float, cu::bf16) {
  using T = TestType;
  const Dims shape = {3, 5, 37};
  const auto a = rounded<T>(randn(3 * 5 * 37, 6)), b = rounded<T>(randn(5 * 37, 7, 1.0f, 3.0f));
  const auto c = rounded<T>(randn(3 * 5 * 37, 8, 1.0f, 3.0f));
  const Dims dense = {5 * 37, 37, 1}, bcast = {0, 37, 1}, col = {5 * 37, 1, 0};  // b over dim 0; a column of a
  for (Binary op : {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::max, Binary::min}) {
    INFO("binary op " << int(op));
    for (int layout = 0; layout < 3; ++layout) {
      const auto& rhs = layout == 0 ? c : b;
      const Dims& as = layout == 2 ? col : dense;
      const Dims& bs = layout == 0 ? dense : bcast;
      std::vector<float> want(3 * 5 * 37);
      cpu::binary(op, DType::f32, want.data(), a.data(), as, rhs.data(), bs, shape);
      const auto av = to_storage<T>(a), bv = to_storage<T>(rhs);
      std::vector<T> got(3 * 5 * 37);
      cu::binary(op, dtype_of<T>(), got.data(), av.data(), as, bv.data(), bs, shape, nullptr);
      check_close(got, want);
    }
  }
}

TEST_CASE("emu fill and strided copy convert like the CPU table", "[emu]") {
  const Dims shape = {4, 3, 7};
  const Dims transposed = {1, 28, 4};  // a [7,3,4] array read as its transpose [4,3,7]
  const auto src = rounded<cu::bf16>(randn(84, 9));
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (DType st : {DType::f32, DType::bf16}) {
      INFO(dtype_name(st) << " -> " << dtype_name(dt));
      std::vector<unsigned char> s(84 * dtype_size(st)), want(84 * dtype_size(dt)), got(84 * dtype_size(dt));
      cpu::copy_strided(s.data(), st, src.data(), DType::f32, {84}, {1});
      cpu::copy_strided(want.data(), dt, s.data(), st, shape, transposed);
      cu::copy_strided(got.data(), dt, s.data(), st, shape, transposed, nullptr);
      REQUIRE(got == want);  // every conversion rounds to nearest even on both sides: bit-exact
    }
  }
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
    INFO(dtype_name(dt));
    std::vector<unsigned char> want(37 * 8), got(37 * 8);
    cpu::fill(want.data(), dt, 37, -2.75);
    cu::fill(got.data(), dt, 37, -2.75, nullptr);
    REQUIRE(got == want);
  }
}
