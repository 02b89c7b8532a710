#!/usr/bin/env bash
# One device call for the one-process-per-rank path (cuda_nvshmem over CUDA IPC, NVSHMEM if built):
# build, the multi-process GPU tests, the multi-GPU benchmark. Logs go to $OUT (default ./gpu_out).
# Finishes inside 9 minutes: build <= 150 s, the optional NVSHMEM module <= 90 s (its failure leaves
# the CUDA IPC path intact; the tests then cover that path only), tests <= 210 s, benchmark <= 80 s
# (each step has its own timeout; a failing step does not stop the later ones; the exit status is
# the first failure's).
# Run it on `nvidia-h200-x2` (two GPUs: same-GPU and one-process-per-GPU sessions + the benchmark);
# on one GPU the per-GPU session and the benchmark skip themselves.
#   scripts/gpu_check_multi.sh            # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh  # env, $OUT, $PY, step()

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.device_count(), "GPUs")'
  "$PY" -c 'import nvidia.nvshmem, os; print("nvshmem wheel:", os.path.dirname(nvidia.nvshmem.__file__))' || true
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.log"

step build 150 scripts/build_native.sh
# Its own build directory: the NVSHMEM option never sticks in the cache of the default build.
step build_nvshmem 90 env OMNIEP_BUILD_DIR=build/native_nvshmem scripts/build_native.sh -DOMNIEP_NVSHMEM=ON
step pytest_multi 210 "$PY" -m pytest -m gpu tests/gpu/test_native_multiprocess.py -q -rs --timeout=200 -p no:cacheprovider
step bench_multi 80 "$PY" benchmarks/bench_multigpu.py
echo "gpu_check_multi: exit $status; logs in $OUT"
exit $status
