// DataParallel (one process, several devices), PyTorch's nn.DataParallel: every step the model on
// the first device is replicated onto the others, the batch's rows are scattered, the replicas
// run forward in parallel threads, their outputs are gathered onto the first device where the
// loss is computed, and backward runs the other way: output gradients scattered, replica
// backward in parallel, parameter gradients summed onto the first device, one optimizer step
// there. Everything gathered lands on the first device — the ledger shows the pile-up that
// makes DDP (one process per device, nothing gathered) the better design.
#pragma once
#include <memory>
#include <vector>

#include "models/gpt.h"

namespace sg::parallel {

class DataParallel {
 public:
  DataParallel(nn::GPT& model, std::vector<Device> devices);
  // Forward + backward of one (micro-)batch: the model's parameters (on devices[0]) receive
  // the gradient of loss = sum of cross-entropy over rows / scale-normaliser, accumulated (+=).
  // Returns the loss value.
  double forward_backward(const Tensor& idx, const Tensor& targets, double scale);
  const std::vector<Device>& devices() const { return devices_; }

 private:
  nn::GPT& model_;
  std::vector<Device> devices_;
};

// "cpu:0,cpu:1" or "cuda:0,cuda:1"
std::vector<Device> parse_devices(const std::string& list);

}  // namespace sg::parallel
