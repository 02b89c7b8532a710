#!/usr/bin/env bash
# Nsight Compute (ncu) reports of the expert-major ("low-latency") kernels at DeepEP's decode shape, one
# rank on one GPU (benchmarks/ll_gpu.py --plain: the ops only, no CUPTI of its own, which ncu needs):
# for each kernel the details page (durations, memory throughput, warp-state stall reasons) and the
# source page (per CUDA line: samples and stall reasons; the build has -lineinfo), under $OUT. Where a
# kernel's time goes, measured, before any change is guessed (issue 14).
#   OUT=... scripts/profile_ll.sh            (on the device machine; builds first unless NO_BUILD=1)
#   SHAPE=ht scripts/profile_ll.sh          the rank-major ("high-throughput") kernels instead, at DeepEP's
#                                           normal shape (benchmarks/hot_path_gpu.py --plain: a cached pair)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh
[[ "${NO_BUILD:-0}" == 1 ]] || build_all
NCU="${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
if [[ "${SHAPE:-ll}" == ht ]]; then
  name=ht prefix="omniep::" run=("$PY" benchmarks/hot_path_gpu.py --world 1 --shapes ht --modes cached --plain 10)
else
  name=ll prefix="em::" run=("$PY" benchmarks/ll_gpu.py --world 1 --variants base --plain 10)
fi
for k in dispatch combine; do
  # Skip the warm-up calls: the 7th launch of the kernel is a steady-state dispatch / combine.
  step "ncu_${name}_$k" 300 "$NCU" --target-processes all --clock-control none --set full --import-source yes \
    --kernel-name-base demangled -k "regex:${prefix}${k}_kernel<" --launch-skip 6 --launch-count 1 -f \
    -o "$OUT/${name}_$k" "${run[@]}"
  "$NCU" --import "$OUT/${name}_$k.ncu-rep" --page details > "$OUT/${name}_${k}_details.txt" 2>&1
  "$NCU" --import "$OUT/${name}_$k.ncu-rep" --page source --csv --print-source cuda > "$OUT/${name}_${k}_source.csv" 2>&1
done
exit $status
