#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU tests (ctest label gpu: the op table against the CPU,
# NCCL at world size 1, the MPI backend with CUDA tensors on 2 ranks sharing cuda:0, the trainer
# on cuda:0 against the CPU), then the single-GPU figures for bench/RESULTS.md: GPT-2 124M
# training (T=1024, bf16) through `shardgrad train`, the PyTorch peer (bench/gpu/), and the
# kernel sandboxes when built; `hf` holds `shardgrad export` to transformers' GPT2LMHeadModel (the
# machine's image has transformers; no GPU needed). Logs go to LOG_DIR (default ./gpu_check). The train part also runs
# the last of BATCHES with GEMM tuning (SG_GEMM_TUNE=1 into LOG_DIR/gemm.tune, then again reading
# that file; README, "GEMM tuning"); TUNED_BATCHES=""
# skips that, TUNED_BATCHES="16 64" tunes both; and with the kernel variants still to be decided
# (VARIANTS; VARIANTS="" skips them).
#   BUILD=build bash scripts/gpu_check.sh [build] [tests] [train] [torch] [kernels] [hf] [sanitize]
# `build` configures BUILD (Release) and builds only what the other parts run (the CLI, the GPU
# tests, the kernel benches): about 4 minutes on 16 cores, where a full build with every CPU test
# takes longer. It installs nothing (scripts/deps.sh does, where apt can reach its mirrors).
# scripts/gpu_pack.sh builds the same here instead and carries the binaries to the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
LOG_DIR=${LOG_DIR:-gpu_check}
BATCH=${BATCH:-16}        # the PyTorch peer's batch, and the first of BATCHES
BATCHES=${BATCHES:-"$BATCH 64"}  # shardgrad's batches (cudnn attention; flash at BATCH only): llm.c trains at 64
STEPS=${STEPS:-20}
PROFILE_STEP=${PROFILE_STEP:-10}  # the step of each training run timed by op-table entry (0 = none)
mkdir -p "$LOG_DIR"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests train torch kernels)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
[ "${parts[*]}" = build ] ||  # `build` alone needs no GPU (scripts/gpu_pack.sh builds here with it)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$LOG_DIR/gpu.txt"

if want build; then
  echo "== build ($BUILD)"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release > "$LOG_DIR/build.log" 2>&1 &&
    cmake --build "$BUILD" -j"$(nproc)" --target shardgrad sg_gpu_kernels sg_gpu_attention_cudnn sg_gpu_nccl \
      sg_gpu_mpi_cuda sg_gpu_train sg_bench_attention_gpu sg_bench_memory_gpu >> "$LOG_DIR/build.log" 2>&1 ||
    { grep -E "error|Error" "$LOG_DIR/build.log" | head -n 30; exit 1; }
  grep "shardgrad:" "$LOG_DIR/build.log"
fi

if want tests; then
  echo "== GPU tests"
  ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 600 -V 2>&1 | tee "$LOG_DIR/ctest_gpu.log" |
    grep -E "max relative|cuBLASLt fused|cuDNN plans|tests passed|Passed|Failed|FAILED|skipped|\*\*\*" | tail -n 40
fi

if want train; then
  echo "== GPT-2 124M, T=1024, bf16, one GPU: shardgrad train"
  # Tokens with text's frequencies (Zipf-Mandelbrot: rank k drawn with probability ~ 1/(k + 2.7),
  # the commonest token ~3% of a batch, as "," and " the" are in FineWeb, where llm.c's figures
  # come from), not uniform ones: the embedding backward's work depends on how often tokens repeat.
  shard="$LOG_DIR/zipf_tokens.bin"
  python3 - "$shard" <<'PY'
import itertools, struct, sys, random
n, V = 4 * 1024 * 1024, 50257
random.seed(0)
ranks = random.sample(range(V), V)  # rank k -> a token id
cum = list(itertools.accumulate(1.0 / (k + 2.7) for k in range(V)))
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<3i", 20240520, 1, n) + bytes(4 * 253))
    f.write(struct.pack(f"<{n}H", *(ranks[k] for k in random.choices(range(V), cum_weights=cum, k=n))))
