#!/usr/bin/env bash
# The GRPO training A/B with TRL 1.16 on CPU (README "Training A/B with TRL"):
# TRL out of the box against TRL with grpo's LM head patched in, 100 steps
# each, one subprocess per arm, then the summary, the table and the PNG in
# microbench/results/train_ab/. Needs the [test,bench] extras (torch, TRL,
# transformers, matplotlib); builds the venv like scripts/test_python.sh when
# it is missing. Run it alone on the machine: the step times are the result.
#   GRPO_PY_VENV   venv directory (default build/venv-python)
#   GRPO_PY_BUILD  CMake build directory of the extension (default build/python)
#   GRPO_SKIP_INSTALL=1  use the venv's installed grpo as it is
# Extra arguments go to scripts/train_ab.py (--smoke, --arms trl,grpo,grpo_loss, --steps N, --set FIELD=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${GRPO_PY_VENV:-build/venv-python}
build_dir=${GRPO_PY_BUILD:-build/python}
python=${GRPO_PYTHON:-/usr/bin/python3}

if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
if [[ "${GRPO_SKIP_INSTALL:-0}" != 1 ]]; then
  "$venv/bin/pip" install -q "./python[test,bench]" --config-settings=build-dir="$PWD/$build_dir"
fi
"$venv/bin/python" scripts/train_ab.py --out microbench/results/train_ab "$@"
