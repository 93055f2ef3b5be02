#!/usr/bin/env bash
# Issue 9's measurements: the fused plan over MPI ranks on this machine
# (loopback: shared memory / TCP), one JSON per config in microbench/results/:
#   configs/mpi/vocab_T1024_bf16.yaml  vocabulary parallelism, B=1 T=1024
#   configs/mpi/data_T1024_bf16.yaml   data parallelism, B=2 T=1024 (one sequence per rank)
# each against the single-process plan of the same invocation (rank 0 alone).
# Run it alone on the machine: a few minutes per config at 2 ranks x 1 thread.
#
#   bash scripts/run_mpi_bench.sh                        # both configs, 2 ranks
#   RANKS=4 bash scripts/run_mpi_bench.sh                # 4 ranks (oversubscribed here)
#   bash scripts/run_mpi_bench.sh --set steps=1          # extra flags go to grpo-mpi-bench
#   CONFIGS="configs/mpi/vocab_T1024_bf16.yaml" bash scripts/run_mpi_bench.sh
# Env: BUILD_DIR (default build), RANKS (default 2), OUT_DIR (default
# microbench/results), MPIRUN_FLAGS (replaces the Open MPI flags below; e.g.
# drop btl_vader_single_copy_mechanism none where the kernel allows CMA: the
# dW reduction of the data config then moves ~1.5x faster on loopback here).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${BUILD_DIR:-build}
ranks=${RANKS:-2}
out_dir=${OUT_DIR:-microbench/results}
configs=${CONFIGS:-"configs/mpi/vocab_T1024_bf16.yaml configs/mpi/data_T1024_bf16.yaml"}

if [[ ! -x "$build/microbench/grpo-mpi-bench" ]]; then
  bash scripts/install_deps.sh
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build "$build" -j2 --target grpo-mpi-bench
fi
flags=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  # More ranks than cores allowed, ranks unbound; shared memory and TCP on
  # loopback, shared memory copied through its buffers (no kernel single-copy,
  # which containers often forbid), as the mpi tests run.
  flags=(--oversubscribe --bind-to none --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none)
  if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
fi
if [[ -n "${MPIRUN_FLAGS+x}" ]]; then read -r -a flags <<< "$MPIRUN_FLAGS"; fi
mkdir -p "$out_dir"
for config in $configs; do
  stem=$(basename "$config" .yaml)
  out="$out_dir/mpi_${stem}_np${ranks}.json"
  echo "=== $config on $ranks ranks -> $out"
  mpirun -np "$ranks" "${flags[@]}" "$build/microbench/grpo-mpi-bench" --config "$config" "$@" \
    --benchmark_out="$out" --benchmark_out_format=json
done
