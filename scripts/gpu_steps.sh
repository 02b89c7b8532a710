# Sourced by scripts/gpu_check*.sh (from the repository root): the environment every GPU step needs and
# `step NAME TIMEOUT_S CMD...`, which runs CMD with a timeout, logs to $OUT/NAME.log and keeps the first
# failure's exit code in $status (a failing step does not stop the later ones), and `build_all`: the
# package installed editable through its CMake project (scikit-build-core, build/<wheel tag> cached
# between calls on a warm machine) with every module required (NVSHMEM and NCCL from the image's
# wheels), then what it built. `python -m pytest` from the repository root imports that build.
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
build_all() {
  step build "${1:-420}" env OMNIEP_GPU=CUDA OMNIEP_NVSHMEM=ON OMNIEP_NCCL=ON \
    "$PY" -m pip install -v --no-build-isolation --no-deps -e .
  step build_info 60 "$PY" -m omniep.cli info --build
}
# The device runner brings back at most 8 files from $OUT (the rest are left out, unread): when a script
# leaves more, they go back as one archive, $OUT/out.tar.gz (`tar xzf` it where the files land).
pack_out() {
  local n
  n=$(find "$OUT" -type f | wc -l)
  if [[ $n -gt 8 ]]; then
    tar czf "/tmp/omniep_out.$$.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/omniep_out.$$.tar.gz" "$OUT/out.tar.gz"
    echo "gpu_steps: $n files under \$OUT, packed into out.tar.gz"
  fi
}
trap pack_out EXIT
# Issue 15's fault-injecting soak on cuda_nvshmem, SOAK_S seconds at most (default 480); extra arguments
# go to benchmarks/soak.py (--per-gpu: one rank per GPU, else both on GPU 0).
soak_step() {
  local limit="${SOAK_S:-480}"
  step soak $((limit + 60)) "$PY" benchmarks/soak.py --backend cuda_nvshmem --device cuda --ops 100000 \
    --fault-rate 0.01 --seed 2 --max-seconds "$limit" --out "$OUT/soak.json" "$@"
}
