// The CUDA op table: each entry adapts an op-table signature (kernels/ops.h) to a launcher of
// kernels/cuda/*.cuh, on the compute stream of the device that holds the op's output. Scratch
// memory comes from the caching allocator through Storage (ledger category `workspace`); its
// blocks are reused only on the compute stream, so a scratch buffer may be released as soon as
// the launches that use it are enqueued.
//
// Per-row statistics (norm mean and rstd; cross-entropy loss, lse, dloss; attention lse) are f32
// for every dtype, as the op table's kernels::stats_dtype says: the kernels read and write the
// callers' buffers directly, and backwards reuse what the forward saved.
//
// Attention: bf16 and f16 at head dim 64 or 128 run on tensor cores (attention_tc.cuh), forward
// and backward; f32 and the other head dims on the FMA flash kernels (attention.cuh). The choice,
// and cuDNN's contiguous detour, are in attention_any.cuh, where the emulation tests reach them.
#include "core/storage.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/attention_any.cuh"
#include "kernels/cuda/classifier.cuh"
#include "kernels/cuda/dropout.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/global_norm.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/softmax.cuh"

namespace sg::cuda {
namespace {

struct On {
  Device dev;
  cudaStream_t stream;
};
// Where an op runs: the device owning p (made current) and its compute stream.
On on(const void* p, const char* op) {
  const Device d = device_of(p, op);
  return {d, compute_stream(d)};
}

// Device scratch of at least `bytes`, charged to the ledger as workspace.
class Scratch {
 public:
  Scratch(size_t bytes, Device d) : s_(bytes ? bytes : 1, d, MemCategory::workspace) {}
  template <class T>
  T* as() const {
    return static_cast<T*>(s_.data());
  }
  void* data() const { return s_.data(); }

