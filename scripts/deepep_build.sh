#!/usr/bin/env bash
# Builds DeepEP V1 (deep_ep_cpp, DeepEP b306af0~1) in place, offline, on the GPU machine, so that DeepEP's tests
# can run against DeepEP itself beside omniep (scripts/deepep_tests.sh with DEEPEP_SELF=1, which calls this);
# afterwards `PYTHONPATH=<tree> python3 -c "import deep_ep"` works. Needs python3 with torch (cu130),
# nvidia-nvshmem-cu13 importable (or NVSHMEM_DIR), nvcc 13 and ninja. Usage: scripts/deepep_build.sh [tree]
# The tree (default .deepep/src) comes from `scripts/deepep_tests.sh --extract <DeepEP git dir>`.
# No source patch is needed for CUDA 13 / NVSHMEM 3.4.5: every .cu and deep_ep.cpp compile as they are (two H200s,
# 2026-11-27: built in 83 s); only the include and library paths below are missing from setup.py's view.
set -euo pipefail
SRC=$(cd "${1:-.deepep/src}" && pwd)
PY=${PYTHON:-python3}
[[ -f $SRC/setup.py && -d $SRC/csrc/kernels ]] || { echo "deepep_build: no DeepEP V1 tree in $SRC"; exit 2; }

# Without NVSHMEM setup.py silently builds without the internode and low-latency kernels: refuse instead.
[[ -n ${NVSHMEM_DIR:-} ]] || "$PY" -c "import nvidia.nvshmem" 2>/dev/null \
  || { echo "deepep_build: nvidia.nvshmem not importable and NVSHMEM_DIR unset"; exit 2; }

# /usr/local/bin/nvcc can be a wrapper script, and torch would then take CUDA_HOME=/usr/local (no headers):
# ask nvcc for its real root.
if [[ -z ${CUDA_HOME:-} ]]; then
  CUDA_HOME=$(readlink -f "$(nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')")
  export CUDA_HOME
fi

# Host-compiler include paths (CPLUS_INCLUDE_PATH reaches g++ and nvcc's host passes alike):
# - CUDA 13 keeps libcu++ (cuda/std/*) under include/cccl; nvcc adds it, g++ for deep_ep.cpp (-> nvshmem.h) does not;
# - ATen/cuda/CUDAContext.h wants cusparse.h, cublas_v2.h, cusolverDn.h: a minimal toolkit lacks them, the
#   nvidia-*-cu13 wheels that torch depends on carry them in nvidia/cu13/include;
# - csrc/kernels/configs.cuh includes <infiniband/mlx5dv.h> (rdma-core), absent from a bare image: use the copy
#   shipped in the tree.
inc=("$CUDA_HOME/include/cccl")
if [[ ! -f $CUDA_HOME/include/cusparse.h ]]; then
  d=$("$PY" -c "import importlib.util as u, os
for p in u.find_spec('nvidia').submodule_search_locations:
    d = os.path.join(p, 'cu13', 'include')
    if os.path.isfile(os.path.join(d, 'cusparse.h')): print(d); break" 2>/dev/null || true)
  [[ -n $d ]] && inc+=("$d")
fi
[[ -f /usr/include/infiniband/mlx5dv.h ]] || inc+=("$SRC/third-party/ibverbs/include")
CPLUS_INCLUDE_PATH=$(IFS=:; echo "${inc[*]}")${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
export CPLUS_INCLUDE_PATH

# setup.py links -lcuda (deep_ep.cpp calls the driver API); the driver may ship only libcuda.so.1 and the toolkit
# no stubs, so give the linker an unversioned name for it (the module still loads libcuda.so.1 by soname).
if ! echo 'int main(){}' | gcc -x c - -o /dev/null -lcuda 2>/dev/null; then
  lib=$({ ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}'; ls /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null; } | head -1 || true)
  [[ -n $lib ]] || { echo "deepep_build: no libcuda.so.1 found"; exit 2; }
  mkdir -p "$SRC/build/libcuda" && ln -sf "$lib" "$SRC/build/libcuda/libcuda.so"
  export LIBRARY_PATH="$SRC/build/libcuda${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi

cd "$SRC"
echo "deepep_build: CUDA_HOME=$CUDA_HOME CPLUS_INCLUDE_PATH=$CPLUS_INCLUDE_PATH"
t0=$SECONDS
# build_ext --inplace needs no wheel tooling and no network; the module lands next to deep_ep/.
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py build_ext --inplace
echo "deepep_build: built in $((SECONDS - t0)) s"
PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import deep_ep, deep_ep_cpp; print('deepep_build: import deep_ep OK from', deep_ep_cpp.__file__)"
