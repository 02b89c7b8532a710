# One rank per process: the p2p transport over CUDA IPC (omniep._native_mp). Included from the
# top-level CMakeLists.txt after omniep_core; needs nothing beyond the CUDA toolkit and pybind11.
add_library(omniep_ipc STATIC csrc/backends/ipc_rank.cu)
target_include_directories(omniep_ipc PUBLIC csrc csrc/include)
set_target_properties(omniep_ipc PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_ipc PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${OMNIEP_CUDA_FLAGS}>)
target_link_libraries(omniep_ipc PUBLIC CUDA::cudart_static)

pybind11_add_module(_native_mp MODULE csrc/python/module_mp.cpp)
target_link_libraries(_native_mp PRIVATE omniep_ipc)
omniep_module(_native_mp)
omniep_part(_native_mp built "one rank per process over CUDA IPC")
