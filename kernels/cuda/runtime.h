// The CUDA runtime side of the backend: checked calls, device memory for the ledger (a caching
// allocator over plain cudaMalloc, never managed memory), host<->device copies, and the streams
// every launcher and the NCCL backend use. Built only when the CUDA toolkit is found.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "core/device.h"
#include "core/error.h"

#define SG_CUDA_CHECK(call)                                                                          \
  do {                                                                                               \
    cudaError_t sg_err_ = (call);                                                                    \
    if (sg_err_ != cudaSuccess)                                                                      \
      throw ::sg::Error(::sg::str(#call, " failed: ", cudaGetErrorString(sg_err_), " (", __FILE__, ":", \
                                  __LINE__, ")"));                                                   \
  } while (0)

namespace sg::cuda {

int device_count();  // 0 when there is no driver or no device (never throws)
// The compute stream of a device: the stream kernels and copies are issued on.
cudaStream_t compute_stream(Device d);
// Registers the CUDA allocator and op table (idempotent); called on first use of a cuda device.
void ensure_registered();

}  // namespace sg::cuda
