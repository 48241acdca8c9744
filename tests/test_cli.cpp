// The shardgrad executable as a user runs it: resume reproduces the uninterrupted losses, flags
// are validated, checkpoints are never overwritten, generate reads what train wrote.
#include "tests/catch.h"
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "autograd/ops.h"
#include "io/gpt2_tokenizer.h"
#include "io/multiple_choice.h"
#include "io/safetensors.h"
#include "io/token_shards.h"
#include "parallel/checkpoint.h"
#include "parallel/sharded_checkpoint.h"
#include "kernels/ops.h"
#include "tests/cli_support.h"

namespace fs = std::filesystem;

namespace {

using Run = sg::testing::CommandResult;
Run run_command(const std::string& cmdline, double* seconds = nullptr) { return sg::testing::run_shell(cmdline, seconds); }
std::vector<nlohmann::json> read_log(const fs::path& p) { return sg::testing::read_json_lines(p); }
Run shardgrad(const std::string& args) { return run_command(std::string(SG_BINARY) + " " + args); }

// dir/<prefix><n>.jsonl (built with append: GCC 12's -Wrestrict misfires on "x" + std::string).
template <class N>
std::filesystem::path log_path(const sg::testing::ScratchDir& d, const char* prefix, const N& n) {
  std::string name(prefix);
  if constexpr (std::is_convertible_v<N, std::string>) name.append(n);
  else name.append(std::to_string(n));
  return d.path / name.append(".jsonl");
}

// The command fails, and its output says why in these words.
// code: the exit status expected, or any but 0 when -1
void refuses(const std::string& cmd, const std::string& text, int code = -1) {
  Run r = run_command(cmd);
  INFO(cmd << "\n" << r.output);
  REQUIRE(r.code != 0);
  REQUIRE(r.output.find(text) != std::string::npos);
  if (code >= 0) CHECK(r.code == code);
}

struct TempDir : sg::testing::ScratchDir {
  TempDir() : ScratchDir("cli_dir_" + std::to_string(std::rand())) {}
};

// A few-second configuration of the default run.
const std::string kSmall = "--n-layer 1 --n-embd 32 --n-head 2 --seq-len 32 --batch-size 8 --micro-batch-size 4 "
                           "--threads 1 --eval-every 0 --eval-batches 1 --eval-problems 8 --dropout 0.1";

}  // namespace

TEST_CASE("resume continues with exactly the losses of the uninterrupted run", "[cli]") {
  TempDir d;
  Run full = shardgrad("train " + kSmall + " --steps 8 --save-every 4 --save " + (d.path / "a").string() +
                       " --log-json " + (d.path / "a.jsonl").string());
  INFO(full.output);
  REQUIRE(full.code == 0);
  REQUIRE(fs::exists(d.path / "a" / "step_00000004" / "index.json"));
  REQUIRE(fs::exists(d.path / "a" / "step_00000008" / "rank_00000.safetensors"));
  Run resumed = shardgrad("train " + kSmall + " --steps 8 --resume " + (d.path / "a" / "step_00000004").string() +
                          " --log-json " + (d.path / "b.jsonl").string());
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  auto a = read_log(d.path / "a.jsonl"), b = read_log(d.path / "b.jsonl");
  REQUIRE(a.size() == 8);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    REQUIRE(b[i]["step"] == a[i + 4]["step"]);
    REQUIRE(b[i]["loss"].get<double>() == a[i + 4]["loss"].get<double>());  // bit-exact
  }
  // the log has what a dashboard needs
  for (const char* k : {"step", "loss", "lr", "step_ms", "tokens_per_s", "mem"}) REQUIRE(a[0].contains(k));
  REQUIRE(a[0]["mem"]["param"]["current"].get<int64_t>() > 0);
}

TEST_CASE("an f32 run resumed from a bf16 checkpoint starts from its f32 masters, in one process and under zero3", "[cli][mpi]") {
  TempDir d;
  const std::string a = (d.path / "a").string(), b = (d.path / "b").string(), c = (d.path / "c").string();
  Run half = shardgrad("train " + kSmall + " --dtype bf16 --steps 3 --save " + a);
  INFO(half.output);
  REQUIRE(half.code == 0);
  // one more step at a learning rate too small to move an f32 weight: what it saves is what it loaded
  const std::string step = " --dtype fp32 --steps 4 --lr 1e-30 --lr-schedule constant --warmup-steps 0 --save ";
  Run wide = shardgrad("train --resume " + a + step + b);
  INFO(wide.output);
  REQUIRE(wide.code == 0);
  // zero3 loads its shards from the masters too (it took the parameter, rounded)
  Run sharded = run_command(sg::testing::mpirun_shardgrad(2) + " train --resume " + a + " --strategy zero3" + step + c);
  INFO(sharded.output);
  REQUIRE(sharded.code == 0);
  auto from = sg::ckpt::open_checkpoint(a), to = sg::ckpt::open_checkpoint(b), to3 = sg::ckpt::open_checkpoint(c);
  int rounded_apart = 0;
  for (const std::string& n : to->names()) {
    if (!from->has(n + ".master")) continue;
    INFO(n);
    const std::vector<float> master = sg::to_vector<float>(from->tensor(n + ".master"));
    REQUIRE(sg::to_vector<float>(to->tensor(n)) == master);
    REQUIRE(sg::to_vector<float>(to3->tensor(n)) == master);
    rounded_apart += sg::to_vector<float>(sg::to(from->tensor(n), sg::DType::f32)) != master;
  }
  CHECK(rounded_apart > 0);  // the bf16 weights are not the masters: the check above could tell them apart
  // export writes the masters too, in f32
  const std::string file = (d.path / "hf" / "model.safetensors").string();
  REQUIRE(shardgrad("export " + a + " --out " + file).code == 0);
  const sg::io::SafetensorsFile f = sg::io::load_safetensors(file);
  const sg::Tensor& fc = f.at("h.0.mlp.c_fc.weight");  // Conv1D: [in, out], the master transposed
  CHECK(fc.dtype() == sg::DType::f32);
  CHECK(sg::to_vector<float>(sg::contiguous(sg::transpose(fc, 0, 1))) ==
        sg::to_vector<float>(from->tensor("h.0.mlp.c_fc.weight.master")));
}

// The run state records argv and paths in JSON, which holds UTF-8 only: a Latin-1 byte in a path
// made every save fail after the training (and launch restart it, to fail the same way).
TEST_CASE("a --save path that is not UTF-8 saves and resumes", "[cli]") {
  TempDir d;
  const std::string save = (d.path / "caf\xe9").string();
  Run first = shardgrad("train " + kSmall + " --steps 3 --stop-at 2 --save '" + save + "'");
  INFO(first.output);
  REQUIRE(first.code == 0);
  REQUIRE(fs::exists(fs::path(save) / "step_00000002" / "index.json"));
  Run rest = shardgrad("train " + kSmall + " --steps 3 --resume auto --save '" + save + "'");
  INFO(rest.output);
  REQUIRE(rest.code == 0);
  CHECK(fs::exists(fs::path(save) / "step_00000003" / "index.json"));
}

