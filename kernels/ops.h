// The op table: the one place where an op meets a device. Each device registers a table of
// function pointers; an entry left null is an op that device cannot do, and calling it fails with
// the op, dtype and device named. Kernels take raw buffers plus sizes (B, T, C in llm.c's sense);
// buffers are contiguous unless strides are passed. Floating kernels compute in f32 or f64; bf16
// and f16 operands are widened by the caller (sg ops) or by the kernel where the table says so.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"

namespace sg::kernels {

using Dims = std::vector<int64_t>;

enum class Binary : uint8_t { add, sub, mul, div, max, min };
enum class Unary : uint8_t { neg, exp, log, sqrt, rsqrt, tanh, relu, gelu, silu, abs, scale, add_scalar, pow, square };
enum class Reduce : uint8_t { sum, max, sum_squares };

// The dtype of per-row statistics and per-row losses (layernorm's mean and rstd, rmsnorm's rstd,
// cross_entropy's loss, lse and dloss, attention's lse): f64 for f64 data, f32 for f32, bf16 and
// f16. A half-precision lse or rstd would be too coarse for the backward (exp(x - lse) off by up
// to 3% in bf16), and f32 costs no conversion pass on a device that computes in f32.
inline DType stats_dtype(DType data) { return data == DType::f64 ? DType::f64 : DType::f32; }

struct GemmArgs {
  DType dtype;
  bool trans_a = false, trans_b = false;  // row-major: C[M,N] = alpha * op(A)[M,K] op(B)[K,N] + beta * C
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* C = nullptr;
  int64_t ldc = 0;
  double alpha = 1.0, beta = 0.0;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;  // batched: element strides between matrices
  // Epilogue (one matrix, C contiguous: batch 1, ldc == N): bias [N] (dtype) added to every row of
  // alpha op(A) op(B) + beta C; then, with gelu (beta 0), C = GELU (tanh form) of that, the value
  // before GELU also stored to pre_gelu ([M, N]) when given, for the backward. A linear layer's
  // forward in one call: a GPU does it in the GEMM's epilogue instead of extra passes over C.
  const void* bias = nullptr;
  bool gelu = false;
  void* pre_gelu = nullptr;
  //  - residual [M, N] (C's layout; beta 0, no GELU): added last, C = alpha op(A) op(B) + bias +
  //    residual, the two-op form's add(residual, linear(...)) without its pass over C. A buffer
  //    of its own (not overlapping C). A GPU reads it as the GEMM's beta = 1 source, rounding
  //    once; the CPU adds it after the bias.
  const void* residual = nullptr;
  // Backward epilogues, the gradients a linear layer's backward needs beside its GEMMs:
  //  - dgelu_pre [M, N] (one contiguous C, beta 0, no forward epilogue): C = the product times
  //    GELU'(dgelu_pre), the gradient through a GELU whose input was dgelu_pre (what the
  //    forward's pre_gelu saved). The input gradient of an MLP's c_proj lands as c_fc's dpre.
  //  - bias_grad [N] (same rules): the sum of C's M rows, after dgelu_pre: the bias gradient of
  //    the layer whose output gradient C is.
  //  - row_sums_a [M] (batch 1, A contiguous): the sum over k of op(A)[m, k]. A weight gradient
  //    dW = dY^T X has op(A) = dY^T, so its row_sums_a is the bias gradient.
  // Each is what the separate ops (unary_backward gelu, a sum over rows) would give, bit for bit
  // on the CPU; a GPU folds them into the GEMM instead of extra passes over C or A.
  const void* dgelu_pre = nullptr;
  void* bias_grad = nullptr;
  void* row_sums_a = nullptr;
};

struct AttentionArgs {
  DType dtype;
  int64_t B = 0, H = 0, T = 0, D = 0;  // q, k, v, out: [B, H, T, D], the head dim contiguous
  // Element strides of the batch, head and time dims: q_strides for q, k, v, dq, dk, dv; o_strides
  // for out and dout. All zero means contiguous [B, H, T, D]: (H T D, T D, D). A model whose q, k
  // and v are the three parts of one [B, T, 3 H D] projection passes pointers into it as they are,
  // q_strides = (3 T H D, D, 3 H D), and an out of [B, T, H D], o_strides = (T H D, D, H D): no
  // head split or merge copies, forward or backward (sg::attention_qkv).
  int64_t q_strides[3] = {0, 0, 0};
  int64_t o_strides[3] = {0, 0, 0};
  // The strides in use: the given ones, or the contiguous [B, H, T, D] ones when all are zero.
  struct Strides {
    int64_t b, h, t;
  };
  Strides q_layout() const { return layout(q_strides); }
  Strides o_layout() const { return layout(o_strides); }
  Strides layout(const int64_t (&s)[3]) const {
    if (s[0] == 0 && s[1] == 0 && s[2] == 0) return {H * T * D, T * D, D};
    return {s[0], s[1], s[2]};
  }
  bool causal = true;
  double scale = 0;  // usually 1/sqrt(D)
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void* out = nullptr;
  void* lse = nullptr;  // [B, H, T] log-sum-exp of each softmax row (stats_dtype), saved for backward
  // backward (all '=' outputs)
  const void* dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
};

struct AdamWArgs {
  DType dtype;  // of param, m, v (f32 or f64), and of grad unless grad_dtype says otherwise
  int64_t n = 0;
  void* param = nullptr;
  const void* grad = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, grad_scale = 1.0;
  int64_t step = 1;  // 1-based, for bias correction
  // Mixed precision: a bf16 or f16 gradient beside an f32 parameter (the model's own gradient,
  // widened as it is read, with the values an f32 copy of it would give), and, when copy is
  // given, the updated parameter rounded to that type into copy (the model's weights refreshed
  // from their f32 master in the same pass). Unset: the gradient is dtype and copy is not allowed.
  std::optional<DType> grad_dtype;
  void* copy = nullptr;
  DType grad_type() const { return grad_dtype.value_or(dtype); }
};

struct OpTable {
  const char* device_name = "?";
  // dst (contiguous, dst_dtype) = src (strided view, src_dtype), converting the element type.
  void (*copy_strided)(void* dst, DType dst_dtype, const void* src, DType src_dtype, const Dims& shape,
                       const Dims& src_strides) = nullptr;
  // dst (strided view, e.g. a narrow() slice) = src (contiguous), same dtype: the bits copied.
  void (*scatter_strided)(void* dst, const Dims& dst_strides, const void* src, DType dtype, const Dims& shape) = nullptr;
  void (*fill)(void* dst, DType dtype, int64_t n, double value) = nullptr;
  // out[shape] = a op b; a and b are strided (stride 0 on broadcast dims); out contiguous. out may be
  // a itself when a is contiguous (an in-place update, add_), never overlap b.
  void (*binary)(Binary op, DType dtype, void* out, const void* a, const Dims& a_strides, const void* b,
                 const Dims& b_strides, const Dims& shape) = nullptr;
  void (*unary)(Unary op, DType dtype, void* out, const void* x, int64_t n, double alpha) = nullptr;
  // dx = dy * f'(x) for gelu/relu/silu (from x) and tanh/exp (from y = f(x), passed as x).
  void (*unary_backward)(Unary op, DType dtype, void* dx, const void* dy, const void* x, int64_t n) = nullptr;
  // out[outer, inner] = reduce over the middle axis of x[outer, n, inner].
  void (*reduce)(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner) = nullptr;
  void (*gemm)(const GemmArgs& a) = nullptr;
  // Row softmax over the last axis (log form if log_softmax). Backward: dx = from dy and y.
  void (*softmax)(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, bool log) = nullptr;
  void (*softmax_backward)(DType dtype, void* dx, const void* dy, const void* y, int64_t rows, int64_t cols,
                           bool log) = nullptr;
  // LayerNorm over C: saves mean and rstd per row (stats_dtype). Backward: dx, dw, db all '='.
  void (*layernorm)(DType dtype, void* y, void* mean, void* rstd, const void* x, const void* w, const void* b,
                    int64_t rows, int64_t C, double eps) = nullptr;
  void (*layernorm_backward)(DType dtype, void* dx, void* dw, void* db, const void* dy, const void* x,
                             const void* w, const void* mean, const void* rstd, int64_t rows, int64_t C) = nullptr;
  // The residual add fused into the LayerNorm after it (one pass over the residual stream, not
  // two): r = x + residual ('=', in dtype), then y = LayerNorm(r) of r as stored, as above. r and
  // y are buffers of their own (neither is x nor residual).
  // Backward: dx = dr + (LayerNorm's input gradient at r) ('='), the gradient of both x and
  // residual; dr (the gradient reaching r itself) may be null for zero and may be dx. dw, db '='.
  void (*residual_layernorm)(DType dtype, void* r, void* y, void* mean, void* rstd, const void* x,
                             const void* residual, const void* w, const void* b, int64_t rows, int64_t C,
                             double eps) = nullptr;
  void (*residual_layernorm_backward)(DType dtype, void* dx, void* dw, void* db, const void* dr, const void* dy,
                                      const void* r, const void* w, const void* mean, const void* rstd, int64_t rows,
                                      int64_t C) = nullptr;
  // RMSNorm: y = x * rstd * w (rstd in stats_dtype). Backward: dx, dw '='.
  void (*rmsnorm)(DType dtype, void* y, void* rstd, const void* x, const void* w, int64_t rows, int64_t C,
                  double eps) = nullptr;
  void (*rmsnorm_backward)(DType dtype, void* dx, void* dw, const void* dy, const void* x, const void* w,
                           const void* rstd, int64_t rows, int64_t C) = nullptr;
  // out[n, C] = weight[idx[n], :]; backward: dweight[idx[n], :] += dout[n, :] ('+=', deterministic order).
  // An index outside [0, num_rows) is an error the forward reports (the CPU at once, CUDA at the
  // next sync, with zeros in its row); the backward throws on one (CPU) or skips it (CUDA), never
  // writing outside dweight [num_rows, C].
  void (*embedding)(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n,
                    int64_t C, int64_t num_rows) = nullptr;
  void (*embedding_backward)(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx,
                             int64_t n, int64_t C, int64_t num_rows) = nullptr;
  // Fused softmax + cross-entropy over logits[rows, Vp] using only the first V columns (padded
  // vocabulary). loss[r] = logsumexp - logit[target]; rows whose target == ignore_index get loss 0.
  // lse[r] is saved. loss, lse and dloss are in stats_dtype. Backward: dlogits = (softmax - onehot)
  // * dloss[r] ('='); padded columns and ignored rows get 0.
  void (*cross_entropy)(DType dtype, DType tgt_dtype, void* loss, void* lse, const void* logits, const void* targets,
                        int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index) = nullptr;
  void (*cross_entropy_backward)(DType dtype, DType tgt_dtype, void* dlogits, const void* dloss, const void* logits,
                                 const void* lse, const void* targets, int64_t rows, int64_t Vp, int64_t V,
                                 int64_t ignore_index) = nullptr;
  // Both in one pass over the logits (the fused classifier): loss[r] as cross_entropy, and dlogits
  // as its backward with the same dloss for every row, known before any backward runs (a mean's
  // 1 / N, a caller's scale). dlogits may be the logits themselves (each element is read before
  // it is written); no lse is kept, as nothing is left to recompute.
  void (*cross_entropy_fused)(DType dtype, DType tgt_dtype, void* loss, void* dlogits, const void* logits,
                              const void* targets, double dloss, int64_t rows, int64_t Vp, int64_t V,
                              int64_t ignore_index) = nullptr;
  // out = x * keep / (1 - p) over n elements seen as rows of row_len: element j of row r keeps
  // when Philox(seed, stream + r, first + j) >= p (row_len = n, first = 0: one stream, index i).
  // The backward is the same call on dy. Rows and an index offset let a rank draw its slice of a
  // global [B, T, C] tensor's mask: stream per global row, index per (t, c).
  void (*dropout)(DType dtype, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t stream,
                  int64_t row_len, uint64_t first) = nullptr;
  // Fused causal scaled-dot-product attention: forward writes out and lse; backward dq, dk, dv.
  void (*attention)(const AttentionArgs& a) = nullptr;
  void (*attention_backward)(const AttentionArgs& a) = nullptr;
  // Philox fills: uniform [lo, hi) or normal(mean, std); element i uses index first + i.
  void (*random)(DType dtype, void* out, int64_t n, bool normal, double a, double b, uint64_t seed, uint64_t stream,
                 uint64_t first) = nullptr;
  // In-place AdamW (decoupled weight decay) on one tensor.
  void (*adamw)(const AdamWArgs& a) = nullptr;
  // The same update on many tensors of this device at once (a GPU does it in one launch per batch
  // of tensors instead of one per tensor). The tensors share dtype, lr, betas, eps, grad_scale and
  // step; weight_decay may differ (biases and gains take none). Entries that differ are refused.
  void (*adamw_many)(const AdamWArgs* args, int64_t count) = nullptr;
  // sum over i of weights[i] * (sum of squares of the ns[i] contiguous elements at xs[i]), all of
  // one dtype, returned to the host: the squared global norm with one device round trip. A tensor
  // of weight 0 is not read (its NaN does not reach the sum). The CPU accumulates each tensor in
  // f64 exactly as reduce(sum_squares) on f64 does; a GPU in f32.
  double (*sum_squares_many)(DType dtype, const void* const* xs, const int64_t* ns, const double* weights,
                             int64_t count) = nullptr;
  // Byte copies between this device and host memory (null on the CPU, which is the host).
  void (*copy_to_host)(void* host_dst, const void* dev_src, size_t bytes, Device d) = nullptr;
  void (*copy_from_host)(void* dev_dst, const void* host_src, size_t bytes, Device d) = nullptr;
};

void register_table(DeviceType t, const OpTable* table);
// The table for a device; throws if none is registered.
const OpTable& table(Device d);

// --attention: "flash" (the hand-written kernels; the CPU always runs its own) or "cudnn" (cuDNN's
// fused attention on the CUDA device d). Refuses cudnn, saying why, for a CPU device or a build
// without CUDA kernels or cuDNN.
void select_attention(const std::string& name, Device d);
// A GPU's dense bf16/fp16 tensor-core peak in TFLOP/s, from the name CUDA reports for it (H100 and
// H200 SXM, GH200: 989; H100 PCIe: 756; A100: 312); 0 for a name not in the table.
double half_peak_tflops_of(const std::string& gpu_name);
// The same for device d: 0 on a CPU, without CUDA, or for a GPU not in the table.
double half_peak_tflops(Device d);

// Throws, naming the device, when a GEMM's epilogue (bias, gelu, pre_gelu, dgelu_pre, bias_grad,
// row_sums_a) breaks GemmArgs' rules.
void check_gemm_epilogue(const GemmArgs& g, const char* device);

// Throws, naming the device and the entry, when args[1..count) differ from args[0] in anything
// but weight_decay (adamw_many's contract).
void check_adamw_batch(const AdamWArgs* args, int64_t count, const char* device);

[[noreturn]] void unsupported(const char* op, DType dtype, const char* device);

}  // namespace sg::kernels

// Fetch an entry, failing loudly when the device lacks it: SG_KERNEL(dev, gemm)(args)
#define SG_KERNEL(device, entry) (::sg::kernels::checked_entry(::sg::kernels::table(device).entry, #entry, device))

namespace sg::kernels {
template <class F>
F checked_entry(F f, const char* op, Device d) {
  if (!f) throw Error(str("op '", op, "' is not implemented on device ", d.str()));
  return f;
}
}  // namespace sg::kernels
