// The memory ledger: every byte allocated is charged to a category on a device, with current and
// peak bytes kept per category. This is how a test proves, in bytes, what a ZeRO stage saves.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "core/device.h"

namespace sg {

enum class MemCategory : uint8_t { param, grad, optim_state, activation, comm_buffer, workspace };
constexpr int kNumMemCategories = 6;
const char* mem_category_name(MemCategory c);

struct MemStats {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;  // peak of the sum, not the sum of peaks
  int64_t cur(MemCategory c) const { return current[size_t(c)]; }
  int64_t pk(MemCategory c) const { return peak[size_t(c)]; }
};

class Ledger {
 public:
  static Ledger& global();
  void on_alloc(Device d, MemCategory c, int64_t bytes);
  void on_free(Device d, MemCategory c, int64_t bytes);
  MemStats stats(Device d) const;
  // Peaks restart from the current values (e.g. at the start of a measured step).
  void reset_peaks(Device d);
  void reset_peaks_all();

 private:
  mutable std::mutex mu_;
  std::map<Device, MemStats> per_device_;
};

// Allocations made while a MemScope is alive are charged to its category (thread-local).
class MemScope {
 public:
  explicit MemScope(MemCategory c);
  ~MemScope();
  MemScope(const MemScope&) = delete;
  MemScope& operator=(const MemScope&) = delete;
  static MemCategory current();

 private:
  MemCategory prev_;
};

}  // namespace sg
