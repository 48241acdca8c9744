// Finite-difference gradient check in f64: compares the tape's gradients of
// L = sum(fn(inputs) * R) (R a fixed random tensor) against central differences.
#pragma once
#include <functional>
#include <string>

#include "autograd/tape.h"

namespace sg::autograd {

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // the first failing input and element, when !ok
};

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                          double eps = 1e-6, double atol = 1e-5, double rtol = 1e-4);

}  // namespace sg::autograd
