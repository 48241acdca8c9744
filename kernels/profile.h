// The op profiler: where a step's time goes, entry by entry of the op table. While an OpProfiler
// lives, its device type's table is a copy whose every entry times the real one around it:
//   host_ms   the wall time the calling thread spent in the call (on a GPU: its checks, the
//             library calls and the launches; on the CPU: the work itself);
//   device_ms on CUDA, the compute stream's time between an event queued just before the call and
//             one just after it: the kernels the call queued, plus any time the stream sat idle
//             waiting for the host in between (none while the host runs ahead of the GPU).
// Only calls made by the thread that created the profiler are timed (communication threads'
// staging copies and DataParallel's replica threads pass through), and a call that reaches the
// table again inside an entry counts once, as the outer entry. One profiler at a time.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "core/device.h"

namespace sg::kernels {

struct OpTime {
  int64_t calls = 0;
  double host_ms = 0;
  double device_ms = 0;  // 0 on the CPU
  // The model FLOPs of the calls, for the entries that count them: gemm (2 M N K per matrix) and
  // attention (4 B H T^2 D forward, halved when causal; the backward 2.5 times that, whatever the
  // kernels recompute). 0 for the others.
  double flops = 0;
};

class OpProfiler {
 public:
  // d: the device whose type's table is timed; on CUDA, the device whose compute stream carries
  // the marks.
  explicit OpProfiler(Device d);
  ~OpProfiler();  // puts the real table back
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

  // Waits for the work queued on the device so far, then returns the calls made since the last
  // take() (or since construction) by entry name, and starts counting afresh.
  std::map<std::string, OpTime> take();

  struct Impl;  // defined in profile.cpp (its wrapped entries reach it)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::kernels
