#!/usr/bin/env bash
# Fuzzes the readers of untrusted input with libFuzzer (clang from Debian): the safetensors
# reader, the token-shard reader, the checkpoint pointer/manifest, the flag parser, the sharded
# checkpoint index, GPT-2's tokenizer (its two files, and any text round-tripping), the
# multiple-choice eval files (HellaSwag) and the GEMM tuning file (SG_GEMM_TUNE_FILE). Each runs
# for FUZZ_SECONDS (default 60) from its seed corpus in tests/fuzz/corpus/<target>; a crash, a
# sanitizer report or an allocation over 2 GiB fails the script and leaves the input in build-fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
command -v clang++ > /dev/null || { sudo_cmd=""; [ "$(id -u)" != 0 ] && sudo_cmd=sudo; $sudo_cmd apt-get install -y -qq clang libclang-rt-dev; }
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSG_FUZZ=ON -DSG_TESTS=OFF -DSG_CUDA=OFF \
  -DSG_NATIVE=OFF > build-fuzz.log 2>&1 || { cat build-fuzz.log; exit 1; }
targets=(safetensors token_shards checkpoint flags sharded_index gpt2_tokenizer multiple_choice gemm_choices)
cmake --build build-fuzz -j"$(nproc)" --target "${targets[@]/#/sg_fuzz_}" 2>&1 | tail -n 1
for t in "${targets[@]}"; do
  corpus="build-fuzz/corpus-$t"
  mkdir -p "$corpus"
  cp -r tests/fuzz/corpus/"$t"/. "$corpus"/ 2>/dev/null || true
  echo "fuzzing $t for ${FUZZ_SECONDS:-60} s"
  (cd build-fuzz && ASAN_OPTIONS=detect_leaks=0 ./sg_fuzz_"$t" -max_total_time="${FUZZ_SECONDS:-60}" \
     -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 "corpus-$t" 2>&1 | tail -n 3)
done
echo "fuzzing: no crash in ${#targets[@]} targets"
