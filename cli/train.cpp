// shardgrad train: its flags, and the run (cli/trainer.h) or its simulation (--simulate N).
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/trainer.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/watchdog.h"

namespace sg::cli {

namespace {

void declare_flags(Args& a) {
  a.flag("model", "tiny", "preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl");
  a.flag("n-layer", "0", "override the preset's layer count");
  a.flag("n-head", "0", "override the preset's head count");
  a.flag("n-embd", "0", "override the preset's width");
  a.flag("block-size", "0", "override the preset's longest sequence (rows of wpe)");
  a.flag("vocab-size", "0", "vocabulary (0 = the data's own: 256 bytes, 50257 GPT-2 tokens, the task's)");
  a.flag("seq-len", "0", "tokens per training row T (0 = the model's block size; synthetic task: one problem per row)");
  a.flag("dropout", "0", "dropout probability");
  a.flag("recompute", "none", "activation recompute: none, selective (the attention core: little to save, as flash "
         "attention stores no scores) or full (whole blocks)");
  a.flag("data", "synthetic", "synthetic | FILE.txt (bytes) | 'GLOB.bin' (llm.c token shards) | random[:V] (uniform "
         "ids, GPT-2's 50257 by default: for sizing and timing, nothing to learn)");
  a.toggle("shuffle", "draw rows at seeded random positions instead of reading sequentially");
  a.flag("batch-size", "0", "global batch: sequences per optimizer step (0 = 32; 128 one-problem rows on the synthetic task)");
  a.flag("micro-batch-size", "0", "sequences per forward/backward (0 = the per-rank batch; under --pp, enough "
         "micro-batches for at least 4 per stage); must divide the per-rank batch (--batch-size over the data-parallel ranks)");
  a.flag("steps", "auto", "optimizer steps (auto: 1500 on the synthetic task, 1000 on file data)");
  a.flag("lr", "auto", "peak learning rate (auto: by model size, non-embedding parameters: 1e-2 below 1M, 1e-3 "
         "below 20M, then GPT-3's 6e-4 / 3e-4 / 2.5e-4 / 2e-4 for GPT-2's four sizes; 5e-3 on the synthetic task)");
  a.flag("lr-schedule", "cosine", "constant | cosine | linear (to --min-lr at the last step) | wsd (warmup, stable, "
         "then a linear decay to --min-lr over the last --decay-steps)");
  a.flag("decay-steps", "0", "wsd: the steps its decay takes, at the end of the run (0: a fifth of the steps after warmup)");
  a.flag("warmup-steps", "20", "linear warmup steps");
  a.flag("min-lr", "0", "final learning rate of the cosine, linear and wsd schedules");
  a.flag("beta1", "0.9", "AdamW beta1");
  a.flag("beta2", "0.95", "AdamW beta2");
  a.flag("eps", "1e-8", "AdamW epsilon");
  a.flag("weight-decay", "0.1", "AdamW decoupled weight decay (matrices and embeddings only; 0 on the synthetic task unless given)");
  a.flag("clip", "1.0", "clip the global gradient norm to this (0 = off)");
  a.flag("seed", "1337", "seed for init, data order and dropout");
  a.flag("device", "cpu", "cpu or cuda:N");
  a.flag("dtype", "fp32", "fp32 | bf16 | fp16 (half types keep f32 master weights; fp16 uses loss scaling)");
  a.flag("attention", "flash", "fused attention on CUDA: flash (hand-written kernels) | cudnn (cuDNN's fused SDPA; bf16/fp16)");
  a.flag("init-from", "", "start from a Hugging Face-named GPT-2 .safetensors file");
  a.flag("save", "", "run directory for checkpoints (never overwritten)");
  a.flag("save-every", "0", "checkpoint every N steps (0 = only at the end, when --save is given)");
  a.flag("stop-at", "0", "stop after step N (saving it, with --save) while --steps still sets the schedule: a long run "
         "in slices, each resumed with --resume auto (0 = run to --steps). With --save, SIGUSR1, SIGTERM or SIGINT "
         "(Ctrl-C) also stops the run after its step, saving it (exit status 75); a second one ends it at once");
  a.flag("resume", "", "continue from a run directory or step directory, or auto: the newest complete checkpoint of "
         "--save (none yet: start at step 0)");
  a.flag("eval-every", "250", "evaluate every N steps (0 = only at the end)");
  a.flag("eval-batches", "4", "validation batches per evaluation (split over the data-parallel ranks)");
  a.flag("eval-problems", "200", "synthetic task: problems for the accuracy figure");
  a.flag("sample-tokens", "0", "at each evaluation, rank 0 prints N tokens sampled (temperature 1, as llm.c) after "
         "the held-out split's first 16 (--shuffle: its first drawn row's; synthetic: its first problem); the same "
         "on every run with the same seed (0 = none)");
  a.flag("tokenizer", "", "GPT-2 token shards: a folder with GPT-2's vocab.json and merges.txt, to show "
         "--sample-tokens' samples as text");
  a.flag("hellaswag", "", "at each evaluation, the accuracy on an llm.c multiple-choice eval file (hellaswag_val.bin "
         "from llm.c's dev/data/hellaswag.py, or `shardgrad tokenize --format hellaswag`): the ending of lowest mean loss");
  a.flag("hellaswag-examples", "0", "--hellaswag: the file's first N examples (0 = all)");
  a.flag("log-json", "", "write one JSON object per step to this file");
  a.flag("threads", "0", "CPU threads per rank (0 = OMP_NUM_THREADS if set, else the cores divided among the node's ranks)");
  a.flag("strategy", "single", "single | dp (one process, --devices) | ddp | zero1 | zero2 | zero3 | fsdp (= zero3) | fsdp-grad-op | hsdp | no-shard (all but single/dp: launch with mpirun -np N)");
  a.flag("shard-group-size", "0", "hsdp: ranks per shard group (parameters sharded inside, replicated across groups)");
  a.flag("wrap-min-params", "0", "fsdp family: one unit per block (0), or consecutive blocks until this many parameters");
  a.flag("reshard-after-forward", "default", "fsdp family: default | true | false (free gathered units after forward)");
  a.flag("prefetch", "none", "fsdp family: none | forward | backward | both (gather the next unit ahead)");
  a.flag("limit-all-gathers", "2", "fsdp family: at most this many block units gathered at once");
  a.flag("offload", "none", "zero1, zero2, fsdp family: none | optimizer (ZeRO-Offload: m, v and an f32 master of "
         "the shard on the host, AdamW there; the compute device (--device cuda:N, or cpu:1 to try it on a CPU) keeps "
         "the parameters and gradients) | params (fsdp family: the parameter shards on the host too, staged to the "
         "device for each gather)");
  a.flag("reduce-dtype", "param", "fsdp family: gradient reduction dtype: param | fp32 | bf16 | fp16");
  a.flag("tp", "1", "tensor-parallel ranks: heads, MLP and vocabulary split (launch with mpirun -np TP)");
  a.toggle("sequence-parallel", "with --tp: LayerNorm/dropout regions split along the sequence");
  a.flag("pp", "1", "pipeline stages (launch with mpirun -np PP)");
  a.flag("pp-schedule", "1f1b", "pipeline schedule: gpipe | 1f1b | interleaved");
  a.flag("virtual-stages", "1", "interleaved: model chunks per pipeline rank");
  a.flag("timeline", "", "pipeline: write the last step's measured timeline as an SVG picture (an early stop's: its last step)");
  a.flag("profile-ops", "0", "time every op-table call of this step (1-based; 0 = off): calls, host ms and, on CUDA, device ms per entry, printed and put in --log-json");
  a.flag("trace", "", "write per-rank Chrome trace events (compute, collectives, gathers, pipeline actions), merged into this file");
  a.flag("keep", "0", "keep only the newest N checkpoints (0 = all)");
  a.flag("devices", "cpu:0,cpu:1", "dp: the devices to replicate over; the first one holds the model");
  a.flag("grad-accumulation", "sharded", "zero2 and the fsdp family with several micro-batches a step: sharded "
         "(DeepSpeed's ZeRO-2, FSDP: every micro-batch reduce-scatters into the gradient shard: 4Ψ/N of gradient, the "
         "reduce-scatter bytes times the micro-batches) | unsharded (PyTorch's no_sync: full gradients accumulate and "
         "only the last micro-batch reduces them, for the full gradient held beside the shard); under --pp or "
         "--sequence-parallel zero2 reduces once a step, unsharded; the fsdp family refuses unsharded under --pp");
  a.flag("bucket-mb", "25", "ddp: gradient bucket size in MiB; zero1/zero2: one stripe's reduce-scatter input in MiB");
  a.flag("backend", "mpi", "collectives of multi-rank runs: mpi (CPU tensors, CUDA through host staging) | nccl (GPUs)");
  a.flag("rendezvous", "mpi", "how ranks find each other: mpi (launched by mpirun) | file:PATH | tcp:HOST:PORT "
         "(--backend nccl without MPI, each process started on its own with RANK, WORLD_SIZE, LOCAL_RANK in the "
         "environment: rank 0 hands NCCL's id to the others through PATH, on a file system they all see, or on "
         "PORT of its host HOST)");
  a.flag("comm-timeout", "300", "seconds without progress before the watchdog aborts the job, naming the stuck rank");
  a.flag("checkpoint-timeout", "0", "seconds a checkpoint's save or load may make no progress (a rank blocked on "
         "a slow disk, its peers waiting for it) before the watchdog aborts the job (0: --comm-timeout's)");
  a.flag("inject-fault", "", "testing: rank=R,step=S,kind=exit|throw|abort|kill|hang|nan|slow[,seconds=N]"
         "[,during=save|load]");
  a.flag("peak-tflops", "auto", "one device's peak TFLOP/s in the training dtype, for the MFU on the progress line "
         "(tokens/s x model FLOPs per token / (devices x peak); auto: a known GPU's dense bf16/fp16 peak, e.g. 989 "
         "for an H100 or H200, else none; 0: none)");
  a.flag("initial-loss-scale", "65536", "fp16: the loss scale to start from (dynamic: an overflowing step is skipped "
         "and the scale backs off; it grows after --loss-scale-window clean steps)");
  a.flag("loss-scale-window", "2000", "fp16: clean steps before the loss scale grows");
  a.flag("loss-scale-growth", "2", "fp16: the factor the loss scale grows by");
  a.flag("loss-scale-backoff", "0.5", "fp16: the factor an overflow multiplies the loss scale by");
  a.flag("min-loss-scale", "1", "fp16: the loss scale never backs off below this");
  a.flag("loss-scale", "0", "fp16: a fixed loss scale instead (overflowing steps are still skipped; 0 = dynamic)");
  a.flag("on-nonfinite", "stop", "a NaN/Inf loss or gradient: stop (naming the step and the tensor) or skip the step (counted)");
  a.toggle("find-unused-parameters", "ddp: allow parameters that get no gradient (one some rank used gets the average, counting "
           "zero for the others; one no rank used keeps no gradient and AdamW skips it)");
  a.flag("simulate", "0", "dry run of N ranks as threads of this one process on the meta device (shapes and bytes, no "
         "values, no arithmetic): each rank's peak ledger bytes per category and bytes sent per collective kind over "
         "3 steps of this layout, as the engine would hold and send them (no mpirun; --log-json gets them as JSON)");
}

}  // namespace

int train_main(int argc, char** argv) {
  Args a("train", "Train a GPT-2-family model. Defaults: the tiny model on the built-in synthetic addition task.");
  declare_flags(a);
  // A command line refused (an unknown flag, a missing value) or a dry run's refusal: nothing ran.
  const auto refused_before_start = [](auto&& f) {
    try {
      return f();
    } catch (const ExitStatusError&) {
      throw;
    } catch (const Error& e) {
      throw ExitStatusError(kRefusedBeforeStart, e.what());  // launch does not restart it
    }
  };
  if (!refused_before_start([&] { return a.parse(argc, argv); })) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  if (a.given("simulate")) return refused_before_start([&] { return simulate_main(a); });
  int rc = 0;
  try {
    std::unique_ptr<Trainer> t;
    try {
      std::unique_ptr<ckpt::Checkpoint> resumed = resume_checkpoint(a);
      inherit_run_flags(a, resumed.get());
      t = std::make_unique<Trainer>(a, std::move(resumed));
    } catch (const Error& e) {
      throw ExitStatusError(kRefusedBeforeStart, e.what());
    }
    rc = t->run();
  } catch (...) {
    // Without MPI (--rendezvous file: or tcp:) nothing aborts the process on the way out: a watchdog
    // thread still running at exit would terminate it instead of letting main report the error.
    parallel::watchdog::disarm();
    throw;
  }
  {
    // MPI's finalize waits for every rank: one stalled after the last collective would hang the
    // job (and launch) with no word, so the watchdog stays on until it returns.
    parallel::watchdog::Waiting w("MPI's finalize (every rank leaves together)");
    comm::finalize();  // a no-op unless this run initialised MPI
  }
  parallel::watchdog::disarm();
  return rc;
}

}  // namespace sg::cli
