# omniep._native_nccl_ep_lib: the adapter to NVIDIA's NCCL EP library (csrc/backends/nccl_ep_lib.*,
# issue 18 item 2). Besides nvcc (its order kernels are CUDA: this file is included by the CUDA build
# only; a build without nvcc records the module as skipped with the no-GPU reason) it needs only
# headers -- nccl_ep.h of the nccl-extensions wheel (OMNIEP_NCCL_EP_ROOT, or the ep/ folder of the
# `nccl` package of ${Python_EXECUTABLE}) and nccl.h (OMNIEP_NCCL_ROOT, or the nvidia-nccl wheel) --
# because it loads libnccl_ep.so with dlopen at run time; so a CUDA build makes it wherever both
# headers are found (CI takes them from the two wheels, .ci/run), and skips it with the reason
# elsewhere. cmake/compile_check.cmake uses the roots found here for the ABI pins.
# Where jax's FFI headers are found (cmake/xla_ffi.cmake) the module also holds the nccl_ep_lib JAX
# handlers (csrc/ffi/jax_nccl_ep_lib_handlers.cpp, over the same adapter entry points).
if(NOT OMNIEP_NCCL_EP_ROOT AND DEFINED ENV{OMNIEP_NCCL_EP_ROOT})
  set(OMNIEP_NCCL_EP_ROOT "$ENV{OMNIEP_NCCL_EP_ROOT}")
endif()
if(NOT OMNIEP_NCCL_EP_ROOT)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import importlib.util as u, os; s = u.find_spec('nccl'); print(next(os.path.join(d, 'ep') for d in s.submodule_search_locations if os.path.isfile(os.path.join(d, 'ep', 'include', 'nccl_ep.h'))))"
    OUTPUT_VARIABLE OMNIEP_NCCL_EP_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
omniep_wheel_root(OMNIEP_NCCL_ROOT nvidia.nccl)
set(OMNIEP_NCCL_EP_HEADERS "")  # why not, when they are not both found
if(NOT EXISTS "${OMNIEP_NCCL_EP_ROOT}/include/nccl_ep.h")
  set(OMNIEP_NCCL_EP_HEADERS "nccl_ep.h not found (pip install nccl-extensions, or -DOMNIEP_NCCL_EP_ROOT=<dir>)")
elseif(NOT EXISTS "${OMNIEP_NCCL_ROOT}/include/nccl.h")
  set(OMNIEP_NCCL_EP_HEADERS "nccl.h not found (pip install nvidia-nccl-cu13, or -DOMNIEP_NCCL_ROOT=<dir>)")
endif()
if(OMNIEP_NCCL_EP_HEADERS)
  omniep_part(_native_nccl_ep_lib skipped "${OMNIEP_NCCL_EP_HEADERS}")
  return()
endif()

# The order kernels (nvcc) and the host side (C++), one static library; nothing links NCCL or NCCL EP.
add_library(omniep_nccl_ep_lib STATIC csrc/backends/nccl_ep_lib.cpp csrc/backends/nccl_ep_lib_order.cu)
target_include_directories(omniep_nccl_ep_lib PUBLIC csrc csrc/include "${OMNIEP_NCCL_ROOT}/include")
target_include_directories(omniep_nccl_ep_lib SYSTEM PUBLIC "${OMNIEP_NCCL_EP_ROOT}/include" ${CUDAToolkit_INCLUDE_DIRS})
set_target_properties(omniep_nccl_ep_lib PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_RUNTIME_LIBRARY Static)
target_compile_options(omniep_nccl_ep_lib PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${OMNIEP_CUDA_FLAGS}>
  $<$<COMPILE_LANGUAGE:CXX>:${OMNIEP_CXX_WERROR}>)
target_link_libraries(omniep_nccl_ep_lib PUBLIC CUDA::cudart_static ${CMAKE_DL_LIBS})

pybind11_add_module(_native_nccl_ep_lib MODULE csrc/python/module_nccl_ep_lib.cpp)
target_link_libraries(_native_nccl_ep_lib PRIVATE omniep_nccl_ep_lib)
target_compile_options(_native_nccl_ep_lib PRIVATE ${OMNIEP_CXX_WERROR})
set(_with "")
if(OMNIEP_XLA_FFI_INCLUDE)  # cmake/xla_ffi.cmake: jax importable by the Python that runs the build
  target_sources(_native_nccl_ep_lib PRIVATE csrc/ffi/jax_nccl_ep_lib_handlers.cpp)
  target_include_directories(_native_nccl_ep_lib SYSTEM PRIVATE "${OMNIEP_XLA_FFI_INCLUDE}")
  target_compile_definitions(_native_nccl_ep_lib PRIVATE OMNIEP_WITH_JAX_FFI=1)
  set(_with "; with the JAX handlers")
else()
  set(_with "; without the JAX handlers: ${OMNIEP_XLA_FFI_WHY}")
endif()
omniep_module(_native_nccl_ep_lib)
omniep_part(_native_nccl_ep_lib built
            "adapter to NCCL EP (headers of ${OMNIEP_NCCL_EP_ROOT}; libnccl_ep.so loaded at run time${_with})")
