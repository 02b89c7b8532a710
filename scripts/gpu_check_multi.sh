#!/usr/bin/env bash
# The two-GPU device check (run it on `nvidia-h200-x2`): build every native module, then the GPU tests
# and/or the multi-GPU benchmarks. Logs go to $OUT (default ./gpu_out). Each step has its own timeout;
# a failing step does not stop the later ones; the exit status is the first failure's.
#   scripts/gpu_check_multi.sh            # build + tests + benchmarks (about 12 minutes)
#   PART=tests scripts/gpu_check_multi.sh # build + every `gpu` test (~165: more than one 10-minute call
#                                          # holds on two H200s; split it with GPU_TESTS, e.g.
#                                          # GPU_TESTS="tests/gpu/test_[a-m]*.py" and
#                                          # GPU_TESTS="tests/gpu/test_[n-z]*.py tests/test_*.py")
#   PART=bench scripts/gpu_check_multi.sh # build (cached: seconds) + the benchmarks
#   GPU_TESTS=tests/gpu/test_layers_gpu.py BENCHES="layer layer_jax" scripts/gpu_check_multi.sh
#                                          # a subset of the tests and of the benchmarks (names below)
# Build: every module, `pip install -e .` through the CMake project (build_all in gpu_steps.sh).
# Benchmarks (benchmarks/bench_multigpu.py, one process per GPU): DeepEP's normal shape rank-major and
# its low-latency shape expert-major, cuda_nvshmem and nccl_ep beside NCCL and the raw copy.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh  # env, $OUT, $PY, step()
PART="${PART:-all}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.device_count(), "GPUs")'
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
} 2>&1 | tee "$OUT/env.log"

build_all
if [[ "$PART" != bench ]]; then
  # shellcheck disable=SC2086
  step pytest_gpu "${GPU_TESTS_LIMIT:-480}" "$PY" -m pytest -m gpu ${GPU_TESTS:-tests} -v -rfEs --timeout=400 -p no:cacheprovider
fi
BENCHES="${BENCHES:-normal ll ll_ops layer layer_jax}"
want() { [[ " $BENCHES " == *" $1 "* ]]; }
if [[ "$PART" != tests ]]; then
  # The benchmarks compile with a fresh TorchInductor cache: the layer's elementwise kernels (compiled
  # with dynamic shapes) ran 3-8x slower at the benchmark's shape after the tests' small layers had filled
  # the cache (benchmarks/RESULTS.md, 2026-11-26 16:23: launch configs of the first shapes, suspected).
  export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
  want normal && step bench_normal 150 "$PY" benchmarks/bench_multigpu.py --nccl --sweep-blocks "" --json "$OUT/bench_normal.json"
  want ll && step bench_ll 120 "$PY" benchmarks/bench_multigpu.py --nccl --layout expert_major --tokens 128 --experts 288 \
    --sweep-blocks "" --json "$OUT/bench_ll.json"
  # DeepEP's low-latency decode op by op through omniep.torch and Buffer (fp8), one process per GPU
  want ll_ops && step bench_ll_ops 120 "$PY" benchmarks/ll_gpu.py --world 2 --per-gpu --out "$OUT/ll_ops.json"
  # The MoE layer (omniep.layers.torch) forward + backward at DeepSeek-V3's shape, native vs collective
  want layer && step bench_layer 200 "$PY" benchmarks/moe_layer_gpu.py --world 2 --per-gpu --out "$OUT/layer.json"
  # ... the same with the layer's elementwise work eager (OMNIEP_LAYER_COMPILE=0): what the fusion buys
  want layer_eager && step bench_layer_eager 150 env OMNIEP_LAYER_COMPILE=0 "$PY" benchmarks/moe_layer_gpu.py --world 2 \
    --per-gpu --backends cuda_nvshmem --out "$OUT/layer_eager.json"
  want layer_jax && step bench_layer_jax 300 "$PY" benchmarks/moe_layer_jax_gpu.py --world 2 --out "$OUT/layer_jax.json"
  # ... both on the layer's grouped-GEMM path (rank-major dispatch, grouped GEMMs over the routed copies)
  want layer_grouped && step bench_layer_grouped 200 "$PY" benchmarks/moe_layer_gpu.py --world 2 --per-gpu \
    --grouped-gemm --out "$OUT/layer_grouped.json"
  # issue 15's soak, one rank per GPU (not in the default list: SOAK_S seconds, ~8 minutes by default)
  want soak && soak_step --per-gpu
  want layer_jax_grouped && step bench_layer_jax_grouped 300 "$PY" benchmarks/moe_layer_jax_gpu.py --world 2 \
    --grouped-gemm --out "$OUT/layer_jax_grouped.json"
fi
echo "gpu_check_multi: exit $status; logs in $OUT"
exit $status
