#!/usr/bin/env bash
# The Python package's tests: builds a venv (reused when present), installs
# ./python with its [test] extra (torch, Liger-Kernel, pytest; pinned in
# python/pyproject.toml), and runs pytest. scripts/test.sh calls it after
# ctest. GRPO_TEST_LABEL=fast skips tests marked slow.
#   GRPO_PY_VENV   venv directory (default build/venv-python)
#   GRPO_PY_BUILD  CMake build directory of the extension, kept between runs
#                  so a re-install only recompiles what changed (default build/python)
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${GRPO_PY_VENV:-build/venv-python}
build_dir=${GRPO_PY_BUILD:-build/python}
# Debian's interpreter (python3-venv / python3-dev from install_deps.sh), not
# whatever python3 is first on PATH: the extension is built against its headers.
python=${GRPO_PYTHON:-/usr/bin/python3}

if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
"$venv/bin/pip" install -q "./python[test]" --config-settings=build-dir="$PWD/$build_dir"

marker=()
if [[ "${GRPO_TEST_LABEL:-}" == fast ]]; then marker=(-m "not slow"); fi
# Run from the repository root so python/grpo (without its compiled _core)
# does not shadow the installed package. Exit code 5 (no tests collected) is
# a failure like any other non-zero code.
"$venv/bin/pytest" -q python/tests "${marker[@]}"
