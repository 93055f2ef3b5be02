# Sourced by scripts/test.sh, scripts/test_python.sh and
# scripts/check_install.sh: compile through ccache (installed by
# install_deps.sh).
# The library's translation units are compiled with the same command in
# build/, in the Python wheel's build tree (build/python) and in the install
# check's (build-pkg/): with ccache each is compiled once, the later trees
# take the objects from the cache (include/grpo/version.hpp is committed,
# not generated, so no tree adds an include directory of its own).
#   CCACHE_DIR   the cache (default build/ccache: `rm -rf build` empties it,
#                and a fresh checkout starts from an empty one, whatever ran
#                before on the machine)
#   GRPO_CCACHE=0  compile without it
# A launcher already set in CMAKE_CXX_COMPILER_LAUNCHER is kept. CMake reads
# it when it configures a new build tree; a tree configured before keeps its
# own setting.
# ccache hashes the compiler's name: CXX names one compiler for every tree
# (CMake's default, c++; without it the wheel's build takes Debian Python's
# x86_64-linux-gnu-g++, the same g++ by another name, and every object
# missed). A CXX already set is kept.
if [[ "${GRPO_CCACHE:-1}" == 1 ]] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CXX=${CXX:-c++}
  CCACHE_DIR=${CCACHE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/build/ccache}
  export CCACHE_DIR
fi
