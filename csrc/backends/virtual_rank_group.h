// VirtualRankGroup: the p2p transport's state for the ranks ONE process runs on ONE device, and the
// launchers of every kernel for them.
//
// It owns one RankWorkspace per rank (device memory, zeroed at creation) and launches each op for
// a contiguous range of ranks as ONE cooperative launch: gridDim = (blocks per rank, ranks). A
// cooperative launch either makes every block co-resident or fails to launch, so ranks waiting on
// each other inside the kernel can never deadlock for want of SMs; the waits' timeouts catch the
// rest (a rank whose kernel never runs). Launching a strict subset of the ranks is allowed (tests
// use it to provoke a timeout).
//
// Host-only header: usable from plain C++ (the C ABI, the Python module).
#pragma once

#include <stdint.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/args.h"
#include "kernels/em_args.h"

typedef struct CUstream_st* cudaStream_t;

namespace omniep {

struct P2PTransport;

class VirtualRankGroup {
 public:
  // Allocates R workspaces on the current device. `timeout_ns` bounds every wait on a peer.
  VirtualRankGroup(int num_ranks, uint64_t timeout_ns);
  ~VirtualRankGroup();
  VirtualRankGroup(const VirtualRankGroup&) = delete;
  VirtualRankGroup& operator=(const VirtualRankGroup&) = delete;

  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  uint64_t timeout_ns() const { return timeout_ns_; }
  void set_timeout_ns(uint64_t ns) { timeout_ns_ = ns; }
  // Blocks per rank of dispatch/combine; 0 = automatic (<= 24, and all ranks co-resident).
  void set_blocks_per_rank(int n) {
    blocks_per_rank_ = n;
    blocks_cache_.clear();
  }

  // Each launches ranks [first_rank, first_rank + count) on `stream`. No host synchronisation.
  // Throw std::runtime_error (message says what and why) on bad arguments or a launch failure.
  void layout(const LayoutArgs& args, int first_rank, int count, cudaStream_t stream);
  void dispatch(const DispatchArgs& args, int first_rank, int count, cudaStream_t stream);
  void combine(const CombineArgs& args, int first_rank, int count, cudaStream_t stream);
  // Expert-major layout (kernels/em_*.cuh; launchers in virtual_rank_group_em.cu). em_layout runs
  // after layout() on the same stream. dispatch_bwd is em_combine with null weights and
  // with_topk_grad = 1.
  void em_layout(const EMLayoutArgs& args, int first_rank, int count, cudaStream_t stream);
  void em_dispatch(const EMDispatchArgs& args, int first_rank, int count, cudaStream_t stream);
  void em_combine(const EMCombineArgs& args, int first_rank, int count, cudaStream_t stream);
  void em_combine_bwd(const EMCombineBwdArgs& args, int first_rank, int count, cudaStream_t stream);

  // Synchronises the device and returns each rank's sticky status (omniep/status.h; code 0 = fine).
  std::vector<Status> read_errors() const;
  // Synchronises the device and zeroes every workspace (after an error, counters disagree).
  void reset();

 private:
  int blocks_for(const void* kernel, int threads, size_t smem, int count) const;
  P2PTransport transport(int first_rank) const;
  // Checks the rank range and the group shape, then launches `kernel` for ranks [first_rank,
  // first_rank + count) with `blocks` per rank (0: as many as blocks_for allows). Defined in
  // virtual_rank_launch.cuh, which both launcher files include.
  template <typename Kernel, typename Args>
  void launch(Kernel kernel, int blocks, int threads, size_t smem, const Args& args, int first_rank, int count,
              cudaStream_t stream, const char* what) const;

  int num_ranks_;
  int device_ = 0;
  int num_sms_ = 0;
  uint64_t timeout_ns_;
  int blocks_per_rank_ = 0;
  std::vector<RankWorkspace*> workspaces_;
  // (kernel, ranks launched, dynamic smem) -> blocks per rank, queried at the first launch of each key — which
  // may be inside a graph capture (the combine's key follows its token counts: combine_ring_smem); the query,
  // like the combine's shared-memory attribute, is not stream work, which a capture allows.
  mutable std::map<std::tuple<const void*, int, size_t>, int> blocks_cache_;
  std::map<const void*, size_t> combine_ring_;  // the combine's shared memory (launch_common.cuh combine_ring_smem)
};

}  // namespace omniep
