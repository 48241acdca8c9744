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
    // The backward scatter-adds ('+=') straight into the gradient the weight has gathered so far
    // (absorb_edge 0: a tied output head's weight gradient, or earlier micro-batches') when it
    // alone holds that buffer and it is in the compute dtype: no zero-filled table-sized buffer and
    // no add of two of them. Otherwise into zeros, added after.
    record(
        "embedding", {weight}, {out},
        [ix, ws, n, C, want](const TensorList& g) {
          Tensor G = detail::operand(g[0]);
          const Tensor& gathered = g[1];
          const auto scatter = [&](const Tensor& into) {
            SG_KERNEL(G.device(), embedding_backward)(G.dtype(), ix.dtype(), into.data_ptr(), G.data_ptr(),
                                                      ix.data_ptr(), n, C, ws[0]);
          };
          if (detail::can_write_over(gathered, G.dtype())) {
            scatter(gathered);
            return TensorList{gathered};
          }
          Tensor dw = zeros(ws, G.dtype(), G.device());
          scatter(dw);
          dw = detail::narrow_result(dw, want);
          return TensorList{gathered.defined() ? add(gathered, dw) : dw};
        },
        /*absorb_edge=*/0);
  }
  return out;
}

}  // namespace sg
