#!/usr/bin/env bash
# Builds the libFuzzer target tests/fuzz/fuzz_api.cpp with clang (library and
# harness both instrumented: ASan + UBSan + coverage) in build-fuzz/ and runs
# it for a bounded time on a copy of the committed seed corpus. Any finding
# (a crash, a sanitizer report, a contract violation: a non-grpo exception, an
# output written before a refusal, a non-finite result) fails the run and
# leaves the reproducer in build-fuzz/findings/.
#
#   scripts/fuzz.sh                   120 s
#   FUZZ_SECONDS=600 scripts/fuzz.sh
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-120}
jobs=${JOBS:-2}
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

GRPO_WITH_FUZZ=1 bash "$root/scripts/install_deps.sh"

# libdnnl is built against GNU OpenMP (libgomp). clang's own -fopenmp would
# link LLVM's libomp as well, giving the process two OpenMP runtimes and grpo's
# omp_set_num_threads the wrong one: point FindOpenMP at libgomp instead.
gomp=$(g++ -print-file-name=libgomp.so)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DGRPO_BUILD_FUZZ=ON -DGRPO_SANITIZE=address,undefined \
  -DGRPO_BUILD_TESTS=OFF -DGRPO_BUILD_MICROBENCH=OFF -DGRPO_INSTALL=OFF \
  -DOpenMP_CXX_FLAGS=-fopenmp=libgomp -DOpenMP_CXX_LIB_NAMES=gomp -DOpenMP_gomp_LIBRARY="$gomp" >/dev/null
cmake --build "$build" -j "$jobs" --target grpo_fuzz_api

# The run works on a copy: new inputs the fuzzer keeps do not dirty the tree.
corpus="$build/corpus"
findings="$build/findings"
rm -rf "$corpus" "$findings"
mkdir -p "$corpus" "$findings"
find "$root/tests/fuzz/corpus" -type f ! -name README.md -exec cp -t "$corpus" {} +

supp="$root/cmake/sanitizers"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
# One thread per call: oneDNN and TBB threads add nothing to coverage and
# would share the 2 cores with the fuzzer.
export OMP_NUM_THREADS=1

log="$build/fuzz.log"
echo "fuzz: running for ${seconds} s (log: $log)"
set +e
"$build/tests/fuzz/grpo_fuzz_api" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" >"$log" 2>&1
status=$?
set -e
grep -E '^(#[0-9]+ +(INITED|DONE)|==[0-9]+==|fuzz_api:|  (entry|loss_type|ids|mask|advantages|old_logp|ref_logp|is_weight|logp|refusal)|SUMMARY|stat::)' \
  "$log" || true
if ((status != 0)); then tail -n 40 "$log" >&2; fi
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
echo "fuzz: ${execs:-0} executions in ${seconds} s, corpus $(ls "$corpus" | wc -l) inputs"
if ((status != 0)); then
  echo "fuzz: FINDING (exit $status); reproducer(s): $(ls "$findings")" >&2
  # The reproducers as base64 (inputs are <= 4096 bytes): a CI log is all a
  # finding on another machine leaves. To replay one: base64 -d > crash, then
  # build-fuzz/tests/fuzz/grpo_fuzz_api crash (GRPO_FUZZ_PRINT=1 prints the problem).
  for f in "$findings"/*; do
    [[ -f "$f" ]] || continue
    echo "fuzz: reproducer $(basename "$f") ($(stat -c %s "$f") bytes), base64:" >&2
    base64 -w 0 "$f" >&2
    echo >&2
  done
  exit "$status"
fi
