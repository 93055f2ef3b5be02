#!/usr/bin/env bash
# The GRPO training A/B with TRL 1.16 on CPU (README "Training A/B with TRL"):
# TRL out of the box against TRL with grpo's LM head patched in, 100 steps
# each, one subprocess per arm, then the summary, the table and the PNG in
# microbench/results/train_ab/. Needs the [test,bench] extras (torch, TRL,
# transformers, matplotlib); builds the venv (scripts/lib/python_venv.sh) when
# it is missing. Run it alone on the machine: the step times are the result.
#   GRPO_PY_VENV, GRPO_PY_BUILD, GRPO_PYTHON  the venv (scripts/lib/python_venv.sh)
#   GRPO_SKIP_INSTALL=1  use the venv's installed grpo as it is
# Extra arguments go to scripts/train_ab.py (--smoke, --arms trl,grpo,grpo_loss, --steps N, --set FIELD=VALUE,
# --checkpoint-every N: resumable arms, run the same command again to go on).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/python_venv.sh
if [[ "${GRPO_SKIP_INSTALL:-0}" != 1 ]]; then grpo_install_python test,bench; fi
"$venv/bin/python" scripts/train_ab.py --out microbench/results/train_ab "$@"
