// RemoteTransportBase: the members that every transport with a remote path (kHasRemote:
// transports/nvshmem.cuh, nccl_dev.cuh, rocshmem.cuh) shares, written once: the one rank a launch runs
// (gridDim.y == 1), which peers are remote, and the mirrors of the data buffer that the rank-major
// kernels stage remote rows in (the remote-path contract: omniep/transport.h).
//
// A transport derives from it and adds peer(), workspace() and its put / signal operations. The host
// side of the transport (its launcher's transport()) fills every member; a kernel gets the transport
// by value, so the struct stays trivially copyable (no constructors, no virtuals).
//
// Device-aware header (OMNIEP_DEVICE, omniep/gpu.h): omniep/transport.h itself stays includable by
// host-only C++.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

struct RemoteTransportBase {
  int me;           // my EP rank
  int group_size;   // R
  uint64_t wait_timeout_ns;
  PerRank<RankWorkspace> workspaces;  // entry [me]: my workspace (a symmetric buffer)
  uint32_t remote_mask;  // bit r: peer r is reached by puts and signals only, never by loads/stores
  const uint8_t* data_base;  // my data buffer (symmetric)
  uint8_t* mirrors;          // symmetric, R x data_bytes: the data buffer's layout once per rank
  int64_t data_bytes;

  OMNIEP_DEVICE int rank() const { return me; }
  OMNIEP_DEVICE int num_ranks() const { return group_size; }
  OMNIEP_DEVICE uint64_t timeout_ns() const { return wait_timeout_ns; }

  template <typename T>
  OMNIEP_DEVICE T* local(const PerRank<T>& a) const { return a.p[me]; }

  OMNIEP_HOST_DEVICE bool is_remote(int r) const { return (remote_mask >> r) & 1u; }
  OMNIEP_HOST_DEVICE bool any_remote() const { return remote_mask != 0; }
  // Signals from remote peers as NVSHMEM and rocSHMEM keep them: workspace memory, which the host's
  // reset zeroes. A transport whose signals live elsewhere (nccl_dev: GIN's) defines its own.
  OMNIEP_DEVICE uint64_t remote_signals(const RankWorkspace* ws, int s) const {
    return gpu::load_acquire_sys(&ws->signals[s]);
  }
  OMNIEP_DEVICE void reset_remote_signals(int) const {}
  // My copy of data-buffer address `p` reserved for peer r: p's offset in the data buffer, inside
  // the r-th repetition of its layout in `mirrors`.
  template <typename T>
  OMNIEP_DEVICE T* mirror(T* p, int r) const {
    return reinterpret_cast<T*>(mirrors + r * data_bytes + (reinterpret_cast<const uint8_t*>(p) - data_base));
  }
};

static_assert(std::is_trivially_copyable<RemoteTransportBase>::value, "transports are kernel arguments");

}  // namespace omniep
