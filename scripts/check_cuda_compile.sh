#!/usr/bin/env bash
# Compile-check every CUDA source of csrc/ with the local nvcc (no GPU needed): CI calls this.
# Each .cu is compiled to an object for sm_90 (override with OMNIEP_CUDA_ARCH); headers are checked
# through the sources that include them. The C++ sources of the C ABI are compiled as well.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
ARCH="${OMNIEP_CUDA_ARCH:-sm_90}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
# NVSHMEM sources need the nvidia-nvshmem wheel's headers: OMNIEP_NVSHMEM_ROOT, or the package of
# $PYTHON (default .venv/bin/python, python3); without them those sources are skipped, and said so.
NVSHMEM_ROOT="${OMNIEP_NVSHMEM_ROOT:-}"
if [[ -z "$NVSHMEM_ROOT" ]]; then
  for py in "${PYTHON:-}" .venv/bin/python python3; do
    [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
    NVSHMEM_ROOT="$("$py" -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null)" && break
  done
fi
# NCCL device-API sources (*nccl*) need nccl.h + nccl_device.h (NCCL >= 2.28, the nvidia-nccl-cu13
# wheel): OMNIEP_NCCL_ROOT, or the package of $PYTHON; without them those sources are skipped, and said so.
NCCL_ROOT="${OMNIEP_NCCL_ROOT:-}"
if [[ -z "$NCCL_ROOT" ]]; then
  for py in "${PYTHON:-}" .venv/bin/python python3; do
    [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
    NCCL_ROOT="$("$py" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)" && break
  done
fi
CUDA_INC="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}/include"
while IFS= read -r src; do
  extra=()
  if [[ "$src" == *rocshmem* ]]; then  # HIP-only (rocSHMEM): scripts/check_hip_compile.sh / cmake/hip.cmake
    echo "skip $src (HIP source, not for nvcc)"
    continue
  fi
  if [[ "$src" == *nvshmem* ]]; then
    if [[ -z "$NVSHMEM_ROOT" || ! -f "$NVSHMEM_ROOT/include/nvshmem.h" ]]; then
      echo "skip $src (NVSHMEM headers not found: set OMNIEP_NVSHMEM_ROOT or pip install nvidia-nvshmem-cu13)"
      continue
    fi
    extra=(-rdc=true -I"$NVSHMEM_ROOT/include" -I"$CUDA_INC/cccl")
  fi
  if [[ "$src" == *nccl* ]]; then
    if [[ -z "$NCCL_ROOT" || ! -f "$NCCL_ROOT/include/nccl_device.h" ]]; then
      echo "skip $src (NCCL >= 2.28 headers not found: set OMNIEP_NCCL_ROOT or pip install nvidia-nccl-cu13)"
      continue
    fi
    extra=(-I"$NCCL_ROOT/include")
  fi
  echo "nvcc -arch=$ARCH ${extra[*]} $src"
  if ! "$NVCC" -arch="$ARCH" -std=c++17 -Icsrc -Icsrc/include --expt-relaxed-constexpr -Werror all-warnings \
       "${extra[@]}" -c "$src" -o "$out/$(basename "$src").o"; then
    status=1
  fi
done < <(find csrc -name '*.cu' | sort)
for src in csrc/capi/*.cpp; do  # host-only C++: must not need CUDA headers
  echo "${CXX:-c++} $src"
  "${CXX:-c++}" -std=c++17 -Wall -Wextra -Werror -Icsrc -Icsrc/include -c "$src" -o "$out/$(basename "$src").o" || status=1
done
# The NCCL EP library's ABI as nccl_ep_lib relies on it (csrc/backends/nccl_ep_lib_abi.cpp, static_asserts
# only): host C++ against nccl_ep.h of NVIDIA's nccl-extensions wheel (OMNIEP_NCCL_EP_ROOT: the folder
# holding include/nccl_ep.h, or the ep/ folder of the `nccl` package of $PYTHON), nccl.h and the CUDA
# runtime headers; skipped, and said so, where nccl_ep.h or nccl.h is not found.
NCCL_EP_ROOT="${OMNIEP_NCCL_EP_ROOT:-}"
if [[ -z "$NCCL_EP_ROOT" ]]; then
  for py in "${PYTHON:-}" .venv/bin/python python3; do
    [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
    NCCL_EP_ROOT="$("$py" -c 'import importlib.util as u, os; s = u.find_spec("nccl"); print(next(os.path.join(d, "ep") for d in s.submodule_search_locations if os.path.isfile(os.path.join(d, "ep", "include", "nccl_ep.h"))))' 2>/dev/null)" && break
  done
fi
src=csrc/backends/nccl_ep_lib_abi.cpp
if [[ -z "$NCCL_EP_ROOT" || ! -f "$NCCL_EP_ROOT/include/nccl_ep.h" ]]; then
  echo "skip $src (nccl_ep.h not found: set OMNIEP_NCCL_EP_ROOT or pip install nccl-extensions)"
elif [[ -z "$NCCL_ROOT" || ! -f "$NCCL_ROOT/include/nccl.h" ]]; then
  echo "skip $src (nccl.h not found: set OMNIEP_NCCL_ROOT or pip install nvidia-nccl-cu13)"
else
  echo "nvcc -x c++ -isystem $NCCL_EP_ROOT/include -I$NCCL_ROOT/include $src (NCCL EP ABI)"
  "$NVCC" -x c++ -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -Icsrc -Icsrc/include -isystem "$NCCL_EP_ROOT/include" \
    -I"$NCCL_ROOT/include" -c "$src" -o "$out/$(basename "$src").o" || status=1
fi
# XLA FFI handlers (csrc/ffi): host C++ against jax.ffi.include_dir() and the CUDA runtime headers;
# skipped, and said so, where no interpreter imports jax.
XLA_FFI_INC=""
for py in "${PYTHON:-}" .venv/bin/python python3; do
  [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
  XLA_FFI_INC="$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())' 2>/dev/null)" && break
done
for src in csrc/ffi/*.cpp; do
  [[ -f "$src" ]] || continue
  if [[ -z "$XLA_FFI_INC" || ! -f "$XLA_FFI_INC/xla/ffi/api/ffi.h" ]]; then
    echo "skip $src (jax not importable: no XLA FFI headers)"
    continue
  fi
  extra=()
  if [[ "$src" == *nccl* ]]; then
    if [[ -z "$NCCL_ROOT" || ! -f "$NCCL_ROOT/include/nccl_device.h" ]]; then
      echo "skip $src (NCCL >= 2.28 headers not found: set OMNIEP_NCCL_ROOT or pip install nvidia-nccl-cu13)"
      continue
    fi
    extra=(-I"$NCCL_ROOT/include")
  fi
  echo "nvcc -x c++ ${extra[*]} $src (XLA FFI)"
  # nvcc as the driver: it adds the CUDA runtime headers; the code is host C++ (-x c++).
  "$NVCC" -x c++ -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -Icsrc -Icsrc/include -isystem "$XLA_FFI_INC" \
    "${extra[@]}" -c "$src" -o "$out/$(basename "$src").o" || status=1
done
# The torch ops (csrc/torch): host C++ against the headers of an importable torch (a CPU build has
# them too, but for one generated header of its CUDA part, c10/cuda/impl/cuda_cmake_macros.h, which is
# written here as a CUDA build has it) and pybind11; skipped, and said so, where neither is found.
TORCH_INC=""
PYBIND_INC=""
for py in "${PYTHON:-}" .venv/bin/python python3; do
  [[ -n "$py" ]] && command -v "$py" >/dev/null || continue
  [[ -n "$TORCH_INC" ]] || TORCH_INC="$("$py" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))' 2>/dev/null)" || true
  [[ -n "$PYBIND_INC" ]] || PYBIND_INC="$("$py" -m pybind11 --includes 2>/dev/null)" || true
done
for src in csrc/torch_ops/*.cpp; do
  [[ -f "$src" ]] || continue
  if [[ -z "$TORCH_INC" || -z "$PYBIND_INC" ]]; then
    echo "skip $src (no interpreter imports torch and pybind11)"
    continue
  fi
  mkdir -p "$out/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  inc=(-isystem "$out/stub")
  for d in $TORCH_INC; do inc+=(-isystem "$d"); done
  for d in $PYBIND_INC; do inc+=(-isystem "${d#-I}"); done
  echo "nvcc -x c++ $src (torch ops)"
  "$NVCC" -x c++ -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -Icsrc -Icsrc/include "${inc[@]}" -D_GLIBCXX_USE_CXX11_ABI=1 \
    -c "$src" -o "$out/$(basename "$src").o" || status=1
done
[[ $status -eq 0 ]] && echo "check_cuda_compile: all CUDA sources compile" || echo "check_cuda_compile: FAILED" >&2
exit $status
