# XLA's FFI headers, from the jax that ${Python_EXECUTABLE} imports (jax.ffi.include_dir()): sets
# OMNIEP_XLA_FFI_INCLUDE (empty without jax) and OMNIEP_XLA_FFI_WHY (why not). Read by the JAX handler
# builds: cmake/jax_ffi.cmake and cmake/nccl.cmake (CUDA), cmake/hip.cmake and the HIP compile check.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import jax.ffi; print(jax.ffi.include_dir())"
  OUTPUT_VARIABLE OMNIEP_XLA_FFI_INCLUDE OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _omniep_jax_found ERROR_QUIET)
set(OMNIEP_XLA_FFI_WHY "")
if(NOT _omniep_jax_found EQUAL 0 OR NOT EXISTS "${OMNIEP_XLA_FFI_INCLUDE}/xla/ffi/api/ffi.h")
  set(OMNIEP_XLA_FFI_INCLUDE "")
  set(OMNIEP_XLA_FFI_WHY "jax not importable by ${Python_EXECUTABLE} (pip install jax; an isolated pip build sees no "
                         "jax: pip install --no-build-isolation .)")
endif()
