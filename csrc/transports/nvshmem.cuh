// nvshmem transport: symmetric buffers from nvshmem_malloc, peers reached through nvshmem_ptr.
//
// A PerRank<T> table needs only entry [me]: my address of a SYMMETRIC buffer (same offset in every
// PE's heap); peer(a, r) asks NVSHMEM for PE r's copy (nvshmem_ptr: non-null when r is reachable
// by loads/stores, i.e. NVLink or the same GPU). Launches run one rank per process (gridDim.y == 1).
//
// The remote path (peers without a pointer: IBGDA/IBRC across nodes, or every peer when
// OMNIEP_FORCE_REMOTE=1) needs kernels that move rows with put_warp() + signal_add() instead of
// stores through peer(); today's kernels (csrc/kernels) only use peer(), so the host launcher
// refuses a group where some peer has no pointer. The primitives are here for those kernels.
// Builds only with nvcc -rdc=true and the nvidia-nvshmem wheel (cmake/nvshmem.cmake).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

struct NvshmemTransport {
  int me;           // my PE == my EP rank
  int group_size;   // R == number of PEs
  uint64_t wait_timeout_ns;
  PerRank<RankWorkspace> workspaces;  // entry [me]: my symmetric workspace

  OMNIEP_DEVICE int rank() const { return me; }
  OMNIEP_DEVICE int num_ranks() const { return group_size; }
  OMNIEP_DEVICE uint64_t timeout_ns() const { return wait_timeout_ns; }

  template <typename T>
  OMNIEP_DEVICE T* local(const PerRank<T>& a) const { return a.p[me]; }
  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const {
    return r == me ? a.p[me] : static_cast<T*>(nvshmem_ptr(const_cast<void*>(static_cast<const void*>(a.p[me])), r));
  }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const { return peer(workspaces, r); }

  // ---- remote path (put + signal), for kernels that use it ----
  // The whole warp copies `bytes` from local `src` into PE r's copy of symmetric `dst`, non-blocking.
  OMNIEP_DEVICE void put_warp(void* dst, const void* src, size_t bytes, int r) const {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, r);
  }
  // Orders my earlier puts to PE r before adding `v` to PE r's copy of symmetric `signal`.
  OMNIEP_DEVICE void signal_add(uint64_t* signal, uint64_t v, int r) const {
    nvshmem_fence();
    nvshmemx_signal_op(signal, v, NVSHMEM_SIGNAL_ADD, r);
  }
};

}  // namespace omniep
