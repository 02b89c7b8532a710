#!/usr/bin/env bash
# Registers and spills of every kernel (ptxas, sm_90), without a GPU: nvcc compiles the compile check's
# translation unit (csrc/kernels/instantiate_all.cu: every kernel over the p2p transport, the instances
# the launchers use) and this prints one line per kernel — registers, spill stores / loads in bytes,
# stack frame — spilling kernels first. A kernel change that makes a hot loop spill shows here in
# ~30 s of CPU, before any device time is spent on it (issue 14's copy-width experiment did).
#   scripts/kernel_resources.sh [extra nvcc flags, e.g. -DSOMETHING]
#   scripts/kernel_resources.sh --hip [extra hipcc flags]   the same for AMD (hipcc, gfx90a, -Werror as in CI): VGPRs, VGPR
#                                                           spills, scratch bytes per lane, waves per SIMD
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--hip" ]]; then
  shift
  log=$(mktemp)
  trap 'rm -f "$log" "$log.o"' EXIT
  HIP_PLATFORM=amd "${HIPCC:-hipcc}" -I csrc -I csrc/include -O2 -Wall -Wextra -Werror -std=c++17 --offload-arch="${HIP_ARCH:-gfx90a}" -x hip \
    -c csrc/kernels/instantiate_all.cu -o "$log.o" -Rpass-analysis=kernel-resource-usage "$@" >"$log" 2>&1 \
    || { cat "$log"; exit 1; }
  # clang's remarks: "Function Name: NAME", then "VGPRs: N", "ScratchSize [bytes/lane]: N", "Occupancy
  # [waves/SIMD]: N", "VGPRs Spill: N", one per line.
  awk '
    /Function Name:/ { name = $NF == "[-Rpass-analysis=kernel-resource-usage]" ? $(NF-1) : $NF; next }
    / VGPRs: / { vgpr = $(NF-1) } /ScratchSize/ { scratch = $(NF-1) } /Occupancy/ { occ = $(NF-1) }
    /VGPRs Spill:/ { printf "%8d %6d %6d %6d  %s\n", scratch, $(NF-1), vgpr, occ, name }
  ' "$log" | sort -k1,1nr -k5 | c++filt -n 2>/dev/null | sed 's/(omniep::[A-Za-z]*Args, omniep::P2PTransport)//' |
    { echo " scratch vspill  vgprs  waves  kernel"; cat; }
  exit 0
fi
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[[ -x "$NVCC" ]] || { echo "kernel_resources: no nvcc (set NVCC=)"; exit 2; }
log=$(mktemp)
trap 'rm -f "$log" "$log.o"' EXIT
"$NVCC" -I csrc -I csrc/include -O3 -DNDEBUG -std=c++17 --generate-code=arch=compute_90,code=sm_90 \
  --expt-relaxed-constexpr -Xptxas=-v -x cu -c csrc/kernels/instantiate_all.cu -o "$log.o" "$@" >"$log" 2>&1 \
  || { cat "$log"; exit 1; }
# ptxas -v: "Compiling entry function 'NAME'", then "N bytes stack frame, S bytes spill stores, L bytes
# spill loads", then "Used R registers".
awk '
  /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2); next }
  /bytes stack frame/ { for (i = 1; i <= NF; i++) { if ($(i+1) == "bytes" && $(i+2) == "stack") frame = $i;
                                                    if ($(i+1) == "bytes" && $(i+3) == "stores,") st = $i;
                                                    if ($(i+1) == "bytes" && $(i+3) == "loads") ld = $i } next }
  /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                            if (name != "") printf "%6d %6d %6d %6d  %s\n", st + 0, ld + 0, regs, frame + 0, name; name = "" }
' "$log" | sort -k1,1nr -k5 | c++filt -n 2>/dev/null | sed 's/(omniep::[A-Za-z]*Args, omniep::P2PTransport)//' |
  { echo "spill-st spill-ld  regs  stack  kernel"; cat; }
