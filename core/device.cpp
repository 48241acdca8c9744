#include "core/device.h"

#include <cstdlib>
#include <utility>

namespace sg {

Device parse_device(const std::string& s) {
  auto index_of = [&](size_t colon) {
    if (colon == std::string::npos) return 0;
    std::string n = s.substr(colon + 1);
    char* end = nullptr;
    long v = std::strtol(n.c_str(), &end, 10);
    SG_CHECK(!n.empty() && *end == 0 && v >= 0 && v < 65536, "device '", s, "': bad index '", n, "'");
    return int(v);
  };
  auto colon = s.find(':');
  std::string kind = s.substr(0, colon);
  if (kind == "cpu") return Device::cpu(index_of(colon));
  if (kind == "cuda") return Device::cuda(index_of(colon));
  if (kind == "meta") return Device::meta(index_of(colon));
  throw Error(str("unknown device '", s, "' (expected cpu, cpu:N, cuda:N or meta)"));
}

namespace {
thread_local bool t_reports_device_errors = true;
}
bool reports_device_errors() { return t_reports_device_errors; }
DeviceErrorsElsewhere::DeviceErrorsElsewhere() : was_(std::exchange(t_reports_device_errors, false)) {}
DeviceErrorsElsewhere::~DeviceErrorsElsewhere() { t_reports_device_errors = was_; }

}  // namespace sg
