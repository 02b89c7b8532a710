#!/usr/bin/env bash
# Compile-check the kernels for AMD with hipcc (no GPU needed): CI calls this after installing
# Debian's hipcc (HIP 5.2.3, clang-15). Every kernel of csrc/kernels and the p2p transport are
# compiled from the SAME sources as for NVIDIA, through csrc/kernels/instantiate_all.cu (which
# instantiates each kernel the launchers use and launches it via omniep/runtime.h, cooperative
# launch included), for each arch of OMNIEP_HIP_ARCHS (default "gfx90a gfx940": this LLVM has no
# gfx942, the MI300X target a ROCm >= 6.2 build uses). Compile only (-c), warnings are errors.
#
# Also compiled: the one-rank-per-process launcher over the p2p transport with HIP IPC peers
# (csrc/backends/ipc_rank.cu + one_rank_launch.cuh, their CUDA runtime names mapped to HIP by
# omniep/runtime.h), i.e. the device and host code of omniep._native_hip, and that module's pybind
# source (csrc/python/module_mp.cpp, host C++ with -DOMNIEP_HIP_HOST) where an interpreter has pybind11.
#
# Left out: the virtual-rank launchers (csrc/backends/virtual_rank_group*.cu), the NVSHMEM transport
# and csrc/ffi (CUDA only); csrc/transports/rocshmem.cuh (needs rocSHMEM headers, absent here).
set -euo pipefail
cd "$(dirname "$0")/.."
HIPCC="${HIPCC:-$(command -v hipcc || echo /opt/rocm/bin/hipcc)}"
[[ -x "$HIPCC" ]] || { echo "check_hip_compile: no hipcc (apt-get install hipcc, or set HIPCC)" >&2; exit 2; }
# Debian's hipcc picks the NVIDIA platform when it finds nvcc: force AMD.
export HIP_PLATFORM=amd
ARCHS="${OMNIEP_HIP_ARCHS:-gfx90a gfx940}"
SOURCES=(csrc/kernels/instantiate_all.cu csrc/backends/ipc_rank.cu)
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
# The pybind module of the HIP build: host C++ (no HIP headers), the stream type as hipStream_t.
PY_INC=""
for py in "${PYTHON:-}" .venv/bin/python python3; do
  [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
  PY_INC="$("$py" -c 'import pybind11, sysconfig; print(pybind11.get_include(), sysconfig.get_paths()["include"])' 2>/dev/null)" && break
done
if [[ -n "$PY_INC" ]]; then
  read -r PYBIND_INC PYTHON_INC <<<"$PY_INC"
  echo "${CXX:-c++} -DOMNIEP_HIP_HOST csrc/python/module_mp.cpp (omniep._native_hip)"
  "${CXX:-c++}" -std=c++17 -DOMNIEP_HIP_HOST -Wall -Wextra -Werror -fPIC -fvisibility=hidden -Icsrc -Icsrc/include \
    -isystem "$PYBIND_INC" -isystem "$PYTHON_INC" -c csrc/python/module_mp.cpp -o "$out/module_hip.o" || status=1
else
  echo "skip csrc/python/module_mp.cpp for HIP (no interpreter with pybind11)"
fi
[[ $status -eq 0 ]] && echo "check_hip_compile: all kernels and the HIP IPC launcher compile for $ARCHS" || echo "check_hip_compile: FAILED" >&2
exit $status
