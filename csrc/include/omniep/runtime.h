// Host runtime dialect: the few CUDA / HIP runtime calls omniep's launchers need, behind one set of
// names (gpu::Error, gpu::Stream, gpu::launch_cooperative, ...), so that host code written against
// it builds with nvcc and with hipcc.
//
// Users: csrc/kernels/instantiate_all.cu (the compile check of every kernel for both vendors) and the
// one-rank-per-process launchers (backends/one_rank_launch.cuh, backends/ipc_rank.cu), which build
// with nvcc for NVIDIA and with hipcc for AMD (omniep._native_hip: p2p over hipIpc* handles).
//
// CUDA runtime names on AMD: under hipcc this header also maps the CUDA runtime names that the
// launchers spell (cudaMalloc, cudaIpcOpenMemHandle, cudaStream_t, ...) to their HIP twins with
// macros, so that one host source serves both vendors and its CUDA build is untouched: on NVIDIA the
// names are CUDA's own and nothing below the `#else` exists. The list is exactly what the launchers
// use; a new CUDA call in them must be added here (the HIP compile check says which one is missing).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "omniep/gpu.h"
#include "omniep/stream.h"

#if defined(OMNIEP_HIP)
// ---- CUDA runtime names -> HIP (host code of the launchers; see the header comment) ----
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaGetLastError hipGetLastError
#define cudaDeviceCanAccessPeer hipDeviceCanAccessPeer
#define cudaDeviceEnablePeerAccess hipDeviceEnablePeerAccess
#define cudaErrorPeerAccessAlreadyEnabled hipErrorPeerAccessAlreadyEnabled
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrCooperativeLaunch hipDeviceAttributeCooperativeLaunch
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpy2DAsync hipMemcpy2DAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamIsCapturing hipStreamIsCapturing
#define cudaStreamCaptureStatus hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone hipStreamCaptureStatusNone
// The exact-size dispatch's host mailbox: pinned host memory the kernel writes through its mapping.
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocMapped hipHostMallocMapped
#define cudaFreeHost hipHostFree
// IPC: hipIpcMemHandle_t is 64 bytes of `reserved`, like CUDA's; across GPUs of one node the mapping
// goes over xGMI (hipIpcMemLazyEnablePeerAccess is the only flag HIP accepts).
#define cudaIpcMemHandle_t hipIpcMemHandle_t
#define cudaIpcGetMemHandle hipIpcGetMemHandle
#define cudaIpcOpenMemHandle hipIpcOpenMemHandle
#define cudaIpcCloseMemHandle hipIpcCloseMemHandle
#define cudaIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#endif

namespace omniep::gpu {

#if defined(OMNIEP_CUDA)
using Error = cudaError_t;
using Stream = cudaStream_t;
inline constexpr Error kSuccess = cudaSuccess;
inline const char* error_name(Error e) { return cudaGetErrorName(e); }
inline const char* error_string(Error e) { return cudaGetErrorString(e); }
inline Error get_device(int* d) { return cudaGetDevice(d); }
inline Error multiprocessor_count(int* n, int device) {
  return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device);
}
inline Error cooperative_launch_supported(int* yes, int device) {
  return cudaDeviceGetAttribute(yes, cudaDevAttrCooperativeLaunch, device);
}
inline Error occupancy_blocks_per_sm(int* n, const void* kernel, int threads, size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kernel, threads, smem);
}
#else
using Error = hipError_t;
using Stream = hipStream_t;
inline constexpr Error kSuccess = hipSuccess;
inline const char* error_name(Error e) { return hipGetErrorName(e); }
inline const char* error_string(Error e) { return hipGetErrorString(e); }
inline Error get_device(int* d) { return hipGetDevice(d); }
inline Error multiprocessor_count(int* n, int device) {
  return hipDeviceGetAttribute(n, hipDeviceAttributeMultiprocessorCount, device);
}
inline Error cooperative_launch_supported(int* yes, int device) {
  return hipDeviceGetAttribute(yes, hipDeviceAttributeCooperativeLaunch, device);
}
inline Error occupancy_blocks_per_sm(int* n, const void* kernel, int threads, size_t smem) {
  return hipOccupancyMaxActiveBlocksPerMultiprocessor(n, kernel, threads, smem);
}
#endif

inline void check(Error err, const char* what) {
  if (err != kSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + error_name(err) + ": " + error_string(err));
  }
}

// Cooperative launch: every block co-resident or no launch at all (ranks wait on each other inside
// the kernel). CUDA: cudaLaunchKernelEx with the cooperative attribute (what the CUDA launchers use);
// HIP: hipLaunchCooperativeKernel with an array of pointers to the (converted) arguments.
template <typename... Params, typename... Args>
Error launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream stream,
                         const Args&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "one argument per kernel parameter");
#if defined(OMNIEP_CUDA)
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
#else
  std::tuple<Params...> values(args...);
  return std::apply(
      [&](auto&... v) {
        void* ptrs[] = {static_cast<void*>(&v)...};
        return hipLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, ptrs,
                                          static_cast<unsigned int>(smem), stream);
      },
      values);
#endif
}

}  // namespace omniep::gpu
