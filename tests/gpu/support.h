// Shared by the GPU tests: host data onto cuda:0 and back, the bf16-rounded values a kernel reads,
// and an element-wise closeness check. Only for builds with SG_CUDA_KERNELS.
#pragma once
#include "tests/catch.h"
#include <cmath>
#include <random>
#include <vector>

#include "autograd/ops.h"
#include "kernels/ops.h"
#include "tests/random_values.h"

namespace sg::gpu_testing {

inline const Device gpu = Device::cuda(0), host = Device::cpu();
inline const kernels::OpTable& G() { return kernels::table(gpu); }
inline const kernels::OpTable& C() { return kernels::table(host); }

using sg::testing::randn;

// v stored as dt on dev.
inline Tensor put(const std::vector<float>& v, DType dt, Device dev) {
  return to(to(from_vector(v, {int64_t(v.size())}), dt), dev);
}
inline std::vector<float> get(const Tensor& t) { return to_vector<float>(t); }
// The values a kernel storing dt reads.
inline std::vector<float> rounded(const std::vector<float>& v, DType dt) { return get(put(v, dt, host)); }
inline Tensor buffer(int64_t n, DType dt, Device dev) { return zeros({n}, dt, dev); }

inline void check_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    if (got[i] == want[i]) continue;  // equal infinities too (inf - inf is NaN)
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]))) {
      INFO("element " << i << " of " << got.size() << ": got " << got[i] << ", want " << want[i]);
      REQUIRE(false);
    }
  }
}

}  // namespace sg::gpu_testing
