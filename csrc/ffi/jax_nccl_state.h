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
#include "ffi/jax_group.h"

namespace omniep {

class JaxNcclState {
 public:
  JaxNcclState(const std::vector<int>& devices, uint64_t timeout_ns);
  JaxNcclState(int rank, int num_ranks, const std::string& unique_id, int device, uint64_t timeout_ns);
  ~JaxNcclState();
  JaxNcclState(const JaxNcclState&) = delete;
  JaxNcclState& operator=(const JaxNcclState&) = delete;

  int64_t handle() const { return group_.handle(); }  // the FFI `state` attribute
  bool alive() const { return !ranks_.empty(); }
  int local_size() const { return static_cast<int>(ranks_.size()); }
  NcclRank& local_rank(int i) const;  // the i-th rank of this process (EP rank order)
  size_t data_bytes() const { return alive() ? ranks_.front()->data_bytes() : 0; }
  void set_blocks(int n);
  // Collective over the group: waits for every local device, then re-allocates and registers every
  // local rank's data window with `bytes`.
  void allocate_data(size_t bytes);
  void synchronize() const;  // every local device
  // Collective: synchronise, tear down devComms, windows and communicators; the object stays.
  void destroy();

 private:
  std::vector<NcclRank*> ranks_;          // local ranks in EP rank order (owned below)
  std::unique_ptr<NcclLocalGroup> local_;  // single-controller
  std::unique_ptr<NcclRank> single_;       // one process per GPU
  JaxGroup<NcclRank> group_;
};

}  // namespace omniep
