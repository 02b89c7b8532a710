#!/usr/bin/env bash
# One device call: build omniep._native, run the GPU tests, run the native benchmark.
# Logs go to $OUT (set by the device runner; defaults to ./gpu_out). Finishes well inside 9 minutes:
# build <= 3 min, tests <= 4 min, benchmark <= 1.5 min (each step has its own timeout, and a
# failing step does not stop the later ones; the exit status is the first failure's).
#   scripts/gpu_check.sh            # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh  # env, $OUT, $PY, step()

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  "$PY" -c 'import sysconfig, os; i = sysconfig.get_paths()["include"]; print("Python.h:", os.path.exists(i + "/Python.h"), i)'
  "$PY" -m pybind11 --cmakedir; cmake --version | head -1; ninja --version
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.log"

step build 180 scripts/build_native.sh
step pytest 400 "$PY" -m pytest -m gpu tests/gpu -q -rs --timeout=400 -p no:cacheprovider
step bench 90 "$PY" benchmarks/bench_native.py
echo "gpu_check: exit $status; logs in $OUT"
exit $status
