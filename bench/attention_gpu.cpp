// Fused causal attention and cuBLASLt GEMM throughput on cuda:0, bf16, through the CUDA op table.
//
// Attention: the hand-written flash kernels and cuDNN's fused SDPA (--attention flash|cudnn) at
// GPT-2 small's head shape (H=12, T=1024, D=64) and at head dim 128 over the same width (H=6,
// D=128; the tensor-core backward's 16-wide tiles) for B = 8 and 16: forward alone, and forward +
// backward (the backward entry re-runs the forward for f32 statistics on both paths, as training
// does). FLOPs are the causal ones: forward 2 matmuls of 2*B*H*T*T*D, halved by the mask;
// backward 2.5x the forward (5 matmuls to the forward's 2). The cuDNN output is validated
// against the flash output (relative L2) before timing, and each backend's backward gradients are
// compared bit for bit over 3 runs from the same inputs (whether the path is run-to-run repeatable).
// At head dim 64 also the flash backward's register variants (flash-q3, flash-3: FlashBackward in
// kernels/cuda/variants.h), the forward with 64-key tiles (flash-k64: FlashForward) and cuDNN
// without its dQ memset (cudnn-e).
// GEMM: C = A B^T (a linear layer), M=N=K=8192 and GPT-2 small's three shapes at 8192 tokens;
// then the two c_proj GEMMs with their bias and the block's residual add in cuBLASLt's epilogue
// (GemmArgs::residual), against the GEMM with its bias and a separate add: whether the beta = 1
// algorithm costs more than the pass over [M, 768] it saves. Then every GEMM of a GPT-2 124M step at
// batch 16 and 64 (T = 1024), with cuBLASLt's heuristic choice and tuned.
// Each figure is the median of 20 timed runs (CUDA events on the compute stream) after 3 warm-ups.
//
//   ./build/bench/sg_bench_attention_gpu
// Exits 77 without a CUDA device or on a build without the CUDA kernels.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/storage.h"
#include "kernels/ops.h"
#ifdef SG_CUDA_KERNELS
#include "bench/gpu/common.h"
#endif

#ifdef SG_CUDA_KERNELS
namespace {

using namespace sg;

const Device gpu = Device::cuda(0);

using bench::median_ms;

// n bf16 values on the GPU: normal(0, 1) from Philox stream `seed`.
struct Buffer : bench::DeviceBuffer {
  Buffer(int64_t n, uint64_t seed) : DeviceBuffer(n, DType::bf16, seed) {}
};

std::vector<float> to_host_f32(const Buffer& b, int64_t n) {
  std::vector<float> f(static_cast<size_t>(n));
  Storage tmp(size_t(n) * 4, gpu, MemCategory::workspace);
  kernels::table(gpu).copy_strided(tmp.data(), DType::f32, b.get(), DType::bf16, {n}, {1});
  kernels::table(gpu).copy_to_host(f.data(), tmp.data(), size_t(n) * 4, gpu);
  return f;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    ref += double(want[i]) * want[i];
  }
  return std::sqrt(err / std::max(ref, 1e-30));
}

