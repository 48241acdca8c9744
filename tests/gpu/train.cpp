// The trainer on a real GPU, run as a user runs it (the shardgrad executable): the tiny GPT's
// losses on cuda:0 against the CPU's in f32; bf16 and fp16 (loss scaling) close to them; and the
// multi-rank paths that fit on one GPU — ddp and zero3 over MPI with the ranks sharing cuda:0
// (host staging), ddp over NCCL at one rank, the optimizer offloaded to the host under zero2 and
// zero3; a run that reads SG_GEMM_TUNE_FILE against the tuned run that wrote it; generate and
// eval (HellaSwag) on cuda:0 against the CPU. Exits 77 (CTest: skipped) without a CUDA device.
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "kernels/cuda/runtime.h"
#include "tests/cli_support.h"

using namespace sg::testing;

namespace {

// One training run of the synthetic task's tiny GPT; returns the per-step losses from --log-json.
std::vector<double> losses(const std::string& launcher, const std::string& flags, const ScratchDir& dir,
                           const std::string& tag) {
  const auto log = dir.path / (tag + ".jsonl");
  const std::string cmd = launcher + " train --steps 12 --eval-every 0 --threads 2 --batch-size 64 --log-json '" +
                          log.string() + "' " + flags;
  const CommandResult r = run_shell(cmd);
  INFO(cmd << "\n" << r.output);
  REQUIRE(r.code == 0);
  std::vector<double> v;
  for (const auto& j : read_json_lines(log)) v.push_back(j.at("loss").get<double>());
  REQUIRE(v.size() == 12);
  return v;
}

// The largest |a - b| / |b| over the steps, printed so the figure can be quoted.
double max_rel(const std::vector<double>& a, const std::vector<double>& b, const char* what) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  std::printf("%-40s max relative loss difference over %zu steps: %.3g\n", what, a.size(), worst);
  return worst;
}

const std::string single = SG_BINARY;

}  // namespace

TEST_CASE("the tiny GPT trains on cuda:0 with the CPU's losses (f32) and close to them in bf16 and fp16", "[gpu][train]") {
  ScratchDir dir("gpu_train");
  const auto cpu = losses(single, "--device cpu", dir, "cpu");
  const auto gpu = losses(single, "--device cuda:0", dir, "gpu");
  // Same arithmetic in another order (GPU reductions, tiled attention): f32 rounding, compounded
  // over 12 AdamW steps.
  CHECK(max_rel(gpu, cpu, "cuda:0 f32 vs cpu f32") < 1e-4);
  const auto bf16 = losses(single, "--device cuda:0 --dtype bf16", dir, "bf16");
  CHECK(max_rel(bf16, gpu, "cuda:0 bf16 vs cuda:0 f32") < 3e-2);
  const auto fp16 = losses(single, "--device cuda:0 --dtype fp16", dir, "fp16");
  CHECK(max_rel(fp16, gpu, "cuda:0 fp16 (loss scaling, flash) vs cuda:0 f32") < 3e-2);
  const auto fp16_cudnn = losses(single, "--device cuda:0 --dtype fp16 --attention cudnn", dir, "fp16_cudnn");
  CHECK(max_rel(fp16_cudnn, gpu, "cuda:0 fp16 (loss scaling, cudnn) vs cuda:0 f32") < 3e-2);
  const auto bf16_cudnn = losses(single, "--device cuda:0 --dtype bf16 --attention cudnn", dir, "bf16_cudnn");
  CHECK(max_rel(bf16_cudnn, gpu, "cuda:0 bf16 (cudnn) vs cuda:0 f32") < 3e-2);
  CHECK(gpu.back() < gpu.front());
}

// SG_GEMM_TUNE_FILE as a user runs it: a tuned run writes its choices, and a later process that
// reads them runs the same algorithms: the tuned run's losses, bit for bit, with no tuning.
TEST_CASE("a run reading SG_GEMM_TUNE_FILE repeats the tuned run's losses exactly", "[gpu][train]") {
  ScratchDir dir("gpu_tune_file");
  const std::string file = (dir.path / "gemm.tune").string();
  const auto read_text = [](const std::string& path) {
    std::ifstream f(path);
    std::ostringstream text;
    text << f.rdbuf();
    return text.str();
  };
  const auto tuned = losses("SG_GEMM_TUNE=1 SG_GEMM_TUNE_FILE='" + file + "' " + single, "--device cuda:0 --dtype bf16",
                            dir, "tuned");
  const std::string text = read_text(file);
  INFO(text);
  CHECK(text.find("\ngemm bf16 ") != std::string::npos);
  const auto read = losses("SG_GEMM_TUNE_FILE='" + file + "' " + single, "--device cuda:0 --dtype bf16", dir, "read");
  CHECK(read == tuned);
  CHECK(read_text(file) == text);  // read, not written
}

