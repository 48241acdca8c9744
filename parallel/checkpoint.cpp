#include "parallel/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

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

std::string save_checkpoint(const std::string& run_dir, int64_t step, const io::NamedTensors& model,
                            const std::map<std::string, std::string>& model_metadata, const io::NamedTensors& optim,
                            const nlohmann::json& state) {
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
  return final_dir.string();
}

std::string resolve_checkpoint(const std::string& dir) {
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
  return c;
}

}  // namespace sg::ckpt
