# Optional NVSHMEM transport: omniep._native_nvshmem. OFF by default so that the p2p build never
# depends on NVSHMEM; turn on with -DOMNIEP_NVSHMEM=ON (scripts/build_native.sh -DOMNIEP_NVSHMEM=ON).
# Headers and libraries come from the nvidia-nvshmem-cu13 wheel, found through the Python package
# (or -DOMNIEP_NVSHMEM_ROOT=<dir holding include/ and lib/>). Device code needs -rdc and a device
# link against libnvshmem_device.a; the host side links libnvshmem_host.so.3 (rpath to the wheel).
option(OMNIEP_NVSHMEM "Build omniep._native_nvshmem (needs the nvidia-nvshmem wheel)" OFF)
if(NOT OMNIEP_NVSHMEM)
  return()
endif()
if(NOT OMNIEP_NVSHMEM_ROOT)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE OMNIEP_NVSHMEM_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _nvshmem_rc)
  if(NOT _nvshmem_rc EQUAL 0)
    message(FATAL_ERROR "OMNIEP_NVSHMEM=ON but nvidia.nvshmem is not importable by ${Python_EXECUTABLE}: "
                        "pip install nvidia-nvshmem-cu13, or pass -DOMNIEP_NVSHMEM_ROOT=<dir>")
  endif()
endif()
set(_nvshmem_lib "${OMNIEP_NVSHMEM_ROOT}/lib")
if(NOT EXISTS "${_nvshmem_lib}/libnvshmem_device.a" OR NOT EXISTS "${_nvshmem_lib}/libnvshmem_host.so.3")
  message(FATAL_ERROR "NVSHMEM libraries not found in ${_nvshmem_lib}")
endif()
message(STATUS "omniep: NVSHMEM from ${OMNIEP_NVSHMEM_ROOT}")

add_library(omniep_nvshmem STATIC csrc/backends/nvshmem_rank.cu)
target_include_directories(omniep_nvshmem PUBLIC csrc csrc/include)
target_include_directories(omniep_nvshmem PRIVATE "${OMNIEP_NVSHMEM_ROOT}/include"
                           "${CUDAToolkit_INCLUDE_DIRS}/cccl")
set_target_properties(omniep_nvshmem PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION ON
  CUDA_RESOLVE_DEVICE_SYMBOLS ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_nvshmem PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
target_link_libraries(omniep_nvshmem PUBLIC "${_nvshmem_lib}/libnvshmem_device.a"
                      "${_nvshmem_lib}/libnvshmem_host.so.3" CUDA::cudart_static)

pybind11_add_module(_native_nvshmem MODULE csrc/python/module_nvshmem.cpp)
target_link_libraries(_native_nvshmem PRIVATE omniep_nvshmem)
set_target_properties(_native_nvshmem PROPERTIES
  BUILD_RPATH "${_nvshmem_lib}"
  LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/omniep"
  LIBRARY_OUTPUT_DIRECTORY_RELEASE "${CMAKE_CURRENT_SOURCE_DIR}/omniep")
