# Sourced by scripts/test_python.sh and scripts/run_train_ab.sh: the venv the
# Python package is installed into, created on first use.
#   GRPO_PY_VENV   venv directory (default build/venv-python)
#   GRPO_PY_BUILD  CMake build directory of the extension, kept between runs
#                  so a re-install only recompiles what changed (default build/python)
#   GRPO_PYTHON    interpreter the venv is made from (default /usr/bin/python3:
#                  Debian's, from install_deps.sh, whose headers the extension
#                  builds against, not whatever python3 is first on PATH)
# Defines venv and build_dir, and grpo_install_python EXTRAS (pip install
# "./python[EXTRAS]" into the venv). Run from the repository root.
venv=${GRPO_PY_VENV:-build/venv-python}
build_dir=${GRPO_PY_BUILD:-build/python}

if [[ ! -x "$venv/bin/python" ]]; then
  "${GRPO_PYTHON:-/usr/bin/python3}" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi

grpo_install_python() {
  "$venv/bin/pip" install -q "./python[$1]" --config-settings=build-dir="$PWD/$build_dir"
}
