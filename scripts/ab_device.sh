#!/usr/bin/env bash
# A kernel change measured against its own baseline in ONE device call, on one machine (lent machines differ
# by more than many changes move): build this tree, run the command, reverse the change, rebuild, run it
# again. Logs under $OUT: new.log, old.log (the command's output on each tree), build.log, build_old.log.
#
# Here, before the call (the patch must be untracked, not ignored, so that it travels with the tree):
#   git diff BASE HEAD -- csrc > ab.patch          # the change as the tree has it now (committed or not:
#                                                  # `git diff -- csrc` for uncommitted work); a diff of an
#                                                  # older commit alone may not reverse on today's tree
# On the device machine (run's command; carry `.deepep` for DeepEP's tests):
#   scripts/ab_device.sh ab.patch 'python3 .deepep/test_low_latency.py --num-processes 2'
#   AB_LIMIT=200 scripts/ab_device.sh ab.patch 'python3 benchmarks/ll_gpu.py --world 1 --variants base'
# The command runs with DeepEP's tests importable (tests/deepep_shim, .deepep) and OMNIEP_BACKEND defaulting
# to cuda_nvshmem; AB_SIDE is "new" or "old" while it runs. Delete the patch afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 2 && -f "$1" ]] || { echo "usage: scripts/ab_device.sh PATCH 'COMMAND'"; exit 2; }
patch_file=$1 cmd=$2
source scripts/gpu_steps.sh  # env (NVLS off), $OUT, $PY, step()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.log"
patch -R -p1 --dry-run < "$patch_file" > /dev/null || { echo "ab_device: $patch_file does not reverse on this tree"; exit 2; }
export PYTHONPATH="$PWD/tests/deepep_shim:$PWD/.deepep:${PYTHONPATH:-}"
export OMNIEP_BACKEND="${OMNIEP_BACKEND:-cuda_nvshmem}"
build_all
AB_SIDE=new step new "${AB_LIMIT:-240}" bash -c "$cmd"
patch -R -p1 < "$patch_file" > /dev/null
step build_old 420 env OMNIEP_GPU=CUDA OMNIEP_NVSHMEM=ON OMNIEP_NCCL=ON "$PY" -m pip install -q --no-build-isolation \
  --no-deps -e .
AB_SIDE=old step old "${AB_LIMIT:-240}" bash -c "$cmd"
patch -p1 < "$patch_file" > /dev/null  # (the tree as it came)
echo "ab_device: exit $status"
exit $status
