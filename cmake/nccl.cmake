# Optional NCCL device-API transport: omniep._native_nccl. OFF by default so that the default build
# never depends on NCCL; turn on with -DOMNIEP_NCCL=ON (scripts/build_native.sh -DOMNIEP_NCCL=ON, in
# its own build dir: OMNIEP_BUILD_DIR=build/native_nccl). Headers (nccl.h + nccl_device.h, NCCL >= 2.28)
# and libnccl.so.2 come from the nvidia-nccl-cu13 wheel, found through the Python package, or from
# -DOMNIEP_NCCL_ROOT=<dir holding include/ and lib/>. The device API is header-only (no -rdc).
option(OMNIEP_NCCL "Build omniep._native_nccl (needs the nvidia-nccl wheel, NCCL >= 2.28)" OFF)
if(NOT OMNIEP_NCCL)
  return()
endif()
if(NOT OMNIEP_NCCL_ROOT AND DEFINED ENV{OMNIEP_NCCL_ROOT})
  set(OMNIEP_NCCL_ROOT "$ENV{OMNIEP_NCCL_ROOT}")
endif()
if(NOT OMNIEP_NCCL_ROOT)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE OMNIEP_NCCL_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _nccl_rc)
  if(NOT _nccl_rc EQUAL 0)
    message(FATAL_ERROR "OMNIEP_NCCL=ON but nvidia.nccl is not importable by ${Python_EXECUTABLE}: "
                        "pip install nvidia-nccl-cu13, or pass -DOMNIEP_NCCL_ROOT=<dir>")
  endif()
endif()
set(_nccl_lib "${OMNIEP_NCCL_ROOT}/lib")
if(NOT EXISTS "${OMNIEP_NCCL_ROOT}/include/nccl_device.h")
  message(FATAL_ERROR "nccl_device.h not found in ${OMNIEP_NCCL_ROOT}/include: NCCL >= 2.28 has the device API")
endif()
if(NOT EXISTS "${_nccl_lib}/libnccl.so.2")
  message(FATAL_ERROR "libnccl.so.2 not found in ${_nccl_lib}")
endif()
message(STATUS "omniep: NCCL from ${OMNIEP_NCCL_ROOT}")

add_library(omniep_nccl STATIC csrc/backends/nccl_rank.cu)
target_include_directories(omniep_nccl PUBLIC csrc csrc/include "${OMNIEP_NCCL_ROOT}/include")
set_target_properties(omniep_nccl PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_nccl PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
target_link_libraries(omniep_nccl PUBLIC "${_nccl_lib}/libnccl.so.2" CUDA::cudart_static)

pybind11_add_module(_native_nccl MODULE csrc/python/module_nccl.cpp)
target_link_libraries(_native_nccl PRIVATE omniep_nccl)
if(OMNIEP_XLA_FFI_INCLUDE)  # set by cmake/jax_ffi.cmake where jax is importable
  message(STATUS "omniep: omniep._native_nccl gets the nccl_ep JAX handlers")
  target_sources(_native_nccl PRIVATE csrc/ffi/jax_nccl_handlers.cpp)
  target_include_directories(_native_nccl SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_compile_definitions(_native_nccl PRIVATE OMNIEP_WITH_JAX_FFI=1)
endif()
set_target_properties(_native_nccl PROPERTIES
  BUILD_RPATH "${_nccl_lib}"
  LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/omniep"
  LIBRARY_OUTPUT_DIRECTORY_RELEASE "${CMAKE_CURRENT_SOURCE_DIR}/omniep")
