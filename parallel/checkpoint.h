// Full (single-file-per-kind) checkpoints of a training run, committed atomically:
//   RUN/step_00000100/{model.safetensors, optim.safetensors, state.json}   and   RUN/latest
// Files are written under RUN/.tmp-step_..., fsynced, state.json (the manifest) last, then the
// directory is renamed into place and `latest` is replaced through a rename. A crash at any point
// leaves the previous checkpoint loadable; an existing step directory is never overwritten.
// Sharded checkpoints (parallel/sharded_checkpoint.h) share the run layout and the commit: their
// manifest is index.json. A step directory is complete when it holds its manifest.
#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace sg::ckpt {

std::string step_dir_name(int64_t step);  // "step_00000100"

// Returns the committed step directory. state.json also records a checksum of every tensor,
// verified on load. keep > 0: afterwards only the newest `keep` step directories remain.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const io::NamedTensors& model,
                            const std::map<std::string, std::string>& model_metadata, const io::NamedTensors& optim,
                            const nlohmann::json& state, int keep = 0);

// The manifests that mark a complete step directory: full and sharded.
inline constexpr const char* kFullManifest = "state.json";
inline constexpr const char* kShardedManifest = "index.json";

// The commit shared by both formats. The temporary directory of a step: RUN/.tmp-step_...
// (`suffix` distinguishes writers; sharded saves use none, since every rank must find it).
std::string temp_step_dir(const std::string& run_dir, int64_t step, const std::string& suffix = "");
// A run's step directories (RUN/step_NNNNNNNN) with their steps, oldest first; none if RUN is not there.
std::vector<std::pair<int64_t, std::filesystem::path>> step_dirs(const std::filesystem::path& run);
// Refuses (naming it) when RUN/step_... already exists.
void check_step_is_new(const std::string& run_dir, int64_t step);
void fsync_path(const std::string& path);  // a file or a directory; best effort
// tmp (its manifest already written last) becomes RUN/step_...; then `latest` names it; then, with
// keep > 0, only the newest `keep` step directories remain. Returns the step directory.
std::string commit_step_dir(const std::string& run_dir, const std::string& tmp, int64_t step, int keep);

// FNV-1a 64 over a tensor's bytes (contiguous, host), as 16 hex digits, with the offset basis
// 1469598103934665603: a variant (the standard's is 14695981039346656037), kept for the files written.
std::string tensor_checksum(const Tensor& t);
std::string bytes_checksum(const void* data, size_t n);

struct LoadedCheckpoint {
  std::string path;  // the step directory
  io::SafetensorsFile model, optim;
  nlohmann::json state;
};

// `dir` is a run directory (its `latest` is followed) or a step directory. Throws naming the path.
// "auto:RUN" picks the newest complete step directory of RUN (by step number), whatever
// `latest` says (a crash between the rename and the pointer update leaves `latest` one behind).
// Either format: the returned step directory holds state.json (full) or index.json (sharded).
// A newer step that auto: passes over is named on stderr when report_skipped (one rank of a job).
std::string resolve_checkpoint(const std::string& dir, bool report_skipped = true);
// "" when every file a step directory's manifest names is there (at its recorded size, for the
// sharded format); else what is not (parallel/sharded_checkpoint.cpp). auto: skips such steps.
std::string checkpoint_files_problem(const std::string& step_dir);
bool is_sharded_checkpoint(const std::string& step_dir);
// The full format only (a sharded step directory is refused, pointing at open_checkpoint).
LoadedCheckpoint load_checkpoint(const std::string& dir);

}  // namespace sg::ckpt
