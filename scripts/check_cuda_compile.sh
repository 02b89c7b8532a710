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
while IFS= read -r src; do
  echo "nvcc -arch=$ARCH $src"
  if ! "$NVCC" -arch="$ARCH" -std=c++17 -Icsrc -Icsrc/include --expt-relaxed-constexpr -Werror all-warnings \
       -c "$src" -o "$out/$(basename "$src").o"; then
    status=1
  fi
done < <(find csrc -name '*.cu' | sort)
for src in csrc/capi/*.cpp; do  # host-only C++: must not need CUDA headers
  echo "${CXX:-c++} $src"
  "${CXX:-c++}" -std=c++17 -Wall -Wextra -Werror -Icsrc -Icsrc/include -c "$src" -o "$out/$(basename "$src").o" || status=1
done
[[ $status -eq 0 ]] && echo "check_cuda_compile: all CUDA sources compile" || echo "check_cuda_compile: FAILED" >&2
exit $status
