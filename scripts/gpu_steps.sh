# Sourced by scripts/gpu_check*.sh (from the repository root): the environment every GPU step needs and
# `step NAME TIMEOUT_S CMD...`, which runs CMD with a timeout, logs to $OUT/NAME.log and keeps the first
# failure's exit code in $status (a failing step does not stop the later ones).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHON="$PY"
status=0
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
  return 0
}