TEST_CASE("train refuses bad flags, missing files and existing checkpoints, naming them", "[cli]") {
  TempDir d;
  // train's refusals come before its first step: exit status 64, which launch does not restart
  auto fails_with = [](const std::string& args, const std::string& text) {
    refuses(std::string(SG_BINARY) + " " + args, text, args.rfind("train", 0) == 0 ? 64 : -1);
  };
  fails_with("train --steps ten", "--steps expects an integer, got 'ten'");
  // an unknown flag names the declared one it likely meant: a few edits away, or the start of it
  fails_with("train --stepz 10", "unknown flag --stepz; did you mean --steps? (see shardgrad train --help)");
  fails_with("train --stpes 10", "unknown flag --stpes; did you mean --steps?");
  fails_with("train --stop-after 10", "unknown flag --stop-after; did you mean --stop-at?");
  fails_with("train --warmup 10", "unknown flag --warmup; did you mean --warmup-steps?");
  fails_with("train --until 10", "unknown flag --until (see shardgrad train --help)");  // nothing near: no guess
  fails_with("train --batch-size 8 --micro-batch-size 3", "--micro-batch-size 3 does not divide --batch-size 8");
  fails_with("train --save " + (d.path / "k").string() + " --keep 4294967297", "--keep must be in [0, 2147483647] (0 = all), got 4294967297");
  fails_with("train --shuffle", "--shuffle draws a file's rows at random; --data synthetic is generated");
  fails_with("train --device meta", "--device meta holds no values (it sizes a layout): use train --simulate N");
  fails_with("train --strategy dp --devices cpu:0,meta", "--devices cpu:0,meta: meta holds no values");
  fails_with("train --strategy dp --devices cpu:0,", "--devices cpu:0,: an empty entry after the last comma");
  fails_with("train --strategy dp --devices 'cpu:0, gpu:1'", "--devices cpu:0, gpu:1: ");
  fails_with("train --strategy dp --tp 2", "--strategy dp (replicas on the devices of one process) does not compose with --tp");
  fails_with("train --simulate 2 --tp 2 --sequence-parallel",
             "rows of 13 tokens (the synthetic task's problem length; no --seq-len given) do not split over --tp 2: give "
             "--seq-len 14");
  fails_with("train --sequence-parallel --strategy zero2 --grad-accumulation sharded", "--sequence-parallel needs --tp > 1");
  {  // the synthetic task's samples start from a whole problem (16 tokens were less than a 5-digit
     // one: the run failed at its final evaluation, after the training, its checkpoint unsaved)
    Run r = shardgrad("train " + kSmall + " --data synthetic:5 --steps 2 --sample-tokens 4 --save " +
                      (d.path / "syn5").string());
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(r.output.find("tokens after \"") != std::string::npos);
    CHECK(fs::exists(d.path / "syn5" / "step_00000002"));
  }
  {  // 2,000 bytes: 200 held out, fewer than 10 batches of 2 x 16 in order need (321)
    std::ofstream(d.path / "short.txt") << std::string(2000, 'a');
    fails_with("train --data " + (d.path / "short.txt").string() + " --batch-size 2 --seq-len 16 --eval-batches 10",
               "--eval-batches 10 of 2 x 16 tokens need 321 held-out tokens in order");
  }
  fails_with("train --n-head 5 --n-embd 64", "not divisible by n_head 5");
  fails_with("train --data /nonexistent/file.txt", "/nonexistent/file.txt");
  fails_with("train --steps 1 --comm-timeout 0", "--comm-timeout must be > 0");  // one process checks it too
  fails_with("train --resume " + (d.path / "nothing").string(), "does not exist");
  fails_with("train --model gpt5", "unknown preset 'gpt5'");
  fails_with("train --lr-schedule step", "unknown schedule 'step' (expected constant, cosine, linear or wsd)");
  fails_with("frobnicate", "unknown command 'frobnicate'");
  fails_with("train --strategy ddp --backend gloo", "--backend must be mpi or nccl, got 'gloo'");
  fails_with("train --strategy ddp --backend nccl", "--backend nccl carries CUDA tensors: pass --device cuda");
  fails_with("train --backend nccl", "--backend nccl is for multi-rank strategies");
  fails_with("train --strategy ddp --rendezvous tcp://x", "--rendezvous tcp://x: expected tcp:HOST:PORT");
  fails_with("train --strategy ddp --rendezvous nccl", "--rendezvous must be mpi, file:PATH or tcp:HOST:PORT, got 'nccl'");
  // an error found after MPI started, in a process no launcher started: one line, no MPI_Abort banner
  {
    Run r = shardgrad("train --tp 2 --steps 1");
    INFO(r.output);
    CHECK(r.code == 64);  // refused before the first step (launch does not restart it)
    CHECK(r.output == "shardgrad train: error: train: --tp 2 x --pp 1 = 2 ranks per model replica does not divide the 1 "
                      "ranks launched\n");
  }
  // a flag of another strategy or layout is refused, not ignored
  fails_with("train --prefetch both", "--prefetch is for the fsdp family (zero3, fsdp, fsdp-grad-op, hsdp, no-shard); "
             "this run is --strategy single");
  fails_with("train --strategy zero3 --bucket-mb 5", "--bucket-mb is for ddp, zero1 and zero2; this run is --strategy zero3");
  fails_with("train --strategy zero3 --shard-group-size 2", "--shard-group-size is for --strategy hsdp");
  fails_with("train --virtual-stages 2", "--virtual-stages is for pipelines (--pp > 1)");
  fails_with("train --strategy zero1 --find-unused-parameters", "--find-unused-parameters is for --strategy ddp");
  fails_with("train --strategy zero1 --grad-accumulation unsharded", "--grad-accumulation is for zero2 and the fsdp "
             "family (ddp and zero1 accumulate full gradients); this run is --strategy zero1");
  fails_with("train --strategy zero3 --pp 2 --grad-accumulation unsharded", "--grad-accumulation unsharded (FSDP's "
             "no_sync) is not for pipelines");
  fails_with("train --strategy zero2 --grad-accumulation local", "--grad-accumulation must be sharded or unsharded, got 'local'");
  fails_with("train --strategy zero2 --pp 2 --grad-accumulation sharded", "--grad-accumulation sharded needs every "
             "gradient complete after each micro-batch's backward; under --pp zero2 sums some across stages after the "
             "last one and reduces once a step (unsharded)");
  fails_with("train --devices cpu:0,cpu:1", "--devices is for --strategy dp (one process, several devices)");
  fails_with("train --save-every 5", "--save-every needs --save DIR");
  fails_with("train --eval-problems 0", "--eval-problems must be >= 1, got 0");  // not after the last step
  fails_with("train --block-size 5", "rows of T=5 tokens are shorter than one 3-digit problem (13 tokens)");
  // what could never fit this machine's memory (RAM and swap) is refused before anything is built,
  // naming what sizes it: a model too large (2.6 PB), one of many small layers (18 TiB: it grew a
  // layer at a time until the OOM killer came), a batch too large (a bare bad_alloc in the first step)
  fails_with("train --vocab-size 10000000000000", "train: a rank needs at least ");
  fails_with("train --vocab-size 10000000000000", "the model's 640000000104192 parameters in f32 (2 layers, width 64, "
             "vocab 10000000000000): 2384185.79 GiB");
  fails_with("train --n-layer 100000000", "the model's 4998400008320 parameters in f32 (100000000 layers, width 64, "
             "vocab 13): 18620.49 GiB");
  fails_with("train --batch-size 1099511627776", "a step's token ids (--batch-size 1099511627776 x --seq-len 13): "
             "212992.00 GiB; one micro-batch's logits (--micro-batch-size 1099511627776 x --seq-len 13 x 64 vocabulary "
             "rows): 3407872.00 GiB");
  fails_with("train --n-embd 4000000000 --n-head 1", "model: about 4.16e+20 parameters (2 layers, width 4000000000");
#ifndef __SANITIZE_ADDRESS__  // ASan's shadow memory needs more address space than any such limit
  // past the process's own limit (1.2 GB) but not the machine's: the allocator's refusal, with the size
  refuses("ulimit -v 1200000 && " + std::string(SG_BINARY) + " train --n-embd 2048 --n-head 4 --n-layer 8 --steps 1",
          "train: the model's 403132416 parameters (8 layers, width 2048, vocab 13) in f32 on cpu do not fit: cpu "
          "allocator: out of memory allocating", 64);
#endif
  // train's own dtypes, and a fault that could never fire
  fails_with("train --dtype fp8", "--dtype must be fp32, bf16 or fp16, got 'fp8'");
  fails_with("train --strategy ddp --inject-fault rank=5,step=2,kind=exit", "--inject-fault rank=5: the job has 1 rank");
  fails_with("train --steps 5 --inject-fault rank=0,step=20,kind=exit", "--inject-fault step=20: the run has 5 steps");
  fails_with("train --steps 5 --inject-fault rank=0,step=3,kind=exit,during=save --save " + (d.path / "nosave").string(),
             "--inject-fault step=3,during=save: that step saves no checkpoint");
  fails_with("train --steps 5 --inject-fault rank=0,step=3,kind=slow,seconds=2,during=load",
             "--inject-fault during=load: the run resumes no checkpoint");
  fails_with("train --steps 5 --inject-fault rank=0,step=3,kind=slow", "--inject-fault: kind slow needs seconds=N > 0");
  fails_with("train --steps 5 --inject-fault rank=0,step=3,kind=hang,seconds=2", "--inject-fault: seconds=N is for kind slow");
  fails_with("train --steps 5 --inject-fault rank=0,step=3,kind=exit,during=eval", "during 'eval' is not 'save' or 'load'");
  fails_with("train --steps 1 --checkpoint-timeout -1", "--checkpoint-timeout must be >= 0 (0: --comm-timeout's), got -1");
  fails_with("plan --model gpt2 --dp 8 --gpu-memory -1", "--gpu-memory must be > 0, got -1");
  {
    // a held-out split too small for the final evaluation is refused before training, not after it
    const std::string small = (d.path / "small.txt").string();
    std::ofstream(small) << "hello world";
    Run r = shardgrad("train --data " + small + " --seq-len 4 --batch-size 2 --steps 2 --eval-every 0");
    INFO(r.output);
    CHECK(r.code != 0);
    CHECK(r.output.find("data " + small + ": the val split has 1 tokens, fewer than one batch needs (B*T+1 = 9)") !=
          std::string::npos);
    CHECK(r.output.find("| loss") == std::string::npos);
  }
  {
    // --rendezvous file: (no MPI): the NCCL world from the file is the job's group; RANK and
    // WORLD_SIZE come from the launcher and are refused by name when missing or wrong.
    const std::string id = (d.path / "id").string();
    fails_with("train --strategy ddp --rendezvous file:" + id, "--rendezvous file:" + id + " needs --backend nccl");
    fails_with("train --strategy ddp --rendezvous tcp:localhost:29500", "--rendezvous tcp:localhost:29500 needs --backend nccl");
    fails_with("train --strategy ddp --backend nccl --device cuda --rendezvous file:", "needs a path (file:PATH)");
    const std::string file_train =
        std::string(SG_BINARY) + " train --strategy ddp --backend nccl --device cuda --rendezvous file:" + id;
    const std::string no_env = "env -u RANK -u WORLD_SIZE -u LOCAL_RANK ";
    refuses(no_env + file_train, "--rendezvous file: needs RANK in the environment");
    refuses(no_env + "RANK=0 " + file_train, "--rendezvous file: needs WORLD_SIZE in the environment");
    refuses(no_env + "RANK=2 WORLD_SIZE=2 " + file_train, "rank 2: error: --rendezvous file: RANK 2 is not below WORLD_SIZE 2");
    refuses(no_env + "RANK=one WORLD_SIZE=2 " + file_train, "RANK='one' is not a non-negative integer");
    const std::string tcp_train =
        std::string(SG_BINARY) + " train --strategy ddp --backend nccl --device cuda --rendezvous tcp:localhost:29500";
    refuses(no_env + "WORLD_SIZE=2 " + tcp_train, "--rendezvous tcp: needs RANK in the environment");
    // without a GPU (CI) this is refused by name; with one, world size 1 trains a step without MPI
    // (head dim 64: what the CUDA attention takes)
    Run r = run_command(no_env + "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 " + file_train +
                        " --steps 1 --n-layer 1 --n-embd 64 --n-head 1 --seq-len 32 --batch-size 8 --threads 1 "
                        "--eval-every 0");
    INFO(r.output);
    if (r.code != 0) REQUIRE(r.output.find("rank 0 sees no CUDA device") != std::string::npos);
    else REQUIRE_FALSE(fs::exists(id));  // rank 0 removes the file once every rank has joined
  }
#ifdef SG_WITH_CUDA
  // A kernel variant named in the environment (kernels/cuda/variants.h) is read when the CUDA
  // backend starts, GPU or not: an unknown name is refused naming the variable and what it takes.
  refuses("SG_CLASSIFIER=bogus " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_CLASSIFIER=bogus: not a variant; one of streaming, staged, reversed");
  refuses("SG_NORM_BACKWARD=registers " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_NORM_BACKWARD=registers: not a variant; one of fused, smem, smem_ahead, split");
  refuses("SG_EMBEDDING_BACKWARD=rows " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_EMBEDDING_BACKWARD=rows: not a variant; one of columns, packs");
  refuses("SG_FLASH_BACKWARD=four " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_FLASH_BACKWARD=four: not a variant; one of free, dq_three, three");
  refuses("SG_FLASH_FORWARD=keys16 " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_FLASH_FORWARD=keys16: not a variant; one of keys32, keys64");
#endif
#ifdef SG_WITH_CUDNN
  refuses("SG_DQ_ACCUMULATOR=zero " + std::string(SG_BINARY) + " train --device cuda --steps 1 " + kSmall,
          "SG_DQ_ACCUMULATOR=zero: not a variant; one of memset, engine, poisoned");
#endif
  {
    // without a GPU (CI) the NCCL backend is refused by name; with one this one-step run succeeds
    Run r = shardgrad("train --strategy ddp --backend nccl --device cuda --steps 1 " + kSmall);
    INFO(r.output);
    if (r.code != 0) REQUIRE(r.output.find("sees no CUDA device") != std::string::npos);
  }
  {
    // an output file's folder is made first; one that cannot be (inside a file) is refused before
    // the first step, naming the flag
    std::ofstream(d.path / "a_file") << "x";
    for (const char* flag : {"--log-json", "--trace", "--timeline"}) {
      Run r = shardgrad("train " + kSmall + " --steps 1 " + flag + " " + (d.path / "a_file" / "out").string());
      INFO(r.output);
      CHECK(r.code != 0);
      CHECK(r.output.find(std::string("train: ") + flag + " " + (d.path / "a_file" / "out").string() +
                          ": cannot create the folder") != std::string::npos);
      CHECK(r.output.find("| loss") == std::string::npos);
    }
    const fs::path log = d.path / "logs" / "a" / "log.jsonl", trace = d.path / "traces" / "t.json";
    Run r = shardgrad("train " + kSmall + " --steps 1 --log-json " + log.string() + " --trace " + trace.string());
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(sg::testing::read_json_lines(log).size() == 1);
    CHECK(fs::exists(trace));
  }
  // a run directory is never overwritten
  std::string save = (d.path / "run").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 1 --save " + save).code == 0);
  auto before = fs::last_write_time(fs::path(save) / "step_00000001" / "index.json");
  fails_with("train " + kSmall + " --steps 1 --save " + save, "already holds a run");
  REQUIRE(fs::last_write_time(fs::path(save) / "step_00000001" / "index.json") == before);
  // a checkpoint of another shape is refused by name
  fails_with("train " + kSmall + " --steps 2 --n-layer 2 --resume " + save, "--n-layer 2 does not match the checkpoint");
  // resume is strict: the same checkpoint rewritten with one tensor more (a valid index, its own
  // bytes) is refused naming it; rewritten as it was, it resumes
  auto rewrite = [&](const std::string& to, bool extra, const std::string& drop_state = "",
                     const std::string& n_head = "", const nlohmann::json& patch = nullptr) {
    auto ck = sg::ckpt::open_checkpoint(save);
    std::vector<sg::ckpt::Piece> pieces;
    for (const std::string& n : ck->names()) {
      sg::Tensor t = ck->tensor(n);
      for (auto& p : sg::ckpt::pieces_of(sg::ckpt::whole_view(n, t.shape()), t)) pieces.push_back(std::move(p));
    }
    if (extra) {
      sg::Tensor a = sg::from_vector<float>({1, 2, 3, 4}, {4});
      for (auto& p : sg::ckpt::pieces_of(sg::ckpt::whole_view("h.0.adapter.bias", a.shape()), a)) pieces.push_back(std::move(p));
    }
    nlohmann::json state = ck->state();
    if (!drop_state.empty()) state.erase(drop_state);
    if (!patch.is_null()) state.merge_patch(patch);
    auto metadata = ck->metadata();
    if (!n_head.empty()) metadata["n_head"] = n_head;
    sg::ckpt::write_rank_shard(to, 1, 0, pieces);
    sg::ckpt::commit_sharded(to, 1, 1, state, metadata);
  };
  const std::string same = (d.path / "same").string(), more = (d.path / "more").string();
  rewrite(same, false);
  rewrite(more, true);
  Run resumed = shardgrad("train " + kSmall + " --steps 2 --resume " + same);
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  fails_with("train " + kSmall + " --steps 2 --resume " + more,
             "holds 1 tensor that a GPT-2 of 1 layer and its optimizer state do not: 'h.0.adapter.bias'");
  // a checkpoint resumed into a folder holding another run's: the two runs' steps would mix
  fails_with("train " + kSmall + " --steps 2 --resume " + same + " --save " + save, "--save " + save + " already holds a run");
  // a fault or a profile at a step the checkpoint (step 1) is past would never happen
  fails_with("train " + kSmall + " --steps 2 --resume " + same + " --inject-fault rank=0,step=1,kind=exit",
             "--inject-fault step=1: the run resumes after the checkpoint's step 1, so it would never fire");
  fails_with("train " + kSmall + " --steps 2 --resume " + same + " --profile-ops 1",
             "--profile-ops 1: the run resumes after the checkpoint's step 1");
  // a manifest with a field lost, or metadata of no valid model, names the checkpoint
  const std::string lost = (d.path / "lost").string(), heads = (d.path / "heads").string();
  rewrite(lost, false, "train_position");
  rewrite(heads, false, "", "3");
  fails_with("train " + kSmall + " --steps 2 --resume " + lost, "train: checkpoint " + lost);
  fails_with("train " + kSmall + " --steps 2 --resume " + lost, "its training state is malformed");
  fails_with("train " + kSmall + " --steps 2 --resume " + heads, "checkpoint " + heads);
  fails_with("train " + kSmall + " --steps 2 --resume " + heads, "n_embd 32 is not divisible by n_head 3");
  // a hand-edited flag of another type is named, not a JSON library's message
  const std::string typed = (d.path / "typed").string();
  rewrite(typed, false, "", "", {{"train_flags", {{"seed", 6}}}});
  fails_with("train --steps 2 --resume " + typed, "its training state is malformed: train_flags.seed is 6, not a string");
  fails_with("train --steps 2 --resume " + typed, "train: checkpoint " + typed);
  // --resume auto in a folder where a run failed before its first save (only a temporary step) starts at 0
  const fs::path failed = d.path / "failed";
  fs::create_directories(failed / ".tmp-step_00000002");
  Run fresh = shardgrad("train " + kSmall + " --steps 1 --resume auto --save " + failed.string());
  INFO(fresh.output);
  REQUIRE(fresh.code == 0);
  CHECK(fresh.output.find("--resume auto: no checkpoint in " + failed.string() + " yet; starting from step 0") !=
        std::string::npos);
  CHECK(fs::exists(failed / "step_00000001" / "index.json"));
  CHECK(!fs::exists(failed / ".tmp-step_00000002"));  // the unfinished save is gone
  CHECK(fresh.output.find("removed 1 unfinished save from " + failed.string()) != std::string::npos);
}

// --help gives a flag's default only when it has one: an empty default is "not given", which the
// help words itself; printed as "none" it read as a value (bench --report none turns the report off).
TEST_CASE("help shows defaults only for flags that have one", "[cli]") {
  Run bench = shardgrad("bench --help");
  INFO(bench.output);
  REQUIRE(bench.code == 0);
  CHECK(bench.output.find("(default: none)") == std::string::npos);
  CHECK(bench.output.find("  --report\n      write the HTML report here (default: PREFIX.html of --out; none: no report)") !=
        std::string::npos);
  CHECK(bench.output.find("  --layouts\n      comma-separated names from the default matrix (default: all)") != std::string::npos);
  CHECK(bench.output.find("  --steps (default: 10)\n") != std::string::npos);
  // elsewhere "none" is shown where it is the value (train --recompute none), and a file not given by default is bare
  for (const auto& [command, line] : std::vector<std::pair<std::string, std::string>>{
           {"train", "  --save\n      run directory"}, {"train", "  --recompute (default: none)\n"},
           {"plan", "  --svg\n      pipeline simulation"}, {"export", "  --out\n      the .safetensors file"}}) {
    Run r = shardgrad(command + " --help");
    INFO(command << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK(r.output.find(line) != std::string::npos);
  }
}

TEST_CASE("train --profile-ops N prints and logs step N's op-table calls by entry and leaves the losses alone", "[cli]") {
  TempDir d;
  const std::string common = "train " + kSmall + " --steps 3 --log-json ";
  Run plain = shardgrad(common + (d.path / "plain.jsonl").string());
  Run profiled = shardgrad(common + (d.path / "profiled.jsonl").string() + " --profile-ops 2");
  INFO(profiled.output);
  REQUIRE(plain.code == 0);
  REQUIRE(profiled.code == 0);
  REQUIRE(profiled.output.find("op profile, step 2 on cpu") != std::string::npos);
  REQUIRE(profiled.output.find("outside the op table") != std::string::npos);
  auto a = read_log(d.path / "plain.jsonl"), b = read_log(d.path / "profiled.jsonl");
  REQUIRE(a.size() == 3);
  REQUIRE(b.size() == 3);
  for (size_t i = 0; i < 3; ++i) REQUIRE(b[i]["loss"].get<double>() == a[i]["loss"].get<double>());  // bit-exact
  CHECK_FALSE(b[0].contains("op_profile"));
  CHECK_FALSE(b[2].contains("op_profile"));
  const nlohmann::json& ops = b[1]["op_profile"];
  // kSmall: 1 layer (4 linears + the tied head: 1 GEMM forward, 2 backward each), 2 micro-batches
  CHECK(ops["gemm"]["calls"] == 2 * 3 * 5);
  CHECK(ops["attention_backward"]["calls"] == 2);
  CHECK(ops["adamw_many"]["calls"] == 1);
  CHECK(ops["gemm"]["flops"].get<double>() > 0);
  CHECK(ops["adamw_many"]["flops"].get<double>() == 0);
  REQUIRE(profiled.output.find("GFLOP/s") != std::string::npos);
  double host = 0;
  for (const auto& [name, o] : ops.items()) host += o["host_ms"].get<double>();
  CHECK(host > 0);
  CHECK(host <= b[1]["step_ms"].get<double>());
  refuses(std::string(SG_BINARY) + " train --profile-ops -1", "--profile-ops must be a step number");
  refuses(std::string(SG_BINARY) + " train --steps 3 --profile-ops 4", "from 1 to --steps (3) or 0, got 4");
  refuses(std::string(SG_BINARY) + " train --strategy dp --profile-ops 1", "--strategy dp runs its replicas");
}

TEST_CASE("a run resumed at another batch size goes on with the next rows, none skipped or repeated", "[cli]") {
  TempDir d;
  // Weights frozen by a learning rate too small to move them: a step's loss names the rows it read,
  // and a batch of 16 rows has the mean loss of the two batches of 8 that held them.
  const std::string frozen = "train --n-layer 1 --n-embd 32 --n-head 2 --seq-len 32 --threads 1 --eval-every 0 "
                             "--eval-problems 8 --eval-batches 1 --steps 12 --lr 1e-30 --lr-schedule constant "
                             "--warmup-steps 0 --batch-size 8 ";
  const std::string readme = std::string(SG_SOURCE_DIR) + "/README.md";
  int k = 0;
  for (const std::string& data : std::vector<std::string>{"", "--data random:61 ", "--data " + readme + " --shuffle "}) {
    INFO(data);
    const std::string save = (d.path / ("s" + std::to_string(++k))).string();
    const fs::path whole = log_path(d, "whole", k), resumed = log_path(d, "resumed", k);
    Run a = shardgrad(frozen + data + "--log-json " + whole.string());
    Run b = shardgrad(frozen + data + "--save " + save + " --stop-at 3");
    Run c = shardgrad("train --resume " + save + " --batch-size 16 --stop-at 4 --log-json " + resumed.string());
    INFO(a.output << b.output << c.output);
    REQUIRE((a.code == 0 && b.code == 0 && c.code == 0));
    const auto ref = read_log(whole), got = read_log(resumed);
    REQUIRE(ref.size() == 12);
    REQUIRE(got.size() == 1);
    REQUIRE(got[0]["step"] == 4);
    const auto loss = [&](size_t step) { return ref[step - 1]["loss"].get<double>(); };
    const double want = (loss(4) + loss(5)) / 2, skipped = (loss(7) + loss(8)) / 2;  // rows 24-39; 48-63
    CHECK(std::abs(got[0]["loss"].get<double>() - want) <= 1e-5 * want);
    // other rows give another loss, farther off than the check above allows: it can tell them apart
    // (README.md's rows change with its text: a margin of 1e-4 once failed by chance)
    CHECK(std::abs(skipped - want) > 1e-5 * want);
  }
}

TEST_CASE("resume takes the run's data, batch, schedule and seed from the checkpoint, and a flag given wins", "[cli]") {
  TempDir d;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i * 7919 % 1000) + ": the quick brown fox.\n";
  const std::string data = (d.path / "in.txt").string(), run = (d.path / "run").string();
  std::ofstream(data) << text;
  // none of these is train's default; the layout and thread flags are not the run's and are not kept
  const std::string flags = "--data " + data + " --shuffle --seq-len 24 --batch-size 6 --lr 3e-3 --warmup-steps 2 "
                            "--weight-decay 0.05 --seed 7 --dropout 0.1 --steps 6 --eval-every 0 --eval-batches 1";
  Run full = shardgrad("train " + flags + " --n-layer 1 --n-embd 32 --n-head 2 --threads 1 --save-every 2 --save " + run +
                       " --log-json " + (d.path / "full.jsonl").string());
  INFO(full.output);
  REQUIRE(full.code == 0);
  // from step 2 with nothing but the checkpoint (and a save into the same run), then from step 4
  // of that resumed run: the flags travel with the checkpoints
  Run r1 = shardgrad("train --resume " + run + "/step_00000002 --threads 1 --save-every 2 --save " + (d.path / "r").string() +
                     " --log-json " + (d.path / "r1.jsonl").string());
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  REQUIRE(r1.output.find("with the run's --data " + data + " --shuffle --seq-len 24 --dropout 0.1 --batch-size 6 --steps 6") != std::string::npos);
  REQUIRE(r1.output.find("not checkpointed") == std::string::npos);
  Run r2 = shardgrad("train --resume " + (d.path / "r" / "step_00000004").string() + " --threads 1 --log-json " +
                     (d.path / "r2.jsonl").string());
  INFO(r2.output);
  REQUIRE(r2.code == 0);
  REQUIRE(r2.output.find("no --save: the steps after 4 are not checkpointed") != std::string::npos);
  Run done = shardgrad("train --resume " + run + " --threads 1");  // the run's last checkpoint: step 6 of 6
  INFO(done.output);
  REQUIRE(done.code == 0);
  REQUIRE(done.output.find("at the run's last step (--steps 6): nothing to train") != std::string::npos);
  Run fresh = shardgrad("train " + kSmall + " --steps 1 --resume auto --save " + (d.path / "fresh").string());
  INFO(fresh.output);
  REQUIRE(fresh.code == 0);
  REQUIRE(fresh.output.find("no checkpoint in " + (d.path / "fresh").string() + " yet; starting from step 0") != std::string::npos);
  auto a = read_log(d.path / "full.jsonl"), b = read_log(d.path / "r1.jsonl"), c = read_log(d.path / "r2.jsonl");
  REQUIRE(a.size() == 6);
  REQUIRE(b.size() == 4);
  REQUIRE(c.size() == 2);
  for (size_t i = 0; i < 4; ++i) CHECK(b[i]["loss"].get<double>() == a[i + 2]["loss"].get<double>());  // bit-exact
  for (size_t i = 0; i < 2; ++i) {
    CHECK(c[i]["loss"].get<double>() == a[i + 4]["loss"].get<double>());
    CHECK(c[i]["lr"].get<double>() == a[i + 4]["lr"].get<double>());
  }
  // given on the command line, a flag overrides the checkpoint's
  Run o = shardgrad("train --resume " + run + "/step_00000002 --lr 1e-4 --threads 1 --log-json " + (d.path / "o.jsonl").string());
  INFO(o.output);
  REQUIRE(o.code == 0);
  REQUIRE(o.output.find("--lr 3e-3") == std::string::npos);
  auto ov = read_log(d.path / "o.jsonl");
  REQUIRE(ov.size() == 4);  // --steps 6 came from the checkpoint
  CHECK(ov[0]["lr"].get<double>() < a[2]["lr"].get<double>() / 10);
}

TEST_CASE("train's default learning rate on file data follows the model's size, and a run within its warmup is told so", "[cli]") {
  TempDir d;
  const std::string data = (d.path / "in.txt").string();
  std::ofstream(data) << std::string(4000, 'a') + "the end\n";
  for (auto [shape, want] : {std::pair<std::string, double>{"--n-layer 1 --n-embd 32 --n-head 2", 1e-2},
                             {"--n-layer 2 --n-embd 256 --n-head 4", 1e-3}}) {  // 98 K and 1.6 M non-embedding
    const std::string log = (d.path / "lr.jsonl").string();
    Run r = shardgrad("train --data " + data + " " + shape + " --seq-len 16 --batch-size 2 --steps 1 --warmup-steps 0 "
                      "--lr-schedule constant --eval-every 0 --eval-batches 1 --threads 1 --log-json " + log);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(read_log(log).at(0)["lr"].get<double>() == want);
  }
  // a run no longer than its warmup is told so (the default 20 warmup steps against --steps 3)
  const std::string tiny = "train --data " + data + " --n-layer 1 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 2 "
                           "--steps 3 --eval-every 0 --eval-batches 1 --threads 1";
  for (const std::string& extra : {std::string(""), std::string(" --warmup-steps 2"), std::string(" --lr-schedule constant")}) {
    Run r = shardgrad(tiny + extra);
    INFO(extra << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK((r.output.find("note: --warmup-steps 20 covers all 3 steps: the learning rate rises to its peak at the last "
                         "step and never decays") != std::string::npos) == extra.empty());
  }
  refuses(std::string(SG_BINARY) + " train --data " + data + " --seq-len 16 --batch-size 2 --lr -1 --steps 1", "--lr must be > 0, got -1");
  // 0 is a learning rate, not "the default" (that is --lr auto): refused, not silently replaced
  refuses(std::string(SG_BINARY) + " train --data " + data + " --seq-len 16 --batch-size 2 --lr 0 --steps 1", "--lr must be > 0, got 0");
}

TEST_CASE("train's default thread count: OMP_NUM_THREADS when set, else the cores shared by the node's ranks", "[cli]") {
  const std::string run = std::string(SG_BINARY) + " train --n-layer 1 --n-embd 32 --n-head 2 --steps 1 --eval-every 0 "
                          "--eval-batches 1 --eval-problems 8";
  Run omp = run_command("env OMP_NUM_THREADS=3 " + run);
  INFO(omp.output);
  REQUIRE(omp.code == 0);
  REQUIRE(omp.output.find("| 3 threads |") != std::string::npos);
  // 64 ranks on this node (a launcher's LOCAL_WORLD_SIZE): one thread each, not every core each
  Run shared = run_command("env -u OMP_NUM_THREADS LOCAL_WORLD_SIZE=64 " + run);
  INFO(shared.output);
  REQUIRE(shared.code == 0);
  REQUIRE(shared.output.find("| 1 threads |") != std::string::npos);
}

TEST_CASE("train refuses before its first step what would stop it at a save or what it would ignore", "[cli]") {
  TempDir d;
  const std::string run = (d.path / "run").string(), log = (d.path / "log.jsonl").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 4 --save-every 2 --save " + run + " --log-json " + log).code == 0);
  const auto not_started = [](const std::string& args, const std::string& text) {
    Run r = shardgrad(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code != 0);
    CHECK(r.output.find(text) != std::string::npos);
    CHECK(r.output.find("| loss") == std::string::npos);
  };
  // --save naming a file, and a rewound run that would meet its own later checkpoint
  std::ofstream(d.path / "a_file") << "x";
  not_started("train " + kSmall + " --steps 2 --save " + (d.path / "a_file").string(), "is a file, not a run directory");
  not_started("train " + kSmall + " --steps 4 --save-every 2 --resume " + run + "/step_00000002 --save " + run,
              "already holds step_00000004, later than the step this run resumes at (2)");
  // the same when this run would stop before that step: the rewound run's steps would mix with its own
  not_started("train " + kSmall + " --steps 4 --save-every 3 --stop-at 3 --resume " + run + "/step_00000002 --save " + run,
              "already holds step_00000004, later than the step this run resumes at (2)");
  // a --save folder that cannot be made, and output files named by a folder
  not_started("train " + kSmall + " --steps 2 --save " + (d.path / "a_file" / "run").string(), "--save " +
              (d.path / "a_file" / "run").string() + ": cannot create it");
  for (const char* flag : {"--trace", "--log-json"})
    not_started("train " + kSmall + " --steps 2 " + flag + " " + d.path.string(), std::string(flag) + " " +
                d.path.string() + " is a folder; give a file name");
  // ... or by a name ending in '/': refused before the folder is made, not after the work
  not_started("train " + kSmall + " --steps 2 --log-json " + (d.path / "logs").string() + "/",
              "--log-json " + (d.path / "logs").string() + "/ names a folder; give a file name");
  CHECK(!fs::exists(d.path / "logs"));
  not_started("train " + kSmall + " --steps 2 --threads 100000", "--threads 100000 is more than 4 per core");
  not_started("train " + kSmall + " --steps 2 --dropout 1", "--dropout 1 is outside [0, 1)");
  // a shape or preset beside what is loaded must agree with it
  not_started("train --threads 1 --steps 6 --eval-every 0 --resume " + run + " --model gpt2",
              "--model gpt2 (n-layer 12) does not match the checkpoint");
  const std::string file = (d.path / "hf" / "model.safetensors").string();
  REQUIRE(shardgrad("export " + run + " --out " + file).code == 0);
  not_started("train " + kSmall + " --steps 2 --init-from " + file + " --n-layer 2",
              "--n-layer 2 does not match --init-from " + file + " (1)");
  not_started("train " + kSmall + " --steps 2 --init-from " + run, "--init-from " + run + " is a folder: it takes one "
              ".safetensors file (a Hugging Face GPT-2's, or what shardgrad export writes); a checkpoint folder goes on "
              "with --resume");
  {
    // A flag that agrees is taken, whatever the default preset's shape (12 heads do not divide the
    // tiny preset's width 64: the check compares with the file, not with a model built from flags).
    const std::string heads12 = (d.path / "h12").string(), file12 = (d.path / "h12.safetensors").string();
    REQUIRE(shardgrad("train --n-layer 1 --n-embd 48 --n-head 12 --seq-len 16 --batch-size 4 --steps 1 --threads 1 "
                      "--eval-every 0 --eval-batches 1 --eval-problems 4 --save " + heads12).code == 0);
    REQUIRE(shardgrad("export " + heads12 + " --out " + file12).code == 0);
    Run taken = shardgrad("train --init-from " + file12 + " --n-head 12 --seq-len 16 --batch-size 4 --steps 1 "
                          "--threads 1 --eval-every 0 --eval-batches 1 --eval-problems 4");
    INFO(taken.output);
    CHECK(taken.code == 0);
  }
  not_started("train " + kSmall + " --steps 6 --init-from " + file + " --resume " + run,
              "give --init-from (start a run from a file) or --resume (continue a run), not both");
  Run restart = shardgrad("train " + kSmall + " --steps 4 --init-from " + file + " --resume auto --save " + run);
  INFO(restart.output);
  CHECK(restart.code == 0);
  CHECK(restart.output.find("is not read: the run goes on from its checkpoint") != std::string::npos);
  not_started("train " + kSmall + " --steps 2 --timeline " + (d.path / "t.svg").string(), "--timeline is for pipelines");
  // Resumed with the same --log-json: the lines after the checkpoint's step (an attempt that died
  // after it, its last line cut short) are replaced, each step logged once.
  std::ofstream(log, std::ios::app) << "{\"step\": 5, \"lo";
  Run again = shardgrad("train " + kSmall + " --steps 4 --resume " + run + "/step_00000002 --save " +
                        (d.path / "again").string() + " --log-json " + log);
  INFO(again.output);
  REQUIRE(again.code == 0);
  // said, not silent: the lines may be another run's (steps 3, 4 and the cut one)
  CHECK(again.output.find("note: --log-json " + log + ": dropped its 3 lines after step 2") != std::string::npos);
  std::vector<int64_t> steps;
  for (const auto& rec : sg::testing::read_json_lines(log)) steps.push_back(rec.at("step").get<int64_t>());
  CHECK(steps == std::vector<int64_t>{1, 2, 3, 4});
}

TEST_CASE("resume auto skips the newest checkpoint when a file it lists is gone, saying so, and saves that step again beside it", "[cli]") {
  TempDir d;
  const std::string run = (d.path / "run").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 4 --save-every 2 --save " + run).code == 0);
  std::filesystem::remove(d.path / "run" / "step_00000004" / "rank_00000.safetensors");
  const std::string resume = "train " + kSmall + " --steps 4 --save-every 2 --resume auto --save " + run;
  Run r = shardgrad(resume);
  INFO(r.output);
  CHECK(r.output.find("skipping " + run + "/step_00000004: " + run + "/step_00000004/rank_00000.safetensors is missing") !=
        std::string::npos);
  // It saves step 4 again: the damaged directory is kept beside it under another name.
  REQUIRE(r.code == 0);
  CHECK(r.output.find("resumed from " + run + "/step_00000002 at step 2") != std::string::npos);
  CHECK(r.output.find("moved the damaged " + run + "/step_00000004") != std::string::npos);
  CHECK(std::filesystem::exists(d.path / "run" / "step_00000004.damaged" / "index.json"));
  CHECK(sg::ckpt::checkpoint_files_problem((d.path / "run" / "step_00000004").string()).empty());
  // Damaged again: the first kept copy stays, the second gets a name of its own.
  std::filesystem::remove(d.path / "run" / "step_00000004" / "rank_00000.safetensors");
  REQUIRE(shardgrad(resume).code == 0);
  CHECK(std::filesystem::exists(d.path / "run" / "step_00000004.damaged.2"));
  CHECK(std::filesystem::exists(d.path / "run" / "step_00000004.damaged"));
  // Its index lost, the damage named is the index (not a full checkpoint's model file it never had).
  std::filesystem::remove(d.path / "run" / "step_00000004" / "index.json");
  Run lost_index = shardgrad(resume);
  INFO(lost_index.output);
  REQUIRE(lost_index.code == 0);
  CHECK(lost_index.output.find("moved the damaged " + run + "/step_00000004 (" + run + "/step_00000004/index.json is "
                               "missing) to ") != std::string::npos);
  // A complete later step is another run's history: refused before training.
  Run complete = shardgrad("train " + kSmall + " --steps 4 --save-every 2 --resume " + run + "/step_00000002 --save " + run);
  INFO(complete.output);
  CHECK(complete.code != 0);
  CHECK(complete.output.find("already holds step_00000004") != std::string::npos);
  CHECK(complete.output.find("| loss") == std::string::npos);
  // Under mpirun every rank opens the checkpoint; one of them names the step it passes over.
  const std::string ranks = (d.path / "ranks").string();
  const std::string two = sg::testing::mpirun_shardgrad(2) + " train " + kSmall + " --strategy ddp --steps 4 --save-every 2 ";
  REQUIRE(run_command(two + "--save " + ranks).code == 0);
  std::filesystem::remove(d.path / "ranks" / "step_00000004" / "rank_00001.safetensors");
  Run both = run_command(two + "--resume auto --save " + ranks);
  INFO(both.output);
  size_t lines = 0;
  for (size_t at = both.output.find("skipping "); at != std::string::npos; at = both.output.find("skipping ", at + 1)) ++lines;
  CHECK(lines == 1);
}

namespace {
// The losses an example prints, one "step N | loss L" line each.
std::vector<double> example_losses(const std::string& out) {
  std::vector<double> v;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step ", 0) == 0) v.push_back(std::stod(line.substr(line.find("loss ") + 5)));
  return v;
}

// Runs examples/<name>.cpp in one process and on 4 ranks: both exit 0 (each checks that it
// learned: the loss down 20x) and print the same 7 losses (to 1e-3: the reductions add in another
// order).
std::pair<Run, Run> run_example_on_1_and_4(const std::string& name) {
  const std::string example = std::string(SG_EXAMPLES_DIR) + "/sg_example_" + name;
  Run one = run_command(example), four = run_command(sg::testing::mpirun_command(4) + example);
  INFO(one.output << four.output);
  REQUIRE(one.code == 0);
  REQUIRE(four.code == 0);
  const auto a = example_losses(one.output), b = example_losses(four.output);
  REQUIRE(a.size() == 7);
  REQUIRE(b.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).epsilon(1e-3));
  return {one, four};
}
}  // namespace

TEST_CASE("the DDP example gives one process's losses on 4 ranks, all-reducing its buckets from backward once a step", "[cli][mpi]") {
  const auto [one, four] = run_example_on_1_and_4("ddp_mlp");
  INFO(one.output << four.output);
  // Ψ = (4·48 + 48) + 2 x (48·48 + 48) + (48 + 1) = 4993; 8 KiB buckets: fc3 with fc2, fc1, fc0. Of
  // the 2 micro-batches only the second's backward all-reduces (no_sync), each bucket from its
  // hooks; the bytes 2(N-1)/N of 4Ψ.
  for (int r = 0; r < 4; ++r)
    CHECK(four.output.find("rank " + std::to_string(r) + " of 4 | Ψ 4993 in 3 buckets | all-reduces a step of 2 "
                           "micro-batches 3, 3 issued during backward | bytes 29958 (2(N-1)/N·4Ψ = 29958)") !=
          std::string::npos);
}

TEST_CASE("the ZeRO-2 example learns y = tanh(3x), gives one process's losses on 4 ranks, and holds ZeRO's bytes", "[cli][mpi]") {
  const auto [one, four] = run_example_on_1_and_4("zero2_mlp");
  INFO(one.output << four.output);
  // Ψ = 193 parameters (1·64 + 64 + 64·1 + 1), padded to 196 on 4 ranks: 4Ψ, 4Ψp/N, 8Ψp/N
  CHECK(one.output.find("params 772 B (4Ψ = 772) | gradient shard 772 B (4Ψp/N = 772) | AdamW m, v 1544 B") !=
        std::string::npos);
  for (int r = 0; r < 4; ++r)
    CHECK(four.output.find("rank " + std::to_string(r) + " of 4 | params 772 B (4Ψ = 772) | gradient shard 196 B "
                           "(4Ψp/N = 196) | AdamW m, v 392 B (8Ψp/N = 392)") != std::string::npos);
}

TEST_CASE("the ZeRO-3 example shards a module of its own: one process's losses on 4 ranks, ZeRO-3's bytes held and sent", "[cli][mpi]") {
  const auto [one, four] = run_example_on_1_and_4("zero3_mlp");
  INFO(one.output << four.output);
  // Ψ = 320 (in, the root) + 4 x 4160 (hidden) + 65 (head) = 17025; on 4 ranks the head pads to 68:
  // Ψp = 17028. Shards 4Ψp/4 = 17028 B; the peak adds the root and one layer gathered, 4 x (320 + 4160);
  // per step 2 x 3/4 x 4Ψp all-gathered and 3/4 x 4Ψp reduce-scattered.
  for (int r = 0; r < 4; ++r)
    CHECK(four.output.find("rank " + std::to_string(r) + " of 4 | 6 units, Ψ 17025, Ψp 17028 | params 17028 B (4Ψp/N = "
                           "17028), peak 34948 B (+ root and one layer = 34948) | gradient shard 17028 B | AdamW m, v "
                           "34056 B (8Ψp/N = 34056) | all-gathered 102168 B (2(N-1)/N·4Ψp = 102168), reduce-scattered "
                           "51084 B ((N-1)/N·4Ψp = 51084)") != std::string::npos);
  CHECK(one.output.find("params 68100 B (4Ψp/N = 68100), peak 68100 B") != std::string::npos);
}

TEST_CASE("the tensor-parallel example equals the unsharded MLP on 2 and 4 ranks, with two all-reduces of 2(p-1)/p of the activation", "[cli][mpi]") {
  const std::string example = std::string(SG_EXAMPLES_DIR) + "/sg_example_tensor_parallel_mlp";
  // 3 ranks cannot split its 128 hidden units: it says so and exits 2 on every rank (it aborted)
  Run three = run_command(sg::testing::mpirun_command(3) + example);
  CHECK(three.code != 0);
  CHECK(three.output.find("tensor_parallel_mlp: the hidden width 128 does not split over 3 ranks") != std::string::npos);
  CHECK(three.output.find("terminate called") == std::string::npos);  // (it aborted: std::terminate)
  for (int p : {2, 4}) {
    Run r = run_command(sg::testing::mpirun_command(p) + example);
    INFO(r.output);
    REQUIRE(r.code == 0);  // it checks y, dX, dA and dB against the unsharded MLP (1e-5) and the bytes
    const std::string bytes = std::to_string(2 * 2 * (p - 1) * 2048 / p);  // [16, 32] f32 = 2048 B
    for (int k = 0; k < p; ++k)
      CHECK(r.output.find("rank " + std::to_string(k) + " of " + std::to_string(p) + " | hidden units " +
                          std::to_string(128 / p) + " of 128") != std::string::npos);
    CHECK(r.output.find("all-reduces 2, " + bytes + " bytes") != std::string::npos);
  }
}

TEST_CASE("the pipeline example gives one process's losses under gpipe, 1f1b and interleaved, each rank holding its stages", "[cli][mpi]") {
  const std::string example = std::string(SG_EXAMPLES_DIR) + "/sg_example_pipeline_mlp";
  const auto losses = [](const std::string& out) {
    std::vector<std::string> v;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("step ", 0) == 0) v.push_back(line);
    return v;
  };
  const auto activation_peak = [](const std::string& out, int rank, int p) {
    const std::string head = "rank " + std::to_string(rank) + " of " + std::to_string(p) + " |";
    const size_t at = out.find("activation peak ", out.find(head));
    return std::stoll(out.substr(at + 16));
  };
  Run one = run_command(example);
  INFO(one.output);
  REQUIRE(one.code == 0);  // it checks that it learned (the loss down 20x)
  const auto reference = losses(one.output);
  REQUIRE(reference.size() == 9);
  CHECK(one.output.find("rank 0 of 1 | 1f1b | stages 0 (layers 0-7) | params 26116 B (4 x 6529)") != std::string::npos);
  std::map<std::string, Run> runs;
  for (const char* kind : {"gpipe", "1f1b", "interleaved"}) {
    Run& r = runs[kind] = run_command(sg::testing::mpirun_command(4) + example + " " + kind);
    INFO(kind << "\n" << r.output);
    REQUIRE(r.code == 0);
    // micro-batch by micro-batch the same arithmetic: the same losses to the last digit printed
    CHECK(losses(r.output) == reference);
    // every rank holds its layers' weights only: 4 x (4·32+32 + 32·32+32) on the first, ... 4 x 6529 in all
    for (const char* held : {"params 4864 B (4 x 1216)", "params 8448 B (4 x 2112)", "params 4356 B (4 x 1089)"})
      CHECK(r.output.find(held) != std::string::npos);
  }
  // the schedules: (p-1)/m of busy time idle, halved by two stages per rank; 1f1b's last stage
  // alternates from the start, and its first stage keeps 4 micro-batches in flight, not gpipe's 8
  CHECK(runs["1f1b"].output.find("37.5% of busy time") != std::string::npos);
  CHECK(runs["interleaved"].output.find("18.8% of busy time") != std::string::npos);
  CHECK(runs["1f1b"].output.find("rank 3 of 4 | 1f1b | stages 3 (layers 6-7) | params 4356 B (4 x 1089)") != std::string::npos);
  CHECK(runs["1f1b"].output.find("| F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n") != std::string::npos);
  CHECK(runs["1f1b"].output.find("| F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n") != std::string::npos);
  CHECK(runs["interleaved"].output.find("stages 0 (layers 0-0) 4 (layers 4-4)") != std::string::npos);
  for (int r = 0; r < 4; ++r) CHECK(activation_peak(runs["1f1b"].output, r, 4) < activation_peak(runs["gpipe"].output, r, 4));
  // a split that cannot be: refused on every rank, named once
  Run three = run_command(sg::testing::mpirun_command(3) + example);
  CHECK(three.code != 0);
  CHECK(three.output.find("pipeline_mlp: 8 layers do not split into 3 stages") != std::string::npos);
}

TEST_CASE("generate samples from what train saved", "[cli]") {
  TempDir d;
  std::string save = (d.path / "run").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 2 --save " + save).code == 0);
  Run g = shardgrad("generate --from " + save + " --prompt 12+34= --max-new-tokens 5 --temperature 0");
  INFO(g.output);
  REQUIRE(g.code == 0);
  REQUIRE(g.output.rfind("12+34=", 0) == 0);
  REQUIRE(shardgrad("generate --from " + save + " --prompt x --top-k -1").code != 0);
  // the task's answer ends with its line, and so does sampling (one line however many tokens are allowed)
  for (const char* seed : {"1", "2", "3"}) {
    Run line = shardgrad("generate --from " + save + " --prompt 123+456= --max-new-tokens 200 --seed " + seed);
    INFO(line.output);
    REQUIRE(line.code == 0);
    CHECK(line.output.find('\n') == line.output.size() - 1);
  }
}

TEST_CASE("generate runs the model on --device in --dtype: cpu:1 samples as cpu does, half precision runs", "[cli]") {
  TempDir d;
  std::string save = (d.path / "run").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 2 --save " + save).code == 0);
  const std::string base = "generate --from " + save + " --prompt 123+456= --max-new-tokens 40";
  for (const char* seed : {"1", "2", "3"}) {  // the ids go to the device, the logits come back, same bits
    Run here = shardgrad(base + " --seed " + seed), there = shardgrad(base + " --seed " + seed + " --device cpu:1");
    INFO(here.output << there.output);
    REQUIRE(here.code == 0);
    REQUIRE(there.code == 0);
    CHECK(here.output == there.output);
  }
  for (const char* dtype : {"bf16", "fp16"}) {
    Run half = shardgrad(base + " --temperature 0 --device cpu:1 --dtype " + dtype);
    INFO(half.output);
    REQUIRE(half.code == 0);
    CHECK(half.output.rfind("123+456=", 0) == 0);
  }
  refuses(std::string(SG_BINARY) + " " + base + " --device meta", "holds no values to sample from");
  refuses(std::string(SG_BINARY) + " " + base + " --dtype i32", "--dtype must be fp32, bf16 or fp16, got 'i32'");
}

TEST_CASE("generate draws only the data's tokens, refuses data the model cannot read, and needs no text file for bytes",
          "[cli]") {
  TempDir d;
  // A model with more rows than its data's 13 tokens: the ids past them are never drawn (each
  // would print as '?'; before, 51 of 64 ids were such).
  const std::string wide = (d.path / "wide").string();
  REQUIRE(shardgrad("train " + kSmall + " --vocab-size 64 --steps 2 --save " + wide).code == 0);
  for (const char* seed : {"1", "2", "3"}) {
    Run g = shardgrad("generate --from " + wide + " --prompt 123+456= --max-new-tokens 40 --seed " + seed);
    INFO(g.output);
    REQUIRE(g.code == 0);
    CHECK(g.output.find('?') == std::string::npos);
  }
  // auto:DIR is the run's newest complete checkpoint, as for export; --n-head may not contradict it
  REQUIRE(shardgrad("generate --from auto:" + wide + " --prompt 1+1= --max-new-tokens 2").code == 0);
  refuses(std::string(SG_BINARY) + " generate --from " + wide + " --n-head 4 --prompt 1", "records 2 heads");
  // A text file's 256 bytes do not fit the synthetic model's 13 rows.
  const std::string text = (d.path / "input.txt").string();
  {
    std::ofstream f(text);
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog\n";
  }
  const std::string narrow = (d.path / "narrow").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 1 --save " + narrow).code == 0);
  refuses(std::string(SG_BINARY) + " generate --from " + narrow + " --data " + text + " --prompt the",
          "has 256 tokens, more than the model's vocabulary of 13");
  // Trained on a text file that then moved: its tokens are bytes, and sampling goes on without it.
  const std::string bytes = (d.path / "bytes").string();
  REQUIRE(shardgrad("train " + kSmall + " --data " + text + " --steps 2 --save " + bytes).code == 0);
  Run before = shardgrad("generate --from " + bytes + " --prompt the --max-new-tokens 8 --seed 5");
  REQUIRE(before.code == 0);
  std::filesystem::rename(text, text + ".moved");
  Run after = shardgrad("generate --from " + bytes + " --prompt the --max-new-tokens 8 --seed 5");
  INFO(after.output);
  REQUIRE(after.code == 0);
  CHECK(after.output.find("which is not here; bytes need no file") != std::string::npos);
  CHECK(after.output.substr(after.output.find('\n') + 1) == before.output);
  // Weights holding a NaN are refused by name as they load; finite ones whose forward overflows,
  // as the logits go non-finite: neither is sampled into noise (or, greedy, nothing at all)
  const std::string exported = (d.path / "hf" / "model.safetensors").string(), nan = (d.path / "nan.safetensors").string();
  const std::string huge = (d.path / "huge.safetensors").string();
  REQUIRE(shardgrad("export " + bytes + " --out " + exported).code == 0);
  for (const auto& [out, value] : {std::pair{nan, std::nanf("")}, std::pair{huge, 3e38f}}) {
    sg::io::SafetensorsFile f = sg::io::load_safetensors(exported);
    sg::io::NamedTensors named;
    for (const std::string& name : f.order) named.emplace_back(name, f.tensors.at(name));
    for (int64_t i = 0; i < f.tensors.at("wte.weight").numel(); ++i) f.tensors.at("wte.weight").data<float>()[i] = value;
    sg::io::save_safetensors(out, named, f.metadata);
  }
  refuses(std::string(SG_BINARY) + " generate --from " + nan + " --prompt the --max-new-tokens 8",
          nan + ": tensor 'wte.weight' holds a non-finite value (element 0 is nan)");
  for (const char* t : {"1", "0"})
    refuses(std::string(SG_BINARY) + " generate --from " + huge + " --prompt the --max-new-tokens 8 --temperature " + t,
            "the logits after 3 tokens are not finite: " + huge + "'s weights overflow the forward in fp32");
}

TEST_CASE("tokenize writes GPT-2 tokens that train reads and generate decodes with the same tokenizer", "[cli][tokenizer]") {
  TempDir d;
  const std::string bpe = std::string(SG_SOURCE_DIR) + "/tests/golden/bpe", data = (d.path / "shards" / "data.bin").string();
  const std::string a = "It's the pieces that the merges work on.\n", b = "The model learns, the model learns again!\n";
  std::ofstream((d.path / "a.txt").string()) << a;
  std::string long_b;
  for (int i = 0; i < 200; ++i) long_b += b;
  std::ofstream((d.path / "b1.txt").string()) << long_b;
  Run t = shardgrad("tokenize " + (d.path / "a.txt").string() + " '" + (d.path / "b*.txt").string() + "' --tokenizer " +
                    bpe + " --out " + data);
  INFO(t.output);
  REQUIRE(t.code == 0);
  REQUIRE(t.output.find("a.txt: 41 bytes -> ") != std::string::npos);
  REQUIRE(t.output.find("train with --data " + data + " --vocab-size 612") != std::string::npos);
  // every file one document, opened by <|endoftext|> (611), as llm.c writes its shards; the ids are
  // the Python oracle's (tests/golden/bpe/cases.json encodes these texts the same way)
  const std::vector<uint16_t> tokens = sg::io::read_token_shard(data);
  const sg::io::Gpt2Tokenizer tok = sg::io::Gpt2Tokenizer::load(bpe);
  std::vector<uint16_t> want = {611};
  for (int64_t id : tok.encode(a)) want.push_back(uint16_t(id));
  want.push_back(611);
  for (int64_t id : tok.encode(long_b)) want.push_back(uint16_t(id));
  REQUIRE(tokens == want);
  REQUIRE(tokens.size() < a.size() + long_b.size() / 4);  // the merges did merge
  refuses(std::string(SG_BINARY) + " tokenize " + (d.path / "a.txt").string() + " --tokenizer " + bpe + " --out " + data,
          "already exists; refusing to overwrite it");
  refuses(std::string(SG_BINARY) + " tokenize " + (d.path / "a.txt").string() + " --tokenizer " + d.path.string() + " --out x.bin",
          "vocab.json");
  refuses(std::string(SG_BINARY) + " tokenize " + (d.path / "nope.txt").string() + " --tokenizer " + bpe + " --out " +
              (d.path / "nope.bin").string(),
          "tokenize: " + (d.path / "nope.txt").string() + ": no such file");
  // inputs and --format are checked before any file is tokenized or --out's folder made
  fs::create_directories(d.path / "g" / "b_sub");
  fs::copy_file(d.path / "a.txt", d.path / "g" / "a.txt");
  refuses(std::string(SG_BINARY) + " tokenize '" + (d.path / "g" / "*").string() + "' --tokenizer " + bpe + " --out " +
              (d.path / "o1" / "x.bin").string(),
          "tokenize: " + (d.path / "g" / "b_sub").string() + " is a folder, not a text file");
  refuses(std::string(SG_BINARY) + " tokenize " + (d.path / "a.txt").string() + " --tokenizer " + bpe + " --format bogus --out " +
              (d.path / "o2" / "x.bin").string(),
          "--format must be text or hellaswag, got bogus");
  CHECK(!fs::exists(d.path / "o1"));
  CHECK(!fs::exists(d.path / "o2"));

  const std::string run = (d.path / "run").string();
  const std::string tiny = " --n-layer 1 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 4 --threads 1 --eval-every 0 "
                           "--eval-batches 1 ";
  Run tr = shardgrad("train --data " + data + tiny + "--vocab-size 612 --steps 2 --save " + run);
  INFO(tr.output);
  REQUIRE(tr.code == 0);
  REQUIRE(tr.output.find("vocab 612 (padded 640)") != std::string::npos);  // not GPT-2's 50257
  // a model too small for the shard's ids fails on the first id past it, naming the file
  refuses(std::string(SG_BINARY) + " train --data " + data + tiny + "--vocab-size 100 --steps 2",
          "is outside the vocabulary of 100");
  refuses(std::string(SG_BINARY) + " train --data " + (d.path / "b1.txt").string() + tiny + "--vocab-size 100 --steps 1",
          "a model of 100 tokens cannot read its 256");
  // a tokenizer larger than GPT-2's: its shards train with the --vocab-size tokenize prints
  const std::string big = (d.path / "big.bin").string();
  {
    std::vector<uint16_t> ids;
    for (int i = 0; i < 1000; ++i) ids.push_back(uint16_t(i % 7 == 0 ? 50299 : i));
    sg::io::write_token_shard(big, ids);
  }
  Run wide = shardgrad("train --data " + big + tiny + "--n-embd 16 --vocab-size 50300 --steps 1");
  INFO(wide.output);
  CHECK(wide.code == 0);
  refuses(std::string(SG_BINARY) + " train --data " + big + tiny + "--vocab-size 50257 --steps 1",
          "token 50299 at index 0 is outside the vocabulary of 50257");
  // train's samples need the tokenizer to be text; with it, ids among its 612
  refuses(std::string(SG_BINARY) + " train --data " + data + tiny + "--vocab-size 612 --steps 1 --sample-tokens 4",
          "the token shards " + data + " carry no tokenizer; pass --tokenizer DIR");
  Run sampled = shardgrad("train --data " + data + tiny + "--vocab-size 612 --steps 1 --sample-tokens 4 --tokenizer " +
                          bpe + " --log-json " + (d.path / "s.jsonl").string());
  INFO(sampled.output);
  REQUIRE(sampled.code == 0);
  // a --tokenizer the checkpoint gave is left unused, not refused, when the resumed run turns the
  // samples off (typed on the command line, it is refused)
  const std::string sampled_run = (d.path / "sampled_run").string();
  REQUIRE(shardgrad("train --data " + data + tiny + "--vocab-size 612 --steps 4 --stop-at 2 --sample-tokens 4 "
                    "--tokenizer " + bpe + " --save " + sampled_run).code == 0);
  Run quiet = shardgrad("train --resume " + sampled_run + " --sample-tokens 0");
  INFO(quiet.output);
  CHECK(quiet.code == 0);
  const auto ev = read_log(d.path / "s.jsonl").back()["eval"];
  const auto ids = ev["sample_ids"].get<std::vector<int64_t>>();
  REQUIRE(ids.size() == 4);
  for (int64_t id : ids) CHECK((id >= 0 && id < 612));
  CHECK(sampled.output.find(":\n" + tok.decode(ids) + "\n---\n") != std::string::npos);  // as text (not always UTF-8)
  // the prompt: the first 16 tokens of the held-out split, the shard's last ones
  const size_t at = sampled.output.find("val split of ");
  REQUIRE(at != std::string::npos);
  const size_t n_val = std::stoul(sampled.output.substr(at + 13));
  const std::vector<int64_t> first(tokens.end() - long(n_val), tokens.end() - long(n_val) + 16);
  CHECK(ev["sample_prompt"].get<std::string>() == tok.decode(first));  // ASCII text: the log holds it as it is
  Run g = shardgrad("generate --from " + run + " --tokenizer " + bpe + " --prompt 'The model' --max-new-tokens 6 --temperature 0");
  INFO(g.output);
  REQUIRE(g.code == 0);
  REQUIRE(g.output.rfind("The model", 0) == 0);
  REQUIRE(g.output.size() > std::string("The model\n").size());
  Run e = shardgrad("generate --from " + run + " --tokenizer " + bpe + " --max-new-tokens 3");  // from <|endoftext|>
  INFO(e.output);
  REQUIRE(e.code == 0);
  // past the model's 64 positions the window slides (and the cache starts afresh)
  Run far = shardgrad("generate --from " + run + " --tokenizer " + bpe + " --prompt 'The model' --max-new-tokens 100");
  INFO(far.output);
  REQUIRE(far.code == 0);
  refuses(std::string(SG_BINARY) + " generate --from " + run + " --prompt x", "trained on GPT-2 token shards");
  // a tokenizer with more ids than the model can embed
  const std::string small = (d.path / "small").string();
  REQUIRE(shardgrad("train " + kSmall + " --steps 1 --save " + small).code == 0);
  refuses(std::string(SG_BINARY) + " generate --from " + small + " --tokenizer " + bpe + " --prompt x",
          "has 612 tokens, more than the model's vocabulary");
  refuses(std::string(SG_BINARY) + " generate --from " + (d.path / "nowhere").string() + " --prompt x",
          "nowhere: no such checkpoint directory (run or step) or .safetensors file");
}

namespace {
std::string mpirun(int np) { return sg::testing::mpirun_shardgrad(np); }
}  // namespace

TEST_CASE("ddp through the CLI on 2 ranks gives the single-process losses", "[cli][mpi]") {
  TempDir d;
  const std::string args = " train " + kSmall + " --steps 4 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  REQUIRE(one.code == 0);
  double secs = 0;
  Run two = run_command(mpirun(2) + args + (d.path / "two.jsonl").string() + " --strategy ddp --bucket-mb 0.01", &secs);
  INFO(two.output);
  REQUIRE(two.code == 0);
  auto a = read_log(d.path / "one.jsonl"), b = read_log(d.path / "two.jsonl");
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < 4; ++i) REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i]["loss"].get<double>()) <= 1e-5 * a[i]["loss"].get<double>());
  // only rank 0 prints progress
  size_t lines = 0;
  for (size_t p = two.output.find("step     1/4"); p != std::string::npos; p = two.output.find("step     1/4", p + 1)) ++lines;
  REQUIRE(lines == 1);
}

