// --on-nonfinite stop|skip: finding NaN/Inf in the loss and the gradients of a step.
// `stop` ends the run naming the step and the first non-finite tensor; `skip` leaves the
// parameters and optimizer state untouched for that step and counts it.
//
// Usage (train, after backward, before the optimizer step):
//   optim::NonFinite bad = optim::first_nonfinite(loss, named_grads);
//   if (bad.found()) { if (policy == optim::NonFinitePolicy::stop) throw Error(optim::nonfinite_message(bad, step));
//                      ++skipped; /* no optimizer step */ }
// Under ZeRO/FSDP pass this rank's gradient shards; agree across ranks (all-reduce max of
// found()) so that every rank skips the same step.
#pragma once
#include <string>

#include "optim/optim.h"

namespace sg::optim {

struct NonFinite {
  std::string name;    // "loss", or the gradient's parameter name; empty when all are finite
  int64_t index = -1;  // the first non-finite element (row-major), -1 for the loss
  double value = 0;    // NaN, +Inf or -Inf
  bool found() const { return !name.empty(); }
};

// The first non-finite value: the loss, then the gradients in the given order (undefined
// gradients are skipped). One reduction per tensor; only a tensor whose sum is not finite is
// scanned element by element (a finite tensor whose sum overflows is scanned and passes).
NonFinite first_nonfinite(const NamedTensors& tensors);
NonFinite first_nonfinite(double loss, const NamedTensors& grads);

enum class NonFinitePolicy { stop, skip };
NonFinitePolicy parse_nonfinite_policy(const std::string& s);  // throws naming --on-nonfinite

// "step 12: the gradient of 'h.0.mlp.c_fc.weight' is not finite (element 5 is nan)"
std::string nonfinite_message(const NonFinite& f, int64_t step);

}  // namespace sg::optim
