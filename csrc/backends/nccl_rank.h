// NcclRank: ONE rank of an EP group over the NCCL device API (transports/nccl_dev.cuh).
//
// Life cycle (NCCL's examples/06_device_api): communicator -> windows -> ncclDevComm -> kernels ->
// teardown. Two ways to make the communicators:
//   * one process per rank: rank 0 calls unique_id(), the caller exchanges the bytes (torch.distributed
//     or JAX's key-value store), every rank constructs NcclRank(rank, R, id, timeout) on its current device;
//   * one process driving several local GPUs: NcclLocalGroup(devices, timeout) makes one communicator
//     per device with grouped init (ncclGroupStart + ncclCommInitRank per device), and runs every
//     collective step (window registration, devComm creation, re-allocation, teardown) for all of
//     its ranks inside one NCCL group, as NCCL requires when one thread drives several ranks.
// The workspace and the data buffer come from ncclMemAlloc and are registered as symmetric windows;
// the kernels reach LSA peers through window pointers. Peers outside the LSA team (other nodes, or
// every peer with OMNIEP_FORCE_REMOTE=1 on every rank) are reached through GIN (remote_mask(): the
// devComm then asks for a GIN context and one signal per rank, and the data buffer gets its
// registered mirrors, R x its size); the expert-major ops are refused for such groups (GIN has no gets
// and no remote atomics). The GIN path has NOT run on a network: our GPU machines have no NICs.
// The ops are IpcRank's and NvshmemRank's (OneRankOps; python/rank_bindings.h binds all three). Host-only header.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/one_rank_ops.h"
#include "kernels/args.h"

typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;

namespace omniep {

class OneRankLauncher;
struct NcclDevCommBox;  // holds the ncclDevComm (nccl_device.h stays out of this header)
struct NcclDevTransport;

class NcclRank : public OneRankOps<NcclRank>, public SymmetricDataRank {
 public:
  static std::string unique_id();  // ncclGetUniqueId, as bytes
  static int runtime_version();    // ncclGetVersion of the loaded libnccl (e.g. 22809)
  // One process per rank: collective over the R processes; uses the current CUDA device.
  NcclRank(int rank, int num_ranks, const std::string& unique_id, uint64_t timeout_ns);
  // One process per rank over a communicator someone else made and keeps (an existing torch NCCL
  // process group: ProcessGroupNCCL's ncclComm_t, passed as an address). Collective over its ranks;
  // uses the current CUDA device, which must be the communicator's. The windows and devComm are ours
  // and go away with this object; the communicator is neither finalized nor destroyed.
  NcclRank(uintptr_t borrowed_comm, uint64_t timeout_ns);
  ~NcclRank();  // collective: devComm, windows, memory, communicator
  NcclRank(const NcclRank&) = delete;
  NcclRank& operator=(const NcclRank&) = delete;

  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  int device() const { return device_; }
  void set_blocks(int n);  // remote_mask(): the peers reached through GIN
  size_t data_bytes() const override { return data_bytes_; }
  // Collective (every rank, same bytes): deregister, free, allocate and register the data buffer (its
  // peers' entries: through the window).
  void allocate_data(size_t bytes);
  void grow_data(size_t bytes, cudaStream_t) { allocate_data(bytes); }  // inside an op (OneRankOps)

 private:
  friend class NcclLocalGroup;
  friend class OneRankOps<NcclRank>;
  OneRankLauncher& launcher() { return *launcher_; }
  NcclDevTransport transport() const;  // the kernels' view of this rank (transports/nccl_dev.cuh)
  RankWorkspace* my_workspace() const { return workspace_; }
  NcclRank(ncclComm_t comm, int device, uint64_t timeout_ns);  // comm made by the caller
  void adopt();                // rank, size, the peers outside the LSA team, the launcher
  // The collective steps, split so that NcclLocalGroup can run each for all its ranks in one group.
  void open_windows();         // one rank by itself: the three steps below (collective)
  void alloc_workspace();      // local: ncclMemAlloc + zero
  void register_workspace();   // collective
  void create_dev_comm();      // collective
  const char* dev_comm_what() const;  // its name in error messages (says GIN when GIN is asked for)
  void require_gin() const;    // after create_dev_comm (and its group): GIN peers got a GIN context
  void release_data();         // collective (deregister) + local free
  void alloc_data(size_t bytes);  // local
  void register_data();        // collective
  void teardown();             // collective; the rank is unusable afterwards
  template <typename F>
  void on_device(F&& f) const;  // f() with device_ current (one process may drive several ranks)

  ncclComm_t comm_ = nullptr;
  bool owns_comm_ = true;  // false: borrowed (a torch process group's), never destroyed here
  int num_ranks_ = 0, device_ = 0;
  RankWorkspace* workspace_ = nullptr;
  ncclWindow_t ws_window_ = nullptr;
  ncclWindow_t data_window_ = nullptr;
  void* mirrors_ = nullptr;  // with GIN peers: R x data_bytes_, registered
  ncclWindow_t mirror_window_ = nullptr;
  std::unique_ptr<NcclDevCommBox> dev_comm_;
  std::unique_ptr<OneRankLauncher> launcher_;
};

extern template class OneRankOps<NcclRank>;  // instantiated in nccl_rank.cu

// One process, several local GPUs: rank i runs on devices[i]. Owns its ranks; destroying it tears
// all of them down together.
class NcclLocalGroup {
 public:
  NcclLocalGroup(const std::vector<int>& devices, uint64_t timeout_ns);
  ~NcclLocalGroup();
  NcclLocalGroup(const NcclLocalGroup&) = delete;
  NcclLocalGroup& operator=(const NcclLocalGroup&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  NcclRank& rank(int i);
  void allocate_data(size_t bytes);  // every rank's data buffer, grouped

 private:
  std::vector<std::unique_ptr<NcclRank>> ranks_;
};

}  // namespace omniep
