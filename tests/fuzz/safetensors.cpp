// libFuzzer: the safetensors reader refuses every malformed file with sg::Error, never crashes,
// never allocates what the file does not back; reading a GPT-2 configuration from what it accepts
// (its tensors' shapes, its metadata) refuses with sg::Error too.
#include "core/error.h"
#include "io/safetensors.h"
#include "models/gpt.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = sg::fuzz::write_input(data, size, ".safetensors");
  try {
    sg::io::SafetensorsFile f = sg::io::load_safetensors(path);
    for (const auto& name : f.order) (void)f.at(name).numel();
    (void)sg::nn::config_from_hf(f, 0);
  } catch (const sg::Error&) {
  }
  return 0;
}
