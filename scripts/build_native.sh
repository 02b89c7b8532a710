#!/usr/bin/env bash
# Build omniep._native in place (omniep/_native*.so) with CMake + Ninja; `make native` calls this.
# Usage: scripts/build_native.sh [extra cmake -D options]
# Env: PYTHON (interpreter the module is for; default .venv/bin/python if present, else python3),
#      OMNIEP_BUILD_DIR (default build/native), CUDACXX (default: nvcc on PATH or /usr/local/cuda),
#      OMNIEP_HIP=1 (build omniep._native_hip for AMD with hipcc instead; default dir build/hip).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PYTHON="$(command -v "$PYTHON")"
BUILD_DIR="${OMNIEP_BUILD_DIR:-build/native}"

# OMNIEP_HIP=1: the AMD build (omniep._native_hip, cmake/hip.cmake; ROCm >= 6.2), in build/hip.
hip=()
if [[ "${OMNIEP_HIP:-0}" == 1 ]]; then
  hip=(-DOMNIEP_HIP=ON)
  BUILD_DIR="${OMNIEP_BUILD_DIR:-build/hip}"
else
  if [[ -z "${CUDACXX:-}" ]]; then
    if command -v nvcc >/dev/null; then CUDACXX="$(command -v nvcc)"; else CUDACXX=/usr/local/cuda/bin/nvcc; fi
  fi
  [[ -x "$CUDACXX" ]] || { echo "build_native: no nvcc found (set CUDACXX)" >&2; exit 1; }
  export CUDACXX
fi

# pybind11 from the target interpreter; if it lacks pybind11, borrow the cmake dir of another
# interpreter of the SAME Python version (pybind11 is header-only).
extra=()
if ! "$PYTHON" -c "import pybind11" 2>/dev/null; then
  want="$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')"
  for other in python3 python; do
    if command -v "$other" >/dev/null && [[ "$("$other" -c 'import sys; print(sys.version_info[:2])')" == "$want" ]] \
       && dir="$("$other" -m pybind11 --cmakedir 2>/dev/null)"; then
      extra+=("-Dpybind11_DIR=$dir"); break
    fi
  done
  [[ ${#extra[@]} -gt 0 ]] || { echo "build_native: pybind11 not found for $PYTHON (pip install pybind11)" >&2; exit 1; }
fi

inc="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[[ -f "$inc/Python.h" ]] || { echo "build_native: $inc/Python.h missing: install the Python development headers" >&2; exit 1; }

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DPython_EXECUTABLE="$PYTHON" -DCMAKE_BUILD_TYPE=Release \
  "${extra[@]}" "${hip[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
ls -l omniep/_native*.so
