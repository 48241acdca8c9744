#include "autograd/gradcheck.h"

#include <cmath>

#include "autograd/ops.h"

namespace sg::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, double eps,
                          double atol, double rtol) {
  GradcheckResult res;
  TensorList leaves;
  for (const auto& t : inputs) {
    SG_CHECK(!t.defined() || !is_floating(t.dtype()) || t.dtype() == DType::f64,
             "gradcheck: floating inputs must be f64, got ", t.describe());
    Tensor l = t.defined() ? clone(t) : t;
    if (l.defined() && is_floating(l.dtype())) l.set_requires_grad(true);
    leaves.push_back(l);
  }
  // Weights R make every output element matter with a different coefficient.
  Tensor probe;
  {
    NoGradGuard ng;
    probe = fn(leaves);
  }
  Tensor R = randn(probe.shape(), 1234, 99, 0, 1, DType::f64, probe.device());
  auto objective = [&](const TensorList& xs) { return sum(mul(fn(xs), R)); };

  Tape tape;
  Tensor L;
  {
    TapeScope scope(tape);
    L = objective(leaves);
  }
  TensorList analytic(leaves.size());
  TensorList wrt;
  std::vector<size_t> which;
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].defined() && leaves[i].requires_grad()) {
      wrt.push_back(leaves[i]);
      which.push_back(i);
    }
  TensorList g = tape.grad({L}, {ones_like(L)}, wrt);
  for (size_t j = 0; j < which.size(); ++j) analytic[which[j]] = g[j];

  NoGradGuard ng;
  for (size_t i : which) {
    Tensor x = leaves[i];
    if (analytic[i].defined() && analytic[i].shape() != x.shape()) {  // a backward returned the wrong shape
      res.ok = false;
      res.message = str("input ", i, ": gradient has shape ", shape_str(analytic[i].shape()), " but the input has ",
                        shape_str(x.shape()));
      return res;
    }
    double* data = x.data<double>();
    std::vector<double> an = analytic[i].defined() ? to_vector<double>(analytic[i]) : std::vector<double>(size_t(x.numel()), 0.0);
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double orig = data[e];
      data[e] = orig + eps;
      double up = item(objective(leaves));
      data[e] = orig - eps;
      double down = item(objective(leaves));
      data[e] = orig;
      double numeric = (up - down) / (2 * eps);
      double err = std::abs(numeric - an[size_t(e)]);
      res.max_abs_error = std::max(res.max_abs_error, err);
      if (err > atol + rtol * std::abs(numeric) && res.ok) {
        res.ok = false;
        res.message = str("input ", i, " element ", e, ": analytic ", an[size_t(e)], " vs numeric ", numeric);
      }
    }
  }
  return res;
}

}  // namespace sg::autograd
