# Optional: the XLA FFI handlers of the cuda_nvshmem JAX backend (omniep._native_jax), built only where
# cmake/xla_ffi.cmake found jax's FFI headers. Included from CMakeLists.txt after cmake/multiprocess.cmake
# (it links omniep_ipc).
if(NOT OMNIEP_XLA_FFI_INCLUDE)
  omniep_part(_native_jax skipped "${OMNIEP_XLA_FFI_WHY}")
  return()
endif()
pybind11_add_module(_native_jax MODULE csrc/python/module_jax.cpp csrc/ffi/jax_handlers.cpp)
target_include_directories(_native_jax SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
target_link_libraries(_native_jax PRIVATE omniep_ipc)
set_source_files_properties(csrc/ffi/jax_handlers.cpp PROPERTIES COMPILE_OPTIONS "${OMNIEP_CXX_WERROR}")
omniep_module(_native_jax)
omniep_part(_native_jax built "XLA FFI handlers of the JAX frontend (headers of ${OMNIEP_XLA_FFI_INCLUDE})")
