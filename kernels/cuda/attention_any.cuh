// Which attention kernel runs, and the contiguous detour for a backend that refuses a layout: the
// op table's attention entries (table.cu) decide through these, and the emulation tests run the
// same decisions on the CPU.
//   - bf16 and f16 at head dim 64 or 128 with a positive scale take the tensor-core kernels
//     (attention_tc.cuh) on a device with mma.sync; everything else the FMA flash kernels
//     (attention.cuh), which take f32 and the other head dims.
//   - with_contiguous_layouts runs an attention call on contiguous [B, H, T, D] copies of its
//     operands and scatters the results back to the caller's strides (cuDNN builds no plan for
//     some packed layouts).
#pragma once
#include <deque>

#include "kernels/cuda/attention_tc.cuh"
#include "kernels/cuda/elementwise.cuh"

namespace sg::cuda {

// mma: the device has mma.sync (sm_80 and later).
inline bool tensor_cores_take(const kernels::AttentionArgs& a, bool mma) {
  return tensor_core_dtype(a.dtype) && tensor_core_head_dim(a.D) && a.scale > 0 && mma;
}

inline void attention_forward_any(const kernels::AttentionArgs& f, bool mma, FlashForward kind, Stream stream) {
  if (tensor_cores_take(f, mma)) return attention_forward_tensor_cores(f, stream, kind);
  attention_forward(f, stream);
}

// workspace: attention_backward_workspace(a) f32 elements, for either kernel family.
inline void attention_backward_any(const kernels::AttentionArgs& a, float* workspace, bool mma, FlashBackward kind,
                                   Stream stream) {
  if (tensor_cores_take(a, mma)) return attention_backward_tensor_cores(a, workspace, stream, kind);
  attention_backward(a, workspace, stream);
}

// a with every [B, H, T, D] operand in a contiguous copy. run(c) gets the contiguous arguments;
// the inputs are copied in before it, the outputs scattered back to a's layouts after it (lse is
// contiguous already and passes through). Buffer(bytes, buffer_args...) owns `bytes` of device
// memory at data(); the buffers live until the scatters are enqueued.
template <class Buffer, class Run, class... Args>
void with_contiguous_layouts(const kernels::AttentionArgs& a, Stream stream, bool backward, Run&& run,
                             const Args&... buffer_args) {
  const Dims shape{a.B, a.H, a.T, a.D};
  const kernels::AttentionArgs::Strides q = a.q_layout(), ol = a.o_layout();
  const Dims qs{q.b, q.h, q.t, 1}, os{ol.b, ol.h, ol.t, 1};
  const size_t bytes = size_t(numel(shape)) * dtype_size(a.dtype);
  std::deque<Buffer> bufs;  // grows without moving what it holds
  const auto out = [&] { return static_cast<void*>(bufs.emplace_back(bytes, buffer_args...).data()); };
  const auto in = [&](const void* src, const Dims& strides) {
    void* dst = out();
    copy_strided(dst, a.dtype, src, a.dtype, shape, strides, stream);
    return dst;
  };
  kernels::AttentionArgs c = a;
  for (int i = 0; i < 3; ++i) c.q_strides[i] = c.o_strides[i] = 0;
  c.q = in(a.q, qs), c.k = in(a.k, qs), c.v = in(a.v, qs);
  if (backward) {
    c.out = in(a.out, os), c.dout = in(a.dout, os);
    c.dq = out(), c.dk = out(), c.dv = out();
  } else {
    c.out = out();
  }
  run(c);
  if (backward) {
    scatter_strided(a.dq, qs, c.dq, a.dtype, shape, stream);
    scatter_strided(a.dk, qs, c.dk, a.dtype, shape, stream);
    scatter_strided(a.dv, qs, c.dv, a.dtype, shape, stream);
  } else {
    scatter_strided(a.out, os, c.out, a.dtype, shape, stream);
  }
}

}  // namespace sg::cuda
