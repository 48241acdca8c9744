// Memory-bound kernels of a GPT-2 124M training step on cuda:0, through the CUDA op table, at the
// issue's shape (B = 16, T = 1024: 16384 rows; C = 768, 4C = 3072, the padded vocabulary 50304),
// bf16 activations and f32 optimizer state as in `train --dtype bf16`. Each row prints the median
// time of 20 runs (CUDA events on the compute stream, after 3 warm-ups) and the effective
// bandwidth: the bytes the op must move at least (every input read once, every output written
// once) over that time, to hold against the card's ~4.3 TB/s (H200; ~3.35 TB/s on an H100 SXM).
// Where one op has several implementations the rows time each: the LayerNorm backward with dw/db
// summed in each place kernels/cuda/variants.h lists (cuda::set_norm_backward), at batch 16 and 64,
// and the classifier as one fused pass (its row read twice, streaming, or once into shared memory,
// staged: cuda::set_classifier) or as the cross_entropy + cross_entropy_backward pair (every row
// counts the fused pass's 2 logits-sized transfers: the pair's lower GB/s is its third one).
// The classifier and norm entries copy a count or a sum to the host and wait, inside the timing.
// The embedding backward runs over uniform and text-like (Zipf) tokens: real text repeats a few
// tokens hundreds of times per batch, and each table row's run is summed by one block.
//
//   ./build/bench/sg_bench_memory_gpu
// Exits 77 without a CUDA device or on a build without the CUDA kernels.
#include <algorithm>
#include <cstdio>
#include <random>
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

using Buffer = bench::DeviceBuffer;

