// JaxRank: the state of ONE rank of a JAX EP group (one process per GPU) for the XLA FFI handlers.
//
// Created once per (process, EP group) from Python (omniep/backends/cuda_nvshmem/jax_state.py), which
// bootstraps it (CUDA IPC handles all-gathered through JAX's distributed key-value store) and passes
// its address to every ffi_call as the integer attribute `state`. The handlers keep no state of their
// own: everything they need (the IpcRank with its peer table and symmetric data buffer) hangs off
// this object. destroy() frees the GPU buffers but leaves the object (kept alive by Python), so a
// compiled executable that still names it gets an FFI error instead of touching freed memory.
//
// Host-only header (no CUDA headers).
#pragma once

#include <stdint.h>

#include <memory>
#include <stdexcept>

#include "backends/ipc_rank.h"

namespace omniep {

class JaxRank {
 public:
  static constexpr uint64_t kMagic = 0x6f6d6e6965702d6aULL;  // "omniep-j"

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
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(this); }

  // The object behind an FFI `state` attribute, or nullptr when it is not a JaxRank.
  static JaxRank* from_handle(int64_t handle) {
    auto* p = reinterpret_cast<JaxRank*>(static_cast<uintptr_t>(handle));
    return (p != nullptr && p->magic_ == kMagic) ? p : nullptr;
  }

 private:
  uint64_t magic_ = kMagic;
  int device_;
  std::unique_ptr<IpcRank> impl_;
};

// Byte offsets of [capacity, row_bytes[i]] regions packed in the symmetric data buffer (256-byte
// aligned, the same rule as omniep/native/ipc_rank.py `regions`); returns the total.
inline int64_t pack_regions(int64_t capacity, const int64_t* row_bytes, int n, int64_t* offsets) {
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    offsets[i] = total;
    total += (capacity * row_bytes[i] + 255) / 256 * 256;
  }
  return total;
}

}  // namespace omniep
