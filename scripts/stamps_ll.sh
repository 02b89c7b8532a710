#!/usr/bin/env bash
# Phase stamps of the expert-major ("low-latency") kernels at DeepEP's decode shape (issue 14): a
# profiling build (OMNIEP_STAMPS=ON, csrc/kernels/stamps.cuh), then benchmarks/ll_gpu.py --plain (the ops
# back to back, nothing else timed) at one rank and, where two GPUs are visible, two ranks one GPU each;
# each run's table of medians (scripts/stamps_table.py) under $OUT — with, for the push / pull loops, the
# first and the last warp of each stamped block (`(first_warp)` / `(last_warp)` rows: how far apart they
# finish). Where the time of a kernel whose ranks wait on each other goes — what ncu's replay cannot show.
# Leaves a stamped build behind: the next build_all without OMNIEP_STAMPS rebuilds.
#   OUT=... scripts/stamps_ll.sh     (on the device machine)
#   SHAPE=ht scripts/stamps_ll.sh    the rank-major kernels at DeepEP's normal shape instead (static and
#                                    cached pairs, benchmarks/hot_path_gpu.py --plain; one rank and, where two
#                                    GPUs are visible, two ranks one GPU each)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh
export OMNIEP_STAMPS=ON
build_all
N="${STAMP_CALLS:-30}"
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
