// Where a tensor lives: the CPU, one CUDA device, or the meta device. A meta tensor has a shape, a
// dtype and ledger bytes but no values: its storage is a unique address never read, its kernels
// do nothing and it reads back as zeros (kernels/meta.cpp). `train --simulate` runs the real
// engine on it to count a layout's bytes without the memory or the arithmetic. A meta device
// acts as a GPU does where the engine chooses by device (half precision is computed in half).
#pragma once
#include <cstdint>
#include <string>

#include "core/error.h"

namespace sg {

enum class DeviceType : uint8_t { cpu = 0, cuda = 1, meta = 2 };
constexpr int kNumDeviceTypes = 3;

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu(int i = 0) { return {DeviceType::cpu, i}; }
  static Device cuda(int i) { return {DeviceType::cuda, i}; }
  static Device meta(int i = 0) { return {DeviceType::meta, i}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool is_meta() const { return type == DeviceType::meta; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const { return type != o.type ? type < o.type : index < o.index; }
  std::string str() const {
    if (is_cpu()) return index == 0 ? "cpu" : "cpu:" + std::to_string(index);
    if (is_meta()) return index == 0 ? "meta" : "meta:" + std::to_string(index);
    return "cuda:" + std::to_string(index);
  }
};

// "cpu", "cpu:1", "cuda", "cuda:3", "meta", "meta:2"
Device parse_device(const std::string& s);

// Whether this thread's waits on a device report the errors that kernels queued earlier found
// (bad indices: kernels/cuda/runtime.h's deferred checks). Every thread does, except inside a
// DeviceErrorsElsewhere scope: a communication thread's staging copies wait on the device too,
// but an error found there belongs to the threads that run the model, and stays for their next
// wait (parallel/comm/work_queue.cpp runs its loop in one).
bool reports_device_errors();
class DeviceErrorsElsewhere {
 public:
  DeviceErrorsElsewhere();
  ~DeviceErrorsElsewhere();
  DeviceErrorsElsewhere(const DeviceErrorsElsewhere&) = delete;
  DeviceErrorsElsewhere& operator=(const DeviceErrorsElsewhere&) = delete;

 private:
  bool was_;
};

}  // namespace sg
