// nvshmem transport: symmetric buffers from nvshmem_malloc; each peer is reached either through
// nvshmem_ptr (loads/stores: NVLink or the same GPU) or through puts, gets and signals (the remote
// path: IBGDA/IBRC across nodes, or every peer when OMNIEP_FORCE_REMOTE=1).
//
// A PerRank<T> table needs only entry [me]: my address of a SYMMETRIC buffer (same offset in every
// PE's heap). peer(a, r) asks NVSHMEM for PE r's copy (nvshmem_ptr) and is only used for peers whose
// bit in `remote_mask` is clear; for the others the kernels (csrc/kernels, `if constexpr
// (Tr::kHasRemote)` branches) pass MY address of the symmetric buffer plus the PE to the put /
// signal operations below (the expert-major kernels also to the gets: kHasGets). The
// rank-major kernels stage rows for remote peers in `mirrors` (omniep/remote_transport.h). The choice
// is per peer and made at run time by the host (NvshmemRank fills remote_mask). Launches run one rank
// per process (gridDim.y == 1).
// Builds only with nvcc -rdc=true and the nvidia-nvshmem wheel (cmake/nvshmem.cmake).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "omniep/gpu.h"
#include "omniep/remote_transport.h"
#include "omniep/transport.h"

namespace omniep {

// me == my PE, group_size == the number of PEs; remote peers are reached by puts / gets / signals.
struct NvshmemTransport : RemoteTransportBase {
  static constexpr bool kHasRemote = true;
  static constexpr bool kHasGets = true;  // the expert-major kernels' one-sided ops below

  uint8_t* scratch;      // symmetric staging area of the expert-major remote path (gets land there)
  int64_t scratch_bytes;

  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const {
    return r == me ? a.p[me] : static_cast<T*>(nvshmem_ptr(const_cast<void*>(static_cast<const void*>(a.p[me])), r));
  }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const { return peer(workspaces, r); }

  // ---- remote path (omniep/transport.h): peer-side addresses are MY addresses of symmetric buffers ----
  OMNIEP_DEVICE void put_block(void* dst, const void* src, size_t bytes, int r) const {
    if (bytes > 0) nvshmem_putmem_nbi(dst, src, bytes, r);
  }
  OMNIEP_DEVICE void put_i32(int32_t* dst, int32_t v, int r) const { nvshmem_int32_p(dst, v, r); }
  OMNIEP_DEVICE void signal_remote(int r) const {
    nvshmem_fence();  // my puts to r before the signal
    nvshmemx_signal_op(&workspaces.p[me]->signals[me], uint64_t{1}, NVSHMEM_SIGNAL_ADD, r);
  }
  // ---- one-sided ops of the expert-major kernels (kHasGets) ----
  // The whole warp copies `bytes` from local `src` into PE r's copy of symmetric `dst`, non-blocking
  // (complete after quiet()).
  OMNIEP_DEVICE void put_warp(void* dst, const void* src, size_t bytes, int r) const {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, r);
  }
  OMNIEP_DEVICE void put_f32(float* dst, float v, int r) const { nvshmem_float_p(dst, v, r); }
  // The whole warp copies `bytes` of PE r's copy of symmetric `src` into local symmetric `dst`;
  // blocking (the data is there when every lane returns).
  OMNIEP_DEVICE void get_warp(void* dst, const void* src, size_t bytes, int r) const {
    nvshmemx_getmem_warp(dst, src, bytes, r);
  }
  OMNIEP_DEVICE float get_f32(const float* src, int r) const { return nvshmem_float_g(src, r); }
  // Completes this thread's outstanding puts and atomics (to every PE).
  OMNIEP_DEVICE void quiet() const { nvshmem_quiet(); }
};

}  // namespace omniep
