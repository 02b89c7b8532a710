// NvshmemRank: ONE rank (PE) of an EP group over NVSHMEM, one process per rank.
//
// Bootstrap by unique id: rank 0 calls unique_id(), the caller broadcasts the bytes (torch.distributed),
// every rank constructs NvshmemRank(rank, R, id). The workspace and the data buffer come from
// nvshmem_malloc (collective, same size on every PE), so a buffer at the same offset is symmetric;
// the kernels reach a peer through nvshmem_ptr (loads/stores: NVLink / same GPU) or, where it has no
// pointer or OMNIEP_FORCE_REMOTE=1 (set on EVERY rank) says to, through puts, gets and signals (the
// remote path of transports/nvshmem.cuh; remote_mask() says which). With some remote peer two more
// symmetric areas are allocated, collectively: the mirrors of the data buffer (R x its size, grown
// with it: where the rank-major kernels stage rows for remote peers and receive rows back), and the
// expert-major kernels' per-warp staging scratch.
// The ops are IpcRank's and NcclRank's (OneRankOps; python/rank_bindings.h binds all three). Host-only header.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>

#include "backends/one_rank_ops.h"
#include "kernels/args.h"

namespace omniep {

class OneRankLauncher;
struct NvshmemTransport;

// The ops are OneRankOps' (backends/one_rank_ops.h), shared with IpcRank and NcclRank.
class NvshmemRank : public OneRankOps<NvshmemRank>, public SymmetricDataRank {
 public:
  static std::string unique_id();  // nvshmemx_get_uniqueid, as bytes
  NvshmemRank(int rank, int num_ranks, const std::string& unique_id, uint64_t timeout_ns);
  ~NvshmemRank();  // nvshmem_free + nvshmem_finalize (collective)
  NvshmemRank(const NvshmemRank&) = delete;
  NvshmemRank& operator=(const NvshmemRank&) = delete;

  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  void set_blocks(int n);
  size_t data_bytes() const override { return data_bytes_; }
  // Collective (every PE, same bytes): free and re-allocate the symmetric data buffer (its peers'
  // entries: nvshmem_ptr).
  void allocate_data(size_t bytes);
  void grow_data(size_t bytes, cudaStream_t) { allocate_data(bytes); }  // inside an op (OneRankOps)

 private:
  friend class OneRankOps<NvshmemRank>;
  OneRankLauncher& launcher() { return *launcher_; }
  NvshmemTransport transport() const;  // the kernels' view of this rank (transports/nvshmem.cuh)
  RankWorkspace* my_workspace() const { return workspace_; }
  template <typename F>
  void on_device(F&& f) const { f(); }  // the current device (the one the PE was made on)

  int num_ranks_;
  RankWorkspace* workspace_ = nullptr;
  uint8_t* scratch_ = nullptr;  // symmetric, only with remote peers: expert-major per-warp staging
  uint8_t* mirrors_ = nullptr;  // symmetric, only with remote peers: R x data_bytes_
  int64_t scratch_bytes_ = 0;
  std::unique_ptr<OneRankLauncher> launcher_;
};

extern template class OneRankOps<NvshmemRank>;  // instantiated in nvshmem_rank.cu

}  // namespace omniep
