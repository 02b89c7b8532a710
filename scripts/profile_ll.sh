#!/usr/bin/env bash
# Nsight Compute (ncu) reports of the expert-major ("low-latency") kernels at DeepEP's decode shape, one
# rank on one GPU (benchmarks/ll_gpu.py --plain: the ops only, no CUPTI of its own, which ncu needs):
# for each kernel the details page (durations, memory throughput, warp-state stall reasons) and the
# source page (per CUDA line: samples and stall reasons; the build has -lineinfo), under $OUT. Where a
# kernel's time goes, measured, before any change is guessed (issue 14).
#   OUT=... scripts/profile_ll.sh            (on the device machine; builds first unless NO_BUILD=1)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_steps.sh
[[ "${NO_BUILD:-0}" == 1 ]] || build_all
NCU="${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}"
for k in dispatch combine; do
  # Skip the warm-up calls: the 7th launch of the kernel is a steady-state ep.dispatch / ep.combine.
  step "ncu_$k" 300 "$NCU" --target-processes all --clock-control none --set full --import-source yes \
    --kernel-name-base demangled -k "regex:em::${k}_kernel<" --launch-skip 6 --launch-count 1 -f -o "$OUT/ll_$k" \
    "$PY" benchmarks/ll_gpu.py --world 1 --variants base --plain 10
  "$NCU" --import "$OUT/ll_$k.ncu-rep" --page details > "$OUT/ll_${k}_details.txt" 2>&1
  "$NCU" --import "$OUT/ll_$k.ncu-rep" --page source --csv --print-source cuda > "$OUT/ll_${k}_source.csv" 2>&1
done
exit $status
