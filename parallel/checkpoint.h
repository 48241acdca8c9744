// Full (single-file-per-kind) checkpoints of a training run, committed atomically:
//   RUN/step_00000100/{model.safetensors, optim.safetensors, state.json}   and   RUN/latest
// Files are written under RUN/.tmp-step_..., fsynced, state.json (the manifest) last, then the
// directory is renamed into place and `latest` is replaced through a rename. A crash at any point
// leaves the previous checkpoint loadable; an existing step directory is never overwritten.
#pragma once
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace sg::ckpt {

std::string step_dir_name(int64_t step);  // "step_00000100"

// Returns the committed step directory. state.json also records a checksum of every tensor,
// verified on load. keep > 0: afterwards only the newest `keep` step directories remain.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const io::NamedTensors& model,
                            const std::map<std::string, std::string>& model_metadata, const io::NamedTensors& optim,
                            const nlohmann::json& state, int keep = 0);

// FNV-1a 64 over a tensor's bytes (contiguous, host), as 16 hex digits.
std::string tensor_checksum(const Tensor& t);

struct LoadedCheckpoint {
  std::string path;  // the step directory
  io::SafetensorsFile model, optim;
  nlohmann::json state;
};

// `dir` is a run directory (its `latest` is followed) or a step directory. Throws naming the path.
// "auto:RUN" picks the newest complete step directory of RUN (by step number), whatever
// `latest` says (a crash between the rename and the pointer update leaves `latest` one behind).
std::string resolve_checkpoint(const std::string& dir);
LoadedCheckpoint load_checkpoint(const std::string& dir);

}  // namespace sg::ckpt