TEST_CASE("a failing rank ends the whole job within --comm-timeout, naming the rank", "[cli][mpi]") {
  for (const char* kind : {"throw", "exit", "abort", "kill", "hang"}) {
    INFO(kind);
    double secs = 0;
    Run r = run_command(mpirun(2) + " train " + kSmall + " --steps 50 --strategy ddp --comm-timeout 10 --inject-fault rank=1,step=3,kind=" + kind, &secs);
    INFO(r.output);
    REQUIRE(r.code != 0);
    REQUIRE(secs < 40);  // 10 s timeout plus start-up and teardown on a loaded 2-core machine
    REQUIRE(r.output.find("rank 1") != std::string::npos);
    REQUIRE(r.output.find("terminate called") == std::string::npos);  // each fault is itself, not an abort
    if (std::string(kind) == "exit") REQUIRE(r.code == 7);             // mpirun passes the rank's status on
  }
}

TEST_CASE("a pipeline's default micro-batches: at least 4 per stage, a multiple of the stages", "[cli][mpi]") {
  for (auto [batch, want] : {std::pair<const char*, const char*>{"32", "(micro-batch 4, 8 per step)"},
                             {"20", "(micro-batch 2, 10 per step)"}}) {  // 20: 8 does not divide it, 10 does
    Run r = run_command(mpirun(2) + " train --n-layer 2 --n-embd 32 --n-head 2 --pp 2 --steps 1 --eval-every 0 "
                                    "--eval-batches 1 --eval-problems 8 --batch-size " + batch);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find(want) != std::string::npos);
  }
}

