#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer + UndefinedBehaviorSanitizer, in ./build-asan, the CUDA
# kernels under emulation included (their global memory is the tests' host buffers, so a kernel
# that reads or writes past one is caught here, without a GPU).
# Multi-rank tests are left out (Open MPI's own allocations make ASan's leak report noise), and so
# is the 1000-step learning run (minutes under ASan; the same code runs in the other tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSG_SANITIZE=ON -DSG_CUDA=OFF > build-asan.log 2>&1 || { cat build-asan.log; exit 1; }
cmake --build build-asan -j"$(nproc)" --target sg_tests sg_emu_tests shardgrad 2>&1 | tail -n 2
cd build-asan
# allocator_may_return_null: a size past ASan's limit is the engine's out-of-memory error, which the
# tests of absurd sizes expect (ASan otherwise aborts the process instead of failing the allocation).
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j"$(nproc)" -E "^mpi\\.|mpirun|ranks|gpu\\.|learns to" --timeout 1800
# The fibers' stack switches are annotated for ASan (kernels/emu/emu.h): a thread unwinding on its
# fiber's stack draws no "False positive error reports may follow" warning.
out=$(ASAN_OPTIONS=detect_leaks=0 ./sg_emu_tests "emu fibers: an exception*" 2>&1) || { echo "$out"; exit 1; }
if grep -q "False positive error reports may follow" <<< "$out"; then
  echo "$out"
  echo "sanitize: ASan does not know the emulation's fiber stacks (the switch annotations in kernels/emu/emu.h)"
  exit 1
fi
