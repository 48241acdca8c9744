#include "optim/nonfinite.h"

#include <cmath>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/error.h"

namespace sg::optim {

NonFinite first_nonfinite(const NamedTensors& tensors) {
  autograd::NoGradGuard ng;
  for (const auto& [name, t] : tensors) {
    if (!t.defined() || t.numel() == 0 || !is_floating(t.dtype())) continue;
    // Only after a non-finite norm: the search may move each tensor to the host.
    if (std::isfinite(item(sum(to(to(t, Device::cpu()), DType::f64))))) continue;
    const std::vector<double> v = to_vector<double>(t);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) return {name, int64_t(i), v[i]};
  }
  return {};
}

NonFinite first_nonfinite(double loss, const NamedTensors& grads) {
  if (!std::isfinite(loss)) return {"loss", -1, loss};
  return first_nonfinite(grads);
}

NonFinitePolicy parse_nonfinite_policy(const std::string& s) {
  if (s == "stop") return NonFinitePolicy::stop;
  if (s == "skip") return NonFinitePolicy::skip;
  throw Error(str("--on-nonfinite: '", s, "' is not one of stop, skip"));
}

std::string nonfinite_message(const NonFinite& f, int64_t step) {
  if (f.name == "loss") return str("step ", step, ": the loss is not finite (", f.value, ")");
  return str("step ", step, ": the gradient of '", f.name, "' is not finite (element ", f.index, " is ", f.value, ")");
}

}  // namespace sg::optim
