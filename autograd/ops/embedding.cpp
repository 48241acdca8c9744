// Embedding lookup: out[..., C] = weight[idx[...], :]; backward scatter-adds rows of dout.
#include "autograd/ops/common.h"

namespace sg {

using autograd::needs_grad;
using autograd::record;
using detail::TensorList;

Tensor embedding(const Tensor& weight, const Tensor& idx) {
  SG_CHECK(weight.dim() == 2, "embedding: weight must be [rows, C], got ", shape_str(weight.shape()));
  SG_CHECK(idx.dtype() == DType::i32 || idx.dtype() == DType::i64, "embedding: indices must be i32/i64, got ",
           idx.describe());
  detail::check_same_device("embedding", weight, idx);
  const int64_t rows = weight.size(0), C = weight.size(1), n = idx.numel();
  Shape s = idx.shape();
  s.push_back(C);
  Tensor ix = contiguous(idx), out;
  {
    autograd::NoGradGuard ng;
    Tensor W = contiguous(weight);
    out = empty(s, W.dtype(), W.device());
    SG_KERNEL(W.device(), embedding)(W.dtype(), ix.dtype(), out.data_ptr(), ix.data_ptr(), W.data_ptr(), n, C, rows);
  }
  if (needs_grad({weight})) {
    Shape ws = weight.shape();
    DType want = weight.dtype();
    record("embedding", {weight}, {out}, [ix, ws, n, C, want](const TensorList& g) {
      Tensor G = detail::operand(g[0]);
      Tensor dw = zeros(ws, G.dtype(), G.device());
      SG_KERNEL(G.device(), embedding_backward)(G.dtype(), ix.dtype(), dw.data_ptr(), G.data_ptr(), ix.data_ptr(), n, C);
      return TensorList{detail::narrow_result(dw, want)};
    });
  }
  return out;
}

}  // namespace sg
