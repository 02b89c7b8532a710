// IpcRank: ONE rank of an EP group whose ranks are separate processes (one per GPU, or several
// sharing a GPU), over the p2p transport with peer pointers from CUDA IPC.
//
// Each rank owns two device allocations that its peers map:
//   * its RankWorkspace (signals, counts; allocated once, zeroed, never moved: the signal counters
//     must keep growing in step with the peers' for the life of the group);
//   * a symmetric DATA buffer (receive rows of dispatch, the rows of y that combine pulls), which
//     every rank sizes identically and may re-allocate (all ranks together) when a call needs more.
// Handles are exported as 64-byte strings; the caller all-gathers them (torch.distributed) and
// hands every rank's string back to open_*(). The kernels of csrc/kernels run unchanged: a launch
// is the rank-dimension slice [me, me + 1) of a virtual-rank launch (first_rank = me, gridDim.y = 1)
// with the table holding the IPC-mapped peer addresses.
//
// Argument structs: entries [me] of local (non-"sym") fields are this process's pointers; sym
// fields are filled by sym<T>(offset): entry r = rank r's data buffer (as mapped here) + offset,
// so a buffer at the same offset on every rank is reachable as a peer buffer.
//
// Host-only header (the pybind module includes it without CUDA headers). The same sources build for
// AMD with hipcc (omniep/runtime.h maps the CUDA runtime names to HIP: IPC handles from
// hipIpcGetMemHandle, xGMI peer mappings from hipIpcOpenMemHandle); see cmake/hip.cmake.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/one_rank_ops.h"
#include "kernels/args.h"

#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace omniep {

class OneRankLauncher;
struct P2PTransport;

// The ops (layout, dispatch, combine, the expert-major ones, barrier, copies, errors) are
// OneRankOps' (backends/one_rank_ops.h), shared with NvshmemRank and NcclRank.
class IpcRank : public OneRankOps<IpcRank> {
 public:
  // Allocates and zeroes this rank's workspace on the CURRENT device. No data buffer yet.
  IpcRank(int rank, int num_ranks, uint64_t timeout_ns);
  ~IpcRank();
  IpcRank(const IpcRank&) = delete;
  IpcRank& operator=(const IpcRank&) = delete;

  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  int device() const { return device_; }
  uint64_t timeout_ns() const { return timeout_ns_; }
  void set_timeout_ns(uint64_t ns) { timeout_ns_ = ns; }
  void set_blocks(int n);  // blocks of dispatch/combine; 0 = automatic (<= 24)

  // ---- bootstrap (collective: every rank calls these in the same order) ----
  std::string workspace_handle() const;  // cudaIpcMemHandle_t bytes of my workspace
  // handles[r] for every rank r (mine is ignored: I use my own pointer).
  void open_workspaces(const std::vector<std::string>& handles);
  // Drop my mappings of the peers' data buffers (before anyone frees theirs).
  void close_peer_data();
  // Drop my mappings of the peers' workspaces (teardown: before anyone frees theirs).
  void close_peer_workspaces();
  // Free my data buffer (if any) and allocate `bytes` (zeroed). Call close_peer_data() on every
  // rank, then a host barrier, then this, so no peer still maps the old buffer.
  void allocate_data(size_t bytes);
  std::string data_handle() const;
  void open_data(const std::vector<std::string>& handles);
  size_t data_bytes() const override { return data_bytes_; }
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(data_[rank_]); }
  // Collective, inside an op (OneRankOps::ensure_data): every rank re-allocates its data buffer and
  // the new IPC handles travel through the workspaces the ranks already map (device barriers between
  // the steps), so growing needs no host collective.
  void grow_data(size_t bytes, cudaStream_t stream);

  // ---- one process driving several GPUs: no IPC, the ranks' own device pointers ----
  // Every rank of `ranks` (rank i is ranks[i], all made in this process, each on its own device or
  // sharing one) reaches the others' workspaces (link_workspaces, once) or data buffers (link_data,
  // after every rank's allocate_data) through their device pointers, with peer access enabled between
  // the devices. Such a rank's close_peer_*() just drop the pointers (nothing was IPC-mapped).
  static void link_workspaces(const std::vector<IpcRank*>& ranks);
  static void link_data(const std::vector<IpcRank*>& ranks);

  // Entry r = rank r's data buffer + offset (as mapped in this process).
  template <typename T>
  PerRank<T> sym(int64_t offset) const {
    PerRank<T> out = {};
    for (int r = 0; r < num_ranks_; ++r) {
      out.p[r] = data_[r] ? reinterpret_cast<T*>(static_cast<char*>(data_[r]) + offset) : nullptr;
    }
    return out;
  }

 private:
  friend class OneRankOps<IpcRank>;
  OneRankLauncher& launcher() { return *launcher_; }
  P2PTransport transport() const;  // throws until every peer's workspace is open
  RankWorkspace* my_workspace() const { return workspaces_[rank_]; }
  template <typename F>
  void on_device(F&& f) const { f(); }  // the current device (the one the rank was made on)

  int rank_, num_ranks_;
  int device_ = 0;
  uint64_t timeout_ns_;
  std::unique_ptr<OneRankLauncher> launcher_;
  std::vector<RankWorkspace*> workspaces_;  // [R]: mine allocated here, peers' IPC-mapped (or linked)
  std::vector<void*> data_;                 // [R]: same
  size_t data_bytes_ = 0;
  bool linked_ = false;  // peers' pointers came from link_*() (same process), not from IPC handles
};

extern template class OneRankOps<IpcRank>;  // instantiated in ipc_rank.cu

}  // namespace omniep
