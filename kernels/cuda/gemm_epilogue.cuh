// A GEMM's epilogue as separate kernels, for the shapes and alignments cuBLASLt cannot fuse it
// into the product (the op table's gemm entry, kernels/cuda/table.cu): the bare product first,
// into the pre-activation buffer when there is one, then bias, residual, GELU or its derivative,
// and the row sums, each the kernel the unfused ops would run, with the same values. Kept apart
// from cuBLASLt so the emulation runs it too (tests/emu), the bare product being the CPU's there.
#pragma once
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/reduce.cuh"

namespace sg::cuda {

// bare(args): the product alone (no epilogue fields set), on `stream`.
// with_scratch(floats, use): calls use(float*) with at least `floats` floats of device scratch
// that stays valid for the launches use() enqueues.
template <class Bare, class WithScratch>
void gemm_epilogue_apart(const kernels::GemmArgs& g, Bare&& bare, WithScratch&& with_scratch, Stream stream) {
  using kernels::Binary;
  using kernels::Reduce;
  using kernels::Unary;
  kernels::GemmArgs plain = g;
  plain.bias = nullptr;
  plain.gelu = false;
  plain.pre_gelu = nullptr;
  plain.dgelu_pre = nullptr;
  plain.bias_grad = nullptr;
  plain.row_sums_a = nullptr;
  plain.residual = nullptr;
  void* pre = g.pre_gelu ? g.pre_gelu : g.C;  // where the value before GELU lands
  plain.C = pre;
  bare(plain);
  if (g.bias) binary(Binary::add, g.dtype, pre, pre, {g.N, 1}, g.bias, {0, 1}, {g.M, g.N}, stream);
  if (g.residual) binary(Binary::add, g.dtype, g.C, g.C, {g.N, 1}, g.residual, {g.N, 1}, {g.M, g.N}, stream);
  if (g.gelu) unary(Unary::gelu, g.dtype, g.C, pre, g.M * g.N, 0, stream);
  if (g.dgelu_pre) unary_backward(Unary::gelu, g.dtype, g.C, g.C, g.dgelu_pre, g.M * g.N, stream);
  // Sums over rows: of C [M, N] for the bias gradient; of op(A) [M, K] for the row sums (a
  // column sum of A stored [K, M] when transposed).
  const auto sum = [&](void* out, const void* x, int64_t outer, int64_t n, int64_t inner) {
    with_scratch(size_t(reduce_workspace(outer, n, inner)),
                 [&](float* work) { reduce(Reduce::sum, g.dtype, out, x, outer, n, inner, stream, work); });
  };
  if (g.bias_grad) sum(g.bias_grad, g.C, 1, g.M, g.N);
  if (g.row_sums_a) {
    if (g.trans_a) sum(g.row_sums_a, g.A, 1, g.K, g.M);
    else sum(g.row_sums_a, g.A, g.M, g.K, 1);
  }
}

}  // namespace sg::cuda
