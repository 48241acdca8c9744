// Activation recompute: run a region without keeping its activations, and re-run it during
// backward to get them back. Dropout masks replay exactly (the Philox stream is rewound).
#pragma once
#include <functional>

#include "autograd/tape.h"

namespace sg::autograd {

using RegionFn = std::function<TensorList(const TensorList& inputs)>;

// inputs: the region's tensor inputs; params: the leaves it uses internally (module parameters),
// which receive their gradients through this node so grad-ready hooks still fire at the right time.
// A leaf the region uses that is in neither list is refused by name when the backward replays it.
TensorList recompute(const RegionFn& fn, const TensorList& inputs, const TensorList& params);

}  // namespace sg::autograd
