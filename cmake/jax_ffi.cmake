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
  omniep_part(_native_jax skipped "jax not importable by ${Python_EXECUTABLE} (pip install jax; an isolated pip build "
                                  "sees no jax: pip install --no-build-isolation .)")
  return()
endif()
pybind11_add_module(_native_jax MODULE csrc/python/module_jax.cpp csrc/ffi/jax_handlers.cpp)
target_include_directories(_native_jax SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
target_link_libraries(_native_jax PRIVATE omniep_ipc)
set_source_files_properties(csrc/ffi/jax_handlers.cpp PROPERTIES COMPILE_OPTIONS "${OMNIEP_CXX_WERROR}")
omniep_module(_native_jax)
omniep_part(_native_jax built "XLA FFI handlers of the JAX frontend (headers of ${OMNIEP_XLA_FFI_INCLUDE})")
