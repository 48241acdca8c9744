// libFuzzer: a checkpoint directory whose `latest` pointer and state.json manifest are the input
// (split at the first newline): loading refuses bad pointers (no path escapes the run directory),
// bad JSON and missing files with sg::Error.
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "parallel/checkpoint.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const fs::path run = fs::temp_directory_path() / ("sg_fuzz_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(run);
  fs::create_directories(run / "step_00000001");
  std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nl = in.find('\n');
  std::ofstream(run / "latest") << in.substr(0, nl);
  std::ofstream(run / "step_00000001" / "state.json") << (nl == std::string::npos ? "" : in.substr(nl + 1));
  try {
    (void)sg::ckpt::load_checkpoint(run.string());
  } catch (const sg::Error&) {
  }
  return 0;
}
