// The model `generate` and `eval` read from --from: a checkpoint directory of any layout (run or
// step; its model consolidated), auto:DIR (the newest complete checkpoint of a run) or a Hugging
// Face-named .safetensors file; --n-head for files that do not record it.
#pragma once
#include <memory>
#include <string>

#include "cli/args.h"
#include "io/safetensors.h"
#include "models/gpt.h"

namespace sg::cli {

struct ModelFrom {
  io::SafetensorsFile weights;  // the tensors and the metadata (a checkpoint's: its data, its config)
  std::string file;             // the file read, for messages
  nn::GPTConfig cfg;
  std::unique_ptr<nn::GPT> model;  // on the device, in the dtype (the file's values rounded to it)
};
// Reads a's --from (and --n-head) for a's command; errors name the flag and the file.
ModelFrom model_from(const Args& a, DType dtype, Device device);

}  // namespace sg::cli
