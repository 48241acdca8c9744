// FNV-1a, 64-bit: a small, stable hash for names and bytes (not for security).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace sg {

constexpr uint64_t kFnvPrime = 1099511628211ull;
constexpr uint64_t kFnvBasis = 14695981039346656037ull;  // the standard offset basis
// The standard basis short of its last digit. Parameter init streams (philox.h) and checkpoint
// checksums were defined with it, so it stays: changing it would change every initialisation and
// fail every written checkpoint's verification.
constexpr uint64_t kFnvShortBasis = 1469598103934665603ull;

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnvBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}
inline uint64_t fnv1a(std::string_view s, uint64_t h = kFnvBasis) { return fnv1a(s.data(), s.size(), h); }

}  // namespace sg
