# Sourced by scripts/sanitize.sh and .ci/run. Defines
#   grpo_fast_tier BUILD_DIR [JOBS]
# which runs the fast test tier of BUILD_DIR: grpo_tests_fast's cases (1414
# of its 1421 tests) as JOBS gtest shards, one process each, instead of one
# process per case as ctest runs them (each process loads oneDNN, oneTBB and
# OpenMP, and under ASan also maps its shadow memory and ends with
# LeakSanitizer's scan: ~0.12 s a process there); then the tier's other tests
# (their own executables) through ctest. A failing shard prints the end of its
# log (BUILD_DIR/fast_shardN.log); any failure returns non-zero.
grpo_fast_tier() {
  local build=$1 jobs=${2:-2} shard status=0
  local -a other pids=()
  mapfile -t other < <(ctest --test-dir "$build" -N --show-only=json-v1 | python3 -c '
import json, sys
tests = json.load(sys.stdin)["tests"]
for number, t in enumerate(tests, 1):
    labels = next((p["value"] for p in t.get("properties", []) if p["name"] == "LABELS"), [])
    if "fast" in labels and not t.get("command", [""])[0].endswith("/grpo_tests_fast"):
        print(number)')
  for ((shard = 0; shard < jobs; ++shard)); do
    GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$shard "$build/tests/grpo_tests_fast" --gtest_brief=1 \
      >"$build/fast_shard$shard.log" 2>&1 &
    pids+=($!)
  done
  for ((shard = 0; shard < jobs; ++shard)); do
    if ! wait "${pids[$shard]}"; then
      status=1
      echo "fast tier: grpo_tests_fast shard $shard of $jobs failed ($build/fast_shard$shard.log):" >&2
      tail -n 60 "$build/fast_shard$shard.log" >&2
    fi
    grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$build/fast_shard$shard.log" | sed "s/^/shard $shard: /" || true
  done
  if ((${#other[@]})); then
    ctest --test-dir "$build" -I "0,0,0,$(IFS=,; echo "${other[*]}")" --output-on-failure -j "$jobs" --timeout 900 ||
      status=1
  fi
  return "$status"
}
