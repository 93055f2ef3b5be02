#!/usr/bin/env bash
# The README's test command: installs what is missing, builds Release, and runs
# every test tier (fast and slow) with ctest, then the Python package's tests
# (scripts/test_python.sh). GRPO_TEST_LABEL=fast runs one tier.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build --output-on-failure ${GRPO_TEST_LABEL:+-L "$GRPO_TEST_LABEL"}
bash scripts/test_python.sh
