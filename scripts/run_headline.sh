#!/usr/bin/env bash
# The headline runs behind the README's results table and plot: every
# headline config at B=1 T=8192 H=4096 V=151936, one process each (so one
# run's peak cannot hide another's), then a T sweep (512..4096) of fused bf16
# and the bf16-logits baseline, then the PNG. About an hour on the 2-core
# machine; the baselines need ~19-21 GB. Run it alone.
# Output: *.json and scaling.png in this machine's results folder,
# microbench/results/<machine>/ (scripts/lib/results_dir.sh; GRPO_RESULTS_DIR
# overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/results_dir.sh
out=${GRPO_RESULTS_DIR:-$(grpo_results_dir)}
mkdir -p "$out"
bench=${GRPO_BENCH:-build/microbench/grpo-microbench}
if [[ ! -x $bench ]]; then
  bash scripts/install_deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j2 --target grpo-microbench
fi

for name in ${GRPO_HEADLINE_CONFIGS:-fused_bf16_tile2048 baseline_bf16_logits fused_f32 baseline_f32 fused_bf16_tile1024 baseline_f32_logits}; do
  "$bench" --config "configs/microbench/headline_$name.yaml" \
    --benchmark_out="$out/headline_$name.json" --benchmark_out_format=json
done

if [[ "${GRPO_SKIP_SWEEP:-0}" != 1 ]]; then
  "$bench" --config configs/microbench/headline_fused_bf16_tile2048.yaml \
    --config configs/microbench/headline_baseline_bf16_logits.yaml \
    --sweep shape.seq_len=512,1024,2048,4096 --set steps=2 --set measure_unfused_gemms=false \
    --benchmark_out="$out/scaling.json" --benchmark_out_format=json
fi

GRPO_WITH_PLOT=1 bash scripts/install_deps.sh
python3 scripts/plot_scaling.py "$out/scaling.json" "$out/headline_fused_bf16_tile2048.json" \
  "$out/headline_baseline_bf16_logits.json" -o "$out/scaling.png"
