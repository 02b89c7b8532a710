// p2p transport: a table of peer pointers.
//
// Serves every setting where one thread can load/store a peer's memory directly:
//   * R virtual ranks on ONE GPU: every rank's buffers on the same device, one launch whose
//     blockIdx.y picks the rank (first_rank + blockIdx.y). Used to test multi-rank kernel logic.
//   * peers in one process over CUDA peer access, or across processes over CUDA IPC handles: the
//     table holds the mapped addresses, and a launch runs one rank (gridDim.y == 1).
// The table itself is a kernel argument (PerRank<T> arrays inside the op's argument struct), so it
// costs no device allocation and a captured CUDA graph replays with the same pointers.
#pragma once

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

struct P2PTransport {
  // Every peer is reached by loads/stores: no put path, so kernels compile their remote branches out
  // (`if constexpr (Tr::kHasRemote)`) and p2p code generation is what it was before that path existed.
  static constexpr bool kHasRemote = false;
  static constexpr bool kHasGets = false;

  int first_rank;   // rank of blockIdx.y == 0
  int group_size;   // R
  uint64_t wait_timeout_ns;
  PerRank<RankWorkspace> workspaces;

  OMNIEP_DEVICE int rank() const { return first_rank + static_cast<int>(blockIdx.y); }
  OMNIEP_DEVICE int num_ranks() const { return group_size; }
  OMNIEP_DEVICE uint64_t timeout_ns() const { return wait_timeout_ns; }

  template <typename T>
  OMNIEP_DEVICE T* local(const PerRank<T>& a) const { return a.p[rank()]; }
  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const { return a.p[r]; }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const { return workspaces.p[r]; }
  OMNIEP_DEVICE bool is_remote(int) const { return false; }
};

}  // namespace omniep
