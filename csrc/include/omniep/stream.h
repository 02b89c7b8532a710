// The GPU stream type as the host-only headers (backends/ipc_rank.h, python/rank_bindings.h) name it:
// `cudaStream_t`, declared without the runtime headers so that host C++ (the pybind modules) builds
// without CUDA or HIP installed.
//
// NVIDIA (default): cudaStream_t is CUDA's own `struct CUstream_st*`.
// AMD (hipcc, or host C++ of a HIP build compiled with -DOMNIEP_HIP_HOST): cudaStream_t is a macro for
// HIP's `hipStream_t` (`struct ihipStream_t*`), the same spelling omniep/runtime.h maps it to, so a
// declaration in a host-only header and its definition in a .cu compiled by hipcc agree.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(OMNIEP_HIP_HOST)
typedef struct ihipStream_t* hipStream_t;
#ifndef cudaStream_t
#define cudaStream_t hipStream_t
#endif
#else
typedef struct CUstream_st* cudaStream_t;
#endif
