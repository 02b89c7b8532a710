#!/usr/bin/env bash
# DeepEP's own tests against omniep.torch (issue 14 item 4), on a GPU machine with two GPUs or more.
# DeepEP's files stay out of the repository: put its V1 tests in the ignored folder .deepep first —
#   the `fetch` tool gives a mirror of github:deepseek-ai/DeepEP, then
#   scripts/deepep_tests.sh --extract <mirror git dir>     # tests/{test_intranode,test_low_latency,utils}.py
#                                                          # as of b306af0~1 (before EPv2 moved them)
# and carry `.deepep` to the device machine (run's `carry`). There:
#   scripts/deepep_tests.sh                                # both tests, 2 processes, logs in $OUT
#   DEEPEP_TRACE=1 scripts/deepep_tests.sh                 # the LL test alone, its profiler periods saved as
#                                                          # traces ($OUT/trace/) and tabled per kernel
#                                                          # (scripts/deepep_trace.py: idle before, cross-rank
#                                                          # start offsets)
# The tests import `deep_ep` from tests/deepep_shim (omniep.torch's Buffer, Config, EventOverlap).
set -uo pipefail
cd "$(dirname "$0")/.."
DEEPEP_REV="${DEEPEP_REV:-b306af0~1}"
if [[ "${1:-}" == "--extract" ]]; then
  mkdir -p .deepep
  for f in test_intranode.py test_low_latency.py utils.py; do
    git --git-dir "$2" show "$DEEPEP_REV:tests/$f" > ".deepep/$f" || exit 1
  done
  echo "DeepEP's tests at $DEEPEP_REV in .deepep/"
  exit 0
fi
[[ -f .deepep/test_intranode.py ]] || { echo "no .deepep/: run scripts/deepep_tests.sh --extract <DeepEP git dir> first"; exit 2; }
source scripts/gpu_steps.sh  # env (NVLS off), $OUT, $PY, step()
build_all
export PYTHONPATH="$PWD/tests/deepep_shim:$PWD/.deepep:${PYTHONPATH:-}"
export OMNIEP_BACKEND="${OMNIEP_BACKEND:-cuda_nvshmem}"
N="${DEEPEP_PROCESSES:-2}"
if [[ -n "${DEEPEP_TRACE:-}" ]]; then
  step deepep_ll_trace 240 "$PY" scripts/deepep_trace.py run --out "$OUT/trace" .deepep/test_low_latency.py -- \
    --num-processes "$N"
  "$PY" scripts/deepep_trace.py table "$OUT/trace" | tee "$OUT/deepep_ll_trace.md"
  exit $status
fi
step deepep_intranode 240 "$PY" .deepep/test_intranode.py --num-processes "$N"
step deepep_low_latency 420 "$PY" .deepep/test_low_latency.py --num-processes "$N"
echo "deepep_tests: exit $status; logs in $OUT"
exit $status
