// JaxLocalRanks<Rank>: what the JAX states holding EVERY rank of an EP group that lives in this
// process share (JaxLocalIpcGroup over IpcRank, ffi/jax_rank.h; JaxNcclState over NcclRank,
// ffi/jax_nccl_state.h), so that the Python side can treat them alike (omniep/backends/jax_native.py
// LocalJaxState): the ranks in EP order, the JaxGroup the FFI handlers find them through (handle()),
// and the accessors and group-wide operations that do not depend on how the ranks were made.
//
// The derived state makes and owns the ranks; it registers each with add_rank() (EP rank order), calls
// prepare_reallocation() before it re-allocates their data buffers, and starts its destroy() with
// retire_ranks() before it frees them. alive() is false from then on, and the object must stay
// alive itself, so that a compiled executable that still names the group gets an FFI error.
//
// Host-only header. synchronize() touches the CUDA runtime: it is defined in
// ffi/jax_local_ranks_impl.h, which the handler source of each backend includes to instantiate the
// class once (`template class JaxLocalRanks<Rank>;`); the derived state's header declares that
// instance extern.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/jax_group.h"

namespace omniep {

template <typename Rank>
class JaxLocalRanks {
 public:
  JaxLocalRanks(const JaxLocalRanks&) = delete;
  JaxLocalRanks& operator=(const JaxLocalRanks&) = delete;

  int64_t handle() const { return group_.handle(); }  // the FFI `state` attribute
  bool alive() const { return !ranks_.empty(); }
  int local_size() const { return static_cast<int>(ranks_.size()); }
  // The i-th rank of this process (EP rank order); std::out_of_range outside [0, local_size()).
  Rank& local_rank(int i) const {
    if (i < 0 || i >= local_size()) throw std::out_of_range("omniep: no local rank " + std::to_string(i));
    return *ranks_[i];
  }
  size_t data_bytes() const { return alive() ? ranks_.front()->data_bytes() : 0; }
  void set_blocks(int n) {
    for (Rank* r : ranks_) r->set_blocks(n);
  }
  // Waits for every local device; the last rank's device stays current on the calling thread.
  void synchronize() const;

 protected:
  JaxLocalRanks() = default;
  ~JaxLocalRanks() = default;

  // `rank` (owned by the derived state until it frees it after retire_ranks()) runs on `device`.
  void add_rank(int device, Rank* rank) {
    ranks_.push_back(rank);
    group_.add(device, rank);
  }
  // Throws unless alive(), then synchronises: executables already enqueued may still use the old
  // buffers. `backend` names the state in the error ("cuda_nvshmem", "nccl_ep").
  void prepare_reallocation(const char* backend) const {
    if (!alive()) throw std::runtime_error(std::string("omniep: the ") + backend + " JAX state was used after destroy()");
    synchronize();
  }
  // Retires the group (an executable that still names it gets an FFI error from now on), waits for
  // every device and forgets the ranks, which the caller then frees. False, and nothing done, when
  // they are gone already.
  bool retire_ranks() {
    if (!alive()) return false;
    group_.retire();
    synchronize();
    ranks_.clear();
    return true;
  }
  // Retires the group alone: a destructor whose members free the ranks next.
  void retire_group() { group_.retire(); }
  const std::vector<Rank*>& ranks() const { return ranks_; }

 private:
  std::vector<Rank*> ranks_;  // EP rank order; empty once destroyed
  JaxGroup<Rank> group_;
};

}  // namespace omniep
