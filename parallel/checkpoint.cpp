#include "parallel/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <vector>

#include "autograd/ops.h"
#include "core/error.h"
#include "core/hash.h"
#include "io/file.h"
#include "parallel/watchdog.h"

namespace fs = std::filesystem;

namespace sg::ckpt {

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

void fsync_path(const std::string& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// FNV-1a with the short offset basis (core/hash.h), so that every checkpoint written verifies.
std::string bytes_checksum(const void* data, size_t n) {
  const uint64_t x = fnv1a(data, n, kFnvShortBasis);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string tensor_checksum(const Tensor& t) {
  Tensor h = contiguous(to(t, Device::cpu()));
  return bytes_checksum(h.data_ptr(), h.nbytes());
}

static nlohmann::json checksums(const io::NamedTensors& ts) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [n, t] : ts) j[n] = tensor_checksum(t);
  return j;
}

static bool has_manifest(const fs::path& step) {
  return fs::exists(step / kFullManifest) || fs::exists(step / kShardedManifest);
}

std::vector<std::pair<int64_t, fs::path>> step_dirs(const fs::path& run) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const std::string n = e.path().filename().string();
    // step_%08lld: 8 digits, more from step 10^8 on (a number of 18 digits at most, as int64 reads it)
    if (!e.is_directory() || n.rfind("step_", 0) != 0 || n.size() < 13 || n.size() > 23) continue;
    if (n.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    out.emplace_back(std::stoll(n.substr(5)), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string temp_step_dir(const std::string& run_dir, int64_t step, const std::string& suffix) {
  return (fs::path(run_dir) / (".tmp-" + step_dir_name(step) + suffix)).string();
}

void check_step_is_new(const std::string& run_dir, int64_t step) {
  const fs::path final_dir = fs::path(run_dir) / step_dir_name(step);
  SG_CHECK(!fs::exists(final_dir), "checkpoint: ", final_dir.string(),
           " already exists; refusing to overwrite it (use another --save directory)");
}

std::string commit_step_dir(const std::string& run_dir, const std::string& tmp, int64_t step, int keep) {
  const fs::path run(run_dir), final_dir = run / step_dir_name(step);
  check_step_is_new(run_dir, step);
  fsync_path(tmp);
  fs::rename(tmp, final_dir);
  fsync_path(run.string());
  io::write_text_atomic((run / "latest").string(), "checkpoint", step_dir_name(step) + "\n");  // fsyncs the folder
  if (keep > 0) {  // only after the new one is committed and pointed at
    // The newest `keep` complete checkpoints up to this one stay. A damaged one (kept where a
    // resumed run does not save its step again) neither counts nor goes; nor does a later step.
    std::error_code ec;
    std::vector<fs::path> complete;
    for (const auto& [s, dir] : step_dirs(run))
      if (s == step || (s < step && checkpoint_files_problem(dir.string()).empty())) complete.push_back(dir);
    for (size_t i = 0; i + size_t(keep) < complete.size(); ++i) fs::remove_all(complete[i], ec);
  }
  return final_dir.string();
}

std::string save_checkpoint(const std::string& run_dir, int64_t step, const io::NamedTensors& model,
                            const std::map<std::string, std::string>& model_metadata, const io::NamedTensors& optim,
                            const nlohmann::json& state_in, int keep) {
  nlohmann::json state = state_in;
  state["checksums"] = {{"model.safetensors", checksums(model)}, {"optim.safetensors", checksums(optim)}};
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  SG_CHECK(!ec, "checkpoint: cannot create ", run_dir, ": ", ec.message());
  check_step_is_new(run_dir, step);
  const fs::path tmp = temp_step_dir(run_dir, step, std::string("-").append(std::to_string(::getpid())));
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  io::save_safetensors((tmp / "model.safetensors").string(), model, model_metadata);
  parallel::maybe_inject_in_save(step);  // testing: a fault with some files written, no manifest
  io::save_safetensors((tmp / "optim.safetensors").string(), optim);
  io::write_text_atomic((tmp / kFullManifest).string(), "checkpoint", state.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));  // the manifest: written last (non-UTF-8 bytes as U+FFFD)
  return commit_step_dir(run_dir, tmp.string(), step, keep);
}

std::string resolve_checkpoint(const std::string& dir_in, bool report_skipped) {
  if (dir_in.rfind("auto:", 0) == 0) {
    fs::path run(dir_in.substr(5));
    SG_CHECK(fs::exists(run), "checkpoint: ", run.string(), " does not exist");
    auto dirs = step_dirs(run);
    for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
      if (!has_manifest(it->second)) continue;
      // A file lost after the commit (a disk, a hand): the step before it is the newest complete one.
      const std::string problem = checkpoint_files_problem(it->second.string());
      if (problem.empty()) return it->second.string();
      if (report_skipped) std::fprintf(stderr, "checkpoint: skipping %s: %s\n", it->second.string().c_str(), problem.c_str());
    }
    throw Error(str("checkpoint: ", run.string(), " holds no complete checkpoint"));
  }
  const std::string& dir = dir_in;
  fs::path p(dir);
  SG_CHECK(fs::exists(p), "checkpoint: ", dir, " does not exist");
  if (has_manifest(p)) return p.string();
  SG_CHECK(fs::exists(p / "latest"), "checkpoint: ", dir, " has no manifest (state.json or index.json) and no 'latest' pointer");
  std::ifstream f(p / "latest");
  std::string name;
  std::getline(f, name);
  // (a name past NAME_MAX would make the filesystem calls below throw their own error, not ours)
  SG_CHECK(!name.empty() && name.size() <= 255 && name.find('/') == std::string::npos &&
               name.find("..") == std::string::npos,
           "checkpoint: ", (p / "latest").string(), " names an invalid directory '", name.substr(0, 300), "'");
  fs::path step = p / name;
  SG_CHECK(fs::exists(step), "checkpoint: ", step.string(), " (from ", (p / "latest").string(), ") does not exist");
  SG_CHECK(has_manifest(step), "checkpoint: ", step.string(), " (from ", (p / "latest").string(),
           ") is incomplete: no state.json or index.json");
  return step.string();
}

bool is_sharded_checkpoint(const std::string& step_dir) { return fs::exists(fs::path(step_dir) / kShardedManifest); }

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  LoadedCheckpoint c;
  c.path = resolve_checkpoint(dir);
  fs::path p(c.path);
  SG_CHECK(!is_sharded_checkpoint(c.path), "checkpoint: ", c.path,
           " is a sharded checkpoint (index.json); open it with ckpt::open_checkpoint");
  std::ifstream f(p / "state.json");
  try {
    c.state = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw Error(str("checkpoint: ", (p / "state.json").string(), " is not valid JSON: ", e.what()));
  }
  c.model = io::load_safetensors((p / "model.safetensors").string());
  c.optim = io::load_safetensors((p / "optim.safetensors").string());
  // Every tensor against the checksum recorded when it was written.
  if (c.state.contains("checksums")) {
    for (auto [file, f] : {std::pair{"model.safetensors", &c.model}, std::pair{"optim.safetensors", &c.optim}}) {
      const auto& sums = c.state["checksums"][file];
      for (const auto& [name, t] : f->tensors) {
        SG_CHECK(sums.contains(name), "checkpoint: ", (p / file).string(), " holds '", name,
                 "', which state.json does not list");
        SG_CHECK(sums[name].get<std::string>() == tensor_checksum(t), "checkpoint: tensor '", name, "' in ",
                 (p / file).string(), " fails its checksum: the file is corrupt");
      }
      SG_CHECK(sums.size() == f->tensors.size(), "checkpoint: ", (p / file).string(), " lacks tensors that state.json lists");
    }
  }
  return c;
}

}  // namespace sg::ckpt