 private:
  Storage s_;
};


}  // namespace

// The entries, named as in the op table.
namespace entry {

void copy_strided(void* dst, DType dt, const void* src, DType st, const Dims& shape, const Dims& src_strides) {
  if (numel(shape) == 0) return;
  cuda::copy_strided(dst, dt, src, st, shape, src_strides, on(dst, "copy_strided").stream);
}

void scatter_strided(void* dst, const Dims& dst_strides, const void* src, DType dtype, const Dims& shape) {
  if (numel(shape) == 0) return;
  cuda::scatter_strided(dst, dst_strides, src, dtype, shape, on(dst, "scatter_strided").stream);
}

void fill(void* dst, DType dtype, int64_t n, double value) {
  if (n == 0) return;
  cuda::fill(dst, dtype, n, value, on(dst, "fill").stream);
}

void binary(Binary op, DType dtype, void* out, const void* a, const Dims& as, const void* b, const Dims& bs,
            const Dims& shape) {
  if (numel(shape) == 0) return;
  cuda::binary(op, dtype, out, a, as, b, bs, shape, on(out, "binary").stream);
}

void unary(Unary op, DType dtype, void* out, const void* x, int64_t n, double alpha) {
  if (n == 0) return;
  cuda::unary(op, dtype, out, x, n, alpha, on(out, "unary").stream);
}

void unary_backward(Unary op, DType dtype, void* dx, const void* dy, const void* x, int64_t n) {
  if (n == 0) return;
  cuda::unary_backward(op, dtype, dx, dy, x, n, on(dx, "unary_backward").stream);
}

void reduce(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner) {
  if (outer * inner == 0) return;
  const On o = on(out, "reduce");
  const Scratch work(size_t(reduce_workspace(outer, n, inner)) * sizeof(float), o.dev);
  cuda::reduce(op, dtype, out, x, outer, n, inner, o.stream, work.as<float>());
}

void softmax(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, bool log) {
  if (rows * cols == 0) return;
  cuda::softmax(dtype, y, x, rows, cols, log, on(y, "softmax").stream);
}

void softmax_backward(DType dtype, void* dx, const void* dy, const void* y, int64_t rows, int64_t cols, bool log) {
  if (rows * cols == 0) return;
  cuda::softmax_backward(dtype, dx, dy, y, rows, cols, log, on(dx, "softmax_backward").stream);
}

// cuBLASLt runs the epilogue inside the GEMM when it can (gemm_fused); otherwise the GEMM runs
// bare and the epilogue follows as elementwise kernels and column sums, with the same values.
void gemm(const kernels::GemmArgs& g) {
  const On o = on(g.C, "gemm");
  if (cuda::gemm_fused(g, o.stream)) return;
  cuda::gemm_epilogue_apart(
      g, [&](const kernels::GemmArgs& bare) { cuda::gemm(bare, o.stream); },
      [&](size_t floats, auto&& use) {
        const Scratch work(floats * sizeof(float), o.dev);
        use(work.as<float>());
      },
      o.stream);
}

// The norms' mean and rstd are f32 for every dtype these kernels take (kernels::stats_dtype).
float* stats(const void* p) { return static_cast<float*>(const_cast<void*>(p)); }

// With residual null this is the plain layernorm (r is not written).
void residual_layernorm(DType dtype, void* r, void* y, void* mean, void* rstd, const void* x, const void* residual,
                        const void* w, const void* b, int64_t rows, int64_t C, double eps) {
  if (rows * C == 0) return;
  const On o = on(y, "layernorm");
  dispatch_storage(dtype, "layernorm", [&](auto tag) {
    using T = decltype(tag);
    residual_layernorm_forward<T>(static_cast<T*>(r), static_cast<T*>(y), stats(mean), stats(rstd),
                                  static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(w),
                                  static_cast<const T*>(b), rows, C, eps, o.stream);
  });
}

void layernorm(DType dtype, void* y, void* mean, void* rstd, const void* x, const void* w, const void* b, int64_t rows,
               int64_t C, double eps) {
  residual_layernorm(dtype, nullptr, y, mean, rstd, x, nullptr, w, b, rows, C, eps);
}

void residual_layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dr, const void* dy,
                                 const void* x, const void* w, const void* mean, const void* rstd, int64_t rows,
                                 int64_t C) {
  if (rows * C == 0) return;
  const On o = on(dx, "layernorm_backward");
  const Scratch work(size_t(norm_backward_workspace(rows, C)) * sizeof(float), o.dev);
  dispatch_storage(dtype, "layernorm_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::residual_layernorm_backward<T>(static_cast<T*>(dx), static_cast<T*>(dw), static_cast<T*>(db),
                                         static_cast<const T*>(dr), static_cast<const T*>(dy), static_cast<const T*>(x),
                                         static_cast<const T*>(w), stats(mean), stats(rstd), rows, C, work.as<float>(),
                                         o.stream, norm_backward());
  });
}

void layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dy, const void* x, const void* w,
                        const void* mean, const void* rstd, int64_t rows, int64_t C) {
  residual_layernorm_backward(dtype, dx, dw, db, nullptr, dy, x, w, mean, rstd, rows, C);
}

void rmsnorm(DType dtype, void* y, void* rstd, const void* x, const void* w, int64_t rows, int64_t C, double eps) {
  if (rows * C == 0) return;
  const On o = on(y, "rmsnorm");
  dispatch_storage(dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward<T>(static_cast<T*>(y), stats(rstd), static_cast<const T*>(x), static_cast<const T*>(w), rows, C,
                       eps, o.stream);
  });
}

void rmsnorm_backward(DType dtype, void* dx, void* dw, const void* dy, const void* x, const void* w, const void* rstd,
                      int64_t rows, int64_t C) {
  if (rows * C == 0) return;
  const On o = on(dx, "rmsnorm_backward");
  const Scratch work(size_t(norm_backward_workspace(rows, C)) * sizeof(float), o.dev);
  dispatch_storage(dtype, "rmsnorm_backward", [&](auto tag) {
    using T = decltype(tag);
    cuda::rmsnorm_backward<T>(static_cast<T*>(dx), static_cast<T*>(dw), static_cast<const T*>(dy),
                              static_cast<const T*>(x), static_cast<const T*>(w), stats(rstd), rows, C,
                              work.as<float>(), o.stream, norm_backward());
  });
}

