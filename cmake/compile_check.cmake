# OMNIEP_COMPILE_CHECK=ON (CI): sources that no module of a CUDA build links, compiled as object
# libraries so that they keep compiling -- the kernels as csrc/kernels/instantiate_all.cu instantiates
# them for the HIP build, the C ABI as host-only C++ (it must not need CUDA headers), and the NCCL EP
# library's ABI pins (csrc/backends/nccl_ep_lib_abi.cpp) where nccl_ep.h and nccl.h are found. The HIP
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

# NVIDIA's NCCL EP library (nccl-extensions wheel): OMNIEP_NCCL_EP_ROOT, or the ep/ folder of the
# `nccl` package of ${Python_EXECUTABLE}.
if(NOT OMNIEP_NCCL_EP_ROOT AND DEFINED ENV{OMNIEP_NCCL_EP_ROOT})
  set(OMNIEP_NCCL_EP_ROOT "$ENV{OMNIEP_NCCL_EP_ROOT}")
endif()
if(NOT OMNIEP_NCCL_EP_ROOT)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import importlib.util as u, os; s = u.find_spec('nccl'); print(next(os.path.join(d, 'ep') for d in s.submodule_search_locations if os.path.isfile(os.path.join(d, 'ep', 'include', 'nccl_ep.h'))))"
    OUTPUT_VARIABLE OMNIEP_NCCL_EP_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
omniep_wheel_root(OMNIEP_NCCL_ROOT nvidia.nccl)
if(NOT EXISTS "${OMNIEP_NCCL_EP_ROOT}/include/nccl_ep.h")
  omniep_part(check_nccl_ep_abi skipped "nccl_ep.h not found (pip install nccl-extensions, or -DOMNIEP_NCCL_EP_ROOT=<dir>)")
elseif(NOT EXISTS "${OMNIEP_NCCL_ROOT}/include/nccl.h")
  omniep_part(check_nccl_ep_abi skipped "nccl.h not found (pip install nvidia-nccl-cu13, or -DOMNIEP_NCCL_ROOT=<dir>)")
else()
  add_library(omniep_check_nccl_ep_abi OBJECT csrc/backends/nccl_ep_lib_abi.cpp)
  target_include_directories(omniep_check_nccl_ep_abi PRIVATE csrc csrc/include "${OMNIEP_NCCL_ROOT}/include")
  target_include_directories(omniep_check_nccl_ep_abi SYSTEM PRIVATE "${OMNIEP_NCCL_EP_ROOT}/include"
                             ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_options(omniep_check_nccl_ep_abi PRIVATE ${OMNIEP_CXX_WERROR})
  omniep_part(check_nccl_ep_abi built "compile only: NCCL EP API version 2 and its struct sizes")
endif()
