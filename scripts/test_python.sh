#!/usr/bin/env bash
# The Python package's tests: builds a venv (reused when present), installs
# ./python with its [test] extra (torch, Liger-Kernel, pytest; pinned in
# python/pyproject.toml), and runs pytest. scripts/test.sh calls it after
# ctest. GRPO_TEST_LABEL=fast skips tests marked slow. The venv and its
# variables (GRPO_PY_VENV, GRPO_PY_BUILD, GRPO_PYTHON): scripts/lib/python_venv.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/ccache.sh  # the wheel's library objects from build/'s compile
source scripts/lib/python_venv.sh
grpo_install_python test

marker=()
if [[ "${GRPO_TEST_LABEL:-}" == fast ]]; then marker=(-m "not slow"); fi
# Run from the repository root so python/grpo (without its compiled _core)
# does not shadow the installed package. Exit code 5 (no tests collected) is
# a failure like any other non-zero code.
"$venv/bin/pytest" -q python/tests "${marker[@]}"
