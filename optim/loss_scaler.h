// Dynamic loss scaling for f16 training: multiply the loss by `scale` so small gradients survive
// f16; a step whose gradients overflow is skipped and the scale backs off; after
// `growth_interval` clean steps the scale grows.
#pragma once
#include <cstdint>

namespace sg::optim {

struct LossScaler {
  double scale = 65536.0;
  double growth_factor = 2.0, backoff_factor = 0.5, min_scale = 1.0;
  int64_t growth_interval = 2000;
  int64_t clean_steps = 0, skipped_steps = 0;
  // Call once per step after the gradients are known; returns whether to apply the step.
  bool update(bool found_nonfinite) {
    if (found_nonfinite) {
      scale = scale * backoff_factor < min_scale ? min_scale : scale * backoff_factor;
      clean_steps = 0;
      ++skipped_steps;
      return false;
    }
    if (++clean_steps >= growth_interval) {
      scale *= growth_factor;
      clean_steps = 0;
    }
    return true;
  }
};

}  // namespace sg::optim
