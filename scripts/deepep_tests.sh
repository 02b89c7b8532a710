#!/usr/bin/env bash
# DeepEP's own tests against omniep.torch (issue 14 item 4), on a GPU machine with two GPUs or more — and the
# same tests against DeepEP itself, built there from its source, for its figures beside ours on the same GPUs.
# DeepEP's files stay out of the repository: put its V1 tests and source in the ignored folder .deepep first —
#   the `fetch` tool gives a mirror of github:deepseek-ai/DeepEP, then
#   scripts/deepep_tests.sh --extract <mirror git dir>     # tests/{test_intranode,test_low_latency,utils}.py
#                                                          # as of b306af0~1 (before EPv2 moved them) in .deepep/,
#                                                          # its setup.py, csrc/ and deep_ep/ in .deepep/src/
# and carry `.deepep` to the device machine (run's `carry`). There:
#   scripts/deepep_tests.sh                                # both tests, 2 processes, logs in $OUT
#   DEEPEP_TRACE=1 scripts/deepep_tests.sh                 # the LL test alone, its profiler periods saved as
#                                                          # traces ($OUT/trace/) and tabled per kernel
#                                                          # (scripts/deepep_trace.py: idle before, cross-rank
#                                                          # start offsets)
#   DEEPEP_SELF=1 scripts/deepep_tests.sh                  # the same against DeepEP itself (built by
#                                                          # scripts/deepep_build.sh from .deepep/src, ~85 s)
#   DEEPEP_SELF=both scripts/deepep_tests.sh               # DeepEP itself, then omniep, in one call (with
#                                                          # DEEPEP_TRACE too); logs deepep_* / omniep_*
# The tests import `deep_ep` from tests/deepep_shim (omniep.torch's Buffer, Config, EventOverlap), or with
# DEEPEP_SELF from DeepEP's own build.
set -uo pipefail
cd "$(dirname "$0")/.."
DEEPEP_REV="${DEEPEP_REV:-b306af0~1}"
if [[ "${1:-}" == "--extract" ]]; then
  mkdir -p .deepep
  for f in test_intranode.py test_low_latency.py utils.py; do
    git --git-dir "$2" show "$DEEPEP_REV:tests/$f" > ".deepep/$f" || exit 1
  done
  rm -rf .deepep/src && mkdir -p .deepep/src
  git --git-dir "$2" archive "$DEEPEP_REV" setup.py csrc deep_ep | tar x -C .deepep/src || exit 1
  # csrc/kernels/configs.cuh includes <infiniband/mlx5dv.h> (rdma-core), which a bare GPU image may lack: its
  # headers ride along (Debian's libibverbs-dev, fetched here where apt reaches a mirror).
  if ibv=$(mktemp -d) && (cd "$ibv" && apt-get download -q libibverbs-dev >/dev/null && dpkg-deb -x ./*.deb x); then
    mkdir -p .deepep/src/third-party/ibverbs && cp -r "$ibv/x/usr/include" .deepep/src/third-party/ibverbs/
  else
    echo "no libibverbs-dev headers fetched: DEEPEP_SELF needs /usr/include/infiniband/mlx5dv.h on the GPU machine"
  fi
  rm -rf "$ibv"
  echo "DeepEP's tests at $DEEPEP_REV in .deepep/, its source in .deepep/src/"
  exit 0
fi
[[ -f .deepep/test_intranode.py ]] || { echo "no .deepep/: run scripts/deepep_tests.sh --extract <DeepEP git dir> first"; exit 2; }
source scripts/gpu_steps.sh  # env (NVLS off), $OUT, $PY, step()
N="${DEEPEP_PROCESSES:-2}"
# One side's runs, logs named after it: "omniep" (the shim over omniep.torch) or "deepep" (DeepEP itself). Each
# side in a subshell, so that its PYTHONPATH (which `deep_ep` it imports) stays its own.
side() (
  local who=$1
  if [[ $who == deepep ]]; then
    step deepep_build 400 bash scripts/deepep_build.sh .deepep/src
    [[ $status -eq 0 ]] || exit $status
    export PYTHONPATH="$PWD/.deepep/src:$PWD/.deepep:${PYTHONPATH:-}"
  else
    build_all
    export PYTHONPATH="$PWD/tests/deepep_shim:$PWD/.deepep:${PYTHONPATH:-}"
    export OMNIEP_BACKEND="${OMNIEP_BACKEND:-cuda_nvshmem}"
  fi
  if [[ -n "${DEEPEP_TRACE:-}" ]]; then
    step "${who}_ll_trace" 240 "$PY" scripts/deepep_trace.py run --out "$OUT/${who}_trace" .deepep/test_low_latency.py \
      -- --num-processes "$N"
    "$PY" scripts/deepep_trace.py table "$OUT/${who}_trace" | tee "$OUT/${who}_ll_trace.md"
  else
    step "${who}_intranode" 240 "$PY" .deepep/test_intranode.py --num-processes "$N"
    step "${who}_low_latency" 420 "$PY" .deepep/test_low_latency.py --num-processes "$N"
  fi
  exit $status
)
case "${DEEPEP_SELF:-}" in
  "") sides=(omniep) ;;
  both) sides=(deepep omniep) ;;
  *) sides=(deepep) ;;
esac
for who in "${sides[@]}"; do
  side "$who" || { rc=$?; [[ $status -eq 0 ]] && status=$rc; }
done
# Each side's own timing lines, one after the other (the two-GPU comparison at a glance).
grep -H -E "Best (dispatch|combine)|bandwidth|send/recv" "$OUT"/*_intranode.log "$OUT"/*_low_latency.log \
  "$OUT"/*_ll_trace.log 2>/dev/null | sed "s|$OUT/||"
echo "deepep_tests: exit $status; logs in $OUT"
exit $status