void embedding(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n, int64_t C,
               int64_t num_rows) {
  if (n * C == 0) return;
  const On o = on(out, "embedding");
  const DeferredCheck bad = deferred_check(o.dev, [n, num_rows](int count) {
    return str("embedding (cuda): ", count, " of ", n, " indices out of range for a table of ", num_rows, " rows");
  });
  embedding_forward(dtype, idx_dtype, out, idx, weight, n, C, num_rows, bad.ptr(), o.stream);
}

// Indices outside the table are skipped: the forward counted them, and the next sync reports them.
void embedding_backward(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx, int64_t n,
                        int64_t C, int64_t num_rows) {
  if (n * C == 0) return;
  const On o = on(dweight, "embedding_backward");
  const Scratch work(embedding_backward_workspace(n, num_rows), o.dev);
  cuda::embedding_backward(dtype, idx_dtype, dweight, dout, idx, n, C, num_rows, work.as<void>(), o.stream,
                           cuda::embedding_backward_kind());
}

// Where the classifier kernels count targets outside [0, V) that are not ignore_index (their loss
// is 0), reported at the next sync.
DeferredCheck check_targets(Device d, int64_t rows, int64_t V, int64_t ignore_index) {
  return deferred_check(d, [rows, V, ignore_index](int count) {
    return str("cross_entropy (cuda): ", count, " of ", rows, " targets out of range [0, ", V,
               ") and not ignore_index (", ignore_index, ")");
  });
}

void cross_entropy(DType dtype, DType tgt_dtype, void* loss, void* lse, const void* logits, const void* targets,
                   int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) {
  if (rows == 0) return;
  const On o = on(loss, "cross_entropy");
  cuda::cross_entropy(dtype, tgt_dtype, stats(loss), stats(lse), logits, targets, rows, Vp, V, ignore_index,
                      check_targets(o.dev, rows, V, ignore_index).ptr(), o.stream);
}

void cross_entropy_backward(DType dtype, DType tgt_dtype, void* dlogits, const void* dloss, const void* logits,
                            const void* lse, const void* targets, int64_t rows, int64_t Vp, int64_t V,
                            int64_t ignore_index) {
  if (rows * Vp == 0) return;
  cuda::cross_entropy_backward(dtype, tgt_dtype, dlogits, stats(dloss), logits, stats(lse), targets, rows, Vp, V,
                               ignore_index, on(dlogits, "cross_entropy_backward").stream);
}

void cross_entropy_fused(DType dtype, DType tgt_dtype, void* loss, void* dlogits, const void* logits,
                         const void* targets, double dloss, int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) {
  if (rows == 0) return;
  const On o = on(loss, "cross_entropy_fused");
  cuda::classifier_forward_backward(dtype, tgt_dtype, stats(loss), nullptr, dlogits, logits, targets, float(dloss),
                                    rows, Vp, V, ignore_index, check_targets(o.dev, rows, V, ignore_index).ptr(),
                                    o.stream, cuda::classifier());
}

void dropout(DType dtype, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t stream,
             int64_t row_len, uint64_t first) {
  if (n == 0) return;
  cuda::dropout(dtype, out, x, n, p, seed, stream, row_len, first, on(out, "dropout").stream);
}

void random(DType dtype, void* out, int64_t n, bool normal, double a, double b, uint64_t seed, uint64_t stream,
            uint64_t first) {
  if (n == 0) return;
  cuda::random(dtype, out, n, normal, a, b, seed, stream, first, on(out, "random").stream);
}

void adamw(const kernels::AdamWArgs& a) {
  if (a.n == 0) return;
  cuda::adamw(a, on(a.param, "adamw").stream);
}

void adamw_many(const kernels::AdamWArgs* args, int64_t count) {
  if (count == 0) return;
  cuda::adamw_many(args, count, on(args[0].param, "adamw_many").stream);
}

