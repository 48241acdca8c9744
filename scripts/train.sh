#!/usr/bin/env bash
# The main job: install what is missing, build, and train the tiny GPT on the built-in synthetic
# addition task on the CPU. Extra arguments go to `shardgrad train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec ./build/shardgrad train "$@"
