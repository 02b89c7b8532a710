// The cuda_nvshmem JAX states for the XLA FFI handlers (ffi/jax_ops.h over IpcRank), one per process
// model: JaxRank (one process per GPU, CUDA IPC peers) and JaxLocalIpcGroup (one process driving every
// local GPU, peers by device pointers).
//
// JaxRank: ONE rank of a cuda_nvshmem JAX EP group.
// Created once per (process, EP group) from Python (omniep/backends/cuda_nvshmem/jax_state.py), which
// bootstraps it (CUDA IPC handles all-gathered through JAX's distributed key-value store) and passes
// handle() (its one-rank JaxGroup) to every ffi_call as the integer attribute `state`. destroy() frees
// the GPU buffers and retires the group but leaves both objects (kept alive by Python), so a compiled
// executable that still names them gets an FFI error instead of touching freed memory.
//
// Host-only header (no CUDA headers).
#pragma once

#include <stdint.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "backends/ipc_rank.h"
#include "ffi/jax_group.h"
#include "ffi/jax_local_ranks.h"

namespace omniep {

extern template class JaxLocalRanks<IpcRank>;  // instantiated in ffi/jax_handlers.cpp

class JaxRank {
 public:
  // Makes `device` current and allocates this rank's workspace there (IpcRank).
  JaxRank(int rank, int num_ranks, int device, uint64_t timeout_ns);
  ~JaxRank();
  JaxRank(const JaxRank&) = delete;
  JaxRank& operator=(const JaxRank&) = delete;

  int device() const { return device_; }
  bool alive() const { return static_cast<bool>(impl_); }
  IpcRank& ipc() const {
    if (!impl_) throw std::runtime_error("omniep: the cuda_nvshmem JAX rank state was used after destroy()");
    return *impl_;
  }
  // Waits for this process's work on the device, then frees the buffers (peers must have closed
  // their mappings: see jax_state.py). The object stays valid and reports "destroyed".
  void destroy();
  // Make the state's device current on the calling thread (XLA runs handlers on its own threads).
  void activate() const;
  void synchronize() const;
  int64_t handle() const { return group_.handle(); }  // the FFI `state` attribute

 private:
  int device_;
  std::unique_ptr<IpcRank> impl_;
  JaxGroup<IpcRank> group_;
};

// JaxLocalIpcGroup: every rank of a cuda_nvshmem JAX EP group, all in THIS process (single-controller
// jit(shard_map) over the local GPUs): rank i on devices[i], the peers' buffers reached through their
// device pointers with peer access enabled (IpcRank::link_*: the p2p transport in one process, no IPC
// handles). handle(), the accessors, set_blocks and synchronize are JaxLocalRanks' (ffi/jax_local_ranks.h),
// like JaxNcclState's.
class JaxLocalIpcGroup : public JaxLocalRanks<IpcRank> {
 public:
  JaxLocalIpcGroup(const std::vector<int>& devices, uint64_t timeout_ns);
  ~JaxLocalIpcGroup();

  // Waits for every device, then re-allocates every rank's data buffer with `bytes` and links them.
  void allocate_data(size_t bytes);
  void statuses(int i, Status* fatal, Status* pending) const;  // local rank i's; synchronises its device
  // Synchronise, free every rank's buffers; the object stays (stale executables get an FFI error).
  void destroy();

 private:
  std::vector<int> devices_;
  std::vector<std::unique_ptr<IpcRank>> owned_;  // the ranks, in EP rank order
};

}  // namespace omniep
