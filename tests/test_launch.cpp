// The supervisor and faults during a save, as a user meets them: `shardgrad launch` restarts a job
// whose rank died and the losses continue exactly; a rank dying inside a checkpoint save leaves
// the previous checkpoint loadable and the job ends within --comm-timeout naming the rank; a rank
// stalled on a slow disk in a save or a load is waited for up to --checkpoint-timeout.
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

// The losses of two logs agree bit for bit, step by step.
void same_losses(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(a[i]["step"] == b[i]["step"]);
    REQUIRE(a[i]["loss"].get<double>() == b[i]["loss"].get<double>());
  }
}

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
  same_losses(a, b);
}

TEST_CASE("launch refuses restarts without --save and gives up after --max-restarts", "[cli][launch]") {
  TempDir d;
  Run r = run_command(launch() + " -n 2 --max-restarts 1 -- train " + kSmall + " --steps 2");
  INFO(r.output);
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("--max-restarts 1 needs --save DIR") != std::string::npos);
  // a launcher that cannot be started ran no job: refused, not restarted; one with flags of its own
  r = run_command(launch() + " -n 1 --max-restarts 2 --mpirun no-such-mpirun -- train --steps 2 --save " +
                  (d.path / "w").string());
  INFO(r.output);
  CHECK(r.code == 1);
  CHECK(r.output.find("cannot run no-such-mpirun: No such file or directory") != std::string::npos);
  CHECK(r.output.find("launch: restart:") == std::string::npos);
  const std::string with_flags = std::string(SG_MPIEXEC) + " --mca btl_base_verbose 0";
  r = run_command(launch() + " -n 1 --mpirun '" + with_flags + "' -- train " + kSmall + " --steps 1");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("launch: run: " + with_flags + " --oversubscribe") != std::string::npos);
  r = run_command(launch() + " --help");
  CHECK(r.code == 0);
  CHECK(r.output.rfind("usage: shardgrad launch -n N [flags] -- train [train flags]\n", 0) == 0);
  CHECK(r.output.find("usage:", 1) == std::string::npos);  // one usage line
  r = run_command(launch() + " -n 1 --max-restarts 1 -- generate");
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("expected `-- train [flags]`") != std::string::npos);
  // A job that fails every time after it started (a learning rate that makes step 2's gradients
  // overflow): one restart, then the failure is reported.
  r = run_command(launch() + " -n 1 --max-restarts 1 -- train " + kSmall + " --steps 4 --lr 1e30 --warmup-steps 0 "
                  "--save " + (d.path / "x").string());
  INFO(r.output);
  REQUIRE(r.code == 1);
  REQUIRE(r.output.find("is not finite") != std::string::npos);
  REQUIRE(r.output.find("restart 1 of 1") != std::string::npos);
  REQUIRE(r.output.find("after 1 restart; giving up") != std::string::npos);
  REQUIRE(r.output.find("save only at the end (no --save-every N)") != std::string::npos);
  // A job refused before its first step is not restarted: the same command would fail the same
  // way, and the restart's --resume auto would pass over "already holds a run" and continue that run.
  r = run_command(launch() + " -n 1 --max-restarts 2 -- train --steps ten --save " + (d.path / "y").string());
  INFO(r.output);
  CHECK(r.code == 64);
  CHECK(r.output.find("--steps expects an integer, got 'ten'") != std::string::npos);
  CHECK(r.output.find("failed before its first step") != std::string::npos);
  CHECK(r.output.find("launch: restart:") == std::string::npos);
  r = run_command(launch() + " -n 1 --max-restarts 2 -- train --stpes 4 --save " + (d.path / "z").string());
  INFO(r.output);
  CHECK(r.code == 64);  // the command line's own refusals too
  CHECK(r.output.find("unknown flag --stpes") != std::string::npos);
  CHECK(r.output.find("launch: restart:") == std::string::npos);
  const std::string other = (d.path / "other").string();
  REQUIRE(run_command(std::string(SG_BINARY) + " train " + kSmall + " --steps 2 --save " + other).code == 0);
  r = run_command(launch() + " -n 1 --max-restarts 2 -- train " + kSmall + " --steps 4 --save-every 1 --save " + other);
  INFO(r.output);
  CHECK(r.code == 64);
  CHECK(r.output.find("--save " + other + " already holds a run") != std::string::npos);
  CHECK(!fs::exists(fs::path(other) / "step_00000003"));  // that run was not continued
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
    // the hung writer is named as the rank that failed, not as one waiting on a peer
    if (std::string(kind) == "hang") CHECK(r.output.find("rank 0: FAILED: no progress for ") != std::string::npos);
    // Step 4's files were being written; step 2 is still the checkpoint, complete and loadable.
    REQUIRE_FALSE(fs::exists(run / "step_00000004"));
    auto c = sg::ckpt::open_checkpoint("auto:" + run.string());
    REQUIRE(c->state()["step"] == 2);
    for (const auto& name : c->names()) (void)c->tensor(name);  // every checksum holds
    REQUIRE(sg::ckpt::open_checkpoint(run.string())->state()["step"] == 2);
  }
}