TEST_CASE("a rank that hangs is the one blamed: its peers say what they wait in, under zero3, tp and pp", "[cli][mpi]") {
  // zero3 waits in its forward's gathers, tp in its layers' all-reduces, pp in a stage's receive:
  // none of them is a phase the trainer names, so each is the wait of the ProcessGroup operation.
  const std::pair<const char*, const char*> cases[] = {{"--strategy zero3", "an all_gather among the 2 ranks"},
                                                       {"--tp 2", "an all_reduce among the 2 ranks"},
                                                       {"--pp 2", "a recv from rank 1 of its 2-rank group"}};
  for (auto [layout, wait] : cases) {
    INFO(layout);
    Run r = run_command(mpirun(2) + " train " + kSmall + " --n-layer 2 " + layout +
                        " --steps 50 --comm-timeout 5 --inject-fault rank=1,step=3,kind=hang");
    INFO(r.output);
    REQUIRE(r.code != 0);
    // "for 5 s" unless the checker's 100 ms tick ran late on a loaded machine
    CHECK(r.output.find("rank 1: FAILED: no progress for ") != std::string::npos);
    CHECK(r.output.find(" s in forward/backward at step 3") != std::string::npos);
    CHECK(r.output.find("rank 0: FAILED") == std::string::npos);
    CHECK(r.output.find(std::string(" s while waiting in ") + wait) != std::string::npos);
    CHECK(r.output.find("rank 0: no progress for ") != std::string::npos);
  }
}

TEST_CASE("a rank computing longer than --comm-timeout is not stuck: the timeout bounds waits and ranks that stopped", "[cli]") {
  // One rank (ddp, nothing to wait for), a forward + backward of ~3 s with no progress mark in it
  // and --comm-timeout 1: the watchdog sees the process busy (its CPU time grows) and lets it run.
  // Before, it aborted the healthy run ("no progress for 1 s ... not waiting on any peer").
  TempDir d;
  const fs::path log = d.path / "busy.jsonl";
  Run r = shardgrad("train --data random:256 --n-layer 4 --n-embd 384 --n-head 6 --seq-len 256 --batch-size 32 "
                    "--strategy ddp --comm-timeout 1 --steps 1 --eval-every 0 --eval-batches 1 --threads 1 --log-json " +
                    log.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("no progress") == std::string::npos);
  REQUIRE(read_log(log).at(0)["step_ms"].get<double>() > 1000);  // the step did outlast the timeout
}

TEST_CASE("the default run (tiny GPT, synthetic 3-digit addition) learns to >= 90% task accuracy", "[cli][learn]") {
  TempDir d;
  Run r = shardgrad("train --log-json " + (d.path / "log.jsonl").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto log = read_log(d.path / "log.jsonl");
  REQUIRE(log.size() == 1500);  // the synthetic task's default step count
  REQUIRE(log.back().contains("eval"));
  const double acc = log.back()["eval"]["accuracy"].get<double>();
  INFO("final accuracy " << acc);
  REQUIRE(acc >= 0.9);
  REQUIRE(log.back()["loss"].get<double>() < log.front()["loss"].get<double>() / 2);
}

TEST_CASE("the FSDP family through the CLI on 4 ranks gives the single-process losses, bf16 stays close, offload moves the optimizer state", "[cli][mpi]") {
  TempDir d;
  const std::string args = " train " + kSmall + " --n-layer 2 --micro-batch-size 1 --steps 3 --log-json ";
  for (const char* dtype : {"fp32", "bf16"}) {
    INFO(dtype);
    // bf16 compute keeps f32 master shards: a stated bound against the bf16 single-process run
    const double tol = std::string(dtype) == "fp32" ? 1e-5 : 2e-3;
    Run one = shardgrad(args + (d.path / "one.jsonl").string() + " --dtype " + dtype);
    REQUIRE(one.code == 0);
    auto a = read_log(d.path / "one.jsonl");
    REQUIRE(a.size() == 3);
    for (const char* layout : {"fsdp --prefetch both", "fsdp-grad-op", "hsdp --shard-group-size 2", "no-shard",
                               "zero3 --wrap-min-params 10000 --reduce-dtype fp32"}) {
      INFO(layout);
      const fs::path log = d.path / "f.jsonl";
      Run four = run_command(mpirun(4) + args + log.string() + " --dtype " + dtype + " --strategy " + layout);
      INFO(four.output);
      REQUIRE(four.code == 0);
      auto b = read_log(log);
      REQUIRE(b.size() == 3);
      for (size_t i = 0; i < 3; ++i) REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i]["loss"].get<double>()) <= tol * a[i]["loss"].get<double>());
      if (std::string(dtype) == "bf16") break;  // one bf16 layout is enough here (tests/mpi/fsdp.cpp has the rest)
    }
  }
  // --offload optimizer: the compute device (cpu:1 here; cuda:N on a GPU) keeps no optimizer state,
  // the host (cpu:0) holds m, v and an f32 master of the shard (12 bytes per element against
  // the 8 of m and v on the device without offload), and the losses do not change
  {
    Run plain = run_command(mpirun(4) + args + (d.path / "p.jsonl").string() + " --strategy fsdp");
    Run off = run_command(mpirun(4) + args + (d.path / "o.jsonl").string() + " --strategy fsdp --device cpu:1 --offload optimizer");
    INFO(off.output);
    REQUIRE(plain.code == 0);
    REQUIRE(off.code == 0);
    auto p = read_log(d.path / "p.jsonl"), o = read_log(d.path / "o.jsonl");
    REQUIRE(o.size() == 3);
    for (size_t i = 0; i < 3; ++i) REQUIRE(o[i]["loss"].get<double>() == p[i]["loss"].get<double>());
    const int64_t on_device = p[2]["mem"]["optim_state"]["current"].get<int64_t>();
    REQUIRE(on_device > 0);
    REQUIRE(o[2]["mem"]["optim_state"]["current"].get<int64_t>() == 0);
    REQUIRE(o[2]["mem_host"]["optim_state"]["current"].get<int64_t>() * 2 == on_device * 3);
    // --offload params: the parameter shards move to the host too; the device holds parameters
    // only while a unit is gathered
    Run offp = run_command(mpirun(4) + args + (d.path / "q.jsonl").string() + " --strategy fsdp --device cpu:1 --offload params");
    INFO(offp.output);
    REQUIRE(offp.code == 0);
    auto q = read_log(d.path / "q.jsonl");
    REQUIRE(q.size() == 3);
    for (size_t i = 0; i < 3; ++i) REQUIRE(q[i]["loss"].get<double>() == p[i]["loss"].get<double>());
    const int64_t shard = p[2]["mem"]["param"]["current"].get<int64_t>(), peak = p[2]["mem"]["param"]["peak"].get<int64_t>();
    REQUIRE(q[2]["mem"]["param"]["current"].get<int64_t>() == 0);
    REQUIRE(q[2]["mem_host"]["param"]["current"].get<int64_t>() == shard);
    REQUIRE(q[2]["mem"]["param"]["peak"].get<int64_t>() == peak - shard);  // the gathered units alone
    refuses(mpirun(4) + args + (d.path / "r.jsonl").string() + " --strategy fsdp --offload optimizer", "give a compute device");
  }
  refuses(mpirun(4) + args + (d.path / "x.jsonl").string() + " --strategy hsdp --shard-group-size 3",
          "--shard-group-size 3 must divide the 4 data-parallel ranks");
}

