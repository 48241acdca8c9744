#include "autograd/recompute.h"

#include <unordered_set>

#include "autograd/ops.h"

namespace sg::autograd {

TensorList recompute(const RegionFn& fn, const TensorList& inputs, const TensorList& params) {
  TensorList all = inputs;
  all.insert(all.end(), params.begin(), params.end());
  if (!needs_grad(all)) return fn(inputs);
  const DropoutGenerator rng_at_forward = dropout_generator();
  TensorList outputs;
  {
    NoGradGuard ng;
    outputs = fn(inputs);
  }
  // Fresh handles on the outputs' memory for the node to own: a region may return one of its inputs
  // (a pass-through residual), whose own grad_fn (or leaf-ness) recording must not overwrite.
  for (Tensor& o : outputs)
    if (o.defined()) o = detach(o);
  const size_t n_in = inputs.size();
  TensorList saved_inputs;
  for (const auto& t : inputs) saved_inputs.push_back(detach(t));
  std::vector<bool> in_grad;
  for (const auto& t : inputs) in_grad.push_back(t.defined() && t.requires_grad());
  record("recompute", all, outputs, [fn, saved_inputs, in_grad, params, n_in, rng_at_forward](const TensorList& g) {
    // Re-run the region on fresh leaves with the forward's dropout streams.
    TensorList leaves;
    for (size_t i = 0; i < n_in; ++i) {
      Tensor l = detach(saved_inputs[i]);
      if (in_grad[i]) l.set_requires_grad(true);
      leaves.push_back(l);
    }
    DropoutGenerator& gen = dropout_generator();
    const DropoutGenerator now = gen;
    gen = rng_at_forward;
    Tape inner;
    TensorList outs;
    {
      GradModeGuard enable(true);
      TapeScope scope(inner);
      outs = fn(leaves);
    }
    gen = now;
    // A leaf the region uses must be an input or in params: this node's edges are the only way its
    // gradient leaves the replay (PyTorch's checkpoint finds them itself; here they are declared).
    std::unordered_set<const TensorImpl*> declared;
    for (const auto& l : leaves) declared.insert(l.impl());
    for (const auto& p : params) declared.insert(p.impl());
    for (const Tensor& l : inner.leaves())
      SG_CHECK(declared.count(l.impl()), "recompute: the region uses ", l.name().empty() ? "a tensor" : "'" + l.name() + "'",
               " (", l.describe(), ") that requires grad but is neither an input nor in params: its gradient would be ",
               "lost; pass it in params");
    TensorList live_outs, live_grads;
    for (size_t i = 0; i < outs.size(); ++i)
      if (g[i].defined() && outs[i].requires_grad()) {
        live_outs.push_back(outs[i]);
        live_grads.push_back(g[i]);
      }
    TensorList wrt = leaves;
    wrt.insert(wrt.end(), params.begin(), params.end());
    if (live_outs.empty()) return TensorList(wrt.size());
    return inner.grad(live_outs, live_grads, wrt);
  });
  return outputs;
}

}  // namespace sg::autograd
