# Optional: the XLA FFI handlers of the cuda_nvshmem JAX backend (omniep._native_jax), built only when
# ${Python_EXECUTABLE} imports jax (headers from jax.ffi.include_dir()). Included from CMakeLists.txt
# after cmake/multiprocess.cmake (it links omniep_ipc). Sets OMNIEP_XLA_FFI_INCLUDE (empty without
# jax) for cmake/nccl.cmake, which adds the nccl_ep handlers to omniep._native_nccl.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import jax.ffi; print(jax.ffi.include_dir())"
  OUTPUT_VARIABLE OMNIEP_XLA_FFI_INCLUDE OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _omniep_jax_found ERROR_QUIET)
if(NOT _omniep_jax_found EQUAL 0 OR NOT EXISTS "${OMNIEP_XLA_FFI_INCLUDE}/xla/ffi/api/ffi.h")
  set(OMNIEP_XLA_FFI_INCLUDE "")
endif()
if(OMNIEP_XLA_FFI_INCLUDE AND TARGET omniep_ipc)
  message(STATUS "omniep: XLA FFI headers in ${OMNIEP_XLA_FFI_INCLUDE}: building omniep._native_jax")
  pybind11_add_module(_native_jax MODULE csrc/python/module_jax.cpp csrc/ffi/jax_handlers.cpp)
  target_include_directories(_native_jax SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_link_libraries(_native_jax PRIVATE omniep_ipc)
  set_target_properties(_native_jax PROPERTIES
    LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/omniep"
    LIBRARY_OUTPUT_DIRECTORY_RELEASE "${CMAKE_CURRENT_SOURCE_DIR}/omniep")
else()
  message(STATUS "omniep: jax not importable by ${Python_EXECUTABLE}: omniep._native_jax (JAX FFI) not built")
endif()