// A slow disk: a rank blocked writing or reading its checkpoint files for longer than
// --comm-timeout, its peer waiting for it at the barriers. --checkpoint-timeout bounds those.
TEST_CASE("a checkpoint save or load stalled past --comm-timeout is waited for up to --checkpoint-timeout", "[cli][mpi][launch]") {
  TempDir d;
  const fs::path run = d.path / "run";
  const std::string train = mpirun(2) + " train " + kSmall + " --strategy ddp --comm-timeout 3 --save " + run.string();
  const std::string slow = ",kind=slow,seconds=7";
  // The save of step 2 stalls (steps 1-4); then the resume from step 4 stalls in its load (steps 5-6).
  struct Stall {
    const char* flags;
    const char* fault;  // rank 1's, beside kind=slow
    const char* said;
    const char* last;
  };
  for (const Stall& st : {Stall{" --steps 4 --save-every 2", "step=2,during=save", "at step 2 while saving the checkpoint",
                                "step_00000004"},
                          Stall{" --steps 6 --resume auto", "step=4,during=load", "at step 4 after reading its checkpoint",
                                "step_00000006"}}) {
    Run r = run_command(train + " --checkpoint-timeout 20" + st.flags + " --inject-fault rank=1," + st.fault + slow);
    INFO(r.output);
    REQUIRE(r.code == 0);
    REQUIRE(r.output.find(std::string("injecting fault 'slow' ") + st.said) != std::string::npos);
    REQUIRE(fs::exists(run / st.last));
  }
  // Without the flag the save has --comm-timeout's bound; with a shorter one the job ends there.
  // Either way at the barrier the peer waits at, naming the flag, and a stalled save commits nothing.
  for (const char* during : {"save", "load"}) {
    INFO(during);
    double secs = 0;
    const bool save = std::string(during) == "save";
    Run r = run_command(train + (save ? "" : " --checkpoint-timeout 2") + " --resume auto --steps 8 --save-every 1 " +
                            "--inject-fault rank=1,step=" + (save ? "7" : "6") + slow + ",during=" + during, &secs);
    INFO(r.output);
    REQUIRE(r.code != 0);
    CHECK(secs < 30);
    CHECK(r.output.find(save ? "aborting the job (--comm-timeout 3)" : "aborting the job (--checkpoint-timeout 2)") !=
          std::string::npos);
    // the waiting peer names the barrier, or the stalled rank itself is named first
    const bool named = r.output.find(save ? "waiting in the checkpoint barrier" : "waiting in the checkpoint load barrier") !=
                           std::string::npos ||
                       r.output.find("rank 1: FAILED: no progress") != std::string::npos;
    CHECK(named);
    CHECK_FALSE(fs::exists(run / "step_00000007"));
  }
  // A load fault for another step than the checkpoint's would never fire: refused.
  Run other = run_command(std::string(SG_BINARY) + " train " + kSmall + " --steps 8 --resume auto --save " + run.string() +
                          " --inject-fault rank=0,step=4,kind=slow,seconds=1,during=load");
  INFO(other.output);
  CHECK(other.code != 0);
  CHECK(other.output.find("--inject-fault step=4,during=load: the run resumes the checkpoint of step 6, so it would "
                          "never fire") != std::string::npos);
}

