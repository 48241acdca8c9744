// Flash attention (kernels/cuda/attention.cuh, attention_tc.cuh) under emulation against the CPU
// table's attention: FMA kernels at head dims 8 to 128, f32 and bf16; tensor-core forward and
// backward at 64 and 128; sequence lengths that are not a multiple of the tiles.
#include <catch2/catch.hpp>
#include <tuple>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_tc.cuh"
#include "tests/emu/support.h"

using namespace sg;
using namespace sg::emu_testing;

TEMPLATE_TEST_CASE("emu causal flash attention forward and backward match the CPU table", "[emu]", float, cu::bf16) {
  using T = TestType;
  for (auto [Tn, D] : {std::pair<int64_t, int64_t>{37, 64}, {70, 64}, {37, 128}, {37, 8}, {70, 16}, {37, 32}}) {
    INFO("T " << Tn << " D " << D);
    const int64_t B = 1, H = 2, n = B * H * Tn * D;
    const auto q = rounded<T>(randn(size_t(n), 60)), k = rounded<T>(randn(size_t(n), 61));
    const auto v = rounded<T>(randn(size_t(n), 62)), dout = rounded<T>(randn(size_t(n), 63));
    std::vector<float> out_ref(n), lse_ref(B * H * Tn), dq_ref(n), dk_ref(n), dv_ref(n);
    kernels::AttentionArgs a;
    a.dtype = DType::f32, a.B = B, a.H = H, a.T = Tn, a.D = D, a.causal = true, a.scale = 1.0 / std::sqrt(double(D));
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out_ref.data(), a.lse = lse_ref.data();
    a.dout = dout.data(), a.dq = dq_ref.data(), a.dk = dk_ref.data(), a.dv = dv_ref.data();
    cpu::attention(a);
    cpu::attention_backward(a);

    const auto qs = to_storage<T>(q), ks = to_storage<T>(k), vs = to_storage<T>(v), dos = to_storage<T>(dout);
    std::vector<T> out(n), dq(n), dk(n), dv(n);
    std::vector<float> lse(B * H * Tn);
    kernels::AttentionArgs g = a;
    g.dtype = dtype_of<T>();
    g.q = qs.data(), g.k = ks.data(), g.v = vs.data(), g.out = out.data(), g.lse = lse.data();
    g.dout = dos.data(), g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
    cu::attention_forward(g, nullptr);
    check_close(out, out_ref, 2.0);
    check_close(lse, lse_ref, 1e-5, 1e-5);
    std::vector<float> work(static_cast<size_t>(cu::attention_backward_workspace(g)));
    cu::attention_backward(g, work.data(), nullptr);
    check_close(dq, dq_ref, 4.0);
    check_close(dk, dk_ref, 4.0);
    check_close(dv, dv_ref, 4.0);
  }
}

TEST_CASE("emu flash attention refuses a head dim it has no kernel for", "[emu]") {
  kernels::AttentionArgs a;
  a.dtype = DType::f32, a.B = 1, a.H = 1, a.T = 4, a.D = 48;
  REQUIRE_THROWS_WITH(cu::attention_forward(a, nullptr), Catch::Contains("head dim 48"));
}

