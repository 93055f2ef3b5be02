#!/usr/bin/env bash
# Installs grpo to a temporary prefix and builds examples/ against that prefix
# only -- never the build tree -- once through find_package(grpo) and once
# through pkg-config, runs both, and checks the printed loss is finite.
#
#   scripts/check_install.sh            static and shared libgrpo
#   scripts/check_install.sh static     one kind only (static | shared)
#
# Build trees: build-pkg/<kind> (library), build-pkg/<kind>-example.
# Env: JOBS (default 2), KEEP_PREFIX=1 keeps the temporary prefix.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/lib/ccache.sh"  # the library's objects from build/'s compile, when test.sh ran first
jobs=${JOBS:-2}
kinds=("$@")
if ((${#kinds[@]} == 0)); then kinds=(static shared); fi
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

check_loss() {  # $1: file with the example's output
  local loss
  loss=$(awk '$1 == "loss" { print $2 }' "$1")
  # A finite decimal number: nan, inf and an empty field all fail here.
  if [[ ! "$loss" =~ ^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$ ]]; then
    echo "check_install: loss '$loss' is not a finite number" >&2
    return 1
  fi
  echo "check_install: finite loss $loss"
}

for kind in "${kinds[@]}"; do
  case "$kind" in
    static) shared=OFF ;;
    shared) shared=ON ;;
    *) echo "check_install: unknown kind '$kind' (static | shared)" >&2; exit 2 ;;
  esac
  build="$root/build-pkg/$kind"
  example_build="$root/build-pkg/$kind-example"
  prefix=$(mktemp -d "${TMPDIR:-/tmp}/grpo-prefix.XXXXXX")
  if [[ "${KEEP_PREFIX:-0}" != 1 ]]; then trap 'rm -rf "$prefix"' EXIT; fi
  echo "== $kind libgrpo -> $prefix"

  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=$shared -DGRPO_BUILD_TESTS=OFF -DGRPO_BUILD_MICROBENCH=OFF \
    -DGRPO_INSTALL=ON -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
  cmake --build "$build" -j "$jobs"
  cmake --install "$build" --prefix "$prefix" >/dev/null
  echo "installed:"; (cd "$prefix" && find . -type f -o -type l | sort | sed 's/^/  /')
  # grpo::grpo carries no comparison path: the unfused baselines are grpo::baseline's own library.
  lib=$(find "$prefix" -name 'libgrpo.a' -o -name 'libgrpo.so' | head -n1)
  if nm -C --defined-only "$lib" | grep -q 'LmHeadBaseline\|LogitsBaseline\|run_unfused_logits'; then
    echo "check_install: $lib defines baseline symbols (they belong to grpo::baseline)" >&2
    exit 1
  fi

  # The consumer sees the prefix and the system, nothing of grpo's trees: no
  # package registry, and a fresh build dir each time.
  rm -rf "$example_build"
  cmake -S "$root/examples" -B "$example_build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >/dev/null
  grpo_dir=$(sed -n 's/^grpo_DIR:PATH=//p' "$example_build/CMakeCache.txt")
  case "$grpo_dir" in
    "$prefix"/*) echo "find_package(grpo) used $grpo_dir" ;;
    *) echo "check_install: grpo found at '$grpo_dir', not in $prefix" >&2; exit 1 ;;
  esac
  cmake --build "$example_build" -j "$jobs" >/dev/null
  "$example_build/fused_step" | tee "$example_build/out.txt"
  check_loss "$example_build/out.txt"

  # grpo::mpi, when this build has MPI: the consumer's find_package(grpo)
  # defines it, and the vocabulary-parallel example runs on 2 ranks, its loss
  # bitwise the single process's (it exits non-zero otherwise).
  if find "$prefix" -name grpoMpiTargets.cmake | grep -q .; then
    if [[ ! -x "$example_build/mpi_step" ]]; then
      echo "check_install: grpo::mpi is installed but examples/mpi_step was not built" >&2
      exit 1
    fi
    mpirun_flags=()
    if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
      mpirun_flags=(--oversubscribe --bind-to none --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none)
    fi
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun -np 2 "${mpirun_flags[@]}" "$example_build/mpi_step" | tee "$example_build/out_mpi.txt"
    echo "check_install: grpo::mpi consumer OK (2 ranks)"
  else
    echo "check_install: no grpo::mpi in this install (built without MPI)"
  fi

  # pkg-config consumer: the plain compiler line a Makefile user would write.
  pc_dir=$(dirname "$(find "$prefix" -name grpo.pc | head -n1)")
  static_flag=()
  if [[ $kind == static ]]; then static_flag=(--static); fi
  flags=$(PKG_CONFIG_PATH="$pc_dir" pkg-config "${static_flag[@]}" --cflags --libs grpo)
  libdir=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --variable=libdir grpo)
  echo "pkg-config: $flags"
  # shellcheck disable=SC2086  # $flags is a list of compiler words
  c++ -std=c++20 -O2 "$root/examples/fused_step.cpp" -o "$example_build/fused_step_pc" $flags \
    -Wl,-rpath,"$libdir"
  "$example_build/fused_step_pc" > "$example_build/out_pc.txt"
  check_loss "$example_build/out_pc.txt"
  if [[ "${KEEP_PREFIX:-0}" != 1 ]]; then rm -rf "$prefix"; trap - EXIT; fi
done
echo "check_install: OK (${kinds[*]})"