void bench_attention(int64_t H, int64_t D) {
  const int64_t T = 1024;
  std::printf("attention, bf16, causal, H=%ld T=%ld D=%ld (median of 20)\n", long(H), long(T), long(D));
  std::printf("%4s  %-7s %9s %9s %12s %12s\n", "B", "backend", "fwd ms", "fwd TF/s", "fwd+bwd ms", "f+b TF/s");
  for (int64_t B : {8, 16}) {
    const int64_t n = B * H * T * D;
    const Buffer q(n, 1), k(n, 2), v(n, 3), dout(n, 4), out(n, 5), lse(B * H * T, 6), dq(n, 7), dk(n, 8), dv(n, 9);
    kernels::AttentionArgs a;
    a.dtype = DType::bf16, a.B = B, a.H = H, a.T = T, a.D = D, a.causal = true, a.scale = 1.0 / std::sqrt(double(D));
    a.q = q.get(), a.k = k.get(), a.v = v.get(), a.out = out.get(), a.lse = lse.get();
    a.dout = dout.get(), a.dq = dq.get(), a.dk = dk.get(), a.dv = dv.get();
    const double fwd_flops = 2.0 * 2.0 * double(B * H) * double(T) * double(T) * double(D) / 2.0;
    const double fb_flops = fwd_flops * 3.5;
    const kernels::OpTable& G = kernels::table(gpu);
    std::vector<float> flash_out;
    for (auto backend : {cuda::AttentionBackend::flash, cuda::AttentionBackend::cudnn}) {
      const char* name = backend == cuda::AttentionBackend::flash ? "flash" : "cudnn";
#ifndef SG_WITH_CUDNN
      if (backend == cuda::AttentionBackend::cudnn) {
        std::printf("%4ld  %-7s (this build has no cuDNN)\n", long(B), name);
        continue;
      }
#endif
      cuda::set_attention_backend(backend);
      cuda::set_flash_forward_kind(cuda::FlashForward::keys32);  // the flash row's, whatever SG_FLASH_FORWARD says
      G.attention(a);
      const std::vector<float> o = to_host_f32(out, n);
      if (flash_out.empty()) flash_out = o;
      const double fwd = median_ms([&] { G.attention(a); });
      const double fb = median_ms([&] {
        G.attention(a);
        G.attention_backward(a);
      });
      // The backward's gradients, bit for bit, over 3 runs from the same inputs: the hand-written
      // kernels sum in a fixed order; whether cuDNN's engine does decides if it can be the default.
      const auto grads = [&] {
        G.attention(a);
        G.attention_backward(a);
        std::vector<float> g = to_host_f32(dq, n), gk = to_host_f32(dk, n), gv = to_host_f32(dv, n);
        g.insert(g.end(), gk.begin(), gk.end());
        g.insert(g.end(), gv.begin(), gv.end());
        return g;
      };
      const std::vector<float> first = grads();
      bool repeatable = true;
      for (int run = 1; run < 3; ++run) repeatable = repeatable && grads() == first;
      std::printf("%4ld  %-7s %9.3f %9.1f %12.3f %12.1f   bwd bits %s over 3 runs", long(B), name, fwd,
                  fwd_flops / fwd * 1e-9, fb, fb_flops / fb * 1e-9, repeatable ? "equal" : "DIFFER");
      if (backend == cuda::AttentionBackend::cudnn) std::printf("   out vs flash: rel L2 %.1e", rel_l2(o, flash_out));
      std::printf("\n");
    }
    // The flash backward built for 3 blocks an SM instead of 2 (variants.h, FlashBackward; head
    // dim 64 only): dq alone, then dk/dv too. The same bits as the flash row (checked).
    if (D == 64) {
      cuda::set_attention_backend(cuda::AttentionBackend::flash);
      cuda::set_flash_backward_kind(cuda::FlashBackward::free);  // the bits to compare with, whatever SG_FLASH_BACKWARD says
      G.attention(a);
      G.attention_backward(a);
      const std::vector<float> base = to_host_f32(dq, n);
      for (const auto kind : {cuda::FlashBackward::dq_three, cuda::FlashBackward::three}) {
        cuda::set_flash_backward_kind(kind);
        const double fb = median_ms([&] {
          G.attention(a);
          G.attention_backward(a);
        });
        const bool same = to_host_f32(dq, n) == base;
        std::printf("%4ld  %-7s %9s %9s %12.3f %12.1f   (flash, backward variant %s; dq bits %s)\n", long(B),
                    kind == cuda::FlashBackward::three ? "flash-3" : "flash-q3", "", "", fb, fb_flops / fb * 1e-9,
                    cuda::name(kind), same ? "equal" : "DIFFER");
      }
      cuda::set_flash_backward_kind(cuda::FlashBackward::free);
      // The forward with 64-key tiles (FlashForward::keys64): its output against the flash row's
      // (the online softmax groups the keys differently, so the two agree to rounding).
      cuda::set_flash_forward_kind(cuda::FlashForward::keys64);
      G.attention(a);
      const double diff = rel_l2(to_host_f32(out, n), flash_out);
      const double fwd = median_ms([&] { G.attention(a); });
      const double fb = median_ms([&] {
        G.attention(a);
        G.attention_backward(a);
      });
      std::printf("%4ld  %-7s %9.3f %9.1f %12.3f %12.1f   (flash, forward variant keys64; out vs flash: rel L2 %.1e)\n",
                  long(B), "flash-k64", fwd, fwd_flops / fwd * 1e-9, fb, fb_flops / fb * 1e-9, diff);
      cuda::set_flash_forward_kind(cuda::FlashForward::keys32);
    }
#ifdef SG_WITH_CUDNN
    // cuDNN's backward leaving its dQ accumulator to the engine (cuDNN 9.6.0 and newer zero it
    // themselves) instead of the memset the row above ran: what skipping the memset saves.
    if (cuda::cudnn_zeroes_dq_accumulator()) {
      const cuda::DqAccumulator before = cuda::dq_accumulator();
      cuda::set_attention_backend(cuda::AttentionBackend::cudnn);
      cuda::set_dq_accumulator(cuda::DqAccumulator::engine);
      const double fb = median_ms([&] {
        G.attention(a);
        G.attention_backward(a);
      });
      std::printf("%4ld  %-7s %9s %9s %12.3f %12.1f   (cudnn, the dQ accumulator zeroed by the engine, no memset)\n",
                  long(B), "cudnn-e", "", "", fb, fb_flops / fb * 1e-9);
      cuda::set_dq_accumulator(before);
    }
#endif
    cuda::set_attention_backend(cuda::AttentionBackend::flash);
  }
}

