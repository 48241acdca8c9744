// libFuzzer: the GEMM tuning file reader (SG_GEMM_TUNE_FILE) refuses what it cannot read back
// exactly with sg::Error naming the line; what it accepts is written out and read back to the same
// text.
#include <string>

#include "core/error.h"
#include "kernels/cuda/gemm_choices.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  sg::cuda::GemmChoices c;
  try {
    c = sg::cuda::parse_gemm_choices(text, "fuzz.tune");
  } catch (const sg::Error&) {
    return 0;
  }
  // Only files with both validators are written (an empty one has nothing to round-trip).
  if (c.cublaslt.empty()) return 0;
  const std::string out = sg::cuda::format_gemm_choices(c);
  if (sg::cuda::format_gemm_choices(sg::cuda::parse_gemm_choices(out, "fuzz.tune")) != out) __builtin_trap();
  return 0;
}
