#!/usr/bin/env bash
# Configures and builds shardgrad into ./build (Release, native ISA unless SG_NATIVE=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# ccache keys on absolute paths unless they are made relative to a base: with it a fresh clone in
# another folder (CI's) reuses what an earlier build here compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSG_NATIVE="${SG_NATIVE:-ON}" > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"$(nproc)" 2>&1 | tail -n 3
