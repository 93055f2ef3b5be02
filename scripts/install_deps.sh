#!/usr/bin/env bash
# Installs the Debian packages grpo builds, tests and benchmarks with.
# Idempotent: packages already present are not touched, and apt-get update
# runs only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  ccache             # ccache 4.7: the library compiled once for build/, the wheel and the install check (scripts/lib/ccache.sh)
  libdnnl-dev        # oneDNN 2.6.3 (OpenMP CPU runtime): matmuls
  ocl-icd-opencl-dev # Debian's dnnl-config.cmake calls find_package(OpenCL); not pulled in with --no-install-recommends
  libtbb-dev         # oneTBB 2021.8: task parallelism
  libxsimd-dev       # xsimd 8.1: SIMD wrappers for the stage kernels
  libbenchmark-dev   # Google Benchmark 1.7: microbench
  libgtest-dev       # GoogleTest 1.12: tests
  libyaml-cpp-dev    # yaml-cpp 0.7: microbench / gradcheck configs
  libcli11-dev       # CLI11 2.1: command-line flags of the tools
  openmpi-bin libopenmpi-dev  # Open MPI 4.1: grpo::mpi, the mpi test label, grpo-mpi-bench
  clang-format clang-tidy
  python3-venv python3-dev python3-pip  # the Python package (python/, scripts/test_python.sh)
)
if [[ "${GRPO_WITH_FUZZ:-0}" == 1 ]]; then
  packages+=(clang libclang-rt-14-dev libomp-14-dev)  # libFuzzer + sanitizer runtimes; omp.h for clang (libgomp is linked)
fi
if [[ "${GRPO_WITH_PLOT:-0}" == 1 ]]; then
  packages+=(python3-matplotlib)         # scripts/plot_scaling.py
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}" >&2
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all packages present" >&2
fi
