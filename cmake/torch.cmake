# omniep._native_torch: the CUDA and Autograd kernels of the omniep_native::* torch ops
# (csrc/torch_ops/native_ops.cpp, native_autograd.cpp) over any rank's EpRank. Built where ${Python_EXECUTABLE} imports a CUDA
# build of torch; headers and libraries come from that torch (torch.utils.cpp_extension's include
# paths, torch/lib), with its C++ ABI. No libtorch_python: the module passes only integers to Python.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch, torch.utils.cpp_extension as c; print(','.join(c.include_paths())); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _omniep_torch OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _omniep_torch_rc ERROR_QUIET)
if(NOT _omniep_torch_rc EQUAL 0)
  message(STATUS "omniep: torch not importable by ${Python_EXECUTABLE}: omniep._native_torch (torch ops) not built")
  return()
endif()
string(REPLACE "\n" ";" _omniep_torch "${_omniep_torch}")
list(GET _omniep_torch 0 _torch_inc)
list(GET _omniep_torch 1 _torch_lib)
list(GET _omniep_torch 2 _torch_abi)
list(LENGTH _omniep_torch _n)
set(_torch_cuda "")
if(_n GREATER 3)
  list(GET _omniep_torch 3 _torch_cuda)
endif()
string(REPLACE "," ";" _torch_inc "${_torch_inc}")
if(NOT _torch_cuda OR NOT EXISTS "${_torch_lib}/libc10_cuda.so")
  message(STATUS "omniep: torch at ${_torch_lib} is not a CUDA build: omniep._native_torch (torch ops) not built")
  return()
endif()
message(STATUS "omniep: torch (CUDA ${_torch_cuda}) from ${_torch_lib}: building omniep._native_torch")
pybind11_add_module(_native_torch MODULE csrc/torch_ops/native_ops.cpp csrc/torch_ops/native_autograd.cpp)
target_include_directories(_native_torch SYSTEM PRIVATE ${_torch_inc})
target_include_directories(_native_torch PRIVATE csrc csrc/include)
target_compile_definitions(_native_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
target_link_libraries(_native_torch PRIVATE "${_torch_lib}/libc10.so" "${_torch_lib}/libc10_cuda.so"
                      "${_torch_lib}/libtorch_cpu.so" "${_torch_lib}/libtorch_cuda.so" CUDA::cudart_static)
set_target_properties(_native_torch PROPERTIES
  BUILD_RPATH "${_torch_lib}"
  LIBRARY_OUTPUT_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}/omniep"
  LIBRARY_OUTPUT_DIRECTORY_RELEASE "${CMAKE_CURRENT_SOURCE_DIR}/omniep")
