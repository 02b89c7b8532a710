# The native core for AMD GPUs (omniep._native_hip): the SAME kernel sources (csrc/kernels) and the
# one-rank-per-process launcher (csrc/backends/ipc_rank.cu: p2p transport over hipIpcGetMemHandle /
# hipIpcOpenMemHandle, xGMI peers) compiled with hipcc. Included from CMakeLists.txt when OMNIEP_GPU is
# HIP, or AUTO on a machine without nvcc (then no CUDA toolchain is needed or used):
#   pip install --no-build-isolation .    (or: make native OMNIEP_GPU=HIP; -DOMNIEP_HIP_ARCH="gfx942;gfx90a",
#                                          -DROCSHMEM_DIR=/opt/rocshmem)
# Needs ROCm >= 6.2 (find_package(hip), CMake's HIP language). Default target gfx942 (MI300X/MI325X).
# Without it: skipped with the reason under AUTO, a configure error under OMNIEP_GPU=HIP.
#
# Built and run status: this file has NOT been configured against a ROCm >= 6.2 install (none on the
# project's machines). What CI checks is that the same sources compile with Debian's hipcc 5.2.3 for
# gfx90a / gfx940 (cmake/hip_compile_check.cmake). Nothing has run on AMD hardware.
#
# Optional: with rocSHMEM >= 3.0 found (-DROCSHMEM_DIR=<prefix> or $ROCSHMEM_DIR, holding
# include/rocshmem/rocshmem.hpp and lib/librocshmem.a) the target omniep_rocshmem_check compiles every
# kernel over the rocshmem transport (csrc/transports/rocshmem.cuh, never compiled so far); without it
# a configure message says it was skipped and why.
set(OMNIEP_HIP_ARCH "gfx942" CACHE STRING "AMD GPU targets for hipcc (semicolon-separated, e.g. gfx942;gfx90a)")
set(OMNIEP_HIP_MIN_ROCM "6.2" CACHE STRING "Oldest ROCm (HIP) version accepted")
if(NOT DEFINED CMAKE_HIP_ARCHITECTURES)
  set(CMAKE_HIP_ARCHITECTURES "${OMNIEP_HIP_ARCH}")
endif()
set(CMAKE_HIP_STANDARD 17)
set(CMAKE_HIP_STANDARD_REQUIRED ON)

if(DEFINED ENV{ROCM_PATH})
  set(_omniep_rocm "$ENV{ROCM_PATH}")
else()
  set(_omniep_rocm "/opt/rocm")
endif()
list(APPEND CMAKE_PREFIX_PATH "${_omniep_rocm}" "${_omniep_rocm}/lib/cmake")

# ROCm cannot build here: say why to CMakeLists.txt (its omniep_no_gpu_build skips, or fails where
# OMNIEP_GPU=HIP asked for it) and stop reading this file.
macro(omniep_no_hip reason)
  set(OMNIEP_NO_HIP "${reason}")
  return()
endmacro()
if(OMNIEP_NVSHMEM STREQUAL "ON" OR OMNIEP_NCCL STREQUAL "ON")
  message(FATAL_ERROR "omniep: OMNIEP_NVSHMEM / OMNIEP_NCCL=ON need a CUDA build; this one is for HIP (no nvcc found, "
                      "or OMNIEP_GPU=HIP)")
endif()
# Older hip-config.cmake files (Debian's HIP 5.2) ask for a CMake policy level CMake 4 no longer has.
if(NOT DEFINED CMAKE_POLICY_VERSION_MINIMUM)
  set(CMAKE_POLICY_VERSION_MINIMUM 3.5)
endif()
find_package(hip CONFIG QUIET)
if(NOT hip_FOUND)
  omniep_no_hip("no ROCm >= ${OMNIEP_HIP_MIN_ROCM} found (hip-config.cmake under ROCM_PATH=${_omniep_rocm})")
endif()
if(hip_VERSION VERSION_LESS OMNIEP_HIP_MIN_ROCM)
  omniep_no_hip("ROCm ${hip_VERSION} in ${hip_DIR} is older than ${OMNIEP_HIP_MIN_ROCM}")
endif()
check_language(HIP)
if(NOT CMAKE_HIP_COMPILER)
  omniep_no_hip("CMake finds no HIP compiler (pass -DCMAKE_HIP_COMPILER=<rocm>/llvm/bin/clang++)")
endif()
enable_language(HIP)
set(OMNIEP_INFO_gpu "HIP ${hip_VERSION}, ${CMAKE_HIP_ARCHITECTURES}")
message(STATUS "omniep: HIP ${hip_VERSION} (${CMAKE_HIP_COMPILER}), targets ${CMAKE_HIP_ARCHITECTURES}")