namespace {

// Starts `cmd` in the background, waits until its --log-json `log` has `lines` steps, sends `sig`
// to it (to_rank: to one of its children, the ranks of an mpirun) and waits for it to end. The
// output ends with "exit status N". A process still running 60 s after the signal is killed and
// reported, so that a signal ignored fails the test rather than hanging it.
Run signal_after_steps(const std::string& cmd, const fs::path& log, int lines, const std::string& sig, bool to_rank = false) {
  const std::string target = to_rank ? "$(cat /proc/$pid/task/*/children | tr ' ' '\\n' | grep . | tail -n 1)" : "$pid";
  // A shell without job control starts its background jobs with SIGINT ignored (as nohup would):
  // with it, the job gets Ctrl-C's signal as a foreground one would.
  const std::string script =
      std::string(sig == "INT" ? "set -m\n" : "") + cmd + " & pid=$!\n"
      "for i in $(seq 1 1200); do [ -f '" + log.string() + "' ] && [ $(wc -l < '" + log.string() + "') -ge " +
      std::to_string(lines) + " ] && break; sleep 0.05; done\n"
      "kill -" + sig + " " + target + "\n"
      "for i in $(seq 1 1200); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done\n"
      "kill -0 $pid 2>/dev/null && { echo 'still running 60 s after the signal'; kill -9 $pid; }\n"
      "wait $pid; echo \"exit status $?\"\n";
  const fs::path file = fs::temp_directory_path() / ("sg_signal_" + std::to_string(::getpid()) + ".sh");
  std::ofstream(file) << script;
  Run r = run_command("bash '" + file.string() + "'");
  fs::remove(file);
  return r;
}

int exit_status(const Run& r) {
  const size_t at = r.output.rfind("exit status ");
  return at == std::string::npos ? -1 : std::stoi(r.output.substr(at + 12));
}

}  // namespace

TEST_CASE("train --stop-at trains a long schedule in slices with the losses of one run", "[cli][launch]") {
  TempDir d;
  const std::string train = std::string(SG_BINARY) + " train " + kSmall + " --steps 12 --log-json ";
  const std::string run = " --save " + (d.path / "run").string();
  Run r = run_command(train + (d.path / "whole.jsonl").string() + " --save " + (d.path / "whole").string());
  REQUIRE(r.code == 0);
  r = run_command(train + (d.path / "sliced.jsonl").string() + run + " --stop-at 5");
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(r.output.find("stopped at step 5 of 12 (--stop-at); go on with --save") != std::string::npos);
  REQUIRE(r.output.find("eval ") == std::string::npos);  // not the end of the run: no final evaluation
  REQUIRE(sg::ckpt::open_checkpoint("auto:" + (d.path / "run").string())->state()["step"] == 5);
  for (const char* slice : {" --stop-at 9", ""}) {
    r = run_command(train + (d.path / "sliced.jsonl").string() + run + " --resume auto" + slice);
    REQUIRE(r.code == 0);
  }
  REQUIRE(r.output.find("eval ") != std::string::npos);
  same_losses(read_log(d.path / "whole.jsonl"), read_log(d.path / "sliced.jsonl"));  // 12 steps, each once
  // The schedule is --steps' throughout: a slice is not a shorter run.
  REQUIRE(read_log(d.path / "sliced.jsonl")[5]["lr"] == read_log(d.path / "whole.jsonl")[5]["lr"]);
  r = run_command(train + (d.path / "x.jsonl").string() + " --stop-at 13");
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("--stop-at must be a step from 1 to --steps (12) or 0, got 13") != std::string::npos);
  r = run_command(train + (d.path / "x.jsonl").string() + run + " --resume auto --stop-at 4");
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find("--stop-at 4 is not after the checkpoint's step 12") != std::string::npos);
}

