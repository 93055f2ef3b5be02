#!/usr/bin/env bash
# clang-tidy 14 (.clang-tidy at the top) over the library's sources, src/,
# with the compile database of a build tree; any warning fails. .ci/run calls
# it after scripts/test.sh built build/.
#
#   bash scripts/check_tidy.sh            # build/ (re-configured to export compile_commands.json)
#   BUILD_DIR=build-docs bash scripts/check_tidy.sh
#   bash scripts/check_tidy.sh src/api    # one folder (or file) only
#
# About 25 translation units under src/, 2 minutes on 2 cores (JOBS, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-2}
tidy=""
for c in clang-tidy-14 clang-tidy; do
  if command -v "$c" >/dev/null; then tidy=$c; break; fi
done
if [[ -z "$tidy" ]]; then
  echo "check_tidy: clang-tidy not found (scripts/install_deps.sh installs it)" >&2
  exit 1
fi
if [[ ! -f "$build/compile_commands.json" ]]; then
  cmake -S . -B "$build" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
fi
paths=("$@")
if ((${#paths[@]} == 0)); then paths=(src/); fi
prefixes=()
for p in "${paths[@]}"; do prefixes+=("$PWD/$p"); done
# The database's translation units under the paths (each once).
mapfile -t files < <(python3 - "$build/compile_commands.json" "${prefixes[@]}" <<'PY'
import json, sys
seen = set()
for entry in json.load(open(sys.argv[1])):
    path = entry["file"]
    if any(path.startswith(p) for p in sys.argv[2:]) and path not in seen:
        seen.add(path)
        print(path)
PY
)
if ((${#files[@]} == 0)); then
  echo "check_tidy: no translation unit of $build/compile_commands.json under ${paths[*]}" >&2
  exit 1
fi
# One clang-tidy per file, JOBS at a time; any warning is an error.
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -n 1 "$tidy" -p "$build" --quiet --warnings-as-errors='*'
echo "check_tidy: clean (${#files[@]} files under ${paths[*]})"
