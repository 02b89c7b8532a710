// The nccl_ep JAX handlers (omniep_nccl_jax_*: ffi/jax_ops.h over NcclRank) and JaxNcclState, the
// state they run on (ffi/jax_nccl_state.h).
#include "ffi/jax_handlers.h"

#include "backends/nccl_rank.h"
#include "ffi/jax_local_ranks_impl.h"
#include "ffi/jax_nccl_state.h"
#include "ffi/jax_ops.h"

namespace omniep {

template class JaxLocalRanks<NcclRank>;

JaxNcclState::JaxNcclState(const std::vector<int>& devices, uint64_t timeout_ns) {
  local_ = std::make_unique<NcclLocalGroup>(devices, timeout_ns);
  for (int i = 0; i < local_->size(); ++i) {
    local_->rank(i).set_grow_in_ops(false);  // grown together by allocate_data (grouped NCCL calls)
    add_rank(local_->rank(i).device(), &local_->rank(i));
  }
}

JaxNcclState::JaxNcclState(int rank, int num_ranks, const std::string& unique_id, int device, uint64_t timeout_ns) {
  jax_ffi::check_runtime(cudaSetDevice(device), "selecting the rank's device");
  single_ = std::make_unique<NcclRank>(rank, num_ranks, unique_id, timeout_ns);
  single_->set_grow_in_ops(false);  // sized while tracing (allocate_data)
  add_rank(device, single_.get());
}

JaxNcclState::~JaxNcclState() { retire_group(); }  // members tear down the ranks

void JaxNcclState::allocate_data(size_t bytes) {
  prepare_reallocation("nccl_ep");
  if (local_) {
    local_->allocate_data(bytes);
  } else {
    single_->allocate_data(bytes);
  }
}

void JaxNcclState::destroy() {
  if (!retire_ranks()) return;
  local_.reset();
  single_.reset();
}

}  // namespace omniep

OMNIEP_JAX_HANDLERS(omniep_nccl_jax, omniep::NcclRank);
