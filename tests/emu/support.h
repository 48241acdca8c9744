// Shared by the emulation tests: random inputs, storage conversions and tolerant comparison.
#pragma once
#include "tests/catch.h"
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu.h"
#include "kernels/cuda/common.cuh"
#include "tests/random_values.h"

namespace sg::emu_testing {

namespace cu = sg::cuda;
namespace cpu = sg::kernels::cpu;

using sg::testing::randn;

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
inline void check_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol) {
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

}  // namespace sg::emu_testing
