#!/usr/bin/env bash
# Build the GPU binaries here and take them to a GPU machine, instead of building there (about 4 of
# a lease's minutes a fresh machine). This machine needs the CUDA toolkit (nvcc, cuBLASLt, cuDNN,
# NCCL) but no GPU; the GPU machine needs the same shared libraries (checked before anything runs).
#
#   bash scripts/gpu_pack.sh pack [BUILD]    here: build BUILD (default build-gpu) as gpu_check.sh's
#                                            `build` part does (Release, what it runs; not for this
#                                            processor alone: SG_NATIVE=OFF), and write
#                                            .gpubin/build.tar.xz (stripped binaries, CTest files;
#                                            about 4 MB) and .gpubin/origin (where and from what)
#   bash scripts/gpu_pack.sh unpack          there, in the repository's root: unpack into the same
#                                            BUILD, so that `ctest --test-dir BUILD -L gpu` and
#                                            `BUILD=BUILD bash scripts/gpu_check.sh tests train ...`
#                                            run them; exits 1 naming what is missing (then build there)
#
# .gpubin is ignored (.git/info/exclude) and travels with the device tool's carry. The binaries hold
# this checkout's absolute paths (the golden files, the CLI, mpiexec): unpack links those paths to
# the GPU machine's checkout and mpiexec where they differ there.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:-}
case "$verb" in
pack)
  BUILD=${2:-build-gpu}
  grep -qxF "/.gpubin/" .git/info/exclude 2>/dev/null || echo "/.gpubin/" >> .git/info/exclude
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  # Not -march=native: the GPU machine's processor is another (SG_NATIVE=OFF stays in BUILD's cache)
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSG_NATIVE=OFF > /dev/null
  # gpu_check.sh's own build: Release, the GPU tests, the CLI and the kernel benches
  LOG_DIR="$stage/log" BUILD="$BUILD" bash scripts/gpu_check.sh build
  grep -q "^CUDAToolkit_NVCC_EXECUTABLE:FILEPATH=/" "$BUILD/CMakeCache.txt" ||
    { echo "gpu_pack: $BUILD was configured without the CUDA toolkit: nothing to pack" >&2; exit 1; }
  mkdir -p "$stage/$BUILD"
  (cd "$BUILD" && find . -name 'CTestTestfile.cmake' -o -name '*_include-*.cmake' -o -name '*_tests-*.cmake' |
     tar -cf - -T -) | tar -xf - -C "$stage/$BUILD"
  for b in "$BUILD/shardgrad" "$BUILD"/tests/sg_gpu_* "$BUILD"/bench/sg_bench_*gpu*; do
    [ -x "$b" ] && mkdir -p "$stage/$(dirname "$b")" && strip -o "$stage/$b" "$b"
  done
  mkdir -p .gpubin
  tar -C "$stage" -cJf .gpubin/build.tar.xz "$BUILD"
  { echo "source_dir=$(pwd)"; echo "build=$BUILD"; echo "mpiexec=$(grep '^MPIEXEC_EXECUTABLE:' "$BUILD/CMakeCache.txt" | cut -d= -f2)"
    echo "commit=$(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!.gpubin' || echo '+changes')"; } > .gpubin/origin
  echo "gpu_pack: .gpubin/build.tar.xz ($(du -h .gpubin/build.tar.xz | cut -f1)) from $(grep commit= .gpubin/origin | cut -d= -f2);" \
       "carry .gpubin and run: bash scripts/gpu_pack.sh unpack"
  ;;
unpack)
  [ -f .gpubin/origin ] && [ -f .gpubin/build.tar.xz ] || { echo "gpu_pack: no .gpubin here (carry it)" >&2; exit 1; }
  src=$(grep '^source_dir=' .gpubin/origin | cut -d= -f2-) BUILD=$(grep '^build=' .gpubin/origin | cut -d= -f2-)
  mpi=$(grep '^mpiexec=' .gpubin/origin | cut -d= -f2-) commit=$(grep '^commit=' .gpubin/origin | cut -d= -f2-)
  here_commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  [ "${commit%+changes}" = "$here_commit" ] || echo "gpu_pack: WARNING: packed from $commit, this checkout is $here_commit"
  tar -xJf .gpubin/build.tar.xz
  missing=$(ldd "$BUILD/shardgrad" "$BUILD"/tests/sg_gpu_* 2>&1 | grep "not found" | sort -u || true)
  [ -z "$missing" ] || { echo "gpu_pack: the packed binaries need what this machine lacks:"; echo "$missing"; exit 1; }
  if [ "$src" != "$(pwd)" ]; then
    [ -e "$src" ] || { mkdir -p "$(dirname "$src")" && ln -s "$(pwd)" "$src"; }
    [ "$(cd "$src" && pwd -P)" = "$(pwd -P)" ] || { echo "gpu_pack: $src is another folder here; build here instead" >&2; exit 1; }
  fi
  here_mpi=$(command -v mpiexec || true)
  if [ -n "$here_mpi" ] && [ "$here_mpi" != "$mpi" ] && [ ! -e "$mpi" ]; then
    mkdir -p "$(dirname "$mpi")" && ln -s "$here_mpi" "$mpi"
  fi
  echo "gpu_pack: $BUILD unpacked ($commit); $(ls "$BUILD"/tests/sg_gpu_* | wc -l) GPU tests, the CLI and the kernel benches"
  ;;
*)
  echo "usage: bash scripts/gpu_pack.sh pack [BUILD] | unpack" >&2
  exit 2
  ;;
esac
