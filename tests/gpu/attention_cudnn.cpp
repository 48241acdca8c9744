// cuDNN's fused causal attention (--attention cudnn) on cuda:0 against the CPU op table and
// against the hand-written flash kernels, forward (out, lse) and backward (dq, dk, dv), bf16 and
// f16 on a regular and an irregular sequence length. The CPU computes in f32 on the rounded
// inputs; the bound is on the relative L2 error of each output (bf16 keeps 8 significant bits).
// Exits 77 (CTest: skipped) without a CUDA device, or on a build without the kernels or cuDNN.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

#include "kernels/cuda/runtime.h"
#include "tests/gpu/support.h"

#if defined(SG_CUDA_KERNELS) && defined(SG_WITH_CUDNN)
using namespace sg;
using namespace sg::gpu_testing;

namespace {

constexpr double kRelL2 = 1e-2;

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    ref += double(want[i]) * want[i];
  }
  return std::sqrt(err / std::max(ref, 1e-30));
}

// Selects a backend for one scope; the process default (flash) comes back after.
struct UseAttention {
  explicit UseAttention(cuda::AttentionBackend b) { cuda::set_attention_backend(b); }
  ~UseAttention() { cuda::set_attention_backend(cuda::AttentionBackend::flash); }
};

// Forward and backward outputs of one attention call, as floats on the host.
struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

struct Problem {
  int64_t B, H, T, D;
  DType dt;
  std::vector<float> q, k, v, dout;
  Problem(int64_t B_, int64_t H_, int64_t T_, int64_t D_, DType dt_) : B(B_), H(H_), T(T_), D(D_), dt(dt_) {
    const size_t n = size_t(B * H * T * D);
    q = randn(n, 41), k = randn(n, 42), v = randn(n, 43), dout = randn(n, 44);
  }
  // Runs the table of dev: dt there on the device, f32 on the rounded inputs on the host.
  Result run(Device dev) const {
    const DType t = dev.is_cuda() ? dt : DType::f32;
    const auto in = [&](const std::vector<float>& x) { return put(dev.is_cuda() ? x : rounded(x, dt), t, dev); };
    const int64_t n = B * H * T * D;
    Tensor tq = in(q), tk = in(k), tv = in(v), tdo = in(dout);
    Tensor o = buffer(n, t, dev), l = buffer(B * H * T, kernels::stats_dtype(t), dev);  // lse: f32
    Tensor dq = buffer(n, t, dev), dk = buffer(n, t, dev), dv = buffer(n, t, dev);
    kernels::AttentionArgs a;
    a.dtype = t, a.B = B, a.H = H, a.T = T, a.D = D, a.causal = true, a.scale = 1.0 / std::sqrt(double(D));
    a.q = tq.data_ptr(), a.k = tk.data_ptr(), a.v = tv.data_ptr(), a.out = o.data_ptr(), a.lse = l.data_ptr();
    a.dout = tdo.data_ptr(), a.dq = dq.data_ptr(), a.dk = dk.data_ptr(), a.dv = dv.data_ptr();
    const kernels::OpTable& table = kernels::table(dev);
    table.attention(a);
    table.attention_backward(a);
    return {get(o), get(l), get(dq), get(dk), get(dv)};
  }
};

// got within the bound of want, output by output; lse element-wise (f32 on both sides).
void require_close(const Result& got, const Result& want) {
  CHECK(rel_l2(got.out, want.out) <= kRelL2);
  check_close(got.lse, want.lse, 1e-2, 1e-2);
  CHECK(rel_l2(got.dq, want.dq) <= kRelL2);
  CHECK(rel_l2(got.dk, want.dk) <= kRelL2);
  CHECK(rel_l2(got.dv, want.dv) <= kRelL2);
}

}  // namespace

TEST_CASE("cuDNN causal attention, forward and backward, matches the CPU and the flash kernels", "[gpu][cudnn]") {
  for (auto [B, H, T, D] : {std::array<int64_t, 4>{2, 3, 64, 64}, std::array<int64_t, 4>{1, 2, 200, 128}}) {
    INFO("B " << B << " H " << H << " T " << T << " D " << D);
    const Problem p(B, H, T, D, DType::bf16);
    const Result cpu = p.run(host);
    Result cudnn, flash;
    {
      UseAttention use(cuda::AttentionBackend::cudnn);
      cudnn = p.run(gpu);
      INFO("a second call reuses the cached plans");
      const Result again = p.run(gpu);
      REQUIRE(again.out == cudnn.out);
    }
    flash = p.run(gpu);
    INFO("cudnn vs cpu");
    require_close(cudnn, cpu);
    INFO("flash vs cpu");
    require_close(flash, cpu);
    INFO("cudnn vs flash");
    require_close(cudnn, flash);
  }
}

TEST_CASE("cuDNN and the flash kernels run f16 causal attention too", "[gpu][cudnn]") {
  const Problem p(2, 2, 96, 64, DType::f16);
  const Result cpu = p.run(host);
  {
    UseAttention use(cuda::AttentionBackend::cudnn);
    INFO("cudnn vs cpu");
    require_close(p.run(gpu), cpu);
  }
  INFO("flash vs cpu");
  require_close(p.run(gpu), cpu);
}

TEST_CASE("cuDNN's backward is right whatever its dQ accumulator held: the engine zeroes it from 9.6.0", "[gpu][cudnn]") {
  UseAttention use(cuda::AttentionBackend::cudnn);
  const cuda::DqAccumulator by_default = cuda::dq_accumulator();
  const Problem p(2, 3, 128, 64, DType::bf16);
  const Result cpu = p.run(host);
  if (!cuda::cudnn_zeroes_dq_accumulator()) {  // cuDNN before 9.6.0: the memset is needed
    REQUIRE_THROWS_WITH(cuda::set_dq_accumulator(cuda::DqAccumulator::poisoned),
                        Catch::Contains("needs cuDNN 9.6.0 or newer"));
    require_close(p.run(gpu), cpu);
    return;
  }
  struct Restore {
    cuda::DqAccumulator how;
    ~Restore() { cuda::set_dq_accumulator(how); }
  } restore{by_default};
  for (cuda::DqAccumulator how : {cuda::DqAccumulator::poisoned, cuda::DqAccumulator::engine, cuda::DqAccumulator::memset}) {
    INFO("dQ accumulator " << cuda::name(how));
    cuda::set_dq_accumulator(how);
    // twice: the caching allocator may hand the second call the first one's block, its dQ sums in it
    const Result first = p.run(gpu), second = p.run(gpu);
    require_close(first, cpu);
    require_close(second, cpu);
  }
}

TEST_CASE("cuDNN attention refuses f32 and unsupported head dims by name", "[gpu][cudnn]") {
  UseAttention use(cuda::AttentionBackend::cudnn);
  REQUIRE_THROWS_WITH(Problem(1, 1, 16, 64, DType::f32).run(gpu),
                      Catch::Contains("attention (cudnn): f32 is not supported; use --attention flash"));
  REQUIRE_THROWS_WITH(Problem(1, 1, 16, 36, DType::bf16).run(gpu), Catch::Contains("head dim D = 36"));
}

#endif  // SG_CUDA_KERNELS && SG_WITH_CUDNN

int main(int argc, char** argv) {
#if !defined(SG_CUDA_KERNELS) || !defined(SG_WITH_CUDNN)
  std::printf("built without SG_CUDA_KERNELS or without cuDNN: the cuDNN attention tests are skipped\n");
  return 77;
#else
  if (sg::cuda::device_count() == 0) {
    std::printf("no CUDA device: the cuDNN attention tests are skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
#endif
}
