// The cuda_nvshmem JAX handlers (omniep_jax_*: ffi/jax_ops.h over IpcRank) and JaxRank, the state
// they run on (ffi/jax_rank.h).
#include "ffi/jax_handlers.h"

#include "backends/ipc_rank.h"
#include "ffi/jax_local_ranks_impl.h"
#include "ffi/jax_ops.h"
#include "ffi/jax_rank.h"

namespace omniep {

JaxRank::JaxRank(int rank, int num_ranks, int device, uint64_t timeout_ns) : device_(device) {
  jax_ffi::check_runtime(cudaSetDevice(device), "selecting the rank's device");
  impl_ = std::make_unique<IpcRank>(rank, num_ranks, timeout_ns);
  impl_->set_grow_in_ops(false);  // sized while tracing (jax_state.py), through JAX's key-value store
  group_.add(device, impl_.get());
}

JaxRank::~JaxRank() {
  group_.retire();
  if (impl_) {
    (void)cudaSetDevice(device_);  // a destructor: nothing to do about a failure here
    impl_.reset();
  }
}

void JaxRank::activate() const { jax_ffi::check_runtime(cudaSetDevice(device_), "selecting the rank's device"); }

void JaxRank::synchronize() const {
  activate();
  jax_ffi::check_runtime(cudaDeviceSynchronize(), "synchronising the device");
}

void JaxRank::destroy() {
  if (!impl_) return;
  group_.retire();  // an executable that still names this state gets an FFI error from now on
  activate();
  impl_.reset();  // ~IpcRank: synchronise, unmap peers, free my buffers
}

template class JaxLocalRanks<IpcRank>;

JaxLocalIpcGroup::JaxLocalIpcGroup(const std::vector<int>& devices, uint64_t timeout_ns) : devices_(devices) {
  const int R = static_cast<int>(devices.size());
  int prev = 0;
  jax_ffi::check_runtime(cudaGetDevice(&prev), "cudaGetDevice");
  for (int r = 0; r < R; ++r) {
    jax_ffi::check_runtime(cudaSetDevice(devices[r]), "selecting the rank's device");
    owned_.push_back(std::make_unique<IpcRank>(r, R, timeout_ns));
    owned_.back()->set_grow_in_ops(false);  // grown by allocate_data (linked peers)
  }
  for (int r = 0; r < R; ++r) add_rank(devices[r], owned_[r].get());
  IpcRank::link_workspaces(ranks());
  jax_ffi::check_runtime(cudaSetDevice(prev), "cudaSetDevice");
}

JaxLocalIpcGroup::~JaxLocalIpcGroup() { destroy(); }

void JaxLocalIpcGroup::allocate_data(size_t bytes) {
  prepare_reallocation("cuda_nvshmem");
  for (IpcRank* r : ranks()) r->close_peer_data();
  for (IpcRank* r : ranks()) {
    jax_ffi::check_runtime(cudaSetDevice(r->device()), "selecting the rank's device");
    r->allocate_data(bytes);
  }
  IpcRank::link_data(ranks());
}

void JaxLocalIpcGroup::statuses(int i, Status* fatal, Status* pending) const {
  IpcRank& r = local_rank(i);
  jax_ffi::check_runtime(cudaSetDevice(r.device()), "selecting the rank's device");
  r.statuses(fatal, pending, /*clear_pending=*/false);
}

void JaxLocalIpcGroup::destroy() {
  if (!retire_ranks()) return;
  for (auto& r : owned_) {
    r->close_peer_data();
    r->close_peer_workspaces();
  }
  for (auto& r : owned_) {  // ~IpcRank frees on the current device: make it the rank's
    (void)cudaSetDevice(r->device());
    r.reset();
  }
  owned_.clear();
}

}  // namespace omniep

OMNIEP_JAX_HANDLERS(omniep_jax, omniep::IpcRank);
