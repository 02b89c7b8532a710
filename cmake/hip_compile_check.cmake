# OMNIEP_COMPILE_CHECK=ON with a hipcc found (HIPCC, PATH or /opt/rocm/bin) and no HIP build in this
# configure: the kernels compile for AMD from the SAME sources -- every kernel as
# csrc/kernels/instantiate_all.cu instantiates and launches it (cooperative launch included) and the
# one-rank-per-process launcher over HIP IPC (csrc/backends/ipc_rank.cu), for each arch of
# OMNIEP_HIP_CHECK_ARCHS (default gfx90a;gfx940), compile only, warnings as errors; and the pybind
# source of omniep._native_hip as host C++ (-DOMNIEP_HIP_HOST). Where jax's FFI headers are found
# (cmake/xla_ffi.cmake), the XLA FFI handlers of the rocm_rocshmem JAX backend too (csrc/ffi/
# jax_handlers.cpp by hipcc, and omniep._native_hip_jax's pybind source as host C++). CI runs it with
# Debian's hipcc 5.2.3 (clang-15: no gfx942, no ROCm >= 6.2 layout for CMake's HIP language, hence
# hipcc as a command rather than cmake/hip.cmake's real build). Left out: the virtual-rank launchers,
# NVSHMEM and the nccl_ep handlers (CUDA only), csrc/transports/rocshmem.cuh (needs rocSHMEM:
# cmake/hip.cmake's omniep_rocshmem_check).
if(DEFINED ENV{HIPCC} AND EXISTS "$ENV{HIPCC}")  # the compiler itself, as hipcc's own scripts use it
  set(OMNIEP_HIPCC "$ENV{HIPCC}")
else()
  find_program(OMNIEP_HIPCC hipcc HINTS /opt/rocm/bin NO_CACHE)
endif()
if(NOT OMNIEP_HIPCC)
  omniep_part(check_hip skipped "no hipcc found (apt-get install hipcc, or ROCm; HIPCC=<path>)")
  return()
endif()
set(OMNIEP_HIP_CHECK_ARCHS "gfx90a;gfx940" CACHE STRING "AMD targets of the HIP compile check")
file(GLOB_RECURSE _headers "${PROJECT_SOURCE_DIR}/csrc/*.h" "${PROJECT_SOURCE_DIR}/csrc/*.cuh")
set(_outs "")
set(_sources csrc/kernels/instantiate_all.cu csrc/backends/ipc_rank.cu)
set(_ffi "")
if(OMNIEP_XLA_FFI_INCLUDE)
  list(APPEND _sources csrc/ffi/jax_handlers.cpp)
  set(_ffi -isystem "${OMNIEP_XLA_FFI_INCLUDE}")
endif()
foreach(arch IN LISTS OMNIEP_HIP_CHECK_ARCHS)
  foreach(src IN LISTS _sources)
    get_filename_component(_name "${src}" NAME)
    set(_out "${PROJECT_BINARY_DIR}/hip_check/${_name}.${arch}.o")
    add_custom_command(
      OUTPUT "${_out}"
      # Debian's hipcc picks the NVIDIA platform when it finds nvcc: force AMD.
      COMMAND "${CMAKE_COMMAND}" -E env HIP_PLATFORM=amd "${OMNIEP_HIPCC}" --offload-arch=${arch} -x hip -std=c++17
              -O3 -Wall -Wextra -Werror -I${PROJECT_SOURCE_DIR}/csrc -I${PROJECT_SOURCE_DIR}/csrc/include ${_ffi}
              -c "${PROJECT_SOURCE_DIR}/${src}" -o "${_out}"
      DEPENDS "${PROJECT_SOURCE_DIR}/${src}" ${_headers}
      COMMENT "hipcc --offload-arch=${arch} ${src} (HIP compile check)"
      VERBATIM)
    list(APPEND _outs "${_out}")
  endforeach()
endforeach()
add_custom_target(omniep_check_hip ALL DEPENDS ${_outs})

# The HIP build's pybind module as host C++ (no HIP headers; the stream type is hipStream_t there).
add_library(omniep_check_hip_module OBJECT csrc/python/module_mp.cpp)
target_compile_definitions(omniep_check_hip_module PRIVATE OMNIEP_HIP_HOST=1)
target_include_directories(omniep_check_hip_module PRIVATE csrc csrc/include)
target_link_libraries(omniep_check_hip_module PRIVATE pybind11::module)
target_compile_options(omniep_check_hip_module PRIVATE ${OMNIEP_CXX_WERROR})
set(_what "every kernel and the HIP IPC launcher for ${OMNIEP_HIP_CHECK_ARCHS} with ${OMNIEP_HIPCC}, and _native_hip's module source")
if(OMNIEP_XLA_FFI_INCLUDE)
  # The JAX module of the HIP build as host C++ (the handlers' source went through hipcc above).
  add_library(omniep_check_hip_jax_module OBJECT csrc/python/module_jax.cpp)
  target_compile_definitions(omniep_check_hip_jax_module PRIVATE OMNIEP_HIP_HOST=1 OMNIEP_JAX_MODULE=_native_hip_jax)
  target_include_directories(omniep_check_hip_jax_module PRIVATE csrc csrc/include)
  target_include_directories(omniep_check_hip_jax_module SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_link_libraries(omniep_check_hip_jax_module PRIVATE pybind11::module)
  target_compile_options(omniep_check_hip_jax_module PRIVATE ${OMNIEP_CXX_WERROR})
  string(APPEND _what "; the XLA FFI handlers and _native_hip_jax's module source")
else()
  string(APPEND _what "; not the XLA FFI handlers: ${OMNIEP_XLA_FFI_WHY}")
endif()
omniep_part(check_hip built "compile only: ${_what}")
