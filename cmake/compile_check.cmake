# OMNIEP_COMPILE_CHECK=ON (CI): sources that no module of a CUDA build links, compiled as object
# libraries so that they keep compiling -- the kernels as csrc/kernels/instantiate_all.cu instantiates
# them for the HIP build, the C ABI as host-only C++ (it must not need CUDA headers), and the NCCL EP
# library's ABI pins (csrc/backends/nccl_ep_lib_abi.cpp) where nccl_ep.h and nccl.h are found (the
# adapter itself, csrc/backends/nccl_ep_lib.*, is a module: cmake/nccl_ep_lib.cmake). The HIP
# side of the check is cmake/hip_compile_check.cmake.
if(NOT OMNIEP_COMPILE_CHECK)
  return()
endif()
add_library(omniep_check_kernels OBJECT csrc/kernels/instantiate_all.cu)
target_include_directories(omniep_check_kernels PRIVATE csrc csrc/include)
target_compile_options(omniep_check_kernels PRIVATE ${OMNIEP_CUDA_FLAGS})
omniep_part(check_kernels built "compile only: every kernel as the HIP build instantiates it, for sm_${CMAKE_CUDA_ARCHITECTURES}")

add_library(omniep_check_capi OBJECT csrc/capi/omniep_capi.cpp)
target_include_directories(omniep_check_capi PRIVATE csrc csrc/include)
target_compile_options(omniep_check_capi PRIVATE ${OMNIEP_CXX_WERROR})
omniep_part(check_capi built "compile only: the C ABI as host C++ without CUDA headers")

# NVIDIA's NCCL EP library: the headers' roots as cmake/nccl_ep_lib.cmake found them (or why not).
if(OMNIEP_NCCL_EP_HEADERS)
  omniep_part(check_nccl_ep_abi skipped "${OMNIEP_NCCL_EP_HEADERS}")
else()
  add_library(omniep_check_nccl_ep_abi OBJECT csrc/backends/nccl_ep_lib_abi.cpp)
  target_include_directories(omniep_check_nccl_ep_abi PRIVATE csrc csrc/include "${OMNIEP_NCCL_ROOT}/include")
  target_include_directories(omniep_check_nccl_ep_abi SYSTEM PRIVATE "${OMNIEP_NCCL_EP_ROOT}/include"
                             ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_options(omniep_check_nccl_ep_abi PRIVATE ${OMNIEP_CXX_WERROR})
  omniep_part(check_nccl_ep_abi built "compile only: NCCL EP API version 2 and its struct sizes")
endif()
