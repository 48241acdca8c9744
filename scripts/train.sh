#!/usr/bin/env bash
# The main job: install what is missing, build, and train the tiny GPT on the built-in synthetic
# addition task on the CPU — by default on 4 ranks under ZeRO-3 (each rank holds a quarter of the
# parameters, gradients and optimizer state). RANKS=1 runs one process; STRATEGY picks another
# strategy (ddp, zero1, zero2, zero3). Extra arguments go to `shardgrad train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
RANKS="${RANKS:-4}"
STRATEGY="${STRATEGY:-zero3}"
if [ "$RANKS" = 1 ]; then
  exec ./build/shardgrad train "$@"
fi
flags=(--oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
if [ "$(id -u)" = 0 ]; then flags+=(--allow-run-as-root); fi  # containers run as root
exec mpirun "${flags[@]}" -np "$RANKS" ./build/shardgrad train --strategy "$STRATEGY" --threads 1 "$@"
