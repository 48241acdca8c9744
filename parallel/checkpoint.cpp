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

namespace fs = std::filesystem;

namespace sg::ckpt {

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

static void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

static void write_text_durably(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    SG_CHECK(f.good(), "checkpoint: cannot write ", tmp.string());
    f << text;
    f.flush();
    SG_CHECK(f.good(), "checkpoint: write to ", tmp.string(), " failed (disk full?)");
  }
  fsync_path(tmp);
  fs::rename(tmp, path);
}

std::string tensor_checksum(const Tensor& t) {
  Tensor h = contiguous(to(t, Device::cpu()));
  const auto* p = static_cast<const unsigned char*>(h.data_ptr());
  uint64_t x = 1469598103934665603ull;
  for (size_t i = 0; i < h.nbytes(); ++i) x = (x ^ p[i]) * 1099511628211ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

static nlohmann::json checksums(const io::NamedTensors& ts) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [n, t] : ts) j[n] = tensor_checksum(t);
  return j;
}

// Step directories of a run, oldest first.
static std::vector<std::pair<int64_t, fs::path>> step_dirs(const fs::path& run) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step_", 0) != 0 || n.size() != 13) continue;
    if (n.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    out.emplace_back(std::stoll(n.substr(5)), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string save_checkpoint(const std::string& run_dir, int64_t step, const io::NamedTensors& model,
                            const std::map<std::string, std::string>& model_metadata, const io::NamedTensors& optim,
                            const nlohmann::json& state_in, int keep) {
  nlohmann::json state = state_in;
  state["checksums"] = {{"model.safetensors", checksums(model)}, {"optim.safetensors", checksums(optim)}};
  fs::path run(run_dir);
  std::error_code ec;
  fs::create_directories(run, ec);
  SG_CHECK(!ec, "checkpoint: cannot create ", run.string(), ": ", ec.message());
  const fs::path final_dir = run / step_dir_name(step);
  SG_CHECK(!fs::exists(final_dir), "checkpoint: ", final_dir.string(),
           " already exists; refusing to overwrite it (use another --save directory)");
  const fs::path tmp = run / (".tmp-" + step_dir_name(step) + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  io::save_safetensors((tmp / "model.safetensors").string(), model, model_metadata);
  io::save_safetensors((tmp / "optim.safetensors").string(), optim);
  write_text_durably(tmp / "state.json", state.dump(2));  // the manifest: written last
  fsync_path(tmp);
  fs::rename(tmp, final_dir);
  fsync_path(run);
  write_text_durably(run / "latest", step_dir_name(step) + "\n");
  fsync_path(run);
  if (keep > 0) {  // only after the new one is committed and pointed at
    auto dirs = step_dirs(run);
    for (size_t i = 0; i + size_t(keep) < dirs.size(); ++i) fs::remove_all(dirs[i].second, ec);
  }
  return final_dir.string();
}

std::string resolve_checkpoint(const std::string& dir_in) {
  if (dir_in.rfind("auto:", 0) == 0) {
    fs::path run(dir_in.substr(5));
    SG_CHECK(fs::exists(run), "checkpoint: ", run.string(), " does not exist");
    auto dirs = step_dirs(run);
    for (auto it = dirs.rbegin(); it != dirs.rend(); ++it)
      if (fs::exists(it->second / "state.json")) return it->second.string();
    throw Error(str("checkpoint: ", run.string(), " holds no complete checkpoint"));
  }
  const std::string& dir = dir_in;
  fs::path p(dir);
  SG_CHECK(fs::exists(p), "checkpoint: ", dir, " does not exist");
  if (fs::exists(p / "state.json")) return p.string();
  SG_CHECK(fs::exists(p / "latest"), "checkpoint: ", dir, " has neither state.json nor a 'latest' pointer");
  std::ifstream f(p / "latest");
  std::string name;
  std::getline(f, name);
  SG_CHECK(!name.empty() && name.find('/') == std::string::npos && name.find("..") == std::string::npos,
           "checkpoint: ", (p / "latest").string(), " names an invalid directory '", name, "'");
  fs::path step = p / name;
  SG_CHECK(fs::exists(step / "state.json"), "checkpoint: ", step.string(), " (from ", (p / "latest").string(),
           ") is incomplete: no state.json");
  return step.string();
}

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  LoadedCheckpoint c;
  c.path = resolve_checkpoint(dir);
  fs::path p(c.path);
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
