// The cuda_nvshmem JAX handlers (omniep_jax_*: ffi/jax_ops.h over IpcRank) and JaxRank, the state
// they run on (ffi/jax_rank.h).
#include "ffi/jax_handlers.h"

#include "backends/ipc_rank.h"
#include "ffi/jax_ops.h"
#include "ffi/jax_rank.h"

namespace omniep {

JaxRank::JaxRank(int rank, int num_ranks, int device, uint64_t timeout_ns) : device_(device) {
  jax_ffi::check_runtime(cudaSetDevice(device), "selecting the rank's device");
  impl_ = std::make_unique<IpcRank>(rank, num_ranks, timeout_ns);
  group_.add(device, impl_.get());
}

JaxRank::~JaxRank() {
  group_.retire();
  if (impl_) {
    cudaSetDevice(device_);
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

}  // namespace omniep

OMNIEP_JAX_HANDLERS(omniep_jax, omniep::IpcRank);
