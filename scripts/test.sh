#!/usr/bin/env bash
# The README's test command: installs what is missing, checks the docs'
# links and paths (scripts/check_docs.py), builds Release (through ccache:
# scripts/lib/ccache.sh), and runs
# every test tier (fast, slow and, when MPI is built, mpi) with ctest, then the
# Python package's tests (scripts/test_python.sh). GRPO_TEST_LABEL=fast runs
# one tier, plus the mpi label (the scale-out tests under mpirun with 1-4
# ranks) whenever grpo::mpi was built. ctest runs JOBS (default 2) tests at a
# time: most tests are single-threaded (the double oracle, finite differences),
# so two at a time take the 2-core machine's fast tier from 76 to 37 s and the
# slow tier from 573 to 434 s (Zen 3), the mpi tests from 34 to 28 s.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
source scripts/lib/ccache.sh  # build/ccache: the wheel's build takes build/'s library objects
# The docs first (a fraction of a second): every link resolves, every script,
# config and path they name exists.
python3 scripts/check_docs.py
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
jobs=${JOBS:-2}
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" ${GRPO_TEST_LABEL:+-L "$GRPO_TEST_LABEL"}
if [[ -n "${GRPO_TEST_LABEL:-}" && "$GRPO_TEST_LABEL" != mpi ]]; then
  if ctest --test-dir build -N -L mpi | grep -q "Total Tests: [1-9]"; then
    ctest --test-dir build --output-on-failure -j "$jobs" -L mpi
  else
    echo "test.sh: grpo::mpi not built (no MPI found): no mpi tests" >&2
  fi
fi
bash scripts/test_python.sh