TEST_CASE("ddp and zero3 on 2 ranks sharing cuda:0 over MPI, and ddp over NCCL, give the single-GPU losses", "[gpu][train][mpi]") {
  ScratchDir dir("gpu_ranks");
  const auto one = losses(single, "--device cuda:0", dir, "one");
  const std::string mpirun2 = mpirun_shardgrad(2), mpirun1 = mpirun_shardgrad(1);
  CHECK(max_rel(losses(mpirun2, "--device cuda:0 --strategy ddp", dir, "ddp"), one, "ddp, 2 ranks on cuda:0 (mpi)") < 1e-5);
  CHECK(max_rel(losses(mpirun2, "--device cuda:0 --strategy zero3", dir, "zero3"), one, "zero3, 2 ranks on cuda:0 (mpi)") <
        1e-5);
  CHECK(max_rel(losses(mpirun1, "--device cuda --backend nccl --strategy ddp", dir, "nccl"), one,
                "ddp, 1 rank over nccl") < 1e-5);
  // the optimizer offloaded to the host (pinned buffers both ways): zero2 (ZeRO-Offload), zero3
  // and zero3 with its parameter shards on the host too; bf16 against bf16 without offload. AdamW
  // then runs on the CPU: f32 rounding of another kernel, as the CPU-vs-GPU bound above
  for (const char* off : {"zero2 --offload optimizer", "zero3 --offload optimizer", "zero3 --offload params"})
    CHECK(max_rel(losses(mpirun2, std::string("--device cuda:0 --strategy ") + off, dir, "offload"), one, off) < 1e-4);
  const auto bf16 = losses(mpirun2, "--device cuda:0 --dtype bf16 --strategy zero2", dir, "bf16");
  CHECK(max_rel(losses(mpirun2, "--device cuda:0 --dtype bf16 --strategy zero2 --offload optimizer", dir, "bf16_off"),
                bf16, "zero2 bf16 offloaded vs not") < 3e-3);
}

TEST_CASE("generate samples on cuda:0 as on the CPU (f32, greedy) and runs in bf16 with its KV cache", "[gpu][generate]") {
  ScratchDir dir("gpu_generate");
  const std::string save = (dir.path / "run").string();
  const CommandResult t = run_shell(single + " train --steps 60 --eval-every 0 --threads 2 --save '" + save + "'");
  INFO(t.output);
  REQUIRE(t.code == 0);
  // 40 new tokens: the prompt goes through the fused attention, each token after it through the cache.
  const std::string gen = single + " generate --from '" + save + "' --prompt 123+456= --max-new-tokens 40 --temperature 0";
  const CommandResult cpu = run_shell(gen), gpu = run_shell(gen + " --device cuda:0"),
                      bf16 = run_shell(gen + " --device cuda:0 --dtype bf16");
  std::printf("generate: cpu %s         cuda:0 %s         cuda:0 bf16 %s", cpu.output.c_str(), gpu.output.c_str(),
              bf16.output.c_str());
  INFO(cpu.output << gpu.output << bf16.output);
  REQUIRE(cpu.code == 0);
  REQUIRE(gpu.code == 0);
  REQUIRE(bf16.code == 0);
  CHECK(gpu.output == cpu.output);
  CHECK(bf16.output.rfind("123+456=", 0) == 0);
}

TEST_CASE("eval and train --hellaswag score on cuda:0 as on the CPU (f32), and run in bf16", "[gpu][eval]") {
  ScratchDir dir("gpu_eval");
  const std::string save = (dir.path / "run").string(), file = std::string(SG_SOURCE_DIR) + "/tests/golden/hellaswag_tiny.bin";
  const std::string train = single + " train --data random:61 --n-layer 2 --n-head 4 --n-embd 32 --block-size 16 "
                            "--seq-len 16 --batch-size 8 --threads 2 --steps 4 --eval-every 0 --hellaswag '" + file + "'";
  const CommandResult t = run_shell(train + " --save '" + save + "'"), tg = run_shell(train + " --device cuda:0");
  INFO(t.output << tg.output);
  REQUIRE(t.code == 0);
  REQUIRE(tg.code == 0);
  // the training run's last evaluation: the same answers on the GPU (same data, losses close)
  const auto score = [](const std::string& out) {
    const size_t at = out.rfind(" | hellaswag ");
    return at == std::string::npos ? std::string("none") : out.substr(at, out.find('\n', at) - at);
  };
  CHECK(score(tg.output) == score(t.output));
  const auto eval = [&](const std::string& flags, const char* tag) {
    const auto log = dir.path / (std::string(tag) + ".jsonl");
    const CommandResult r = run_shell(single + " eval --from '" + save + "' --hellaswag '" + file + "' --log-json '" +
                                      log.string() + "' " + flags);
    INFO(r.output);
    REQUIRE(r.code == 0);
    return read_json_lines(log);
  };
  const auto cpu = eval("", "cpu"), gpu = eval("--device cuda:0", "gpu"), bf16 = eval("--device cuda:0 --dtype bf16", "bf16");
  REQUIRE(cpu.size() == 17);
  REQUIRE(gpu.size() == 17);
  double worst = 0;
  for (size_t i = 0; i < 16; ++i) {
    CHECK(gpu[i]["chosen"] == cpu[i]["chosen"]);
    const auto a = gpu[i]["mean_loss"].get<std::vector<double>>(), b = cpu[i]["mean_loss"].get<std::vector<double>>();
    for (size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::fabs(a[k] - b[k]) / b[k]);
  }
  std::printf("eval on cuda:0 (f32): largest relative difference of an ending's mean loss from the CPU's: %.3g\n", worst);
  CHECK(worst < 1e-4);
  CHECK(bf16.back()["examples"] == 16);
}

int main(int argc, char** argv) {
  if (sg::cuda::device_count() == 0) {
    std::printf("no CUDA device: the GPU training tests are skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