// One f32 accumulator on the device, one copy back: a single host round trip for the whole list.
double sum_squares_many(DType dtype, const void* const* xs, const int64_t* ns, const double* weights, int64_t count) {
  const std::vector<NormTensor> list = norm_tensors(xs, ns, weights, count);
  if (list.empty()) return 0;
  const On o = on(list[0].data, "sum_squares_many");
  const Scratch work(size_t(global_norm_workspace(list) + 1) * sizeof(float), o.dev);
  float* total = work.as<float>();
  dispatch_storage(dtype, "sum_squares_many", [&](auto tag) {
    global_norm_squared<decltype(tag)>(total, list, total + 1, o.stream);
  });
  float host = 0;
  SG_CUDA_CHECK(cudaMemcpyAsync(&host, total, sizeof(float), cudaMemcpyDeviceToHost, o.stream));
  sync(o.dev);
  return host;
}

// a.lse is f32 for every dtype (kernels::stats_dtype): the backward reads the forward's own lse and
// out, so nothing runs twice.
void attention(const kernels::AttentionArgs& a) {
  if (a.B * a.H * a.T == 0) return;
#ifdef SG_WITH_CUDNN
  if (attention_backend() == AttentionBackend::cudnn) {
    const On o = on(a.out, "attention (cudnn)");
    const auto run = [&](const kernels::AttentionArgs& c) { cudnn_attention_forward(c, stats(a.lse), o.dev, o.stream); };
    if (cudnn_attention_takes_layout(a, o.dev, false)) return run(a);
    return with_contiguous_layouts<Scratch>(a, o.stream, false, run, o.dev);
  }
#endif
  if (a.dtype != DType::f32 && !is_half(a.dtype)) kernels::unsupported("attention", a.dtype, "cuda");
  const On o = on(a.out, "attention");
  attention_forward_any(a, has_mma_sync(o.dev), flash_forward_kind(), o.stream);
}

void attention_backward(const kernels::AttentionArgs& a) {
  if (a.B * a.H * a.T == 0) return;
#ifdef SG_WITH_CUDNN
  if (attention_backend() == AttentionBackend::cudnn) {
    const On o = on(a.dq, "attention_backward (cudnn)");
    const auto run = [&](const kernels::AttentionArgs& c) { cudnn_attention_backward(c, stats(a.lse), o.dev, o.stream); };
    if (cudnn_attention_takes_layout(a, o.dev, true)) return run(a);
    return with_contiguous_layouts<Scratch>(a, o.stream, true, run, o.dev);
  }
#endif
  if (a.dtype != DType::f32 && !is_half(a.dtype)) kernels::unsupported("attention_backward", a.dtype, "cuda");
  const On o = on(a.dq, "attention_backward");
  const Scratch work(size_t(attention_backward_workspace(a)) * sizeof(float), o.dev);
  attention_backward_any(a, work.as<float>(), has_mma_sync(o.dev), flash_backward_kind(), o.stream);
}

}  // namespace entry

void fill_kernel_table(kernels::OpTable& t) {
  t.gemm = entry::gemm;
  t.copy_strided = entry::copy_strided;
  t.scatter_strided = entry::scatter_strided;
  t.fill = entry::fill;
  t.binary = entry::binary;
  t.unary = entry::unary;
  t.unary_backward = entry::unary_backward;
  t.reduce = entry::reduce;
  t.softmax = entry::softmax;
  t.softmax_backward = entry::softmax_backward;
  t.layernorm = entry::layernorm;
  t.layernorm_backward = entry::layernorm_backward;
  t.residual_layernorm = entry::residual_layernorm;
  t.residual_layernorm_backward = entry::residual_layernorm_backward;
  t.rmsnorm = entry::rmsnorm;
  t.rmsnorm_backward = entry::rmsnorm_backward;
  t.embedding = entry::embedding;
  t.embedding_backward = entry::embedding_backward;
  t.cross_entropy = entry::cross_entropy;
  t.cross_entropy_backward = entry::cross_entropy_backward;
  t.cross_entropy_fused = entry::cross_entropy_fused;
  t.dropout = entry::dropout;
  t.random = entry::random;
  t.adamw = entry::adamw;
  t.adamw_many = entry::adamw_many;
  t.sum_squares_many = entry::sum_squares_many;
  t.attention = entry::attention;
  t.attention_backward = entry::attention_backward;
}

}  // namespace sg::cuda
