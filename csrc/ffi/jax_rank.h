// JaxRank: ONE rank of a cuda_nvshmem JAX EP group (one process per GPU, CUDA IPC peers) for the XLA
// FFI handlers (ffi/jax_ops.h over IpcRank).
//
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

#include "backends/ipc_rank.h"
#include "ffi/jax_group.h"

namespace omniep {

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

}  // namespace omniep
