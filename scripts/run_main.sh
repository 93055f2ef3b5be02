#!/usr/bin/env bash
# The README's main job: installs what is missing, builds Release, and runs the
# quick compare (B=1 T=512 H=4096 V=151936 bf16): the unfused baseline (bf16
# logits) and the fused kernel, each measured in its own process, ending with
# the table of step time, peak bytes and their ratios.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2 --target grpo-microbench
build/microbench/grpo-microbench --compare \
  configs/microbench/quick_baseline_bf16_logits.yaml \
  configs/microbench/quick_fused_bf16_tile2048.yaml
