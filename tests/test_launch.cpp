// The supervisor and faults during a save, as a user meets them: `shardgrad launch` restarts a job
// whose rank died and the losses continue exactly; a rank dying inside a checkpoint save leaves
// the previous checkpoint loadable and the job ends within --comm-timeout naming the rank.
#include "tests/catch.h"
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "parallel/sharded_checkpoint.h"

#include "tests/cli_support.h"

namespace fs = std::filesystem;

namespace {

using Run = sg::testing::CommandResult;
Run run_command(const std::string& cmdline, double* seconds = nullptr) { return sg::testing::run_shell(cmdline, seconds); }
std::vector<nlohmann::json> read_log(const fs::path& p) { return sg::testing::read_json_lines(p); }

struct TempDir : sg::testing::ScratchDir {
  TempDir() : ScratchDir("launch_dir_" + std::to_string(std::rand())) {}
};

const std::string kSmall = "--n-layer 1 --n-embd 32 --n-head 2 --seq-len 32 --batch-size 8 --micro-batch-size 4 "
                           "--threads 1 --eval-every 0 --eval-batches 1 --eval-problems 8 --dropout 0.1";

std::string mpirun(int np) { return sg::testing::mpirun_shardgrad(np); }
std::string launch() { return std::string("OMP_NUM_THREADS=1 ") + SG_BINARY + " launch --mpirun " + SG_MPIEXEC; }

}  // namespace

TEST_CASE("launch restarts a job whose rank exited and the losses continue as if uninterrupted", "[cli][mpi][launch]") {
  TempDir d;
  const std::string train = " train " + kSmall + " --steps 6 --strategy ddp --save-every 1 --comm-timeout 10";
  Run whole = run_command(mpirun(2) + train + " --save " + (d.path / "a").string() + " --log-json " +
                          (d.path / "a.jsonl").string());
  INFO(whole.output);
  REQUIRE(whole.code == 0);
  Run sup = run_command(launch() + " -n 2 --max-restarts 2 --" + train + " --save " + (d.path / "b").string() +
                        " --log-json " + (d.path / "b.jsonl").string() + " --inject-fault rank=1,step=3,kind=exit");
  INFO(sup.output);
  REQUIRE(sup.code == 0);
  REQUIRE(sup.output.find("injecting fault 'exit' at step 3") != std::string::npos);
  REQUIRE(sup.output.find("restart 1 of 2") != std::string::npos);
  REQUIRE(sup.output.find("--resume auto") != std::string::npos);
  REQUIRE(sup.output.find("restart 2 of 2") == std::string::npos);  // one restart was enough
  REQUIRE(sup.output.find("save only at the end") == std::string::npos);
  auto a = read_log(d.path / "a.jsonl"), b = read_log(d.path / "b.jsonl");
  REQUIRE(a.size() == 6);
  REQUIRE(b.size() == 6);  // steps 1-2 from the first run, 3-6 from the restart: none twice
  for (size_t i = 0; i < 6; ++i) {
    INFO("step " << i + 1);
    REQUIRE(b[i]["step"] == a[i]["step"]);
    REQUIRE(b[i]["loss"].get<double>() == a[i]["loss"].get<double>());  // bit-exact
  }
}

TEST_CASE("launch refuses restarts without --save and gives up after --max-restarts", "[cli][launch]") {
  TempDir d;
  Run r = run_command(launch() + " -n 2 --max-restarts 1 -- train " + kSmall + " --steps 2");
  INFO(r.output);
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("--max-restarts 1 needs --save DIR") != std::string::npos);
  r = run_command(launch() + " -n 1 --max-restarts 1 -- generate");
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("expected `-- train [flags]`") != std::string::npos);
  // A job that fails every time: one restart, then the failure is reported.
  r = run_command(launch() + " -n 1 --max-restarts 1 -- train --steps ten --save " + (d.path / "x").string());
  INFO(r.output);
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("restart 1 of 1") != std::string::npos);
  REQUIRE(r.output.find("after 1 restart; giving up") != std::string::npos);
  REQUIRE(r.output.find("save only at the end (no --save-every N)") != std::string::npos);
}

TEST_CASE("a rank dying inside a checkpoint save leaves the previous checkpoint and ends the job naming it", "[cli][mpi][launch]") {
  for (const char* kind : {"exit", "throw", "abort", "kill", "hang"}) {
    INFO(kind);
    TempDir d;
    const fs::path run = d.path / "run";
    double secs = 0;
    Run r = run_command(mpirun(2) + " train " + kSmall + " --steps 6 --strategy ddp --save-every 2 --comm-timeout 10 --save " +
                            run.string() + " --inject-fault rank=0,step=4,kind=" + kind + ",during=save",
                        &secs);
    INFO(r.output);
    REQUIRE(r.code != 0);
    REQUIRE(secs < 40);  // 10 s timeout plus start-up and teardown on a loaded 2-core machine
    REQUIRE(r.output.find("rank 0") != std::string::npos);
    REQUIRE(r.output.find("while saving the checkpoint") != std::string::npos);
    REQUIRE(r.output.find("terminate called") == std::string::npos);
    // Step 4's files were being written; step 2 is still the checkpoint, complete and loadable.
    REQUIRE_FALSE(fs::exists(run / "step_00000004"));
    auto c = sg::ckpt::open_checkpoint("auto:" + run.string());
    REQUIRE(c->state()["step"] == 2);
    for (const auto& name : c->names()) (void)c->tensor(name);  // every checksum holds
    REQUIRE(sg::ckpt::open_checkpoint(run.string())->state()["step"] == 2);
  }
}
