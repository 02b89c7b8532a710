// The nccl_ep JAX handlers (omniep_nccl_jax_*: ffi/jax_ops.h over NcclRank) and JaxNcclState, the
// state they run on (ffi/jax_nccl_state.h).
#include "ffi/jax_handlers.h"

#include "backends/nccl_rank.h"
#include "ffi/jax_nccl_state.h"
#include "ffi/jax_ops.h"

namespace omniep {

JaxNcclState::JaxNcclState(const std::vector<int>& devices, uint64_t timeout_ns) {
  local_ = std::make_unique<NcclLocalGroup>(devices, timeout_ns);
  for (int i = 0; i < local_->size(); ++i) {
    ranks_.push_back(&local_->rank(i));
    group_.add(ranks_.back()->device(), ranks_.back());
  }
}

JaxNcclState::JaxNcclState(int rank, int num_ranks, const std::string& unique_id, int device, uint64_t timeout_ns) {
  jax_ffi::check_runtime(cudaSetDevice(device), "selecting the rank's device");
  single_ = std::make_unique<NcclRank>(rank, num_ranks, unique_id, timeout_ns);
  ranks_.push_back(single_.get());
  group_.add(device, single_.get());
}

JaxNcclState::~JaxNcclState() { group_.retire(); }  // members tear down the ranks

NcclRank& JaxNcclState::local_rank(int i) const {
  if (i < 0 || i >= local_size()) throw std::out_of_range("omniep: no local rank " + std::to_string(i));
  return *ranks_[i];
}

void JaxNcclState::set_blocks(int n) {
  for (NcclRank* r : ranks_) r->set_blocks(n);
}

void JaxNcclState::synchronize() const {
  for (NcclRank* r : ranks_) {
    jax_ffi::check_runtime(cudaSetDevice(r->device()), "selecting the rank's device");
    jax_ffi::check_runtime(cudaDeviceSynchronize(), "synchronising the device");
  }
}

void JaxNcclState::allocate_data(size_t bytes) {
  if (!alive()) throw std::runtime_error("omniep: the nccl_ep JAX state was used after destroy()");
  synchronize();  // executables already enqueued may still use the old windows
  if (local_) {
    local_->allocate_data(bytes);
  } else {
    single_->allocate_data(bytes);
  }
}

void JaxNcclState::destroy() {
  if (!alive()) return;
  group_.retire();  // an executable that still names this state gets an FFI error from now on
  synchronize();
  ranks_.clear();
  local_.reset();
  single_.reset();
}

}  // namespace omniep

OMNIEP_JAX_HANDLERS(omniep_nccl_jax, omniep::NcclRank);