TEST_CASE("zero1, zero2 and zero3 (sharded and unsharded accumulation) through the CLI on 2 ranks give the single-process losses", "[cli][mpi]") {
  TempDir d;
  // two micro-batches per rank: accumulation, clipping (--clip 1.0 by default) and several stripes
  const std::string args = " train " + kSmall + " --micro-batch-size 2 --steps 4 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  REQUIRE(one.code == 0);
  auto a = read_log(d.path / "one.jsonl");
  REQUIRE(a.size() == 4);
  std::map<std::string, int64_t> reduce_scatter_bytes;  // rank 0's, over the 4 steps
  for (const char* strategy : {"zero1", "zero2", "zero2 --grad-accumulation unsharded", "zero3",
                               "zero3 --grad-accumulation unsharded"}) {
    INFO(strategy);
    const fs::path log = d.path / (std::to_string(reduce_scatter_bytes.size()) + ".jsonl");
    const std::string stripes = std::string(strategy).rfind("zero3", 0) == 0 ? "" : " --bucket-mb 0.01";  // zero1/2's stripes
    Run two = run_command(mpirun(2) + args + log.string() + " --strategy " + strategy + stripes);
    INFO(two.output);
    REQUIRE(two.code == 0);
    auto b = read_log(log);
    REQUIRE(b.size() == 4);
    for (size_t i = 0; i < 4; ++i) REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i]["loss"].get<double>()) <= 1e-5 * a[i]["loss"].get<double>());
    reduce_scatter_bytes[strategy] = b[3]["ranks"][0]["comm"]["reduce_scatter"]["bytes"].get<int64_t>();
    // the header says where the micro-batches' gradients go
    const bool unsharded = std::string(strategy).find("unsharded") != std::string::npos;
    if (std::string(strategy) != "zero1")
      CHECK(two.output.find(unsharded ? ", micro-batches accumulated unsharded" : ", micro-batches reduced into the shard") !=
            std::string::npos);
  }
  // zero2 accumulating in the shard (the default) reduce-scatters each of the 2 micro-batches;
  // unsharded, as zero1, once a step
  CHECK(reduce_scatter_bytes["zero2 --grad-accumulation unsharded"] == reduce_scatter_bytes["zero1"]);
  CHECK(reduce_scatter_bytes["zero2"] == 2 * reduce_scatter_bytes["zero1"]);
  // zero3 with FSDP's no_sync reduces once a step too (its units padded apart: not zero1's bytes)
  CHECK(reduce_scatter_bytes["zero3"] == 2 * reduce_scatter_bytes["zero3 --grad-accumulation unsharded"]);
  // ZeRO-Offload: --offload optimizer under zero1/zero2 keeps m, v and an f32 master of the shard
  // on the host (cpu:0; 12 bytes per element against the device's 8 of m and v, also in bf16, where
  // the device kept the master too) and steps there: the run without it, to rounding (AdamW's
  // vector loop meets the host master at another alignment than the parameter itself)
  for (const char* run : {"zero1", "zero2", "zero2 --dtype bf16"}) {
    INFO(run);
    const std::string stripes = " --bucket-mb 0.01 --strategy " + std::string(run);
    Run plain = run_command(mpirun(2) + args + (d.path / "p.jsonl").string() + stripes + " --device cpu:1");
    Run off = run_command(mpirun(2) + args + (d.path / "o.jsonl").string() + stripes + " --device cpu:1 --offload optimizer");
    INFO(off.output);
    REQUIRE(plain.code == 0);
    REQUIRE(off.code == 0);
    auto p = read_log(d.path / "p.jsonl"), o = read_log(d.path / "o.jsonl");
    REQUIRE(o.size() == 4);
    for (size_t i = 0; i < 4; ++i)
      for (const char* key : {"loss", "grad_norm"})
        REQUIRE(std::abs(o[i][key].get<double>() - p[i][key].get<double>()) <= 1e-6 * p[i][key].get<double>());
    const int64_t on_device = p[3]["mem"]["optim_state"]["current"].get<int64_t>();
    REQUIRE(on_device > 0);
    REQUIRE(o[3]["mem"]["optim_state"]["current"].get<int64_t>() == 0);
    const bool half = std::string(run).find("bf16") != std::string::npos;
    REQUIRE(o[3]["mem_host"]["optim_state"]["current"].get<int64_t>() * (half ? 1 : 2) == on_device * (half ? 1 : 3));
    REQUIRE(o[3]["mem"]["param"]["current"] == p[3]["mem"]["param"]["current"]);
    REQUIRE(o[3]["mem"]["grad"]["current"] == p[3]["mem"]["grad"]["current"]);
  }
  refuses(mpirun(2) + args + (d.path / "q.jsonl").string() + " --strategy zero2 --device cpu:1 --offload params",
          "--offload params moves parameter shards to the host; --strategy zero2 keeps whole parameters");
  refuses(mpirun(2) + args + (d.path / "q.jsonl").string() + " --strategy ddp --offload optimizer",
          "--offload is for the sharded strategies");
}

TEST_CASE("a checkpoint saved under one layout resumes under any other with the uninterrupted losses", "[cli][mpi][ckpt]") {
  TempDir d;
  // with dropout (kSmall's 0.1): the masks are the same under every layout, before and after
  const std::string args = " train " + kSmall + " --n-layer 2 --micro-batch-size 2 --steps 6 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  REQUIRE(one.code == 0);
  auto a = read_log(d.path / "one.jsonl");
  REQUIRE(a.size() == 6);
  // saved at step 3 by zero3 on 4 ranks (each rank holds a quarter of every unit)
  const std::string run = (d.path / "run").string();
  Run saved = run_command(mpirun(4) + args + (d.path / "z.jsonl").string() + " --strategy zero3 --steps 3 --save " + run);
  INFO(saved.output);
  REQUIRE(saved.code == 0);
  REQUIRE(fs::exists(d.path / "run" / "step_00000003" / "rank_00003.safetensors"));
  const auto saving = read_log(d.path / "z.jsonl");  // kept alive: the loop walks one of its members
  for (const auto& rank : saving.at(0)["ranks"]) CHECK(rank["comm"]["broadcast"]["calls"] > 0);
  const std::vector<std::pair<int, std::string>> layouts = {
      {4, "--tp 2 --pp 2"}, {2, "--strategy zero2"}, {4, "--strategy ddp --tp 2"}, {2, "--strategy fsdp-grad-op"},
      {4, "--pp 2 --strategy zero3"}, {4, "--strategy zero2 --tp 2 --bucket-mb 0.01"}, {1, ""}};  // zero2 x tp: sharded accumulation
  for (size_t k = 0; k < layouts.size(); ++k) {
    INFO(layouts[k].second);
    const fs::path log = log_path(d, "r", k);
    const std::string launch = layouts[k].first > 1 ? mpirun(layouts[k].first) : std::string(SG_BINARY);
    Run r = run_command(launch + args + log.string() + " " + layouts[k].second + " --resume " + run);
    INFO(r.output);
    REQUIRE(r.code == 0);
    auto b = read_log(log);
    REQUIRE(b.size() == 3);
    // The FSDP family reads its shards from the checkpoint: no unit is broadcast at setup (the
    // saving run's first step counts its setup's broadcasts, one a unit).
    if (layouts[k].second.find("zero3") != std::string::npos || layouts[k].second.find("fsdp") != std::string::npos)
      for (const auto& rank : b[0]["ranks"]) CHECK(rank["comm"]["broadcast"]["calls"] == 0);
    for (size_t i = 0; i < 3; ++i) {
      REQUIRE(b[i]["step"] == a[i + 3]["step"]);
      REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i + 3]["loss"].get<double>()) <= 1e-5 * a[i + 3]["loss"].get<double>());
    }
  }
  // saved by zero3 under a pipeline (each stage's shards; the tied embedding once, from the first
  // stage), resumed by one process
  const std::string piped = (d.path / "piped").string();
  Run zp = run_command(mpirun(4) + args + (d.path / "zp.jsonl").string() + " --pp 2 --strategy zero3 --steps 3 --save " + piped);
  INFO(zp.output);
  REQUIRE(zp.code == 0);
  Run from_zp = shardgrad(args + (d.path / "fzp.jsonl").string() + " --resume " + piped);
  INFO(from_zp.output);
  REQUIRE(from_zp.code == 0);
  auto c = read_log(d.path / "fzp.jsonl");
  REQUIRE(c.size() == 3);
  for (size_t i = 0; i < 3; ++i)
    REQUIRE(std::abs(c[i]["loss"].get<double>() - a[i + 3]["loss"].get<double>()) <= 1e-5 * a[i + 3]["loss"].get<double>());
  // consolidated into one Hugging Face-named file that train and generate read back
  const std::string hf = (d.path / "model.safetensors").string();
  Run ex = shardgrad("export " + run + " --out " + hf);
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  Run gen = shardgrad("generate --from " + run + " --prompt 12+34= --max-new-tokens 4");
  INFO(gen.output);
  REQUIRE(gen.code == 0);
}

TEST_CASE("pipeline (every schedule) and tensor parallelism (with and without sequence parallelism) give the single-process losses", "[cli][mpi]") {
  TempDir d;
  // 2 layers over 2 stages; micro-batches of 2 rows: 4 per step for the pipeline
  const std::string args = " train " + kSmall + " --n-layer 2 --n-head 2 --seq-len 26 --micro-batch-size 2 --steps 3 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  REQUIRE(one.code == 0);
  auto a = read_log(d.path / "one.jsonl");
  REQUIRE(a.size() == 3);
  const std::vector<std::string> layouts = {"--pp 2 --pp-schedule gpipe", "--pp 2 --pp-schedule 1f1b",
                                            "--pp 2 --pp-schedule interleaved --virtual-stages 1",
                                            "--tp 2", "--tp 2 --sequence-parallel"};
  for (size_t k = 0; k < layouts.size(); ++k) {
    INFO(layouts[k]);
    const fs::path log = log_path(d, "l", k);
    Run two = run_command(mpirun(2) + args + log.string() + " " + layouts[k]);
    INFO(two.output);
    REQUIRE(two.code == 0);
    auto b = read_log(log);
    REQUIRE(b.size() == 3);
    for (size_t i = 0; i < 3; ++i) REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i]["loss"].get<double>()) <= 1e-5 * a[i]["loss"].get<double>());
  }
  // the measured pipeline timeline, of the last step run when the run stops early
  Run t = run_command(mpirun(2) + args + (d.path / "t.jsonl").string() + " --pp 2 --stop-at 2 --timeline " +
                      (d.path / "t.svg").string());
  INFO(t.output);
  REQUIRE(t.code == 0);
  REQUIRE(t.output.find("measured bubble") != std::string::npos);
  REQUIRE(fs::file_size(d.path / "t.svg") > 1000);
}

TEST_CASE("ranks that find different checkpoints to resume are refused, naming the steps", "[cli][mpi]") {
  TempDir d;
  const std::string a = (d.path / "a").string(), b = (d.path / "b").string(), bin = std::string(SG_BINARY);
  fs::create_directories(a);
  fs::create_directories(b);
  REQUIRE(run_command("cd " + a + " && " + bin + " train " + kSmall + " --steps 4 --stop-at 2 --save run").code == 0);
  // each rank in its own working folder: a relative --save that only rank 0 sees a step in, as on
  // nodes without a shared filesystem
  const std::string args = " " + bin + " train " + kSmall + " --strategy ddp --steps 4 --save run --resume auto";
  refuses(sg::testing::mpirun_command(1) + "-wdir " + a + args + " : -np 1 -wdir " + b + args,
          "the ranks resume from different steps (0 to 2");
}

// The synthetic task's vocabulary pads to 64 rows, which 3 does not divide: under --tp 3 it pads
// to 192, zero rows that no loss sees; the checkpoint holds the real rows, so the run resumes in
// one process (64 rows again) with the uninterrupted run's losses.
TEST_CASE("tp 3 pads the vocabulary for its split, and its checkpoint resumes in one process", "[cli][mpi]") {
  TempDir d;
  const std::string args = " train " + kSmall + " --n-head 3 --n-embd 48 --steps 4 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  REQUIRE(one.code == 0);
  const auto a = read_log(d.path / "one.jsonl");
  const std::string save = (d.path / "run").string();
  Run three = run_command(mpirun(3) + args + (d.path / "three.jsonl").string() + " --tp 3 --stop-at 2 --save " + save);
  INFO(three.output);
  REQUIRE(three.code == 0);
  CHECK(three.output.find("(padded 192)") != std::string::npos);
  Run rest = shardgrad("train --resume auto --save " + save + " --log-json " + (d.path / "rest.jsonl").string());
  INFO(rest.output);
  REQUIRE(rest.code == 0);
  CHECK(rest.output.find("(padded 64)") != std::string::npos);
  auto b = read_log(d.path / "three.jsonl");
  for (const auto& r : read_log(d.path / "rest.jsonl")) b.push_back(r);
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    INFO("step " << i + 1);
    CHECK(b[i]["loss"].get<double>() == Approx(a[i]["loss"].get<double>()).epsilon(1e-5));
  }
}

TEST_CASE("impossible layouts are refused before any work, with the reason", "[cli][mpi]") {
  refuses(mpirun(2) + " train " + kSmall + " --tp 3", "--tp 3 x --pp 1 = 3 ranks per model replica does not divide the 2 ranks");
  refuses(mpirun(2) + " train " + kSmall + " --tp 2 --pp 2", "does not divide the 2 ranks launched");
  // copies of a one-process run would write one folder (and log) twice over
  refuses(mpirun(2) + " train " + kSmall + " --save never_written", "mpirun started 2 processes, but --strategy single "
          "trains in each on its own, and all 2 would write --save never_written");
  CHECK(!fs::exists("never_written"));
  refuses(mpirun(2) + " train " + kSmall + " --n-head 3 --n-embd 48 --tp 2", "--tp 2: 3 heads cannot be split 2 ways");
  refuses(mpirun(2) + " train " + kSmall + " --n-layer 3 --pp 2", "--pp 2: 3 layers cannot be split evenly into 2 stages");
  // the schedule's flags are named before the layer split they change is checked
  refuses(mpirun(2) + " train " + kSmall + " --n-layer 3 --pp 2 --pp-schedule zigzag", "unknown schedule 'zigzag'");
  refuses(mpirun(2) + " train " + kSmall + " --n-layer 2 --pp 2 --virtual-stages 2",
          "--virtual-stages 2 is for --pp-schedule interleaved (1f1b runs one chunk of layers per rank)");
  refuses(mpirun(2) + " train " + kSmall + " --strategy zero3 --reshard-after-forward false",
          "--reshard-after-forward false with full sharding (zero3, fsdp) is shard_grad_op: give --strategy fsdp-grad-op");
}

// Step by step, b's losses and gradient norms equal a's to `tol` (relative).
void same_losses_and_norms(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b, double tol = 1e-5) {
  REQUIRE(b.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(std::abs(b[i]["loss"].get<double>() - a[i]["loss"].get<double>()) <= tol * a[i]["loss"].get<double>());
    REQUIRE(std::abs(b[i]["grad_norm"].get<double>() - a[i]["grad_norm"].get<double>()) <=
            tol * a[i]["grad_norm"].get<double>());
  }
}

// The layout tests' model and run, 3 steps; the flags that follow end with --log-json.
const std::string kLayoutRun = " train --n-layer 4 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 8 "
                               "--micro-batch-size 2 --steps 3 --threads 1 --eval-every 0 ";

// The one-process run of `args` (ending in --log-json) logged to dir/one.jsonl: its 3 records.
std::vector<nlohmann::json> one_process(const std::string& args, const fs::path& dir, Run* run = nullptr) {
  Run one = shardgrad(args + (dir / "one.jsonl").string());
  INFO(one.output);
  REQUIRE(one.code == 0);
  if (run) *run = one;
  auto a = read_log(dir / "one.jsonl");
  REQUIRE(a.size() == 3);
  return a;
}

// `args` (ending in --log-json) + log + `layout` on `ranks` processes: it succeeds and gives the
// one-process records a; its records.
std::vector<nlohmann::json> matches_one_process(const std::vector<nlohmann::json>& a, int ranks, const std::string& args,
                                                const std::string& layout, const fs::path& log, Run* run = nullptr) {
  INFO(layout);
  Run r = run_command(mpirun(ranks) + args + log.string() + " " + layout);
  INFO(r.output);
  REQUIRE(r.code == 0);
  if (run) *run = r;
  auto b = read_log(log);
  same_losses_and_norms(a, b);
  return b;
}

// The number after `key` in a progress line ("val loss 2.3456"), or NaN.
double number_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  return at == std::string::npos ? std::nan("") : std::atof(text.c_str() + at + key.size());
}

TEST_CASE("3-D layouts (dp x tp x pp, ddp, zero1/2, zero3, hsdp or no-shard across dp, with and without sequence parallelism) give the single-process losses and gradient norms", "[cli][mpi]") {
  TempDir d;
  const std::string args = kLayoutRun + "--log-json ";
  Run one;
  auto a = one_process(args, d.path, &one);
  const std::vector<std::pair<int, std::string>> layouts = {
      {4, "--tp 2 --strategy ddp"},
      {4, "--pp 2 --strategy ddp --pp-schedule interleaved --virtual-stages 2"},
      {4, "--tp 2 --pp 2"},
      {4, "--tp 2 --pp 2 --sequence-parallel"},
      {8, "--tp 2 --pp 2 --strategy ddp"},
      {4, "--tp 2 --strategy zero1 --sequence-parallel"},
      {4, "--pp 2 --strategy zero2"},
      {4, "--tp 2 --strategy zero3"},
      {4, "--tp 2 --strategy zero3 --sequence-parallel"},
      {8, "--tp 2 --pp 2 --strategy zero2 --pp-schedule gpipe"},
      {4, "--pp 2 --strategy zero3"},
      {4, "--pp 2 --strategy zero3 --prefetch both"},
      {4, "--pp 2 --strategy fsdp --pp-schedule interleaved --virtual-stages 2"},
      {4, "--pp 2 --strategy fsdp --pp-schedule interleaved --virtual-stages 2 --prefetch both"},
      {8, "--tp 2 --pp 2 --strategy zero3 --sequence-parallel"},
      {8, "--tp 2 --strategy hsdp --shard-group-size 2"},
      {8, "--pp 2 --strategy hsdp --shard-group-size 2 --pp-schedule gpipe"},
      {4, "--pp 2 --strategy no-shard"},
      {4, "--pp 2 --strategy fsdp-grad-op"},
      {4, "--pp 2 --strategy hsdp --shard-group-size 2 --reshard-after-forward false --pp-schedule interleaved --virtual-stages 2"}};
  std::map<std::string, int64_t> param_bytes, param_peak;  // rank 0's after the step and at its peak, by layout
  for (size_t k = 0; k < layouts.size(); ++k) {
    INFO(layouts[k].second);
    Run r;
    auto b = matches_one_process(a, layouts[k].first, args, layouts[k].second, log_path(d, "l", k), &r);
    INFO(r.output);
    {
      // the progress line shows the range of the ranks' peaks (they differ under a pipeline)
      int64_t lo = INT64_MAX, hi = 0;
      for (const auto& rk : b[2]["ranks"]) {
        lo = std::min(lo, rk["mem"]["total"]["peak"].get<int64_t>());
        hi = std::max(hi, rk["mem"]["total"]["peak"].get<int64_t>());
      }
      auto human = [](int64_t v) {  // the progress line's units: KiB below 1 MiB, MiB below 1 GiB
        char buf[32];
        if (v < (1 << 20)) std::snprintf(buf, sizeof buf, "%.1f KiB", double(v) / 1024.0);
        else std::snprintf(buf, sizeof buf, "%.1f MiB", double(v) / double(1 << 20));
        return std::string(buf);
      };
      const std::string a = human(lo), b = human(hi);
      const bool same_unit = a.substr(a.find(' ')) == b.substr(b.find(' '));
      const std::string want = "peak/rank " + (a == b ? b : same_unit ? a.substr(0, a.find(' ')) + "-" + b : a + "-" + b);
      const size_t at = r.output.find("step     3/3");
      REQUIRE(at != std::string::npos);
      REQUIRE(r.output.substr(at, r.output.find('\n', at) - at).find(want) != std::string::npos);
      if (layouts[k].second.find("--pp 2 --strategy zero3") == 0) REQUIRE(lo < hi);
    }
    param_bytes[layouts[k].second] = b[2]["mem"]["param"]["current"].get<int64_t>();
    param_peak[layouts[k].second] = b[2]["mem"]["param"]["peak"].get<int64_t>();
    if (layouts[k].second.find("--prefetch both") != std::string::npos) {
      // rank 0 runs 2 micro-batches a step. Under 1F1B (stage 0: h.0, h.1) each forward gathers
      // h.0 as it begins and h.1 while h.0 runs, each backward h.1 as it begins and h.0 while h.1
      // runs: 8 gathers ahead a step. Interleaved (chunks h.0 and h.2, one unit each): each of
      // the 8 actions gathers its unit as it begins.
      REQUIRE(b[2]["fsdp"]["gathers_ahead"] == 3 * 8);
    } else if (b[2].contains("fsdp")) {
      REQUIRE(b[2]["fsdp"]["gathers_ahead"] == 0);
    }
    if (layouts[k].second.rfind("--pp 2 --strategy zero3", 0) == 0) {  // with and without prefetch
      // rank 0 (stage 0: wte, wpe and 2 blocks; 2 micro-batches a step): the two root units are
      // gathered once a step and reduced once; each block unit is gathered for every forward and
      // again for every backward, and reduced after every backward (counters since the start)
      const nlohmann::json& comm = b[2]["ranks"][0]["comm"];
      REQUIRE(comm["all_gather"]["calls"] == 3 * (2 + 2 * 2 * 2));
      REQUIRE(comm["reduce_scatter"]["calls"] == 3 * (2 + 2 * 2));
    }
    if (layouts[k].second.find("fsdp-grad-op") != std::string::npos ||
        layouts[k].second.find("--reshard-after-forward false") != std::string::npos) {
      // every unit of rank 0 (wte, wpe, and h.0, h.1 under 1F1B or h.0, h.2 interleaved) stays
      // gathered from its first forward to the step's end: gathered once and reduced once a step,
      // whatever the 2 micro-batches
      const nlohmann::json& comm = b[2]["ranks"][0]["comm"];
      REQUIRE(comm["all_gather"]["calls"] == 3 * 4);
      REQUIRE(comm["reduce_scatter"]["calls"] == 3 * 4);
    }
    // under a pipeline every rank's step record has its busy time from its own place in the
    // pipeline (the mesh makes that differ from its world rank)
    if (layouts[k].second.find("--pp") != std::string::npos) {
      REQUIRE(b[2]["ranks"].size() == size_t(layouts[k].first));
      for (const auto& rk : b[2]["ranks"]) REQUIRE(rk.value("busy_s", 0.0) > 0);
    }
    // the final evaluation runs under tp and pp too (every rank of the first replica; the last
    // stage's logits sent to every stage, their vocabulary slices gathered; under sequence
    // parallelism the prompts padded to a multiple of tp) and sees the same model: the same
    // validation loss and the same greedy answers
    const nlohmann::json& ev = b.back()["eval"];
    const nlohmann::json& ref = a.back()["eval"];
    REQUIRE(std::abs(ev["val_loss"].get<double>() - ref["val_loss"].get<double>()) <= 1e-5 * ref["val_loss"].get<double>());
    REQUIRE(std::abs(number_after(r.output, "val loss ") - number_after(one.output, "val loss ")) <= 2e-4);
    REQUIRE(r.output.find("task accuracy") != std::string::npos);
    REQUIRE(ev["accuracy"] == ref["accuracy"]);
    REQUIRE(ev["examples"] == ref["examples"]);
  }
  // zero3 under the pipeline: rank 0 holds the same stages (wte, wpe, h.0, h.2) as under ddp, half
  // of them over dp 2, up to one padding element in each of its 4 units
  const int64_t replicated = param_bytes.at("--pp 2 --strategy ddp --pp-schedule interleaved --virtual-stages 2");
  const int64_t sharded = param_bytes.at("--pp 2 --strategy fsdp --pp-schedule interleaved --virtual-stages 2");
  REQUIRE(replicated > 0);
  REQUIRE(2 * sharded >= replicated);
  REQUIRE(2 * sharded <= replicated + 2 * 4 * 4);
  // prefetch under the pipeline: stage 0's chunk is h.0-h.1, so gathering h.1 while h.0 runs
  // holds one more block unit (the same gathers, made earlier); the interleaved rank 0's chunks
  // are h.0 and h.2, one unit each, so there is nothing to prefetch and no other chunk is gathered
  const int64_t C = 32, block_bytes = 4 * (12 * C * C + 13 * C);  // one gathered block unit, f32
  REQUIRE(param_peak.at("--pp 2 --strategy zero3 --prefetch both") - param_peak.at("--pp 2 --strategy zero3") == block_bytes);
  REQUIRE(param_peak.at("--pp 2 --strategy fsdp --pp-schedule interleaved --virtual-stages 2 --prefetch both") ==
          param_peak.at("--pp 2 --strategy fsdp --pp-schedule interleaved --virtual-stages 2"));
  // fsdp-grad-op under the pipeline holds both of rank 0's blocks gathered at once, zero3 one
  REQUIRE(param_peak.at("--pp 2 --strategy fsdp-grad-op") - param_peak.at("--pp 2 --strategy zero3") == block_bytes);
  refuses(mpirun(4) + args + (d.path / "s.jsonl").string() + " --tp 2",
          "leaves dp = 2: the data-parallel replicas need a --strategy");
}

