// Normal random test inputs from a seed, shared by the emulation and GPU kernel tests.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace sg::testing {

inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(shift, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

}  // namespace sg::testing
