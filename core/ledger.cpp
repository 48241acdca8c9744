#include "core/ledger.h"

#include <algorithm>

namespace sg {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::param: return "param";
    case MemCategory::grad: return "grad";
    case MemCategory::optim_state: return "optim_state";
    case MemCategory::activation: return "activation";
    case MemCategory::comm_buffer: return "comm_buffer";
    case MemCategory::workspace: return "workspace";
  }
  return "?";
}

Ledger& Ledger::global() {
  static Ledger* l = new Ledger();  // never destroyed: storages may be freed during static teardown
  return *l;
}

void Ledger::on_alloc(Device d, MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  MemStats& s = per_device_[d];
  auto i = size_t(c);
  s.current[i] += bytes;
  s.peak[i] = std::max(s.peak[i], s.current[i]);
  s.total_current += bytes;
  s.total_peak = std::max(s.total_peak, s.total_current);
}

void Ledger::on_free(Device d, MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  MemStats& s = per_device_[d];
  s.current[size_t(c)] -= bytes;
  s.total_current -= bytes;
}

MemStats Ledger::stats(Device d) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = per_device_.find(d);
  return it == per_device_.end() ? MemStats{} : it->second;
}

void Ledger::reset_peaks(Device d) {
  std::lock_guard<std::mutex> g(mu_);
  MemStats& s = per_device_[d];
  s.peak = s.current;
  s.total_peak = s.total_current;
}

void Ledger::reset_peaks_all() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [d, s] : per_device_) {
    s.peak = s.current;
    s.total_peak = s.total_current;
  }
}

static thread_local MemCategory t_category = MemCategory::activation;

MemScope::MemScope(MemCategory c) : prev_(t_category) { t_category = c; }
MemScope::~MemScope() { t_category = prev_; }
MemCategory MemScope::current() { return t_category; }

}  // namespace sg