# One rank per process over HIP IPC: the .cu sources are HIP here (omniep/runtime.h maps the CUDA
# runtime names they spell to HIP).
set_source_files_properties(csrc/backends/ipc_rank.cu PROPERTIES LANGUAGE HIP)
add_library(omniep_hip_ipc STATIC csrc/backends/ipc_rank.cu)
target_include_directories(omniep_hip_ipc PUBLIC csrc csrc/include)
set_target_properties(omniep_hip_ipc PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_link_libraries(omniep_hip_ipc PUBLIC hip::host)

# NO_EXTRAS: no GCC LTO objects (the HIP linker, clang, cannot read them) and no strip.
pybind11_add_module(_native_hip MODULE NO_EXTRAS csrc/python/module_mp.cpp)
target_compile_definitions(_native_hip PRIVATE OMNIEP_HIP_HOST=1)  # cudaStream_t is hipStream_t
target_link_libraries(_native_hip PRIVATE omniep_hip_ipc)
omniep_module(_native_hip)
foreach(part _native _native_mp _native_jax _native_torch _native_nvshmem _native_nccl)
  omniep_part(${part} skipped "HIP build (the CUDA modules need nvcc)")
endforeach()
omniep_part(_native_hip built "one rank per process over HIP IPC (${OMNIEP_INFO_gpu})")

# The rocm_rocshmem JAX backend's XLA FFI handlers: the CUDA build's sources (csrc/ffi/jax_handlers.cpp,
# csrc/python/module_jax.cpp) through hipcc, one rank per process over hipIpc* peers or every local GPU
# of one process by peer access, registered with XLA for the ROCM platform.
if(OMNIEP_XLA_FFI_INCLUDE)
  set_source_files_properties(csrc/ffi/jax_handlers.cpp PROPERTIES LANGUAGE HIP)
  pybind11_add_module(_native_hip_jax MODULE NO_EXTRAS csrc/python/module_jax.cpp csrc/ffi/jax_handlers.cpp)
  target_compile_definitions(_native_hip_jax PRIVATE OMNIEP_HIP_HOST=1 OMNIEP_JAX_MODULE=_native_hip_jax)
  target_include_directories(_native_hip_jax SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_link_libraries(_native_hip_jax PRIVATE omniep_hip_ipc)
  omniep_module(_native_hip_jax)
  omniep_part(_native_hip_jax built "XLA FFI handlers of the JAX frontend for AMD GPUs (${OMNIEP_INFO_gpu})")
else()
  omniep_part(_native_hip_jax skipped "${OMNIEP_XLA_FFI_WHY}")
endif()

# ---- optional: the rocshmem transport (GPU-initiated RDMA), only where rocSHMEM is found ----
if(NOT ROCSHMEM_DIR AND DEFINED ENV{ROCSHMEM_DIR})
  set(ROCSHMEM_DIR "$ENV{ROCSHMEM_DIR}")
endif()
find_path(OMNIEP_ROCSHMEM_INCLUDE rocshmem/rocshmem.hpp
          HINTS "${ROCSHMEM_DIR}/include" "${_omniep_rocm}/include" NO_CACHE)
find_library(OMNIEP_ROCSHMEM_LIB NAMES rocshmem HINTS "${ROCSHMEM_DIR}/lib" "${_omniep_rocm}/lib" NO_CACHE)
if(OMNIEP_ROCSHMEM_INCLUDE AND OMNIEP_ROCSHMEM_LIB)
  set_source_files_properties(csrc/transports/rocshmem_compile_check.hip PROPERTIES LANGUAGE HIP)
  add_library(omniep_rocshmem_check OBJECT csrc/transports/rocshmem_compile_check.hip)
  target_include_directories(omniep_rocshmem_check PRIVATE csrc csrc/include "${OMNIEP_ROCSHMEM_INCLUDE}")
  # rocSHMEM's device API is a device library: relocatable device code (-fgpu-rdc).
  target_compile_options(omniep_rocshmem_check PRIVATE -fgpu-rdc)
  target_link_libraries(omniep_rocshmem_check PRIVATE hip::host)
  omniep_part(check_rocshmem built "compile only: every kernel over the rocshmem transport")
else()
  omniep_part(check_rocshmem skipped "rocSHMEM not found (no rocshmem/rocshmem.hpp and librocshmem under ROCSHMEM_DIR='${ROCSHMEM_DIR}' or ${_omniep_rocm}); the rocm_rocshmem backend uses the p2p transport over HIP IPC")
endif()