TEST_CASE("train --init-from under tp, sequence parallelism, pp and zero3: each rank takes its slices of the file, the single-process losses", "[cli][mpi]") {
  TempDir d;
  // a model of vocabulary 61 (64 rows: under tp 2 each rank holds real rows of wte), exported to a
  // Hugging Face file after 2 steps so that no tensor holds its initial values
  const std::string model = " --data random:61 --n-layer 4 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 8 "
                            "--micro-batch-size 2 --threads 1 --eval-every 0 --eval-batches 1 ";
  REQUIRE(shardgrad("train" + model + "--steps 2 --save " + (d.path / "run").string()).code == 0);
  const std::string file = (d.path / "hf" / "model.safetensors").string();
  REQUIRE(shardgrad("export " + (d.path / "run").string() + " --out " + file).code == 0);
  const std::string args = " train" + model + "--steps 3 --seed 7 --init-from " + file + " --log-json ";
  const auto a = one_process(args, d.path);
  // the file's weights, not a fresh initialisation: the seed's own model starts elsewhere
  Run fresh = shardgrad("train" + model + "--steps 1 --seed 7 --log-json " + (d.path / "fresh.jsonl").string());
  REQUIRE(fresh.code == 0);
  CHECK(std::abs(read_log(d.path / "fresh.jsonl")[0]["loss"].get<double>() - a[0]["loss"].get<double>()) > 1e-3);
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, "--tp 2"}, {2, "--tp 2 --sequence-parallel"}, {4, "--tp 2 --pp 2 --strategy ddp"}, {4, "--tp 2 --strategy zero3"},
      {4, "--pp 2 --strategy zero3"}};  // zero3: each unit's tensors read as the unit is made, its stages' alone
  for (size_t k = 0; k < layouts.size(); ++k)
    matches_one_process(a, layouts[k].first, args, layouts[k].second, log_path(d, "l", k));
  // a file of another width than the flags ask for is refused before any step, under tp too
  Run other = run_command(mpirun(2) + " train --data random:61 --n-layer 4 --n-embd 64 --n-head 2 --seq-len 16 "
                          "--batch-size 8 --threads 1 --steps 1 --tp 2 --init-from " + file);
  INFO(other.output);
  CHECK(other.code != 0);
  CHECK(other.output.find("does not match --init-from") != std::string::npos);
}

TEST_CASE("with dropout every layout draws the single-process masks and gives its losses, and evaluation runs without dropout", "[cli][mpi]") {
  TempDir d;
  const std::string args = kLayoutRun + "--dropout 0.1 --log-json ";
  const auto a = one_process(args, d.path);
  // masks follow the element's place in the step's batch (row, position), not the rank, the
  // micro-batch or the order of the calls
  const std::vector<std::pair<int, std::string>> layouts = {
      {1, "--micro-batch-size 4"},
      {1, "--recompute full"},
      {1, "--eval-every 1"},  // evaluating between steps takes nothing from training's masks
      {1, "--strategy dp"},
      {2, "--strategy ddp"},
      {2, "--strategy zero3"},
      {2, "--tp 2 --sequence-parallel"},
      {2, "--pp 2 --pp-schedule interleaved --virtual-stages 2"},
      {8, "--tp 2 --pp 2 --strategy zero1 --sequence-parallel"}};
  for (size_t k = 0; k < layouts.size(); ++k)
    matches_one_process(a, layouts[k].first, args, layouts[k].second, log_path(d, "l", k));
  // with a learning rate of 1e-12 the weights stay as initialised (to 1e-12): the validation loss is
  // the same whatever the dropout, as evaluation drops nothing (with dropout it moves by ~1e-2)
  std::map<std::string, double> val;
  for (const char* p : {"0", "0.1", "0.5"}) {
    const fs::path log = log_path(d, "p", p);
    Run r = shardgrad(" train --n-layer 2 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 8 --steps 1 --threads 1 "
                      "--eval-every 0 --lr 1e-12 --min-lr 0 --dropout " + std::string(p) + " --log-json " + log.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    val[p] = read_log(log).back()["eval"]["val_loss"].get<double>();
  }
  CHECK(val["0.1"] == Approx(val["0"]).epsilon(1e-9));
  CHECK(val["0.5"] == Approx(val["0"]).epsilon(1e-9));
}

TEST_CASE("evaluation runs training's micro-batches: the same val loss as whole batches, its peak below a training step's", "[cli]") {
  TempDir d;
  // A 4096-token vocabulary so that the logits dominate; learning rate ~0 so both runs evaluate
  // the same weights whatever their micro-batches.
  const std::string args = " train --data random --vocab-size 4096 --n-layer 2 --n-embd 32 --n-head 2 --seq-len 32 "
                           "--batch-size 16 --steps 1 --threads 1 --eval-every 0 --lr 1e-12 --min-lr 0 --log-json ";
  std::map<int, nlohmann::json> last;
  for (int micro : {2, 16}) {
    const fs::path log = log_path(d, "m", std::to_string(micro));
    Run r = shardgrad(args + log.string() + " --micro-batch-size " + std::to_string(micro));
    INFO(r.output);
    REQUIRE(r.code == 0);
    last[micro] = read_log(log).back();
    REQUIRE(last[micro]["eval"].contains("mem"));
  }
  const auto peak = [](const nlohmann::json& mem) { return mem["activation"]["peak"].get<int64_t>(); };
  CHECK(last[2]["eval"]["val_loss"].get<double>() == Approx(last[16]["eval"]["val_loss"].get<double>()).epsilon(1e-6));
  // 2 rows a forward: an eighth of the 16-row forward's logits (whole batches held 8x)
  CHECK(peak(last[2]["eval"]["mem"]) * 4 < peak(last[16]["eval"]["mem"]));
  CHECK(peak(last[2]["eval"]["mem"]) <= peak(last[2]["mem"]));  // no more than a training step
}

TEST_CASE("bf16 and fp16 under ddp, zero2, tp, pp and their compositions stay with the single-process run, a bf16 pipeline's f32 masters resume in one process", "[cli][mpi]") {
  TempDir d;
  const std::string args = " train --n-layer 2 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 8 --micro-batch-size 2 "
                           "--threads 1 --eval-every 0 --dropout 0 --log-json ";
  // f32 masters everywhere; what differs is where bf16/f16 rounding happens (split GEMMs under tp,
  // reduction orders): a stated bound, as for the FSDP family
  const double tol = 2e-3;
  for (const char* dtype : {"bf16", "fp16"}) {
    INFO(dtype);
    const std::string dt = std::string(" --dtype ") + dtype;
    Run one = shardgrad(args + (d.path / "one.jsonl").string() + dt + " --steps 4");
    INFO(one.output);
    REQUIRE(one.code == 0);
    auto a = read_log(d.path / "one.jsonl");
    REQUIRE(a.size() == 4);
    const std::vector<std::pair<int, std::string>> layouts = {
        {2, "--strategy ddp"}, {2, "--strategy zero2"},
        {2, "--pp 2"}, {2, "--tp 2"}, {4, "--pp 2 --strategy ddp --pp-schedule interleaved --virtual-stages 1"},
        {4, "--tp 2 --pp 2"}, {4, "--tp 2 --strategy zero3 --sequence-parallel"}, {4, "--pp 2 --strategy zero1"},
        {4, "--pp 2 --strategy zero3"}};
    for (size_t k = 0; k < layouts.size(); ++k) {
      INFO(layouts[k].second);
      const fs::path log = log_path(d, "m", k);
      Run r = run_command(mpirun(layouts[k].first) + args + log.string() + dt + " --steps 4 " + layouts[k].second);
      INFO(r.output);
      REQUIRE(r.code == 0);
      auto b = read_log(log);
      same_losses_and_norms(a, b, tol);
      for (const auto& rec : b) REQUIRE_FALSE(rec["skipped"].get<bool>());
    }
  }
  // a bf16 pipeline saves its stages' f32 masters (the tied embedding's from the first stage);
  // one process resumes from them and continues as the uninterrupted run does
  const std::string run = (d.path / "run").string();
  Run saved = run_command(mpirun(2) + args + (d.path / "s.jsonl").string() + " --dtype bf16 --steps 2 --pp 2 --save " + run);
  INFO(saved.output);
  REQUIRE(saved.code == 0);
  Run whole = shardgrad(args + (d.path / "w.jsonl").string() + " --dtype bf16 --steps 4");
  Run resumed = shardgrad(args + (d.path / "r.jsonl").string() + " --dtype bf16 --steps 4 --resume " + run);
  INFO(resumed.output);
  REQUIRE(whole.code == 0);
  REQUIRE(resumed.code == 0);
  auto w = read_log(d.path / "w.jsonl"), r = read_log(d.path / "r.jsonl");
  REQUIRE(r.size() == 2);
  // measured: 2e-6 apart at step 4 (the pipeline's rounding in steps 1-2); masters seeded from the
  // bf16 weights instead would put it 5.6e-5 apart
  for (size_t i = 0; i < 2; ++i) REQUIRE(std::abs(r[i]["loss"].get<double>() - w[i + 2]["loss"].get<double>()) <= 1e-5 * w[i + 2]["loss"].get<double>());
}

TEST_CASE("fp16 data parallelism skips no step that one process does not: an average's parts are divided before the sum", "[cli][mpi]") {
  // At the loss scaler's first scale this model's fp16 gradients are finite but more than half of
  // f16's 65504: summed over 2 ranks before dividing, step 1 overflowed and was skipped (4 ranks:
  // steps 1 and 2), and the runs parted from the single process.
  TempDir d;
  const std::string args = " train --n-layer 4 --steps 5 --batch-size 16 --eval-every 0 --eval-batches 1 "
                           "--eval-problems 8 --threads 1 --dtype fp16 --log-json ";
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  INFO(one.output);
  REQUIRE(one.code == 0);
  const auto a = read_log(d.path / "one.jsonl");
  for (const auto& rec : a) REQUIRE_FALSE(rec["skipped"].get<bool>());
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, "--strategy ddp"}, {2, "--strategy zero2"}, {2, "--strategy zero3"}, {4, "--strategy ddp"}};
  for (size_t k = 0; k < layouts.size(); ++k) {
    INFO(layouts[k].first << " ranks " << layouts[k].second);
    const fs::path log = log_path(d, "r", k);
    Run r = run_command(mpirun(layouts[k].first) + args + log.string() + " " + layouts[k].second);
    INFO(r.output);
    REQUIRE(r.code == 0);
    const auto b = read_log(log);
    for (const auto& rec : b) CHECK_FALSE(rec["skipped"].get<bool>());
    same_losses_and_norms(a, b, 2e-3);
  }
}

TEST_CASE("the progress line's MFU: tokens/s times the model FLOPs per token over the devices' peak", "[cli][mpi]") {
  // A known GPU's dense half-precision peak comes from its name (auto); CPUs and unknown parts
  // have none unless --peak-tflops gives it.
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA H200") == 989);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA H100 80GB HBM3") == 989);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA GH200 480GB") == 989);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA H100 PCIe") == 756);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA H100 NVL") == 0);
  CHECK(sg::kernels::half_peak_tflops_of("NVIDIA L4") == 0);
  CHECK(sg::kernels::half_peak_tflops(sg::Device::cpu()) == 0);
  TempDir d;
  // kSmall: 1 layer, width 32, T = 32 rows of wpe, the synthetic task's 13 tokens padded to 64 rows.
  const double C = 32, T = 32, L = 1, Vp = 64;
  const double params = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C;
  const double flops_per_token = 6 * (params - T * C) + 12 * L * T * C;
  const std::string args = " train " + kSmall + " --block-size 32 --steps 3 --log-json ";
  for (int ranks : {1, 2}) {
    INFO(ranks << " ranks");
    const fs::path log = log_path(d, "m", ranks);
    Run r = run_command((ranks == 1 ? std::string(SG_BINARY) : mpirun(2) + " ") + args + log.string() +
                        " --peak-tflops 0.05" + (ranks > 1 ? " --strategy ddp" : ""));
    INFO(r.output);
    REQUIRE(r.code == 0);
    REQUIRE(r.output.find("% | peak") != std::string::npos);
    for (const auto& rec : read_log(log))
      REQUIRE(rec["mfu"].get<double>() ==
              Approx(rec["tokens_per_s"].get<double>() * flops_per_token / (ranks * 0.05e12)).epsilon(1e-12));
  }
  Run plain = shardgrad(args + (d.path / "p.jsonl").string());
  REQUIRE(plain.code == 0);
  REQUIRE(plain.output.find("MFU") == std::string::npos);  // a CPU's peak is not guessed
  REQUIRE_FALSE(read_log(d.path / "p.jsonl")[0].contains("mfu"));
  refuses(std::string(SG_BINARY) + args + (d.path / "x.jsonl").string() + " --peak-tflops -1",
          "--peak-tflops must be auto or >= 0, got -1");
}

TEST_CASE("train's wsd and linear schedules: the log's learning rates, through a resume", "[cli]") {
  TempDir d;
  const std::string args = "train " + kSmall + " --steps 12 --warmup-steps 2 --lr 1e-3 --min-lr 1e-4 --log-json ";
  // wsd: warmup 2 steps, stable, the last 4 steps (and step 12's end) a line from 1e-3 to 1e-4.
  REQUIRE(shardgrad(args + (d.path / "w.jsonl").string() + " --lr-schedule wsd --decay-steps 4 --save " +
                    (d.path / "w").string() + " --stop-at 6").code == 0);
  REQUIRE(shardgrad(args + (d.path / "w.jsonl").string() + " --save " + (d.path / "w").string() + " --resume auto").code == 0);
  const std::vector<double> wsd = {5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4};
  const auto w = read_log(d.path / "w.jsonl");
  REQUIRE(w.size() == wsd.size());
  for (size_t i = 0; i < wsd.size(); ++i) CHECK(w[i]["lr"].get<double>() == Approx(wsd[i]).epsilon(1e-12));
  REQUIRE(shardgrad(args + (d.path / "l.jsonl").string() + " --lr-schedule linear").code == 0);
  const auto l = read_log(d.path / "l.jsonl");  // from 1e-3 at step 3 down by 9e-4 / 10 a step
  for (size_t i = 2; i < l.size(); ++i) CHECK(l[i]["lr"].get<double>() == Approx(1e-3 - 9e-5 * double(i - 2)).epsilon(1e-12));
  refuses(std::string(SG_BINARY) + " " + args + (d.path / "x.jsonl").string() + " --decay-steps 4",
          "--decay-steps sets the wsd schedule's decay, not cosine's");
  refuses(std::string(SG_BINARY) + " " + args + (d.path / "x.jsonl").string() + " --lr-schedule wsd --decay-steps 11",
          "--decay-steps must be in [0, steps - warmup steps] = [0, 10], got 11");
}