void bench_gemm() {
  struct Shape {
    int64_t M, N, K;
    const char* what;
  };
  std::printf("\ngemm, bf16, cuBLASLt, C[M,N] = A[M,K] B[N,K]^T (median of 20)\n");
  std::printf("%6s %6s %6s  %-14s %9s %9s\n", "M", "N", "K", "", "ms", "TF/s");
  for (const Shape& s : {Shape{8192, 8192, 8192, "square"}, Shape{8192, 2304, 768, "qkv (c_attn)"},
                         Shape{8192, 768, 3072, "mlp c_proj"}, Shape{8192, 3072, 768, "mlp c_fc"}}) {
    const Buffer A(s.M * s.K, 10), Bm(s.N * s.K, 11), C(s.M * s.N, 12);
    kernels::GemmArgs g;
    g.dtype = DType::bf16, g.trans_b = true, g.M = s.M, g.N = s.N, g.K = s.K;
    g.A = A.get(), g.lda = s.K, g.B = Bm.get(), g.ldb = s.K, g.C = C.get(), g.ldc = s.N;
    const double ms = median_ms([&] { cuda::gemm(g, cuda::compute_stream(gpu)); });
    std::printf("%6ld %6ld %6ld  %-14s %9.3f %9.1f\n", long(s.M), long(s.N), long(s.K), s.what, ms,
                2.0 * double(s.M) * double(s.N) * double(s.K) / ms * 1e-9);
  }
}

