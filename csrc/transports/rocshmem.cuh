// rocshmem transport (AMD): symmetric buffers from rocshmem_malloc, peers through rocshmem_ptr.
//
// STATUS: NEVER COMPILED, NEVER RUN. rocSHMEM is not installed on any machine this project has had
// (no ROCm there either), so this file has not been through a compiler. It is written against the
// rocSHMEM >= 3.0 device API (namespace rocshmem, <rocshmem/rocshmem.hpp>) as documented, and is
// compiled only by cmake/hip.cmake when rocSHMEM is found (ROCSHMEM_DIR), through
// csrc/transports/rocshmem_compile_check.hip. cmake/hip_compile_check.cmake leaves it out.
//
// The twin of transports/nvshmem.cuh, with the same members (the Transport concept of
// omniep/transport.h, remote path included). A PerRank<T> table needs only entry [me]: my address of
// a SYMMETRIC buffer (same offset in every PE's heap). peer(a, r) asks rocSHMEM for PE r's copy
// (rocshmem_ptr: non-null over xGMI inside a node, or on the same GPU) and is used only for peers
// whose bit in `remote_mask` is clear; the others (GPU-initiated RDMA through the GDA providers
// mlx5 / bnxt / ionic, across nodes) are reached by the put / get / signal operations below, which
// take MY address of the symmetric buffer plus the PE. One rank per process (gridDim.y == 1). On AMD
// a "warp" of the kernels is a 64-lane wavefront, hence the *_wave rocSHMEM calls.
//
// What does not exist yet: the launcher over this transport (a RocshmemRank: rocshmem_init,
// rocshmem_malloc of the workspace, data buffer and scratch, remote_mask from rocshmem_ptr == nullptr,
// its pybind module), so the rocm_rocshmem backend runs the p2p transport over HIP IPC.
#pragma once

#include <rocshmem/rocshmem.hpp>

#include "omniep/gpu.h"
#include "omniep/remote_transport.h"
#include "omniep/transport.h"

namespace omniep {

// me == my PE, group_size == the number of PEs, workspaces / data buffer / mirrors from rocshmem_malloc;
// remote peers are reached by puts / gets / signals.
struct RocshmemTransport : RemoteTransportBase {
  static constexpr bool kHasRemote = true;
  static constexpr bool kHasGets = true;  // the expert-major kernels' one-sided ops below

  uint8_t* scratch;      // symmetric staging area of the expert-major remote path
  int64_t scratch_bytes;

  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const {
    return r == me ? a.p[me] : static_cast<T*>(rocshmem::rocshmem_ptr(static_cast<const void*>(a.p[me]), r));
  }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const { return peer(workspaces, r); }

  // ---- remote path: `dst` / `src` on the peer side are MY addresses of symmetric buffers ----
  OMNIEP_DEVICE void put_block(void* dst, const void* src, size_t bytes, int r) const {
    if (bytes > 0) rocshmem::rocshmem_putmem_nbi(dst, src, bytes, r);
  }
  // After my puts to PE r: a zero-byte put with a signal add on signals[me] of r's workspace.
  OMNIEP_DEVICE void signal_remote(int r) const {
    uint64_t* signal = &workspaces.p[me]->signals[me];
    rocshmem::rocshmem_fence();
    rocshmem::rocshmem_putmem_signal_nbi(signal, signal, 0, signal, uint64_t{1}, rocshmem::ROCSHMEM_SIGNAL_ADD, r);
  }
  // ---- one-sided ops of the expert-major kernels (kHasGets) ----
  // The whole wavefront copies `bytes` from local `src` into PE r's copy of symmetric `dst`,
  // non-blocking (complete after quiet()); all 64 lanes pass the same arguments.
  OMNIEP_DEVICE void put_warp(void* dst, const void* src, size_t bytes, int r) const {
    rocshmem::rocshmem_putmem_nbi_wave(dst, src, bytes, r);
  }
  OMNIEP_DEVICE void put_i32(int32_t* dst, int32_t v, int r) const { rocshmem::rocshmem_int_p(dst, v, r); }
  OMNIEP_DEVICE void put_f32(float* dst, float v, int r) const { rocshmem::rocshmem_float_p(dst, v, r); }
  // The whole wavefront copies `bytes` of PE r's copy of symmetric `src` into local `dst`; blocking.
  OMNIEP_DEVICE void get_warp(void* dst, const void* src, size_t bytes, int r) const {
    rocshmem::rocshmem_getmem_wave(dst, src, bytes, r);
  }
  OMNIEP_DEVICE float get_f32(const float* src, int r) const {
    return rocshmem::rocshmem_float_g(const_cast<float*>(src), r);
  }
  // Completes this thread's outstanding puts and atomics (to every PE).
  OMNIEP_DEVICE void quiet() const { rocshmem::rocshmem_quiet(); }
};

}  // namespace omniep
