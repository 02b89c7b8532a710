#!/usr/bin/env bash
# Phase stamps of the expert-major ("low-latency") kernels at DeepEP's decode shape (issue 14): a
# profiling build (OMNIEP_STAMPS=ON, csrc/kernels/stamps.cuh), then benchmarks/ll_gpu.py --plain (the ops
# back to back, nothing else timed) at one rank and, where two GPUs are visible, two ranks one GPU each;
# each run's table of medians (scripts/stamps_table.py) under $OUT — with, for the push / pull loops, the
# first and the last warp of each stamped block (`(first_warp)` / `(last_warp)` rows: how far apart they
# finish). Where the time of a kernel whose ranks wait on each other goes — what ncu's replay cannot show.
# Leaves a stamped build behind: the next build_all without OMNIEP_STAMPS rebuilds.
#   OUT=... scripts/stamps_ll.sh     (on the device machine)
#   SHAPE=deepep scripts/stamps_ll.sh   DeepEP's test_low_latency.py itself (carry .deepep), its kineto figures
#                                    beside the stamps of its timed loop (STAMP_LAST calls, default 60)
#   SHAPE=skew scripts/stamps_ll.sh  two GPUs: the Buffer's LL ops with the last rank starting SKEW_US (default 100)
#                                    µs late (benchmarks/ll_gpu.py --skew-us): where the wait goes; with IDLE_MS
#                                    (e.g. 500) after its host slept that long instead (--idle-ms: DeepEP's first
#                                    timed call)
#   SHAPE=ht scripts/stamps_ll.sh    the rank-major kernels at DeepEP's normal shape instead (static and
#                                    cached pairs, benchmarks/hot_path_gpu.py --plain; one rank and, where two
#                                    GPUs are visible, two ranks one GPU each)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh
export OMNIEP_STAMPS=ON
build_all
N="${STAMP_CALLS:-30}"
if [[ "${SHAPE:-ll}" == deepep ]]; then
  # DeepEP's own LL test through the shim (carry .deepep; two GPUs): its kineto figures and the stamps of the
  # same calls side by side — the kernel's duration as DeepEP times it against the span its blocks stamp. Its
  # timed loop is the last 60 fp8 dispatches and combines (two profiler periods of 30; the hook periods stamp
  # as (send) / (receive)). Each process's stdout goes to stamps_deepep.rank<r> (scripts/deepep_trace.py
  # --rank-stdout: on one stdout the two ranks' printf interleaved, most lines lost), its periods' traces to
  # stamps_deepep_trace/. Its kineto figures here include the stamps' printf at each kernel's end: set the spans
  # against an unstamped run's figures (scripts/deepep_tests.sh with DEEPEP_TRACE=1).
  export PYTHONPATH="$PWD/tests/deepep_shim:$PWD/.deepep:${PYTHONPATH:-}"
  export OMNIEP_BACKEND="${OMNIEP_BACKEND:-cuda_nvshmem}"
  step stamps_deepep 240 "$PY" scripts/deepep_trace.py run --out "$OUT/stamps_deepep_trace" \
    --rank-stdout "$OUT/stamps_deepep" .deepep/test_low_latency.py -- --num-processes 2
  grep -hE "bandwidth|send/recv|Error|Traceback" "$OUT"/stamps_deepep.rank*
  "$PY" scripts/stamps_table.py "$OUT"/stamps_deepep.rank* --last "${STAMP_LAST:-60}" | tee "$OUT/stamps_deepep.md"
  unset OMNIEP_STAMPS
  exit $status
fi
if [[ "${SHAPE:-ll}" == skew ]]; then
  step stamps_skew 200 "$PY" benchmarks/ll_gpu.py --world 2 --per-gpu --variants base --iters "$N" \
    $(if [[ -n "${IDLE_MS:-}" ]]; then echo --idle-ms "$IDLE_MS"; else echo --skew-us "${SKEW_US:-100}"; fi) \
    --rank-stdout "$OUT/stamps_skew"
  # (--idle-ms times min(N, 5) calls per op)
  "$PY" scripts/stamps_table.py "$OUT"/stamps_skew.rank* --last "$([[ -n "${IDLE_MS:-}" ]] && echo 5 || echo "$N")" |
    tee "$OUT/stamps_skew.md"
  unset OMNIEP_STAMPS
  exit $status
fi
if [[ "${SHAPE:-ll}" == ht ]]; then
  step stamps_ht 150 "$PY" benchmarks/hot_path_gpu.py --world 1 --shapes ht --modes static,cached --plain "$N" \
    --rank-stdout "$OUT/stamps_ht"
  "$PY" scripts/stamps_table.py "$OUT"/stamps_ht.rank* | tee "$OUT/stamps_ht.md"
  if [[ $(nvidia-smi -L | wc -l) -ge 2 ]]; then
    step stamps_ht_world2 200 "$PY" benchmarks/hot_path_gpu.py --world 2 --per-gpu --shapes ht --modes static,cached \
      --plain "$N" --rank-stdout "$OUT/stamps_ht_world2"
    "$PY" scripts/stamps_table.py "$OUT"/stamps_ht_world2.rank* | tee "$OUT/stamps_ht_world2.md"
  fi
  unset OMNIEP_STAMPS
  exit $status
fi
step stamps_world1 120 "$PY" benchmarks/ll_gpu.py --world 1 --variants base --plain "$N" \
  --rank-stdout "$OUT/stamps_world1"
"$PY" scripts/stamps_table.py "$OUT"/stamps_world1.rank* | tee "$OUT/stamps_world1.md"
if [[ $(nvidia-smi -L | wc -l) -ge 2 ]]; then
  step stamps_world2 180 "$PY" benchmarks/ll_gpu.py --world 2 --per-gpu --variants base --plain "$N" \
    --rank-stdout "$OUT/stamps_world2"
  "$PY" scripts/stamps_table.py "$OUT"/stamps_world2.rank* | tee "$OUT/stamps_world2.md"
fi
unset OMNIEP_STAMPS
exit $status
