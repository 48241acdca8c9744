// Shared helpers for the op implementations (not part of the public API).
#pragma once
#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"

namespace sg::detail {

using autograd::TensorList;

// The dtype kernels compute in: bf16/f16 are widened to f32 on the CPU.
inline DType compute_dtype(const Tensor& t) {
  return (is_half(t.dtype()) && t.device().is_cpu()) ? DType::f32 : t.dtype();
}
// A contiguous tensor in the compute dtype (the same handle when nothing needs to change).
inline Tensor operand(const Tensor& t) {
  Tensor c = contiguous(t);
  DType cd = compute_dtype(c);
  return cd == c.dtype() ? c : to(c, cd);
}
// operand() of an optional input (a bias, a residual): undefined stays undefined.
inline Tensor operand_if(const Tensor& t) { return t.defined() ? operand(t) : Tensor(); }
// Whether a node may write its result over g, a gradient the tape handed it (absorb_edge): g holds
// its bytes alone (autograd::sole_owner) and is already in the dtype the node computes in.
inline bool can_write_over(const Tensor& g, DType dtype) {
  return g.defined() && g.dtype() == dtype && autograd::sole_owner(g);
}
// Brings a computed result back to the dtype of the op's inputs.
inline Tensor narrow_result(const Tensor& r, DType want) { return r.dtype() == want ? r : to(r, want); }

inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  SG_CHECK(a.device() == b.device(), op, ": operands on different devices (", a.device().str(), " and ",
           b.device().str(), ")");
}
inline void check_floating(const char* op, const Tensor& t) {
  SG_CHECK(is_floating(t.dtype()), op, ": expected a floating tensor, got ", t.describe());
}
// A dim of an n-d tensor, negative counting from the end. A 0-d tensor has none: the ops that
// take dim 0 (or -1) of one as PyTorch does (reductions, transpose, squeeze) check it with n = 1.
inline int64_t wrap_dim(int64_t d, int64_t n, const char* op) {
  SG_CHECK(n > 0, op, ": a 0-d tensor has no dimension ", d);
  SG_CHECK(d >= -n && d < n, op, ": dimension ", d, " out of range for a ", n, "-d tensor");
  return d < 0 ? d + n : d;
}

}  // namespace sg::detail
