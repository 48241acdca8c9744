#include "parallel/functional.h"

#include "autograd/ops.h"
#include "autograd/tape.h"

namespace sg::parallel {

Tensor all_reduce_sum(const Tensor& x, comm::ProcessGroup& group) {
  Tensor y;
  {
    autograd::NoGradGuard ng;
    y = clone(contiguous(x));
  }
  group.all_reduce(y, comm::ReduceOp::sum)->wait();
  if (autograd::needs_grad({x})) {
    comm::ProcessGroup* g = &group;
    autograd::record("all_reduce_sum", {x}, {y}, [g](const autograd::TensorList& dy) {
      Tensor d = clone(contiguous(dy[0]));
      g->all_reduce(d, comm::ReduceOp::sum)->wait();
      return autograd::TensorList{d};
    });
  }
  return y;
}

}  // namespace sg::parallel
