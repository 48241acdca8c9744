// Checkpoint commit: atomic directories, a latest pointer, keep-last-K, checksums that catch a
// flipped byte, and recovery of the newest complete checkpoint after a crash.
#include "tests/catch.h"
#include <filesystem>
#include <fstream>

#include "autograd/ops.h"
#include "parallel/checkpoint.h"

using namespace sg;
namespace fs = std::filesystem;

namespace {
struct Dir {
  fs::path p = fs::temp_directory_path() / ("sg_ckpt_" + std::to_string(::getpid()));
  Dir() { fs::remove_all(p); }
  ~Dir() { fs::remove_all(p); }
};
io::NamedTensors model_at(float v) { return {{"w", full({2, 3}, v)}, {"b", full({3}, v + 1)}}; }
std::string save(const fs::path& run, int64_t step, int keep = 0) {
  return ckpt::save_checkpoint(run.string(), step, model_at(float(step)), {{"n_head", "1"}},
                               {{"w.exp_avg", full({2, 3}, 0.5)}}, {{"step", step}}, keep);
}
}  // namespace

TEST_CASE("checkpoints commit whole step directories, follow latest, keep the newest K", "[ckpt]") {
  Dir d;
  save(d.p, 1);
  save(d.p, 2, 2);
  save(d.p, 3, 2);
  REQUIRE_FALSE(fs::exists(d.p / "step_00000001"));
  REQUIRE(fs::exists(d.p / "step_00000002" / "state.json"));
  auto c = ckpt::load_checkpoint(d.p.string());
  REQUIRE(c.state["step"] == 3);
  REQUIRE(item(sum(c.model.at("w"))) == 18.0);
  REQUIRE_THROWS_WITH(save(d.p, 3), Catch::Contains("already exists; refusing to overwrite"));
  for (const auto& e : fs::directory_iterator(d.p)) REQUIRE(e.path().filename().string().rfind(".tmp", 0) != 0);
}

TEST_CASE("keep counts complete checkpoints up to the one saved: a damaged or later step neither counts nor goes", "[ckpt]") {
  Dir d;
  save(d.p, 10);
  save(d.p, 20);
  save(d.p, 30);
  fs::remove(d.p / "step_00000030" / "optim.safetensors");  // damaged, left where a resumed run keeps it
  fs::remove(d.p / "step_00000020" / "optim.safetensors");
  save(d.p, 15, 1);  // a run resumed at 10 that saves step 15, keeping one
  CHECK(fs::exists(d.p / "step_00000015" / "state.json"));  // the one just saved stays
  CHECK_FALSE(fs::exists(d.p / "step_00000010"));          // the older complete one goes
  CHECK(fs::exists(d.p / "step_00000020"));                // damaged and later: left alone
  CHECK(fs::exists(d.p / "step_00000030"));
  CHECK(ckpt::load_checkpoint(d.p.string()).state["step"] == 15);
  // steps past 10^8 have 9 digits and are steps all the same
  save(d.p, 123456789, 2);
  CHECK(fs::exists(d.p / "step_123456789"));
  CHECK(fs::exists(d.p / "step_00000015"));
  save(d.p, 123456790, 2);
  CHECK_FALSE(fs::exists(d.p / "step_00000015"));
  REQUIRE(ckpt::step_dirs(d.p).back().first == 123456790);
}

TEST_CASE("a flipped byte in a checkpoint is caught by its checksum, naming tensor and file", "[ckpt]") {
  Dir d;
  std::string step = save(d.p, 5);
  fs::path f = fs::path(step) / "model.safetensors";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-1, std::ios::end);
    char ch;
    io.get(ch);
    io.seekp(-1, std::ios::end);
    io.put(char(ch ^ 0x10));
  }
  REQUIRE_THROWS_WITH(ckpt::load_checkpoint(d.p.string()), Catch::Contains("fails its checksum") && Catch::Contains("model.safetensors"));
}

TEST_CASE("after a crash mid-save the previous checkpoint still loads, auto: finds the newest complete", "[ckpt]") {
  Dir d;
  save(d.p, 10);
  save(d.p, 20);
  // A crash while writing step 30: its temporary directory and no state.json.
  fs::create_directories(d.p / ".tmp-step_00000030-999");
  fs::create_directories(d.p / "step_00000030");
  std::ofstream(d.p / "step_00000030" / "model.safetensors") << "partial";
  REQUIRE(ckpt::load_checkpoint(d.p.string()).state["step"] == 20);
  REQUIRE(ckpt::load_checkpoint("auto:" + d.p.string()).state["step"] == 20);
  // A crash after the rename but before `latest` moved: auto: still finds the newest.
  fs::remove_all(d.p / "step_00000030");
  save(d.p, 30);
  std::ofstream(d.p / "latest") << "step_00000020\n";
  REQUIRE(ckpt::load_checkpoint(d.p.string()).state["step"] == 20);
  REQUIRE(ckpt::load_checkpoint("auto:" + d.p.string()).state["step"] == 30);
  std::ofstream(d.p / "latest") << "../../etc\n";
  REQUIRE_THROWS_WITH(ckpt::load_checkpoint(d.p.string()), Catch::Contains("invalid directory"));
  // a name longer than a file name may be (found by the fuzzer: std::filesystem threw its own error)
  std::ofstream(d.p / "latest") << std::string(300, 'N') << "\n";
  REQUIRE_THROWS_WITH(ckpt::load_checkpoint(d.p.string()), Catch::Contains("invalid directory"));
}
