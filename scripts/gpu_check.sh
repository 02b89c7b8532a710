#!/usr/bin/env bash
# One device call on a one-GPU machine (nvidia-h100-x1 / nvidia-h200): build every native module
# (`pip install -e .`; nccl_ep's tests need two GPUs: scripts/gpu_check_multi.sh), run the `gpu`
# tests and the benchmarks. Logs go to $OUT (set by the device runner; defaults to ./gpu_out). Each
# step has its own timeout; a failing step does not stop the later ones; the exit status is the first
# failure's.
#   scripts/gpu_check.sh                                   # everything (~9 minutes)
#   GPU_TESTS="tests/gpu/test_hot_path.py" scripts/gpu_check.sh   # a subset of the tests
#   PART=tests | PART=bench scripts/gpu_check.sh           # build + only one of the two
#   PART=tests GPU_SHARD=1/2 scripts/gpu_check.sh          # the first of two contiguous halves of the tests
#                                                          # (where the build and the whole suite do not fit
#                                                          # one call: the two-GPU kinds, ~130 s to build)
#   PART=soak SOAK_S=480 scripts/gpu_check.sh              # build + the fault-injecting soak (issue 15):
#                                                          # two ranks on GPU 0, cuda_nvshmem over CUDA IPC
#                                                          # (then GPU_TESTS, if set, in the same call)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh  # env, $OUT, $PY, step()
PART="${PART:-all}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.log"

build_all
if [[ "$PART" == soak ]]; then
  soak_step
  # shellcheck disable=SC2086
  [[ -n "${GPU_TESTS:-}" ]] && step pytest "${GPU_TESTS_LIMIT:-300}" "$PY" -m pytest -m gpu $GPU_TESTS -v -rfEs \
    --timeout=280 -p no:cacheprovider
  echo "gpu_check: exit $status; logs in $OUT"
  exit $status
fi
if [[ "$PART" != bench ]]; then
  # shellcheck disable=SC2206
  tests=(${GPU_TESTS:-tests/gpu})
  if [[ -n "${GPU_SHARD:-}" ]]; then  # K/N: the K-th of N contiguous parts of the collected tests
    mapfile -t tests < <("$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${tests[@]}" 2>/dev/null |
      grep '::' | awk -v k="${GPU_SHARD%/*}" -v n="${GPU_SHARD#*/}" \
        '{ id[NR] = $0 } END { c = int((NR + n - 1) / n); for (i = (k - 1) * c + 1; i <= k * c && i <= NR; i++) print id[i] }')
    echo "gpu_check: shard $GPU_SHARD: ${#tests[@]} tests"
  fi
  step pytest "${GPU_TESTS_LIMIT:-420}" "$PY" -m pytest -m gpu "${tests[@]}" -v -rfEs --timeout=400 -p no:cacheprovider
fi
if [[ "$PART" != tests ]]; then
  # The benchmarks compile with a fresh TorchInductor cache: the layer's elementwise kernels (compiled
  # with dynamic shapes) ran 3-8x slower at the benchmark's shape after the tests' small layers had filled
  # the cache (benchmarks/RESULTS.md, 2026-11-26 16:23: launch configs of the first shapes, suspected).
  export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
  step bench_hot_path 200 "$PY" benchmarks/hot_path_gpu.py --world 1 --out "$OUT/hot_path_world1.json"
  step bench_host_split 100 "$PY" benchmarks/host_split_gpu.py --stamps
  # ... at DeepEP's normal shape too: where a rank-major pair's host time goes when y passes 4 MiB
  step bench_host_split_ht 120 "$PY" benchmarks/host_split_gpu.py --tokens 4096 --iters 100 --stamps
  step bench_ll_ops 120 "$PY" benchmarks/ll_gpu.py --world 1 --out "$OUT/ll_ops.json"
  step bench_native 90 "$PY" benchmarks/bench_native.py
fi
echo "gpu_check: exit $status; logs in $OUT"
exit $status