TEST_CASE("fp16's loss scale follows its flags step by step, resumes where it was, and can be held fixed", "[cli]") {
  TempDir d;
  const std::string args = "train " + kSmall + " --dtype fp16 --steps 14 --log-json ";
  const std::string dynamic = " --initial-loss-scale 16777216 --loss-scale-backoff 0.25 --loss-scale-window 3 "
                              "--loss-scale-growth 4 --min-loss-scale 16";
  Run r = shardgrad(args + (d.path / "a.jsonl").string() + dynamic + " --save " + (d.path / "a").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  // The scaler's rule replayed over the log: back off by 4 on an overflow (not below 16), grow by 4
  // after 3 clean steps in a row.
  const auto a = read_log(d.path / "a.jsonl");
  REQUIRE(a.size() == 14);
  double scale = 16777216;
  int clean = 0, backoffs = 0, growths = 0;
  for (const auto& rec : a) {
    INFO("step " << rec["step"]);
    REQUIRE(rec["loss_scale"].get<double>() == scale);
    if (rec["skipped"].get<bool>()) {
      scale = std::max(16.0, scale * 0.25), clean = 0, ++backoffs;
    } else if (++clean == 3) {
      scale *= 4, clean = 0, ++growths;
    }
  }
  REQUIRE(backoffs >= 2);  // the run met both rules, so both flags were read
  REQUIRE(growths >= 2);
  REQUIRE(r.output.find("| scale 1.67772e+07 | skipped (overflow)") != std::string::npos);
  // Stopped after step 7 (three clean steps at 65536) and resumed: step 8 grows the scale as in the
  // whole run, with the checkpoint's scale, clean count and the run's scaler flags.
  REQUIRE(shardgrad(args + (d.path / "b.jsonl").string() + dynamic + " --save " + (d.path / "b").string() +
                    " --stop-at 7").code == 0);
  Run resumed = shardgrad(args + (d.path / "b.jsonl").string() + " --save " + (d.path / "b").string() + " --resume auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  const auto b = read_log(d.path / "b.jsonl");
  REQUIRE(b.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(b[i]["loss_scale"] == a[i]["loss_scale"]);
    REQUIRE(b[i]["loss"] == a[i]["loss"]);
  }
  // The floor: nothing below --min-loss-scale, even when every step overflows.
  REQUIRE(shardgrad(args + (d.path / "m.jsonl").string() + " --initial-loss-scale 16777216 --min-loss-scale 4194304")
              .code == 0);
  for (const auto& rec : read_log(d.path / "m.jsonl")) REQUIRE(rec["loss_scale"].get<double>() >= 4194304);
  REQUIRE(read_log(d.path / "m.jsonl").back()["loss_scale"].get<double>() == 4194304);
  // A fixed scale: never moves; an overflowing one skips every step.
  for (const char* fixed : {"1024", "16777216"}) {
    INFO(fixed);
    REQUIRE(shardgrad(args + (d.path / "f.jsonl").string() + " --loss-scale " + fixed).code == 0);
    for (const auto& rec : read_log(d.path / "f.jsonl")) {
      REQUIRE(rec["loss_scale"].get<double>() == std::stod(fixed));
      REQUIRE(rec["skipped"].get<bool>() == (std::string(fixed) != "1024"));
    }
  }
  const std::string bad = std::string(SG_BINARY) + " train " + kSmall + " --steps 1 ";
  refuses(bad + "--initial-loss-scale 8", "--initial-loss-scale applies to --dtype fp16 only (fp32 trains without");
  refuses(bad + "--dtype bf16 --loss-scale 8", "--loss-scale applies to --dtype fp16 only (bf16");
  refuses(bad + "--dtype fp16 --loss-scale-backoff 1.5", "--loss-scale-backoff must be in (0, 1], got 1.5");
  refuses(bad + "--dtype fp16 --loss-scale-growth 0.5", "--loss-scale-growth must be >= 1, got 0.5");
  refuses(bad + "--dtype fp16 --min-loss-scale 131072", "--min-loss-scale must be > 0 and at most --initial-loss-scale");
  refuses(bad + "--dtype fp16 --loss-scale-window 0", "--loss-scale-window");
  refuses(bad + "--dtype fp16 --loss-scale 8 --initial-loss-scale 16", "give one of them");
  refuses(bad + "--dtype fp16 --loss-scale 1e6 --min-loss-scale 1e5",
          "--loss-scale 1e+06 is a fixed scale; --min-loss-scale is for a dynamic one");  // not checked against 65536
  refuses(bad + "--dtype fp16 --loss-scale 8 --loss-scale-window 4", "--loss-scale-window is for a dynamic one");
  // A loss that is not finite is the forward's (the f16 weights overflowed at this learning rate),
  // not the scaler's: --on-nonfinite's, which stops by default (it skipped every step, exit 0)
  const std::string blowup = bad + "--dtype fp16 --lr 1e5 --warmup-steps 0 --lr-schedule constant --steps 4";
  refuses(blowup, "(--on-nonfinite stop)", 1);
  Run skip = shardgrad("train " + kSmall + " --dtype fp16 --lr 1e5 --warmup-steps 0 --lr-schedule constant --steps 4 "
                       "--on-nonfinite skip");
  INFO(skip.output);
  REQUIRE(skip.code == 0);
  CHECK(skip.output.find("non-finite loss: skipped") != std::string::npos);
  CHECK(skip.output.find("| skipped (non-finite)") != std::string::npos);
  CHECK(skip.output.find("| skipped (overflow)") == std::string::npos);
  // A bf16 checkpoint holds no loss scale: resumed in fp16, the typed one applies
  const std::string half = (d.path / "half").string();
  REQUIRE(shardgrad("train " + kSmall + " --dtype bf16 --steps 4 --stop-at 2 --save " + half).code == 0);
  Run fp16 = shardgrad("train --resume auto --save " + half + " --dtype fp16 --initial-loss-scale 8 --log-json " +
                       (d.path / "h.jsonl").string());
  INFO(fp16.output);
  REQUIRE(fp16.code == 0);
  for (const auto& rec : read_log(d.path / "h.jsonl")) CHECK(rec["loss_scale"].get<double>() <= 8);
  refuses(bad + "--dtype fp16 --loss-scale -2", "--loss-scale must be > 0 (or 0: dynamic), got -2");
}

TEST_CASE("non-finite steps: --on-nonfinite stop names the step and the tensor, skip leaves the step out and counts it", "[cli][mpi]") {
  TempDir d;
  const std::string args = " train " + kSmall + " --dropout 0 --steps 4 --strategy ddp --inject-fault rank=1,step=2,kind=nan";
  Run stop = run_command(mpirun(2) + args);
  INFO(stop.output);
  REQUIRE(stop.code != 0);
  REQUIRE(stop.output.find("step 2: the gradient of '") != std::string::npos);
  REQUIRE(stop.output.find("--on-nonfinite stop") != std::string::npos);
  REQUIRE(stop.output.find("step     3/4") == std::string::npos);  // nothing ran after it
  const fs::path log = d.path / "skip.jsonl";
  Run skip = run_command(mpirun(2) + args + " --on-nonfinite skip --log-json " + log.string());
  INFO(skip.output);
  REQUIRE(skip.code == 0);
  REQUIRE(skip.output.find("step 2: non-finite loss: skipped (1 skipped so far)") != std::string::npos);
  auto b = read_log(log);
  REQUIRE(b.size() == 4);
  REQUIRE(b[1]["skipped"].get<bool>());
  for (size_t i : {0, 2, 3}) {
    REQUIRE(!b[i]["skipped"].get<bool>());
    REQUIRE(std::isfinite(b[i]["loss"].get<double>()));
    REQUIRE(std::isfinite(b[i]["grad_norm"].get<double>()));
  }
  // against the run without the fault: step 1 is the same; step 3 differs, since only the clean
  // run applied step 2's update
  Run clean = run_command(mpirun(2) + " train " + kSmall + " --dropout 0 --steps 4 --strategy ddp --log-json " + (d.path / "c.jsonl").string());
  REQUIRE(clean.code == 0);
  auto c = read_log(d.path / "c.jsonl");
  REQUIRE(c[0]["loss"].get<double>() == b[0]["loss"].get<double>());
  REQUIRE(c[2]["loss"].get<double>() != b[2]["loss"].get<double>());
  // Under a pipeline the NaN rides in the first stage's loss scale, which only the last stage's
  // backward would use: the stages still skip the step together (before, the last stage applied
  // it and the first did not), and the run goes on as one process skipping that step does.
  const std::string two = " train --n-layer 2 --n-embd 32 --n-head 2 --seq-len 32 --batch-size 8 --micro-batch-size 4 "
                          "--threads 1 --eval-every 0 --eval-batches 1 --eval-problems 8 --dropout 0 --steps 4 "
                          "--inject-fault rank=0,step=2,kind=nan --on-nonfinite skip --log-json ";
  Run one = shardgrad(two + (d.path / "one.jsonl").string());
  const fs::path pp_log = d.path / "pp.jsonl";
  Run pp = run_command(mpirun(2) + two + pp_log.string() + " --pp 2");
  INFO(one.output << pp.output);
  REQUIRE(one.code == 0);
  REQUIRE(pp.code == 0);
  auto o = read_log(d.path / "one.jsonl"), p = read_log(pp_log);
  REQUIRE(p.size() == 4);
  REQUIRE(o[1]["skipped"].get<bool>());
  REQUIRE(p[1]["skipped"].get<bool>());
  for (size_t i : {0, 2, 3}) CHECK(p[i]["loss"].get<double>() == Approx(o[i]["loss"].get<double>()).epsilon(1e-5));
}

// --simulate runs the ranks as threads on the meta device; its bytes must be the real run's. Two
// differences are known and exact or left out:
// - The CPU run's ledger also holds the host batch (inputs and targets, int64, all B rows), where
//   the meta device, like a GPU, holds its rank's B/dp rows copied in: (B - B/dp)·T·16 bytes more
//   activation on every rank of a real CPU run with dp > 1.
// - comm_buffer (and the peak of the sum) depends on how long reductions overlap the backward,
//   which the simulated collectives, done at once, do not; it is not compared.
// - A pipeline stage frees what it sent (an output, an input gradient) once the send completes,
//   which a simulated send does at once and a real one when the peer has received it: a real
//   run's activation and grad peaks lie between the simulated ones and those plus every byte the
//   rank sends in a step (all of its sends still in flight).
TEST_CASE("train --simulate: every rank's peak bytes and bytes sent are the real run's under mpirun", "[cli][mpi]") {
  struct Layout {
    int np, dp;
    int64_t T;
    std::string args;
  };
  const int64_t B = 128;  // the synthetic task's default batch
  for (const Layout& l : {Layout{1, 1, 13, ""}, Layout{2, 2, 13, "--strategy ddp"}, Layout{2, 2, 13, "--strategy zero2"},
                          Layout{2, 1, 14, "--tp 2 --sequence-parallel --seq-len 14"},
                          Layout{2, 1, 13, "--pp 2 --pp-schedule interleaved --virtual-stages 2 --n-layer 4"},
                          Layout{4, 2, 13, "--strategy zero3 --pp 2"},
                          Layout{4, 4, 13, "--strategy hsdp --shard-group-size 2"}}) {
    INFO(l.np << " ranks " << l.args);
    TempDir d;
    const std::string args = " --steps 3 " + l.args + " --log-json ";
    Run real = run_command(mpirun(l.np) + " train" + args + (d.path / "real.jsonl").string());
    INFO(real.output);
    REQUIRE(real.code == 0);
    Run sim = shardgrad("train --simulate " + std::to_string(l.np) + args + (d.path / "sim.json").string());
    INFO(sim.output);
    REQUIRE(sim.code == 0);
    REQUIRE(sim.output.find("meta device") != std::string::npos);
    const auto steps = read_log(d.path / "real.jsonl");
    const auto sims = read_log(d.path / "sim.json");
    REQUIRE(steps.size() == 3);
    REQUIRE(sims.size() == 1);
    const nlohmann::json& ranks = sims[0]["ranks"];
    REQUIRE(int(ranks.size()) == l.np);
    const int64_t host_batch = (B - B / l.dp) * l.T * 16;
    for (int r = 0; r < l.np; ++r) {
      INFO("rank " << r);
      const nlohmann::json& s = ranks[size_t(r)];
      REQUIRE(s["rank"] == r);
      for (const char* cat : {"param", "grad", "optim_state", "activation", "workspace"}) {
        INFO(cat);
        int64_t peak = 0;
        for (const auto& step : steps) peak = std::max(peak, step["ranks"][size_t(r)]["mem"][cat]["peak"].get<int64_t>());
        const int64_t extra = std::string(cat) == "activation" ? host_batch : 0, sim = s["peak"][cat].get<int64_t>();
        const bool sent = l.args.find("--pp") != std::string::npos &&
                          (std::string(cat) == "activation" || std::string(cat) == "grad");
        if (sent) {
          REQUIRE(peak >= sim + extra);
          REQUIRE(peak <= sim + extra + s["comm"]["send"]["bytes"].get<int64_t>());
        } else {
          REQUIRE(peak == sim + extra);
        }
        if (std::string(cat) == "param") REQUIRE(peak > 0);
      }
      for (const auto& [kind, v] : steps[2]["ranks"][size_t(r)]["comm"].items()) {
        INFO(kind);
        const nlohmann::json& before = steps[1]["ranks"][size_t(r)]["comm"][kind];
        REQUIRE(v["bytes"].get<int64_t>() - before["bytes"].get<int64_t>() == s["comm"][kind]["bytes"].get<int64_t>());
        REQUIRE(v["calls"].get<int64_t>() - before["calls"].get<int64_t>() == s["comm"][kind]["calls"].get<int64_t>());
      }
    }
  }
}

// ZeRO-Offload under --simulate: the offloaded state goes to a meta device standing for the host.
// The real run computes on cpu:1 and offloads to cpu:0, so its device ledger holds no host batch:
// both ledgers must match the simulation's to the byte.
TEST_CASE("train --simulate --offload: the host's optimizer state and parameter shards and the device's bytes are the real run's", "[cli][mpi]") {
  for (const char* off : {"optimizer", "params"}) {
    INFO("--offload " << off);
    TempDir d;
    const std::string args = std::string(" --steps 3 --strategy zero3 --offload ") + off + " --log-json ";
    Run real = run_command(mpirun(2) + " train --device cpu:1" + args + (d.path / "real.jsonl").string());
    INFO(real.output);
    REQUIRE(real.code == 0);
    Run sim = shardgrad("train --simulate 2" + args + (d.path / "sim.json").string());
    INFO(sim.output);
    REQUIRE(sim.code == 0);
    REQUIRE(sim.output.find("host (--offload)") != std::string::npos);
    const auto steps = read_log(d.path / "real.jsonl");
    const nlohmann::json s = read_log(d.path / "sim.json").at(0)["ranks"][0];
    REQUIRE(steps.size() == 3);
    for (const char* cat : {"param", "optim_state"})
      CHECK(steps.back()["mem_host"][cat]["peak"] == s["host_peak"][cat]);
    CHECK(s["host_peak"]["optim_state"].get<int64_t>() > 0);
    for (const char* cat : {"param", "grad", "optim_state", "activation"}) {
      INFO(cat);
      int64_t peak = 0;
      for (const auto& step : steps) peak = std::max(peak, step["ranks"][0]["mem"][cat]["peak"].get<int64_t>());
      CHECK(peak == s["peak"][cat].get<int64_t>());
    }
  }
}

TEST_CASE("zero3 frees its last reductions' buffers before the next micro-batch's forward, so two micro-batches peak as one", "[cli]") {
  // A 4096-token vocabulary makes the root unit (wte, reduced last in each backward) the largest;
  // its full-size reduction buffer held through the next forward raised the peak by a quarter.
  TempDir d;
  std::map<int, int64_t> peak;
  for (int batch : {2, 4}) {  // 1 and 2 micro-batches of 1 row per rank
    const fs::path log = log_path(d, "b", batch);
    Run r = shardgrad("train --simulate 2 --strategy zero3 --data random --vocab-size 4096 --seq-len 64 --micro-batch-size 1 "
                      "--steps 2 --batch-size " + std::to_string(batch) + " --log-json " + log.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    peak[batch] = read_log(log).back()["ranks"][0]["peak"]["total"].get<int64_t>();
  }
  CHECK(double(peak[4]) <= 1.01 * double(peak[2]));
}

TEST_CASE("train --simulate sizes what this machine cannot hold, and refuses what has no meaning there", "[cli]") {
  // gpt2-xl under zero3 on 8 ranks, bf16: ZeRO-3's optimizer state is (4 + 4 + 4)·Ψ/8 bytes per
  // rank (f32 master, m, v), on a machine with 24 GiB in all.
  TempDir d;
  Run r = shardgrad("train --simulate 8 --model gpt2-xl --strategy zero3 --dtype bf16 --batch-size 8 --seq-len 1024 "
                    "--data random --log-json " + (d.path / "xl.json").string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  REQUIRE(r.output.find("zero3 x 8") != std::string::npos);
  const auto sims = read_log(d.path / "xl.json");
  REQUIRE(sims.size() == 1);
  const int64_t psi = 1557686400;  // GPT2-XL's parameters, wte tied
  for (const auto& rank : sims[0]["ranks"]) {
    const int64_t optim = rank["peak"]["optim_state"].get<int64_t>();
    REQUIRE(optim >= 12 * psi / 8);
    REQUIRE(optim < 12 * psi / 8 + 12 * 8 * 64);  // each unit padded to a multiple of 8 elements
    REQUIRE(rank["comm"]["all_gather"]["bytes"].get<int64_t>() > 0);
  }
  refuses(std::string(SG_BINARY) + " train --simulate 2 --strategy ddp --save " + (d.path / "s").string(),
          "--save is not available with --simulate");
  refuses(std::string(SG_BINARY) + " train --simulate 2", "copies of one rank");
  refuses(std::string(SG_BINARY) + " train --simulate -1", "--simulate takes the number of ranks");
  refuses(std::string(SG_BINARY) + " train --simulate 0", "--simulate takes the number of ranks");
  // a GPT-2 preset without --data is sized on random tokens of its own vocabulary, not on the
  // synthetic task's 13
  Run preset = shardgrad("train --simulate 1 --model gpt2 --batch-size 1 --seq-len 64");
  INFO(preset.output);
  REQUIRE(preset.code == 0);
  CHECK(preset.output.find("model gpt2: 124.4") != std::string::npos);
  // More ranks than any device index of a real machine: zero1's optimizer state is 8 Ψp/N bytes,
  // Ψp the tiny model's 108,288 parameters padded to a multiple of 1030.
  Run many = shardgrad("train --simulate 1030 --strategy zero1 --batch-size 1030 --steps 1 --log-json " +
                       (d.path / "many.json").string());
  INFO(many.output);
  REQUIRE(many.code == 0);
  const auto wide = read_log(d.path / "many.json").at(0)["ranks"];
  REQUIRE(wide.size() == 1030);
  CHECK(wide[1029]["peak"]["optim_state"] == 8 * ((108288 + 1029) / 1030));
  // A layout the mesh refuses fails on every simulated rank, named once, without a hang.
  refuses(std::string(SG_BINARY) + " train --simulate 3 --tp 3", "--tp 3");
}

// A pipeline rank builds the model on a meta device and gives memory to its stages' parameters
// alone: at no point of the setup does it hold the whole model (a model that fits only when split
// must start). The setup's peaks are the engine's own ledger, printed by --simulate's --log-json.
TEST_CASE("a pipeline rank never holds the whole model: its setup's parameter peak is its stages' share", "[cli]") {
  TempDir d;
  const std::string common = " --model gpt2-medium --dtype bf16 --data random --batch-size 4 --seq-len 64 --steps 1 --log-json ";
  Run whole = shardgrad("train --simulate 1" + common + (d.path / "one.json").string());
  INFO(whole.output);
  REQUIRE(whole.code == 0);
  const int64_t C = 1024, Vp = 50304, bf16 = 2;
  const int64_t model = read_log(d.path / "one.json").at(0)["ranks"][0]["setup_peak"]["param"].get<int64_t>();
  CHECK(model == 354871296 * bf16);  // GPT-2 medium, vocabulary padded to 50,304
  Run pp = shardgrad("train --simulate 4 --pp 4" + common + (d.path / "pp.json").string());
  INFO(pp.output);
  REQUIRE(pp.code == 0);
  const auto ranks = read_log(d.path / "pp.json").at(0)["ranks"];
  REQUIRE(ranks.size() == 4);
  int64_t sum = 0;
  for (const auto& rank : ranks) {
    const int64_t setup = rank["setup_peak"]["param"].get<int64_t>();
    CHECK(setup == rank["end"]["param"].get<int64_t>());  // what it keeps is all it ever held
    CHECK(setup < model / 2);
    CHECK(rank["setup_peak"]["activation"] == 0);  // each parameter drawn in place, wte included
    sum += setup;
  }
  CHECK(sum == model + Vp * C * bf16);  // every parameter once, the tied embedding on two stages
}

// ZeRO-3's point is a model larger than one device: the FSDP family builds the GPT on a meta device
// and gives memory to one unit at a time as it shards it (PyTorch FSDP's meta-device init).
TEST_CASE("a ZeRO-3 / FSDP rank never holds the whole model: its setup's parameter peak is its shards and one unit", "[cli]") {
  TempDir d;
  const std::string common = " --model gpt2-medium --dtype bf16 --data random --batch-size 4 --seq-len 64 --steps 1 --log-json ";
  const int64_t C = 1024, bf16 = 2, model = 354871296 * bf16, block = (12 * C * C + 13 * C) * bf16;
  for (const char* strategy : {"zero3", "fsdp-grad-op"}) {
    INFO(strategy);
    const std::string log = (d.path / (std::string(strategy) + ".json")).string();
    Run r = shardgrad(std::string("train --simulate 4 --strategy ") + strategy + common + log);
    INFO(r.output);
    REQUIRE(r.code == 0);
    const auto ranks = read_log(log).at(0)["ranks"];
    REQUIRE(ranks.size() == 4);
    for (const auto& rank : ranks) {
      const int64_t setup = rank["setup_peak"]["param"].get<int64_t>(), shards = rank["end"]["param"].get<int64_t>();
      CHECK(shards * 4 == model);  // a quarter of every unit (no padding at these sizes)
      CHECK(setup == shards + block);  // at most: the shards made so far, the last block unit whole
      CHECK(rank["setup_peak"]["activation"] == 0);  // each parameter drawn in place, wte included
    }
  }
}

// At a real model's size the engine runs only on the meta device: plan's closed forms (ZeRO's
// sharded optimizer state, FSDP's gathers and reductions, tp's all-reduces, the pipeline's
// sends) must equal what train --simulate counts, rank by rank. plan also prints that command.
TEST_CASE("plan's optimizer bytes and traffic equal train --simulate's for GPT-2 large under zero3, tp 2 and pp 2", "[cli]") {
  const std::string layout = " plan --model gpt2-large --cluster 8xH100-NVLink-IB --strategy zero3 --batch-size 16 "
                             "--micro-batch-size 2 --tp 2 --pp 2";
  Run text = shardgrad(layout);
  INFO(text.output);
  REQUIRE(text.code == 0);
  const size_t at = text.output.find("shardgrad train --simulate 8 ");
  REQUIRE(at != std::string::npos);
  const std::string command = text.output.substr(at, text.output.find('\n', at) - at);
  Run json_plan = shardgrad(layout + " --json");
  REQUIRE(json_plan.code == 0);
  const nlohmann::json plan = nlohmann::json::parse(json_plan.output);
  TempDir d;
  Run sim = run_command(std::string(SG_BINARY) + command.substr(std::string("shardgrad").size()) + " --log-json " +
                        (d.path / "sim.json").string());
  INFO(sim.output);
  REQUIRE(sim.code == 0);
  const nlohmann::json ranks = read_log(d.path / "sim.json").at(0)["ranks"];
  REQUIRE(ranks.size() == 8);
  // rank 0 is pipeline stage 0, rank 2 stage 1 (tp innermost)
  for (auto [rank, stage] : {std::pair<int, int>{0, 0}, {2, 1}}) {
    INFO("rank " << rank);
    CHECK(ranks[size_t(rank)]["peak"]["optim_state"] == plan["memory_per_stage"][size_t(stage)]["optim_state"]);
  }
  for (const auto& [kind, bytes] : plan["comm_bytes_per_step"].items()) {
    INFO(kind);
    CHECK(ranks[0]["comm"][kind]["bytes"] == bytes);
  }
  // hsdp's line names the shard group the plan assumed (a node's dp ranks), and runs
  Run hsdp = shardgrad(" plan --model gpt2 --cluster 8xH100-NVLink-IB --nodes 2 --strategy hsdp --batch-size 16");
  REQUIRE(hsdp.code == 0);
  const size_t h = hsdp.output.find("shardgrad train --simulate 16 ");
  REQUIRE(h != std::string::npos);
  const std::string line = hsdp.output.substr(h, hsdp.output.find('\n', h) - h);
  CHECK(line.find("--shard-group-size 8") != std::string::npos);
  Run ran = run_command(std::string(SG_BINARY) + line.substr(std::string("shardgrad").size()));
  INFO(ran.output);
  CHECK(ran.code == 0);
}

TEST_CASE("plan --micro-batches sets the layout's micro-batch size, so the plan and its schedule count the same", "[cli]") {
  Run r = shardgrad("plan --pp 4 --micro-batches 8 --pp-schedule 1f1b");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("(8 GPUs, 8 micro-batches per step)") != std::string::npos);
  CHECK(r.output.find("1f1b schedule, 4 stages x 1 chunk(s), 8 micro-batches") != std::string::npos);
  CHECK(r.output.find("--micro-batch-size 4") != std::string::npos);  // 64 rows over dp 2, in 8
  refuses(std::string(SG_BINARY) + " plan --pp 4 --micro-batches 7", "--micro-batches 7 does not divide the rank's 32 rows");
  refuses(std::string(SG_BINARY) + " plan --pp 4 --micro-batches 8 --micro-batch-size 2",
          "means micro-batches of 4 rows, but --micro-batch-size is 2");
}

// Numbers past the planner's limits are refused naming the flag and its range, before anything is
// printed: not narrowed to int (--tp 2^32 + 1 planned as tp 1), not overflowed into a division by
// zero, a wrong flag or a model "without parameters", not simulated for minutes (timeout 20).
TEST_CASE("plan refuses numbers past its limits by name before printing anything", "[cli]") {
  const auto plan_refuses = [](const std::string& args, const std::string& text) {
    Run r = run_command("timeout 20 " + std::string(SG_BINARY) + " plan " + args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 1);
    CHECK(r.output.find(text) != std::string::npos);
    CHECK(r.output.find("memory per GPU") == std::string::npos);
  };
  plan_refuses("--tp 65536 --pp 65536", "--tp 65536 x --pp 65536 = 4294967296 GPUs per replica, more than the planner's 1048576 (2^20)");
  plan_refuses("--tp 4294967297", "--tp must be in [1, 1048576] (2^20), got 4294967297");
  plan_refuses("--pp 2 --pp-schedule interleaved --virtual-stages 4294967298", "--virtual-stages must be in [1, 1048576] (2^20), got 4294967298");
  plan_refuses("--pp 2 --pp-schedule interleaved --virtual-stages 2147483647", "--virtual-stages must be in [1, 1048576]");
  plan_refuses("--nodes 2147483647", "--nodes must be in [1, 1048576] (2^20), got 2147483647");
  plan_refuses("--gpus-per-node 65536 --nodes 65536", "--gpus-per-node 65536 x --nodes 65536 = 4294967296 GPUs, more than the planner's");
  plan_refuses("--n-layer 99999999999", "--n-layer must be in [1, 100000], got 99999999999");
  plan_refuses("--search --n-layer 99999999999", "--n-layer must be in [1, 100000], got 99999999999");
  plan_refuses("--vocab-size 9223372036854775807", "--vocab-size must be in [1, 1073741824], got 9223372036854775807");
  plan_refuses("--n-embd 9223372036854775807 --n-head 1", "--n-embd must be in [1, 1048576], got 9223372036854775807");
  plan_refuses("--params 9000000000000", "--params 9000000000000 is more than the planner's 8796093022208 (2^43)");
  plan_refuses("--params 1000 --model gpt2-xl", "--params 1000 is a raw parameter count; --model shapes a model "
               "instead: give one or the other");
  plan_refuses("--params 7500000000 --search", "--search ranks layouts by tokens/s: with --params, give --seq-len");
  plan_refuses("--batch-size 1048576 --dp 8", "is 131072 micro-batches a step, more than the planner's 65536");
  // flags the schedule simulation reads, checked before the report rather than after it
  plan_refuses("--pp 2 --backward-ratio 0", "--backward-ratio must be > 0, got 0");
  plan_refuses("--svg t.svg", "--svg draws one layout's pipeline schedule: give --pp > 1");
  plan_refuses("--pp 2 --search --svg t.svg", "--svg draws one layout's pipeline schedule: not with --search");
  plan_refuses("--pp 2 --search", "--search tries the layouts itself (every tp, pp, strategy, schedule, recompute and "
               "micro-batch size that fits): --pp would be ignored");
  plan_refuses("--search --micro-batches 4", "--micro-batches would be ignored");
}

// --json prints the JSON alone on stdout (the SVG's "wrote" line goes to stderr), writes --svg's
// picture too, and --search --json fails as the text does when nothing fits.
TEST_CASE("plan --json writes the --svg schedule and --search --json exits 1 when nothing fits", "[cli]") {
  TempDir d;
  const fs::path svg = d.path / "pics" / "t.svg";
  Run r = run_command("(" + std::string(SG_BINARY) + " plan --pp 2 --json --svg " + svg.string() + " 2>/dev/null)");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(nlohmann::json::parse(r.output)["layout"]["pp"] == 2);
  std::ifstream f(svg);
  std::stringstream picture;
  picture << f.rdbuf();
  CHECK(picture.str().find("<svg") != std::string::npos);
  Run none = shardgrad("plan --search --json --gpu-memory 0.001");
  INFO(none.output);
  CHECK(none.code == 1);
  CHECK(nlohmann::json::parse(none.output).empty());
  CHECK(shardgrad("plan --search --gpu-memory 0.001").code == 1);
}

namespace {
// The layouts whose evaluation forwards differ from one process's: tp (vocabulary slices gathered),
// tp with sequence parallelism (inputs padded to a multiple of tp), pp (the last stage's logits
// sent to every stage) and zero3 (a collective forward). Runs `args` + a log of its own under each
// on 2 ranks and hands the log and the run to `check`.
void on_two_ranks(const TempDir& d, const std::string& args, const char* prefix,
                  const std::function<void(const fs::path&, const Run&)>& check) {
  int k = 0;
  for (const std::string layout : {"--tp 2", "--tp 2 --sequence-parallel", "--pp 2", "--strategy zero3"}) {
    INFO(layout);
    const fs::path log = log_path(d, prefix, k++);
    Run two = run_command(mpirun(2) + args + log.string() + " " + layout);
    INFO(two.output);
    REQUIRE(two.code == 0);
    check(log, two);
  }
}
}  // namespace

TEST_CASE("train --sample-tokens prints at each evaluation the same sampled text under every layout", "[cli][mpi]") {
  TempDir d;
  const std::string text = (d.path / "text.txt").string();
  {
    std::ofstream f(text);
    for (int i = 0; i < 120; ++i) f << "The pieces of a model learn " << i % 7 << " things at a time.\n";
  }
  const std::string args = " train --data " + text + " --n-layer 2 --n-head 2 --n-embd 32 --seq-len 16 --batch-size 4 "
                           "--micro-batch-size 2 --threads 1 --steps 6 --eval-every 3 --eval-batches 1 --sample-tokens 12 "
                           "--log-json ";
  // each evaluation's sample from the log: its 12 ids (bytes here), and the output shows them as text
  const auto samples = [&](const fs::path& log, const std::string& output) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& rec : read_log(log)) {
      if (!rec.contains("eval")) continue;
      const auto& ev = rec["eval"];
      const auto ids = ev["sample_ids"].get<std::vector<int64_t>>();
      const std::string prompt = ev["sample_prompt"].get<std::string>();
      INFO("step " << rec["step"] << " prompt '" << prompt << "'");
      CHECK(ids.size() == 12);
      CHECK(prompt.size() == 16);  // the held-out split's first 16 bytes (tiny's block size is 64)
      std::string shown;
      for (int64_t id : ids) {
        CHECK((id >= 0 && id < 256));
        shown += char(id);
      }
      CHECK(output.find("sample step " + std::to_string(rec["step"].get<int>()) + " | 12 tokens after \"") !=
            std::string::npos);
      CHECK(output.find("\":\n" + shown + "\n---\n") != std::string::npos);
      out.push_back(ids);
    }
    return out;
  };
  Run one = shardgrad(args + (d.path / "one.jsonl").string());
  INFO(one.output);
  REQUIRE(one.code == 0);
  const auto want = samples(d.path / "one.jsonl", one.output);
  REQUIRE(want.size() == 2);  // steps 3 and 6
  CHECK(want[0] != want[1]);  // other weights, other draws
  Run again = shardgrad(args + (d.path / "again.jsonl").string());
  REQUIRE(again.code == 0);
  CHECK(samples(d.path / "again.jsonl", again.output) == want);  // seeded: the same text each run
  // every rank of a replica draws the same tokens from the same logits: tp, pp and zero3 show the
  // single process's samples (their logits agree to rounding); under sequence parallelism the
  // prompt is padded to a multiple of tp (16 + 1 tokens: odd lengths on the way)
  on_two_ranks(d, args, "l", [&](const fs::path& log, const Run& two) { CHECK(samples(log, two.output) == want); });
  const std::string bin = std::string(SG_BINARY);
  refuses(bin + " train --data random:64 --steps 1 --sample-tokens 4", "--sample-tokens: random tokens (--data random:64) have no text to show");
  refuses(bin + " train --steps 1 --sample-tokens -1", "--sample-tokens must be in 0..1048575, got -1");
  refuses(bin + " train --data " + text + " --seq-len 16 --batch-size 4 --steps 1 --tokenizer " + d.path.string(),
          "--tokenizer shows --sample-tokens' samples as text; give --sample-tokens N too");
  refuses(bin + " train --data " + text + " --seq-len 16 --batch-size 4 --steps 1 --sample-tokens 4 --tokenizer " +
              d.path.string(),
          "--tokenizer is for GPT-2 token shards; --data " + text + " brings its own tokens");
}

TEST_CASE("train --hellaswag scores an eval file at each evaluation, the same under every layout and as eval scores the saved model", "[cli][mpi]") {
  TempDir d;
  // the golden file: 16 examples of tokens below 61, some contexts longer than block 16 allows
  const std::string file = std::string(SG_SOURCE_DIR) + "/tests/golden/hellaswag_tiny.bin";
  const std::string args = " train --data random:61 --n-layer 2 --n-head 4 --n-embd 32 --block-size 16 --seq-len 16 "
                           "--batch-size 8 --threads 1 --steps 4 --warmup-steps 1 --eval-every 2 --eval-batches 1 "
                           "--hellaswag " + file + " --log-json ";
  const auto scores = [](const fs::path& log) {
    std::vector<nlohmann::json> out;
    for (const auto& rec : read_log(log))
      if (rec.contains("eval")) out.push_back(rec["eval"]["hellaswag"]);
    return out;
  };
  Run one = shardgrad(args + (d.path / "one.jsonl").string() + " --save " + (d.path / "run").string());
  INFO(one.output);
  REQUIRE(one.code == 0);
  const auto want = scores(d.path / "one.jsonl");
  REQUIRE(want.size() == 2);  // steps 2 and 4
  for (const auto& h : want) {
    CHECK(h["examples"] == 16);
    CHECK(h["accuracy"].get<double>() == h["correct"].get<double>() / 16);
  }
  CHECK(one.output.find(" | hellaswag 0.") != std::string::npos);
  CHECK(one.output.find("/16)") != std::string::npos);
  // eval of the saved model scores what train's last evaluation scored
  Run ev = shardgrad("eval --from " + (d.path / "run").string() + " --hellaswag " + file + " --batch-size 8 --log-json " +
                     (d.path / "eval.jsonl").string());
  INFO(ev.output);
  REQUIRE(ev.code == 0);
  const auto lines = read_log(d.path / "eval.jsonl");
  REQUIRE(lines.size() == 17);  // 16 examples, then the totals
  CHECK(lines.back()["correct"] == want.back()["correct"]);
  CHECK(lines.back()["accuracy_sum"] == want.back()["accuracy_sum"]);
  CHECK(lines[5]["mean_loss"].size() == 4);
  CHECK(ev.output.find("hellaswag " + file + ": 16 examples | acc_norm ") != std::string::npos);
  CHECK(ev.output.find("note: --examples") == std::string::npos);
  // more examples asked for than the file holds: all of them, said
  Run past = shardgrad("eval --from " + (d.path / "run").string() + " --hellaswag " + file + " --batch-size 8 --examples 100");
  INFO(past.output);
  REQUIRE(past.code == 0);
  CHECK(past.output.find("note: --examples 100: " + file + " holds 16; all are scored") != std::string::npos);
  CHECK(past.output.find("hellaswag " + file + ": 16 examples | acc_norm ") != std::string::npos);
  // every rank of a replica scores the same examples with the whole model: tp (its vocabulary
  // slices gathered), sequence parallelism (rows padded to a multiple of tp), pp, zero3
  on_two_ranks(d, args, "h", [&](const fs::path& log, const Run&) {
    const auto got = scores(log);
    REQUIRE(got.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
      CHECK(got[i]["correct"] == want[i]["correct"]);
      CHECK(got[i]["accuracy_sum"] == want[i]["accuracy_sum"]);
    }
  });
  // --hellaswag-examples: the first N
  const std::string five = " --hellaswag-examples 5 --steps 2 --eval-batches 3";
  Run few = shardgrad(args + (d.path / "few.jsonl").string() + five);
  INFO(few.output);
  REQUIRE(few.code == 0);
  const nlohmann::json few_eval = read_log(d.path / "few.jsonl").back()["eval"];
  CHECK(few_eval["hellaswag"]["examples"] == 5);
  CHECK(few_eval["hellaswag"]["per_rank"] == nlohmann::json::array({5}));
  CHECK(few_eval["val_batches_per_rank"] == nlohmann::json::array({3}));
  CHECK(few.output.find("note: --hellaswag-examples") == std::string::npos);
  Run many = shardgrad(args + (d.path / "many.jsonl").string() + " --hellaswag-examples 100 --steps 1");
  INFO(many.output);
  REQUIRE(many.code == 0);
  CHECK(many.output.find("note: --hellaswag-examples 100: " + file + " holds 16; all are scored") != std::string::npos);
  CHECK(read_log(d.path / "many.jsonl").back()["eval"]["hellaswag"]["examples"] == 16);
  // the data-parallel ranks split the examples and the held-out batches (rank 0: examples 0, 2, 4
  // and batches 0, 2) and sum what they score; under zero3 the rank with the shorter share runs
  // forwards that count nothing, as the gathers are collective (without them it waits out the timeout)
  for (const std::string layout : {"--strategy ddp", "--strategy zero3", "--strategy zero3 --tp 2"}) {
    INFO(layout);
    const int np = layout.find("--tp") != std::string::npos ? 4 : 2;
    const fs::path log = log_path(d, "split", layout.size());
    Run split = run_command(mpirun(np) + args + log.string() + five + " --comm-timeout 60 " + layout);
    INFO(split.output);
    REQUIRE(split.code == 0);
    const nlohmann::json ev = read_log(log).back()["eval"];
    CHECK(ev["hellaswag"]["per_rank"] == nlohmann::json::array({3, 2}));
    CHECK(ev["val_batches_per_rank"] == nlohmann::json::array({2, 1}));
    CHECK(ev["hellaswag"]["correct"] == few_eval["hellaswag"]["correct"]);
    CHECK(ev["hellaswag"]["accuracy_sum"] == few_eval["hellaswag"]["accuracy_sum"]);
    CHECK(std::abs(ev["val_loss"].get<double>() - few_eval["val_loss"].get<double>()) <= 1e-5 * few_eval["val_loss"].get<double>());
  }

  const std::string bin = std::string(SG_BINARY);
  refuses(bin + " train --steps 1 --hellaswag " + file, "--hellaswag " + file + ": example 0 has token");
  refuses(bin + " train --steps 1 --hellaswag-examples 3", "--hellaswag-examples limits --hellaswag's examples");
  refuses(bin + " train --steps 1 --hellaswag " + (d.path / "none.bin").string(), (d.path / "none.bin").string());
  refuses(bin + " train --simulate 2 --hellaswag " + file, "--hellaswag is not available with --simulate");
  refuses(bin + " eval --from " + (d.path / "run").string(), "eval: --hellaswag is required");
  refuses(bin + " eval --hellaswag " + file, "eval: --from is required");
  refuses(bin + " eval --from " + (d.path / "run").string() + " --hellaswag " + file + " --batch-size 0",
          "--batch-size must be >= 1");
}

TEST_CASE("a resumed run finds its --hellaswag file from any folder, or names the flag", "[cli]") {
  TempDir d;
  fs::copy_file(std::string(SG_SOURCE_DIR) + "/tests/golden/hellaswag_tiny.bin", d.path / "hs.bin");
  const std::string bin = std::string(SG_BINARY), run = (d.path / "run").string();
  Run first = run_command("cd " + d.path.string() + " && " + bin + " train --data random:61 --n-layer 1 --n-head 2 "
                          "--n-embd 32 --block-size 16 --seq-len 16 --batch-size 8 --threads 1 --steps 4 --eval-every 2 "
                          "--eval-batches 1 --hellaswag hs.bin --stop-at 2 --save run");  // a relative path
  INFO(first.output);
  REQUIRE(first.code == 0);
  Run elsewhere = run_command("cd / && " + bin + " train --resume " + run);
  INFO(elsewhere.output);
  REQUIRE(elsewhere.code == 0);
  CHECK(elsewhere.output.find(" | hellaswag 0.") != std::string::npos);
  fs::remove(d.path / "hs.bin");
  refuses(bin + " train --resume " + run, "is the checkpoint's; give --hellaswag to read it elsewhere");
}

TEST_CASE("tokenize --format hellaswag turns HellaSwag's jsonl into the eval file train --hellaswag reads", "[cli]") {
  TempDir d;
  const std::string bpe = std::string(SG_SOURCE_DIR) + "/tests/golden/bpe";
  const fs::path jsonl = d.path / "hellaswag_val.jsonl", out = d.path / "hs.bin";
  {
    std::ofstream f(jsonl);
    f << R"({"ind": 24, "ctx": "A man is sitting on a roof. he", "endings": ["is using wrap to wrap a pair of skis.", )"
      << R"("is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": 3})" << "\n"
      << R"({"ind": 92, "ctx": "Hello, world", "endings": ["!", " again", "\u00e9t\u00e9"], "label": 0})" << "\n";
  }
  Run r = shardgrad("tokenize --format hellaswag " + jsonl.string() + " --tokenizer " + bpe + " --out " + out.string());
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("wrote " + out.string() + ": 2 examples") != std::string::npos);
  const auto ex = sg::io::read_choice_file(out.string());
  REQUIRE(ex.size() == 2);
  const sg::io::Gpt2Tokenizer tok = sg::io::Gpt2Tokenizer::load(bpe);
  const auto ids = [&](const std::string& s) {
    const auto v = tok.encode(s);
    return std::vector<int32_t>(v.begin(), v.end());
  };
  CHECK(ex[0].label == 3);
  CHECK(ex[0].context == ids("A man is sitting on a roof. he"));
  CHECK(ex[0].endings[3] == ids(" starts pulling up roofing on a roof."));
  CHECK(ex[1].endings[1] == ids("  again"));
  CHECK(ex[1].endings[2] == ids(" \xc3\xa9t\xc3\xa9"));
  refuses(std::string(SG_BINARY) + " tokenize --format hellaswag " + jsonl.string() + " " + jsonl.string() +
              " --tokenizer " + bpe + " --out " + (d.path / "two.bin").string(),
          "--format hellaswag reads one jsonl file, got 2");
  refuses(std::string(SG_BINARY) + " tokenize --format csv " + jsonl.string() + " --tokenizer " + bpe + " --out " +
              (d.path / "x.bin").string(),
          "--format must be text or hellaswag, got csv");
}
