#!/usr/bin/env bash
# Fails when a tracked C++ file differs from what clang-format 14 makes of it
# (.clang-format at the top). Build dirs and generated files are never looked
# at: only files git tracks are checked.
#
#   scripts/check_format.sh            check (CI)
#   scripts/check_format.sh --fix      rewrite the files in place
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

clang_format=${CLANG_FORMAT:-}
if [[ -z "$clang_format" ]]; then
  for c in clang-format-14 clang-format; do
    if command -v "$c" >/dev/null; then clang_format=$c; break; fi
  done
fi
if [[ -z "$clang_format" ]]; then
  echo "check_format: clang-format not found (scripts/install_deps.sh installs it)" >&2
  exit 2
fi
# Other major versions format some constructs differently: the check is only
# meaningful with the version the tree was formatted with.
version=$("$clang_format" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [[ "$version" != 14 ]]; then
  echo "check_format: $clang_format is version $version, the tree is formatted with 14" >&2
  exit 2
fi

# *.hpp.in templates hold @VAR@ placeholders that are not C++.
mapfile -t files < <(git ls-files -- '*.cpp' '*.hpp' '*.h' '*.cc' | grep -vE '^(build[^/]*|out)/')
if ((${#files[@]} == 0)); then
  echo "check_format: no C++ files" >&2
  exit 2
fi

if [[ "${1:-}" == --fix ]]; then
  "$clang_format" -i --style=file "${files[@]}"
  echo "check_format: formatted ${#files[@]} files"
  exit 0
fi
if "$clang_format" --dry-run -Werror --style=file "${files[@]}"; then
  echo "check_format: ${#files[@]} files formatted"
else
  echo "check_format: run scripts/check_format.sh --fix" >&2
  exit 1
fi
