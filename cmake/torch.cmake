# omniep._native_torch: the CUDA and Autograd kernels of the omniep_native::* torch ops
# (csrc/torch_ops/native_ops.cpp, native_autograd.cpp) over any rank's EpRank. Built where ${Python_EXECUTABLE} imports a CUDA
# build of torch; headers and libraries come from that torch (torch.utils.cpp_extension's include
# paths, torch/lib), with its C++ ABI. libtorch_python for the direct entries (eager_*: tensors cross pybind11
# through torch's own casters, torch/csrc/utils/pybind.h).
# Under OMNIEP_COMPILE_CHECK a CPU torch still compiles the sources (object library, not linked): its
# headers lack only one generated header of the CUDA part, written here as a CUDA build has it.
set(_torch_sources csrc/torch_ops/native_ops.cpp csrc/torch_ops/native_autograd.cpp)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch, torch.utils.cpp_extension as c; print(','.join(c.include_paths())); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _omniep_torch OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _omniep_torch_rc ERROR_QUIET)
if(NOT _omniep_torch_rc EQUAL 0)
  omniep_part(_native_torch skipped "torch not importable by ${Python_EXECUTABLE} (a CUDA torch; an isolated pip "
                                    "build sees no torch: pip install --no-build-isolation .)")
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
  omniep_part(_native_torch skipped "torch at ${_torch_lib} is not a CUDA build")
  if(OMNIEP_COMPILE_CHECK)
    set(_stub "${PROJECT_BINARY_DIR}/torch_stub")
    file(WRITE "${_stub}/c10/cuda/impl/cuda_cmake_macros.h" "#define C10_CUDA_BUILD_SHARED_LIBS\n")
    add_library(omniep_check_torch_ops OBJECT ${_torch_sources})
    target_include_directories(omniep_check_torch_ops SYSTEM PRIVATE "${_stub}" ${_torch_inc} ${pybind11_INCLUDE_DIRS}
                               ${Python_INCLUDE_DIRS} ${CUDAToolkit_INCLUDE_DIRS})
    target_include_directories(omniep_check_torch_ops PRIVATE csrc csrc/include)
    target_compile_definitions(omniep_check_torch_ops PRIVATE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
    # -O3 makes GCC 12 see a maybe-uninitialized std::optional<Tensor> inside torch's own headers.
    target_compile_options(omniep_check_torch_ops PRIVATE ${OMNIEP_CXX_WERROR} -Wno-maybe-uninitialized)
    omniep_part(check_torch_ops built "compile only, against the CPU torch's headers")
  endif()
  return()
endif()
pybind11_add_module(_native_torch MODULE ${_torch_sources})
target_include_directories(_native_torch SYSTEM PRIVATE ${_torch_inc})
target_include_directories(_native_torch PRIVATE csrc csrc/include)
target_compile_definitions(_native_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
target_compile_options(_native_torch PRIVATE ${OMNIEP_CXX_WERROR})
target_link_libraries(_native_torch PRIVATE "${_torch_lib}/libc10.so" "${_torch_lib}/libc10_cuda.so"
                      "${_torch_lib}/libtorch_cpu.so" "${_torch_lib}/libtorch_cuda.so"
                      "${_torch_lib}/libtorch_python.so" CUDA::cudart_static)
omniep_module(_native_torch RPATH_WHEEL_DIRS torch/lib RPATH_DIRS "${_torch_lib}")
omniep_part(_native_torch built "torch ops (torch CUDA ${_torch_cuda}, ${_torch_lib})")
