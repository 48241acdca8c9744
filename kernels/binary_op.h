// The binary ops of the op table as one function, shared by the CPU kernels and the CUDA kernels
// (host and device; the CPU emulation compiles it as plain C++).
#pragma once
#include "kernels/ops.h"

#ifdef __CUDACC__
#define SG_BINARY_FN __host__ __device__ inline
#else
#define SG_BINARY_FN inline
#endif

namespace sg::kernels {

template <class T>
SG_BINARY_FN T apply_binary(Binary op, T a, T b) {
  switch (op) {
    case Binary::add: return a + b;
    case Binary::sub: return a - b;
    case Binary::mul: return a * b;
    case Binary::div: return a / b;
    case Binary::max: return (a > b || a != a) ? a : b;  // a NaN on either side is kept, as in PyTorch
    case Binary::min: return (a < b || a != a) ? a : b;
  }
  return T(0);
}

}  // namespace sg::kernels