// Every GEMM of a GPT-2 124M training step at BT tokens, as bare bf16 GEMMs (the model's carry
// bias, GELU, residual and bias-gradient epilogues on some): each linear layer's forward
// (Y = X W^T), input gradient (dX = dY W) and weight gradient (dW = dY^T X), W stored [out, in];
// the per-block ones 12 times a step, the tied head once. Each timed with cuBLASLt's heuristic
// choice and with tuning (cuda::set_gemm_tuning), then the step's sum: where the GEMMs' 70% of a
// step is lost against the square GEMM's rate.
void bench_gpt2_gemms(int64_t BT) {
  struct Layer {
    const char* name;
    int64_t in, out, per_step;
  };
  std::printf("\nGPT-2 124M's GEMMs at %ld tokens, bf16, bare (median of 20): heuristic | tuned\n", long(BT));
  std::printf("%-18s %-4s %6s %6s %6s %9s %7s %9s %7s\n", "layer", "", "M", "N", "K", "ms", "TF/s", "ms", "TF/s");
  double step[2] = {0, 0}, flops = 0;
  for (const Layer& l : {Layer{"attn c_attn", 768, 2304, 12}, Layer{"attn c_proj", 768, 768, 12},
                         Layer{"mlp c_fc", 768, 3072, 12}, Layer{"mlp c_proj", 3072, 768, 12},
                         Layer{"lm_head (wte)", 768, 50304, 1}}) {
    const Buffer X(BT * l.in, 60), W(l.out * l.in, 61), dY(BT * l.out, 62), out(std::max(BT * l.out, BT * l.in), 63),
        dW(l.out * l.in, 64);
    for (int pass = 0; pass < 3; ++pass) {  // forward, dX, dW
      kernels::GemmArgs g;
      g.dtype = DType::bf16;
      if (pass == 0) {
        g.M = BT, g.N = l.out, g.K = l.in, g.trans_b = true;
        g.A = X.get(), g.lda = l.in, g.B = W.get(), g.ldb = l.in, g.C = out.get(), g.ldc = l.out;
      } else if (pass == 1) {
        g.M = BT, g.N = l.in, g.K = l.out;
        g.A = dY.get(), g.lda = l.out, g.B = W.get(), g.ldb = l.in, g.C = out.get(), g.ldc = l.in;
      } else {
        g.M = l.out, g.N = l.in, g.K = BT, g.trans_a = true;
        g.A = dY.get(), g.lda = l.out, g.B = X.get(), g.ldb = l.in, g.C = dW.get(), g.ldc = l.in;
      }
      double ms[2];
      for (int tuned = 0; tuned < 2; ++tuned) {
        cuda::set_gemm_tuning(tuned == 1);
        ms[tuned] = median_ms([&] { cuda::gemm(g, cuda::compute_stream(gpu)); });
        step[tuned] += double(l.per_step) * ms[tuned];
      }
      cuda::set_gemm_tuning(false);
      const double f = 2.0 * double(g.M) * double(g.N) * double(g.K);
      flops += double(l.per_step) * f;
      const char* what = pass == 0 ? "fwd" : pass == 1 ? "dX" : "dW";
      std::printf("%-18s %-4s %6ld %6ld %6ld %9.3f %7.1f %9.3f %7.1f\n", l.name, what, long(g.M), long(g.N), long(g.K),
                  ms[0], f / ms[0] * 1e-9, ms[1], f / ms[1] * 1e-9);
    }
  }
  std::printf("%-18s %-4s %20s %9.3f %7.1f %9.3f %7.1f\n", "a step's GEMMs", "", "", step[0], flops / step[0] * 1e-9,
              step[1], flops / step[1] * 1e-9);
}

void bench_gemm_residual() {
  const int64_t M = 8192, N = 768;
  const kernels::OpTable& G = kernels::table(gpu);
  std::printf("\nc_proj + bias + residual, bf16: in the GEMM's epilogue or a separate add (median of 20)\n");
  std::printf("%6s %6s %6s  %-36s %9s\n", "M", "N", "K", "", "ms");
  for (int64_t K : {int64_t(768), int64_t(3072)}) {  // the attention's c_proj, the MLP's
    const Buffer A(M * K, 20), W(N * K, 21), bias(N, 22), res(M * N, 23), C(M * N, 24);
    kernels::GemmArgs g;
    g.dtype = DType::bf16, g.trans_b = true, g.M = M, g.N = N, g.K = K, g.bias = bias.get();
    g.A = A.get(), g.lda = K, g.B = W.get(), g.ldb = K, g.C = C.get(), g.ldc = N;
    kernels::GemmArgs with = g;
    with.residual = res.get();
    const kernels::Dims shape{M, N}, strides{N, 1};
    const char* how = cuda::gemm_fused(with, cuda::compute_stream(gpu)) ? "residual in the epilogue" : "residual: NOT fused (GEMM + add)";
    std::printf("%6ld %6ld %6ld  %-36s %9.3f\n", long(M), long(N), long(K), how, median_ms([&] { G.gemm(with); }));
    std::printf("%6ld %6ld %6ld  %-36s %9.3f\n", long(M), long(N), long(K), "GEMM, then the add", median_ms([&] {
                  G.gemm(g);
                  G.binary(kernels::Binary::add, DType::bf16, C.get(), res.get(), strides, C.get(), strides, shape);
                }));
  }
}

}  // namespace
#endif  // SG_CUDA_KERNELS

int main() {
#ifndef SG_CUDA_KERNELS
  std::printf("built without SG_CUDA_KERNELS: nothing to time\n");
  return 77;
#else
  if (sg::cuda::device_count() == 0) {
    std::printf("no CUDA device: nothing to time\n");
    return 77;
  }
  sg::cuda::ensure_registered();  // the CUDA allocator, before the first buffer
  bench_attention(12, 64);  // GPT-2 small
  std::printf("\n");
  bench_attention(6, 128);
  bench_gemm();
  bench_gemm_residual();
  for (int64_t BT : {int64_t(16384), int64_t(65536)}) bench_gpt2_gemms(BT);  // batch 16 and 64 at T = 1024
  return 0;
#endif
}
