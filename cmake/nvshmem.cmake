# The NVSHMEM transport: omniep._native_nvshmem. OMNIEP_NVSHMEM=AUTO (default) builds it where the
# nvidia-nvshmem-cu13 wheel is importable (or -DOMNIEP_NVSHMEM_ROOT=<dir holding include/ and lib/>),
# ON requires it, OFF skips it. Device code needs -rdc and a device link against libnvshmem_device.a;
# the host side links libnvshmem_host.so.3, found next to the module's wheel dir first.
if(OMNIEP_NVSHMEM STREQUAL "OFF")
  omniep_part(_native_nvshmem skipped "OMNIEP_NVSHMEM=OFF")
  return()
endif()
omniep_wheel_root(OMNIEP_NVSHMEM_ROOT nvidia.nvshmem)
if(NOT OMNIEP_NVSHMEM_ROOT)
  omniep_cannot(_native_nvshmem "${OMNIEP_NVSHMEM}"
                "nvidia.nvshmem not importable by ${Python_EXECUTABLE} (pip install nvidia-nvshmem-cu13, or -DOMNIEP_NVSHMEM_ROOT=<dir>)")
  return()
endif()
set(_nvshmem_lib "${OMNIEP_NVSHMEM_ROOT}/lib")
if(NOT EXISTS "${_nvshmem_lib}/libnvshmem_device.a" OR NOT EXISTS "${_nvshmem_lib}/libnvshmem_host.so.3")
  omniep_cannot(_native_nvshmem "${OMNIEP_NVSHMEM}" "NVSHMEM libraries not found in ${_nvshmem_lib}")
  return()
endif()

add_library(omniep_nvshmem STATIC csrc/backends/nvshmem_rank.cu)
target_include_directories(omniep_nvshmem PUBLIC csrc csrc/include)
target_include_directories(omniep_nvshmem PRIVATE "${OMNIEP_NVSHMEM_ROOT}/include"
                           "${CUDAToolkit_INCLUDE_DIRS}/cccl")
set_target_properties(omniep_nvshmem PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION ON
  CUDA_RESOLVE_DEVICE_SYMBOLS ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_nvshmem PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${OMNIEP_CUDA_FLAGS}>)
target_link_libraries(omniep_nvshmem PUBLIC "${_nvshmem_lib}/libnvshmem_device.a"
                      "${_nvshmem_lib}/libnvshmem_host.so.3" CUDA::cudart_static)

pybind11_add_module(_native_nvshmem MODULE csrc/python/module_nvshmem.cpp)
target_link_libraries(_native_nvshmem PRIVATE omniep_nvshmem)
omniep_module(_native_nvshmem RPATH_WHEEL_DIRS nvidia/nvshmem/lib RPATH_DIRS "${_nvshmem_lib}")
omniep_part(_native_nvshmem built "NVSHMEM from ${OMNIEP_NVSHMEM_ROOT}")
