# The NCCL device-API transport: omniep._native_nccl (with the nccl_ep JAX handlers where jax is
# importable). OMNIEP_NCCL=AUTO (default) builds it where the nvidia-nccl-cu13 wheel (NCCL >= 2.28:
# nccl.h + nccl_device.h, libnccl.so.2) is importable or -DOMNIEP_NCCL_ROOT=<dir holding include/ and
# lib/> points at it, ON requires it, OFF skips it. The device API is header-only (no -rdc).
if(OMNIEP_NCCL STREQUAL "OFF")
  omniep_part(_native_nccl skipped "OMNIEP_NCCL=OFF")
  return()
endif()
omniep_wheel_root(OMNIEP_NCCL_ROOT nvidia.nccl)
if(NOT OMNIEP_NCCL_ROOT)
  omniep_cannot(_native_nccl "${OMNIEP_NCCL}"
                "nvidia.nccl not importable by ${Python_EXECUTABLE} (pip install nvidia-nccl-cu13, or -DOMNIEP_NCCL_ROOT=<dir>)")
  return()
endif()
set(_nccl_lib "${OMNIEP_NCCL_ROOT}/lib")
if(NOT EXISTS "${OMNIEP_NCCL_ROOT}/include/nccl_device.h")
  omniep_cannot(_native_nccl "${OMNIEP_NCCL}"
                "nccl_device.h not found in ${OMNIEP_NCCL_ROOT}/include (NCCL >= 2.28 has the device API)")
  return()
endif()
if(NOT EXISTS "${_nccl_lib}/libnccl.so.2")
  omniep_cannot(_native_nccl "${OMNIEP_NCCL}" "libnccl.so.2 not found in ${_nccl_lib}")
  return()
endif()

add_library(omniep_nccl STATIC csrc/backends/nccl_rank.cu)
target_include_directories(omniep_nccl PUBLIC csrc csrc/include "${OMNIEP_NCCL_ROOT}/include")
set_target_properties(omniep_nccl PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_nccl PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${OMNIEP_CUDA_FLAGS}>)
target_link_libraries(omniep_nccl PUBLIC "${_nccl_lib}/libnccl.so.2" CUDA::cudart_static)

pybind11_add_module(_native_nccl MODULE csrc/python/module_nccl.cpp)
target_link_libraries(_native_nccl PRIVATE omniep_nccl)
set(_with "")
if(OMNIEP_XLA_FFI_INCLUDE)  # set by cmake/xla_ffi.cmake where jax is importable
  target_sources(_native_nccl PRIVATE csrc/ffi/jax_nccl_handlers.cpp)
  target_include_directories(_native_nccl SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_compile_definitions(_native_nccl PRIVATE OMNIEP_WITH_JAX_FFI=1)
  set_source_files_properties(csrc/ffi/jax_nccl_handlers.cpp PROPERTIES COMPILE_OPTIONS "${OMNIEP_CXX_WERROR}")
  set(_with ", with the nccl_ep JAX handlers")
endif()
omniep_module(_native_nccl RPATH_WHEEL_DIRS nvidia/nccl/lib RPATH_DIRS "${_nccl_lib}")
omniep_part(_native_nccl built "NCCL device API from ${OMNIEP_NCCL_ROOT}${_with}")