// The tensor-core forward (kernels/cuda/attention_tc.cuh): bf16, head dims 64 and 128, lengths
// that end inside a 32-key tile and inside a 64-row block, causal and not.
TEST_CASE("emu tensor-core flash attention forward (mma m16n8k16, bf16) matches the CPU table", "[emu]") {
  for (auto [Tn, D, causal] : {std::tuple<int64_t, int64_t, bool>{37, 64, true}, {70, 64, true}, {37, 128, true},
                               {70, 128, true}, {45, 64, false}}) {
    INFO("T " << Tn << " D " << D << " causal " << causal);
    const int64_t B = 1, H = 2, n = B * H * Tn * D;
    const auto q = rounded<cu::bf16>(randn(size_t(n), 90)), k = rounded<cu::bf16>(randn(size_t(n), 91));
    const auto v = rounded<cu::bf16>(randn(size_t(n), 92));
    std::vector<float> out_ref(n), lse_ref(B * H * Tn);
    kernels::AttentionArgs a;
    a.dtype = DType::f32, a.B = B, a.H = H, a.T = Tn, a.D = D, a.causal = causal, a.scale = 1.0 / std::sqrt(double(D));
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out_ref.data(), a.lse = lse_ref.data();
    cpu::attention(a);

    const auto qs = to_storage<cu::bf16>(q), ks = to_storage<cu::bf16>(k), vs = to_storage<cu::bf16>(v);
    std::vector<cu::bf16> out(n);
    std::vector<float> lse(B * H * Tn);
    kernels::AttentionArgs g = a;
    g.dtype = DType::bf16;
    g.q = qs.data(), g.k = ks.data(), g.v = vs.data(), g.out = out.data(), g.lse = lse.data();
    cu::attention_forward_tensor_cores(g, nullptr);
    check_close(out, out_ref, 2.0);  // P V takes P rounded to bf16, as FlashAttention-2 does
    check_close(lse, lse_ref, 1e-5, 1e-5);
  }
}

// The tensor-core backward (dk/dv per key block, dq per query block) against the CPU's f32
// gradients of the same bf16 inputs; P and dS are rounded to bf16 as mma operands, hence the
// looser bound than the forward's.
TEST_CASE("emu tensor-core flash attention backward (mma m16n8k16, bf16) matches the CPU table", "[emu]") {
  for (auto [Tn, D, causal] : {std::tuple<int64_t, int64_t, bool>{37, 64, true}, {70, 64, true}, {70, 128, true},
                               {45, 64, false}}) {
    INFO("T " << Tn << " D " << D << " causal " << causal);
    const int64_t B = 1, H = 2, n = B * H * Tn * D;
    const auto q = rounded<cu::bf16>(randn(size_t(n), 93)), k = rounded<cu::bf16>(randn(size_t(n), 94));
    const auto v = rounded<cu::bf16>(randn(size_t(n), 95)), dout = rounded<cu::bf16>(randn(size_t(n), 96));
    std::vector<float> out_ref(n), lse_ref(B * H * Tn), dq_ref(n), dk_ref(n), dv_ref(n);
    kernels::AttentionArgs a;
    a.dtype = DType::f32, a.B = B, a.H = H, a.T = Tn, a.D = D, a.causal = causal, a.scale = 1.0 / std::sqrt(double(D));
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out_ref.data(), a.lse = lse_ref.data();
    a.dout = dout.data(), a.dq = dq_ref.data(), a.dk = dk_ref.data(), a.dv = dv_ref.data();
    cpu::attention(a);
    cpu::attention_backward(a);

    const auto qs = to_storage<cu::bf16>(q), ks = to_storage<cu::bf16>(k), vs = to_storage<cu::bf16>(v);
    const auto dos = to_storage<cu::bf16>(dout);
    std::vector<cu::bf16> out(n), dq(n, cu::bf16{}), dk(n), dv(n);
    std::vector<float> lse(B * H * Tn), work(size_t(cu::attention_backward_workspace(a)));
    kernels::AttentionArgs g = a;
    g.dtype = DType::bf16;
    g.q = qs.data(), g.k = ks.data(), g.v = vs.data(), g.out = out.data(), g.lse = lse.data();
    g.dout = dos.data(), g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
    cu::attention_forward_tensor_cores(g, nullptr);
    cu::attention_backward_tensor_cores(g, work.data(), nullptr);
    check_close(dv, dv_ref, 4.0);
    check_close(dk, dk_ref, 4.0);
    check_close(dq, dq_ref, 4.0);
  }
}

TEST_CASE("emu tensor-core flash attention refuses f32 and names it", "[emu]") {
  kernels::AttentionArgs a;
  a.dtype = DType::f32, a.B = 1, a.H = 1, a.T = 4, a.D = 64;
  REQUIRE_THROWS_WITH(cu::attention_forward_tensor_cores(a, nullptr), Catch::Contains("f32"));
}
