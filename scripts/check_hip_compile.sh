#!/usr/bin/env bash
# Compile-check the kernels for AMD with hipcc (no GPU needed): CI calls this after installing
# Debian's hipcc (HIP 5.2.3, clang-15). Every kernel of csrc/kernels and the p2p transport are
# compiled from the SAME sources as for NVIDIA, through csrc/kernels/instantiate_all.cu (which
# instantiates each kernel the launchers use and launches it via omniep/runtime.h, cooperative
# launch included), for each arch of OMNIEP_HIP_ARCHS (default "gfx90a gfx940": this LLVM has no
# gfx942, the MI300X target a ROCm >= 6.2 build uses). Compile only (-c), warnings are errors.
#
# Left out: csrc/backends/*.cu (CUDA-only host glue: cudaLaunchKernelEx, CUDA IPC), the NVSHMEM
# transport, csrc/python, csrc/ffi. The kernels they launch are the ones compiled here.
set -euo pipefail
cd "$(dirname "$0")/.."
HIPCC="${HIPCC:-$(command -v hipcc || echo /opt/rocm/bin/hipcc)}"
[[ -x "$HIPCC" ]] || { echo "check_hip_compile: no hipcc (apt-get install hipcc, or set HIPCC)" >&2; exit 2; }
# Debian's hipcc picks the NVIDIA platform when it finds nvcc: force AMD.
export HIP_PLATFORM=amd
ARCHS="${OMNIEP_HIP_ARCHS:-gfx90a gfx940}"
SOURCES=(csrc/kernels/instantiate_all.cu)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for arch in $ARCHS; do
  for src in "${SOURCES[@]}"; do
    echo "hipcc --offload-arch=$arch $src"
    if ! "$HIPCC" --offload-arch="$arch" -x hip -std=c++17 -O3 -Wall -Wextra -Werror -Icsrc -Icsrc/include \
         -c "$src" -o "$out/$(basename "$src").$arch.o"; then
      status=1
    fi
  done
done
[[ $status -eq 0 ]] && echo "check_hip_compile: all kernels compile for $ARCHS" || echo "check_hip_compile: FAILED" >&2
exit $status