void row(const char* what, double bytes, double ms) {
  std::printf("%-68s %9.3f %9.1f\n", what, ms, bytes / ms * 1e-6);
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
  sg::cuda::ensure_registered();
  const kernels::OpTable& G = kernels::table(gpu);
  const DType bf = DType::bf16, f32 = DType::f32;
  const int64_t R = 16 * 1024, C = 768, F = 4 * C, V = 50257, Vp = 50304, N = R * C;
  const double h = 2.0;  // bytes per bf16
  std::printf("memory-bound kernels, GPT-2 124M shapes at B=16 T=1024 (median of 20)\n");
  std::printf("%-68s %9s %9s\n", "", "ms", "GB/s");

  {  // LayerNorm, with and without the residual add, forward; then the residual add alone
    const Buffer x(N, bf, 1), res(N, bf, 2), w(C, bf, 5, 1.0, 0.1), b(C, bf, 6);
    const Buffer y(N, bf, 7), r(N, bf, 8), mean(R, f32, 12), rstd(R, f32, 13, 1.0, 0.1);
    const double stats = 8.0 * double(R);
    row("layernorm forward [16384, 768]", h * 2 * N + stats,
        median_ms([&] { G.layernorm(bf, y.get(), mean.get(), rstd.get(), x.get(), w.get(), b.get(), R, C, 1e-5); }));
    row("residual_layernorm forward (r = x + res, y)", h * 4 * N + stats, median_ms([&] {
          G.residual_layernorm(bf, r.get(), y.get(), mean.get(), rstd.get(), x.get(), res.get(), w.get(), b.get(), R,
                               C, 1e-5);
        }));
    const kernels::Dims shape{R, C}, strides{C, 1};
    row("add [16384, 768] (the residual add)", h * 3 * N, median_ms([&] {
          G.binary(kernels::Binary::add, bf, y.get(), x.get(), strides, res.get(), strides, shape);
        }));
  }
  // The LayerNorm backward, each place dw/db can be summed (cuda::set_norm_backward), at batch 16
  // and at batch 64 (4x the row chunks: the fused kernels' grid fills the GPU differently).
  for (const int64_t rows : {R, 4 * R}) {
    const int64_t n = rows * C;
    const Buffer x(n, bf, 1), dy(n, bf, 3), dr(n, bf, 4), w(C, bf, 5, 1.0, 0.1), dx(n, bf, 9), dw(C, bf, 10),
        db(C, bf, 11), mean(rows, f32, 12), rstd(rows, f32, 13, 1.0, 0.1);
    const double stats = 8.0 * double(rows);
    for (auto kind : {cuda::NormBackward::fused, cuda::NormBackward::smem, cuda::NormBackward::smem_ahead,
                      cuda::NormBackward::split}) {
      cuda::set_norm_backward(kind);
      char what[96];
      std::snprintf(what, sizeof what, "layernorm backward [%lld, 768], dw/db %s", static_cast<long long>(rows),
                    cuda::name(kind));
      row(what, h * 3 * double(n) + stats, median_ms([&] {
            G.layernorm_backward(bf, dx.get(), dw.get(), db.get(), dy.get(), x.get(), w.get(), mean.get(), rstd.get(),
                                 rows, C);
          }));
      std::snprintf(what, sizeof what, "residual_layernorm backward (+ dr) [%lld, 768], dw/db %s",
                    static_cast<long long>(rows), cuda::name(kind));
      row(what, h * 4 * double(n) + stats, median_ms([&] {
            G.residual_layernorm_backward(bf, dx.get(), dw.get(), db.get(), dr.get(), dy.get(), x.get(), w.get(),
                                          mean.get(), rstd.get(), rows, C);
          }));
    }
    cuda::set_norm_backward(cuda::NormBackward::fused);
  }
  {  // GELU's derivative over the MLP's hidden activations
    const Buffer x(R * F, bf, 20), dy(R * F, bf, 21), dx(R * F, bf, 22);
    row("gelu backward [16384, 3072]", h * 3 * double(R * F), median_ms([&] {
          G.unary_backward(kernels::Unary::gelu, bf, dx.get(), dy.get(), x.get(), R * F);
        }));
  }
  {  // the classifier over the padded vocabulary
    const Buffer logits(R * Vp, bf, 30), loss(R, f32, 31), lse(R, f32, 32), dloss(R, f32, 33);
    std::vector<int32_t> t(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) t[size_t(i)] = int32_t((i * 7919) % V);
    Storage tg(size_t(R) * 4, gpu, MemCategory::activation);
    G.copy_from_host(tg.data(), t.data(), size_t(R) * 4, gpu);
    const double L = h * double(R * Vp);
    // in place over the logits each run: the values become gradients, which are as good logits
    for (auto kind : cuda::kClassifiers) {
      cuda::set_classifier(kind);
      char what[96];
      std::snprintf(what, sizeof what, "classifier, fused: loss + dlogits in one call, %s", cuda::name(kind));
      row(what, 2 * L, median_ms([&] {
            G.cross_entropy_fused(bf, DType::i32, loss.get(), logits.get(), logits.get(), tg.data(), 1.0 / double(R),
                                  R, Vp, V, -1);
          }));
    }
    cuda::set_classifier(cuda::Classifier::streaming);
    row("classifier, two calls: cross_entropy + its backward", 2 * L, median_ms([&] {
          G.cross_entropy(bf, DType::i32, loss.get(), lse.get(), logits.get(), tg.data(), R, Vp, V, -1);
          G.cross_entropy_backward(bf, DType::i32, logits.get(), dloss.get(), logits.get(), lse.get(), tg.data(), R, Vp,
                                   V, -1);
        }));
  }
  {  // the token embedding's backward: uniform tokens, and text-like ones (Zipf-Mandelbrot: rank k
    // drawn with probability ~ 1/(k + 2.7), the commonest token ~3% of the batch, one long run)
    const Buffer dout(N, bf, 50), dw(Vp * C, bf, 51);
    std::mt19937_64 rng(7);
    std::vector<double> cdf(static_cast<size_t>(V));
    double total = 0;
    for (int64_t k = 0; k < V; ++k) cdf[size_t(k)] = total += 1.0 / (double(k) + 2.7);
    for (bool zipf : {false, true}) {
      std::vector<int32_t> idx(static_cast<size_t>(R));
      std::vector<int64_t> count(static_cast<size_t>(V), 0);
      std::uniform_real_distribution<double> u(0, total);
      for (auto& t : idx) {
        const int64_t k = zipf ? int64_t(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin())
                               : int64_t(rng() % uint64_t(V));
        t = int32_t(k * 7919 % V);  // ranks spread over the table
        ++count[size_t(t)];
      }
      const int64_t distinct = std::count_if(count.begin(), count.end(), [](int64_t c) { return c > 0; }),
                    longest = *std::max_element(count.begin(), count.end());
      Storage ti(size_t(R) * 4, gpu, MemCategory::activation);
      G.copy_from_host(ti.data(), idx.data(), size_t(R) * 4, gpu);
      char what[96];
      std::snprintf(what, sizeof what, "embedding backward, %s tokens (%lld rows, run <= %lld)",
                    zipf ? "text-like" : "uniform", static_cast<long long>(distinct), static_cast<long long>(longest));
      // dout read once; each touched row of the table read and written; each way a run is summed
      for (cuda::EmbeddingBackward kind : {cuda::EmbeddingBackward::columns, cuda::EmbeddingBackward::packs}) {
        cuda::set_embedding_backward_kind(kind);
        char label[128];
        std::snprintf(label, sizeof label, "%s, %s", what, cuda::name(kind));
        row(label, h * double(N) + 2 * h * double(distinct * C), median_ms([&] {
              G.embedding_backward(bf, DType::i32, dw.get(), dout.get(), ti.data(), R, C, V);
            }));
      }
      cuda::set_embedding_backward_kind(cuda::EmbeddingBackward::columns);
    }
  }
  {  // the optimizer over GPT-2 124M's parameters as one f32 tensor, its bf16 gradient and copy
    const int64_t P = 124'475'904;
    const Buffer p(P, f32, 40, 0.0, 0.02), g(P, bf, 41), m(P, f32, 42, 0.0, 0.01), v(P, f32, 43, 1.0, 0.0),
        copy(P, bf, 44);
    kernels::AdamWArgs a;
    a.dtype = f32, a.n = P, a.param = p.get(), a.grad = g.get(), a.m = m.get(), a.v = v.get(), a.lr = 1e-4,
    a.weight_decay = 0.1, a.grad_dtype = bf, a.copy = copy.get();
    // read p, m, v (f32) and g (bf16); write p, m, v and the bf16 copy
    row("adamw, 124.5 M f32 params, bf16 grad and copy", double(P) * (3 * 4 + 2 + 3 * 4 + 2),
        median_ms([&] { G.adamw_many(&a, 1); }));
    const void* xs[] = {g.get()};
    const int64_t ns[] = {P};
    const double ws[] = {1.0};
    row("global norm (sum of squares), 124.5 M bf16 grads", double(P) * 2,
        median_ms([&] { G.sum_squares_many(bf, xs, ns, ws, 1); }));
  }
  return 0;
#endif
}
