#!/usr/bin/env bash
# The test suite: install what is missing, build, run every test under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900
