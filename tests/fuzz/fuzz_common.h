// Shared by the libFuzzer targets: the input goes to a private temporary file (the readers
// under test take paths), and any sg::Error is the expected, clean refusal.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace sg::fuzz {

inline std::string write_input(const uint8_t* data, size_t size, const char* suffix) {
  static const std::string path = "/tmp/sg_fuzz_" + std::to_string(::getpid()) + suffix;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

}  // namespace sg::fuzz