TEST_CASE("SIGTERM, SIGINT or SIGUSR1 stops train after its step, saved, every rank at the same step", "[cli][mpi][launch]") {
  TempDir d;
  const std::string flags = " train " + kSmall + " --steps 100000 --save-every 1000";
  for (const std::string sig : {"TERM", "INT"})  // INT: Ctrl-C
    SECTION("one process, SIG" + sig + ": the step it reached is saved and resumes as if uninterrupted") {
      const fs::path log = d.path / "a.jsonl", run = d.path / "a";
      Run r = signal_after_steps(std::string(SG_BINARY) + flags + " --save " + run.string() + " --log-json " +
                                     log.string(),
                                 log, 3, sig);
      INFO(r.output);
      REQUIRE(exit_status(r) == 75);
      const auto steps = read_log(log);
      const int64_t at = steps.back()["step"].get<int64_t>();
      REQUIRE(at >= 3);
      REQUIRE(r.output.find("stopped at step " + std::to_string(at) + " of 100000 (SIG" + sig + ")") !=
              std::string::npos);
      REQUIRE(sg::ckpt::open_checkpoint("auto:" + run.string())->state()["step"] == at);
      // Two more steps from there match a run that was never stopped.
      const std::string more = " --stop-at " + std::to_string(at + 2);
      REQUIRE(run_command(std::string(SG_BINARY) + flags + " --save " + run.string() + " --resume auto --log-json " +
                          log.string() + more).code == 0);
      REQUIRE(run_command(std::string(SG_BINARY) + flags + " --save " + (d.path / "b").string() + " --log-json " +
                          (d.path / "b.jsonl").string() + more).code == 0);
      same_losses(read_log(d.path / "b.jsonl"), read_log(log));
    }
  SECTION("two ranks, SIGUSR1 to one of them: both stop after the same step and the checkpoint is whole") {
    const fs::path log = d.path / "c.jsonl", run = d.path / "c";
    Run r = signal_after_steps(mpirun(2) + flags + " --strategy zero2 --save " + run.string() + " --log-json " + log.string(),
                               log, 3, "USR1", true);
    INFO(r.output);
    REQUIRE(exit_status(r) == 75);
    const int64_t at = read_log(log).back()["step"].get<int64_t>();
    REQUIRE(r.output.find("stopped at step " + std::to_string(at) + " of 100000 (SIGUSR1)") != std::string::npos);
    auto c = sg::ckpt::open_checkpoint("auto:" + run.string());
    REQUIRE(c->state()["step"] == at);
    for (const auto& name : c->names()) (void)c->tensor(name);  // both ranks' pieces, every checksum
  }
  // launch passes a first SIGTERM (Slurm's at a time limit) or SIGINT on as SIGUSR1: mpirun would
  // kill the ranks a second after passing either on, saved or not
  for (const std::string sig : {"USR1", "TERM"})
    SECTION("launch passes SIG" + sig + " on to the job as SIGUSR1 and does not restart what stopped on request") {
      const fs::path log = d.path / "e.jsonl", run = d.path / "e";
      Run r = signal_after_steps(launch() + " -n 2 --max-restarts 3 --" + flags + " --strategy ddp --save " +
                                     run.string() + " --log-json " + log.string(),
                                 log, 3, sig);
      INFO(r.output);
      REQUIRE(exit_status(r) == 75);
      REQUIRE(r.output.find("the job stopped on SIG" + sig + " (exit status 75) after saving its checkpoint in " +
                            run.string() + "; not restarted") != std::string::npos);
      REQUIRE(r.output.find("restart 1") == std::string::npos);
      REQUIRE(sg::ckpt::open_checkpoint("auto:" + run.string())->state()["step"] == read_log(log).back()["step"]);
    }
}
