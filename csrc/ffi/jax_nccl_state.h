// JaxNcclState: the nccl_ep ranks of one JAX EP group that live in this process, for the XLA FFI
// handlers (ffi/jax_ops.h over NcclRank, exported as omniep_nccl_jax_*). Two process models:
//   * one process driving every local GPU (single-controller JAX, jit(shard_map) over the local
//     devices): rank i on devices[i], communicators from grouped init (NcclLocalGroup);
//   * one process per GPU (jax.distributed): this process's rank, its communicator made from a unique
//     id that Python exchanged through JAX's key-value store.
// Python (omniep/backends/nccl_ep/jax_backend.py) passes handle() (a JaxGroup<NcclRank> keyed by
// device ordinal) to every ffi_call as `state`. destroy() tears the ranks down (collectively) and
// retires the group; the object stays alive so a stale executable gets an FFI error. Host-only header.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/nccl_rank.h"
#include "ffi/jax_local_ranks.h"

namespace omniep {

extern template class JaxLocalRanks<NcclRank>;  // instantiated in ffi/jax_nccl_handlers.cpp

// handle(), the accessors, set_blocks and synchronize are JaxLocalRanks' (ffi/jax_local_ranks.h).
class JaxNcclState : public JaxLocalRanks<NcclRank> {
 public:
  JaxNcclState(const std::vector<int>& devices, uint64_t timeout_ns);
  JaxNcclState(int rank, int num_ranks, const std::string& unique_id, int device, uint64_t timeout_ns);
  ~JaxNcclState();

  // Collective over the group: waits for every local device, then re-allocates and registers every
  // local rank's data window with `bytes`.
  void allocate_data(size_t bytes);
  // Collective: synchronise, tear down devComms, windows and communicators; the object stays.
  void destroy();

 private:
  std::unique_ptr<NcclLocalGroup> local_;  // single-controller
  std::unique_ptr<NcclRank> single_;       // one process per GPU
};

}  // namespace omniep
