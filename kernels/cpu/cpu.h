// CPU kernels: the entries of the CPU op table. Each op family lives in its own .cpp (forward,
// backward). Loops are parallel over rows with OpenMP; GEMMs go to Eigen.
#pragma once
#include "kernels/ops.h"

namespace sg::kernels::cpu {

// Runs body(T{}) for the floating types the CPU computes in (bf16/f16 are widened by callers).
template <class Body>
void dispatch_float(DType dtype, const char* op, Body&& body) {
  switch (dtype) {
    case DType::f32: body(float{}); break;
    case DType::f64: body(double{}); break;
    default: unsupported(op, dtype, "cpu");
  }
}

inline int64_t read_index(DType t, const void* p, int64_t i) {
  return t == DType::i64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

void scatter_strided(void* dst, const Dims& dst_strides, const void* src, DType dtype, const Dims& shape);
void copy_strided(void* dst, DType dst_dtype, const void* src, DType src_dtype, const Dims& shape,
                  const Dims& src_strides);
void fill(void* dst, DType dtype, int64_t n, double value);
void binary(Binary op, DType dtype, void* out, const void* a, const Dims& as, const void* b, const Dims& bs,
            const Dims& shape);
void unary(Unary op, DType dtype, void* out, const void* x, int64_t n, double alpha);
void unary_backward(Unary op, DType dtype, void* dx, const void* dy, const void* x, int64_t n);
void reduce(Reduce op, DType dtype, void* out, const void* x, int64_t outer, int64_t n, int64_t inner);
double sum_squares_many(DType dtype, const void* const* xs, const int64_t* ns, const double* weights, int64_t count);
void random(DType dtype, void* out, int64_t n, bool normal, double a, double b, uint64_t seed, uint64_t stream,
            uint64_t first);
void dropout(DType dtype, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t stream,
             int64_t row_len, uint64_t first);
void gemm(const GemmArgs& a);
void softmax(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, bool log);
void softmax_backward(DType dtype, void* dx, const void* dy, const void* y, int64_t rows, int64_t cols, bool log);
void cross_entropy(DType dtype, DType tgt_dtype, void* loss, void* lse, const void* logits, const void* targets,
                   int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index);
void cross_entropy_backward(DType dtype, DType tgt_dtype, void* dlogits, const void* dloss, const void* logits,
                            const void* lse, const void* targets, int64_t rows, int64_t Vp, int64_t V,
                            int64_t ignore_index);
void cross_entropy_fused(DType dtype, DType tgt_dtype, void* loss, void* dlogits, const void* logits,
                         const void* targets, double dloss, int64_t rows, int64_t Vp, int64_t V, int64_t ignore_index);
void layernorm(DType dtype, void* y, void* mean, void* rstd, const void* x, const void* w, const void* b,
               int64_t rows, int64_t C, double eps);
void layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dy, const void* x, const void* w,
                        const void* mean, const void* rstd, int64_t rows, int64_t C);
void residual_layernorm(DType dtype, void* r, void* y, void* mean, void* rstd, const void* x, const void* residual,
                        const void* w, const void* b, int64_t rows, int64_t C, double eps);
void residual_layernorm_backward(DType dtype, void* dx, void* dw, void* db, const void* dr, const void* dy,
                                 const void* r, const void* w, const void* mean, const void* rstd, int64_t rows,
                                 int64_t C);
void rmsnorm(DType dtype, void* y, void* rstd, const void* x, const void* w, int64_t rows, int64_t C, double eps);
void rmsnorm_backward(DType dtype, void* dx, void* dw, const void* dy, const void* x, const void* w,
                      const void* rstd, int64_t rows, int64_t C);
void embedding(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n, int64_t C,
               int64_t num_rows);
void embedding_backward(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx, int64_t n,
                        int64_t C, int64_t num_rows);
void attention(const AttentionArgs& a);
void attention_backward(const AttentionArgs& a);
void adamw(const AdamWArgs& a);
void adamw_many(const AdamWArgs* args, int64_t count);

}  // namespace sg::kernels::cpu
