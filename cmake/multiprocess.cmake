# One rank per process: the p2p transport over CUDA IPC (omniep._native_mp). Included from the
# top-level CMakeLists.txt after omniep_core; needs nothing beyond the CUDA toolkit and pybind11.
add_library(omniep_ipc STATIC csrc/backends/ipc_rank.cu)
target_include_directories(omniep_ipc PUBLIC csrc csrc/include)
set_target_properties(omniep_ipc PROPERTIES
  POSITION_INDEPENDENT_CODE ON
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_ipc PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xptxas=-warn-spills -lineinfo>)
target_link_libraries(omniep_ipc PUBLIC CUDA::cudart_static)

pybind11_add_module(_native_mp MODULE csrc/python/module_mp.cpp)
target_link_libraries(_native_mp PRIVATE omniep_ipc)
set_target_properties(_native_mp PROPERTIES
  LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/omniep"
  LIBRARY_OUTPUT_DIRECTORY_RELEASE "${CMAKE_CURRENT_SOURCE_DIR}/omniep")

# Optional: the NVSHMEM transport (omniep._native_nvshmem), only when the nvidia-nvshmem wheel is found.
include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/nvshmem.cmake OPTIONAL)
