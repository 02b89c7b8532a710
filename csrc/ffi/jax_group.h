// JaxGroup<G>: the ranks of one JAX EP group that live in THIS process, as the XLA FFI handlers
// (ffi/jax_ops.h) find them: by the device ordinal XLA runs the handler on.
//
//   * one process per GPU (cuda_nvshmem over CUDA IPC, nccl_ep from a unique id): one rank;
//   * one process driving every local GPU (cuda_nvshmem over JaxLocalIpcGroup's peer access, nccl_ep
//     over NcclLocalGroup): one rank per device, so the SAME compiled program (one `state` attribute
//     for every shard of a jit(shard_map)) reaches the rank of the device each shard runs on.
//
// Python passes handle() to every ffi_call as the integer attribute `state`. The group does not own
// its ranks: the object that does (JaxRank, JaxLocalIpcGroup, JaxNcclState) retires the group before
// freeing them, and stays alive itself, so a compiled executable that still names a retired group gets
// an FFI error instead of touching freed memory. Host-only header.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace omniep {

template <typename G>
class JaxGroup {
 public:
  JaxGroup() : magic_(magic()) {}
  ~JaxGroup() { magic_ = 0; }
  JaxGroup(const JaxGroup&) = delete;
  JaxGroup& operator=(const JaxGroup&) = delete;

  // `rank` serves the handlers that XLA runs on device `ordinal`; the caller keeps it alive until retire().
  void add(int ordinal, G* rank) {
    for (const auto& e : ranks_) {
      if (e.first == ordinal) throw std::invalid_argument("omniep: two ranks of one JAX group on device " + std::to_string(ordinal));
    }
    ranks_.emplace_back(ordinal, rank);
  }
  void retire() {
    ranks_.clear();
    retired_ = true;
  }
  bool alive() const { return !retired_; }
  int size() const { return static_cast<int>(ranks_.size()); }

  // The rank on device `ordinal`. A group with a single rank serves any ordinal: a process given one
  // device (jax.distributed.initialize(local_device_ids=[i])) may see it under another number than CUDA's.
  G& at(int ordinal) const {
    if (retired_) throw std::runtime_error("the JAX rank state was used after destroy()");
    for (const auto& e : ranks_) {
      if (e.first == ordinal) return *e.second;
    }
    if (ranks_.size() == 1) return *ranks_.front().second;
    throw std::invalid_argument("no rank of this EP group runs on device " + std::to_string(ordinal) +
                                " (the EP axis must span the devices the group was made for)");
  }

  int64_t handle() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(this)); }

  // The group behind an FFI `state` attribute, or nullptr when it is not a JaxGroup<G>.
  static const JaxGroup* from_handle(int64_t handle) {
    auto* p = reinterpret_cast<const JaxGroup*>(static_cast<uintptr_t>(handle));
    return (p != nullptr && p->magic_ == magic()) ? p : nullptr;
  }

 private:
  // Distinct per rank type, so a state of one backend passed to another's handlers is refused.
  static uint64_t magic() { return 0x6f6d6e6965702d6aULL ^ static_cast<uint64_t>(typeid(G).hash_code()); }

  uint64_t magic_;
  bool retired_ = false;
  std::vector<std::pair<int, G*>> ranks_;
};

}  // namespace omniep
