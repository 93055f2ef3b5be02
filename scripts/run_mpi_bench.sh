#!/usr/bin/env bash
# The scale-out measurements: the fused plan over MPI ranks on this machine
# (loopback: shared memory / TCP), one JSON per config in this machine's
# results folder, microbench/results/<machine>/ (scripts/lib/results_dir.sh):
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
# microbench/results/<machine>), MPIRUN_FLAGS (replaces the Open MPI flags below).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${BUILD_DIR:-build}
ranks=${RANKS:-2}
source scripts/lib/results_dir.sh
out_dir=${OUT_DIR:-$(grpo_results_dir)}
configs=${CONFIGS:-"configs/mpi/vocab_T1024_bf16.yaml configs/mpi/data_T1024_bf16.yaml"}

if [[ ! -x "$build/microbench/grpo-mpi-bench" ]]; then
  bash scripts/install_deps.sh
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build "$build" -j2 --target grpo-mpi-bench
fi
flags=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  # Ranks unbound (more ranks than cores allowed); shared memory and TCP on
  # loopback. Unlike the mpi tests, shared memory keeps its kernel single-copy
  # (CMA) for large messages: copied through Open MPI's 32 KiB buffers instead
  # (btl_vader_single_copy_mechanism none), the data config's 2.5 GB dW
  # reduction took 0.9-3 s on a quiet moment and 204 s on a loaded one here
  # (each buffer hand-off waits for the other rank to be scheduled); with CMA
  # 2.3-4.9 s under the same load.
  flags=(--bind-to none --mca btl self,vader,tcp)
  if ((ranks > $(nproc))); then flags+=(--oversubscribe); fi
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