PY
  # attention:batch[:variant] runs; TUNED_BATCHES (default the last of BATCHES) also with GEMM
  # tuning; VARIANTS (default below) the last of BATCHES with other kernel variants
  # (kernels/cuda/variants.h), each a comma-separated list of NAME=VALUE set for the run.
  VARIANTS=${VARIANTS-"SG_NORM_BACKWARD=smem,SG_CLASSIFIER=staged SG_NORM_BACKWARD=smem_ahead,SG_CLASSIFIER=staged SG_CLASSIFIER=reversed SG_DQ_ACCUMULATOR=engine,SG_EMBEDDING_BACKWARD=packs"}
  # The tuned run writes its choices there; the run after it reads them back without tuning.
  tune_file="$LOG_DIR/gemm.tune"
  rm -f "$tune_file"
  for run in $(for b in $BATCHES; do for a in ${ATTENTION:-cudnn flash}; do
                 [ "$a" = cudnn ] || [ "$b" = "$BATCH" ] && echo "$a:$b"; done; done
               for b in ${TUNED_BATCHES-${BATCHES##* }}; do
                 echo "cudnn:$b:SG_GEMM_TUNE=1,SG_GEMM_TUNE_FILE=$tune_file cudnn:$b:SG_GEMM_TUNE_FILE=$tune_file"; done
               for v in $VARIANTS; do echo "cudnn:${BATCHES##* }:$v"; done); do
    attn=${run%%:*} rest=${run#*:} batch=${rest%%:*} variant=""
    [ "$rest" != "$batch" ] && variant=${rest#*:}
    # the log's name: _tuned for GEMM tuning, else the variant's values joined by _
    suffix=$(case "$variant" in "") ;; SG_GEMM_TUNE=1*) echo _tuned ;; SG_GEMM_TUNE_FILE=*) echo _tune_file ;;
             *) echo "$variant" | tr ',' '\n' | sed 's/.*=/_/' | tr -d '\n' ;; esac)
    log="$LOG_DIR/gpt2_bf16_${attn}_b$batch$suffix.jsonl"
    # --profile-ops: one step's time by op-table entry (device ms between events around each call)
    env ${variant//,/ } timeout 300 "$BUILD/shardgrad" train --model gpt2 --data "$shard" --device cuda:0 --dtype bf16 --attention "$attn" \
      --batch-size "$batch" --seq-len 1024 --steps "$STEPS" --warmup-steps 2 --lr 6e-4 --eval-every 0 \
      --profile-ops "$PROFILE_STEP" --log-json "$log" > "${log%.jsonl}.txt" 2>&1
    sed -n '/^op profile/,/outside the op table/p' "${log%.jsonl}.txt"
    # The same step on the meta device: the ledger bytes the GPU run's peak line should show
    # (bench/RESULTS.md, "Counting a layout's bytes"), kernel workspaces aside.
    "$BUILD/shardgrad" train --simulate 1 --model gpt2 --data random --dtype bf16 --batch-size "$batch" --seq-len 1024 |
      sed -n 2,3p
    tail -n 3 "${log%.jsonl}.txt"
    python3 - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tail = rows[5:] or rows
if rows:
    print(f"shardgrad {sys.argv[1]}: median tokens/s {statistics.median(r['tokens_per_s'] for r in tail):.0f} "
          f"over {len(tail)} steps; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
  done
fi

if want torch; then
  echo "== GPT-2 124M, T=1024, bf16, one GPU: PyTorch peer"
  # torch.compile at each of shardgrad's batches, eager at the first
  for run in "$BATCH:0" $(for b in $BATCHES; do echo "$b:1"; done); do
    b=${run%%:*} c=${run##*:}
    timeout 400 python3 bench/gpu/torch_gpt2_step.py --batch-size "$b" --compile $c \
      --json-out "$LOG_DIR/torch_b${b}_compile$c.json" 2>&1 | tail -n 2
  done
fi

if want kernels; then
  echo "== kernel sandboxes"
  for b in "$BUILD"/bench/sg_bench_*gpu*; do
    [ -x "$b" ] && timeout 300 "$b" 2>&1 | tee "$LOG_DIR/$(basename "$b").log" | tail -n 30
  done
fi

if want hf; then
  # Needs transformers (the GPU machine's image has it; no GPU used). A byte-level tiny GPT trained
  # 300 steps on this README, exported, read by GPT2LMHeadModel.from_pretrained(folder): its greedy
  # continuation of a prompt must be shardgrad generate's, byte for byte (a transposed Conv1D weight,
  # a wrong epsilon, GELU or tied head would change it).
  echo "== export read by transformers: greedy continuations, shardgrad vs GPT2LMHeadModel"
  hf_run="$LOG_DIR/hf_run" hf="$LOG_DIR/hf" prompt="The model " n=48
  rm -rf "$hf_run" "$hf"
  "$BUILD/shardgrad" train --data README.md --steps 300 --save "$hf_run" > "$LOG_DIR/hf_train.txt" 2>&1 &&
    "$BUILD/shardgrad" export "$hf_run" --out "$hf/model.safetensors" &&
    "$BUILD/shardgrad" generate --from "$hf/model.safetensors" --prompt "$prompt" --max-new-tokens $n --temperature 0 \
      > "$hf/shardgrad.txt" &&
    python3 - "$hf" "$prompt" $n <<'PY'
import sys
import torch
import transformers
from transformers import GPT2LMHeadModel
folder, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = GPT2LMHeadModel.from_pretrained(folder).eval()
ids = list(prompt.encode())  # the byte-level model's ids are the bytes
with torch.no_grad():
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
theirs = bytes(ids)
ours = open(f"{folder}/shardgrad.txt", "rb").read()
ours = ours[:-1] if ours.endswith(b"\n") else ours  # generate prints the text and one newline
same = ours == theirs
print(f"transformers {transformers.__version__}: {'same' if same else 'DIFFERENT'} greedy text: {theirs!r}")
if not same:
    print(f"shardgrad generate:                   {ours!r}")
sys.exit(0 if same else 1)
PY
fi

if want sanitize; then
  echo "== compute-sanitizer (memcheck, racecheck) on the op-table suite"
  timeout "${SANITIZE_TIMEOUT:-400}" compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/sg_gpu_kernels" 2>&1 | tail -n 4
  timeout "${SANITIZE_TIMEOUT:-400}" compute-sanitizer --tool racecheck --error-exitcode 9 "$BUILD/tests/sg_gpu_kernels" \
    "*attention*,*layernorm*,*softmax*" > "$LOG_DIR/racecheck.log" 2>&1
  tail -n 4 "$LOG_DIR/racecheck.log"
  # The packed-qkv case also runs cuDNN, whose generated SDPA kernels racecheck reports hazards in
  # (24 on an H200, 2026-11-24): count ours apart.
  echo "racecheck hazards: $(grep "Race reported" "$LOG_DIR/racecheck.log" | grep -vc cudnn_generated) in shardgrad's" \
       "kernels, $(grep "Race reported" "$LOG_DIR/racecheck.log" | grep -c cudnn_generated) in cuDNN's"
fi
