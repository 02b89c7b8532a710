// Launchers of the kernels over the p2p transport for virtual ranks (see virtual_rank_group.h).
#include "backends/virtual_rank_group.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "backends/virtual_rank_launch.cuh"

namespace omniep {
namespace {

constexpr int kMaxBlocksPerRank = 24;  // the SM budget for communication (issue 4)

}  // namespace

VirtualRankGroup::VirtualRankGroup(int num_ranks, uint64_t timeout_ns)
    : num_ranks_(num_ranks), timeout_ns_(timeout_ns) {
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    throw std::invalid_argument("omniep: num_ranks=" + std::to_string(num_ranks) + " must be in [1, " +
                                std::to_string(kMaxRanks) + "] for the p2p transport");
  }
  gpu::check(cudaGetDevice(&device_), "cudaGetDevice");
  gpu::check(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "SM count");
  int coop = 0;
  gpu::check(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device_), "cooperative attr");
  if (!coop) throw std::runtime_error("omniep: device does not support cooperative launches");
  for (int r = 0; r < num_ranks; ++r) {
    RankWorkspace* ws = nullptr;
    cudaError_t err = cudaMalloc(&ws, sizeof(RankWorkspace));
    if (err == cudaSuccess) err = cudaMemset(ws, 0, sizeof(RankWorkspace));
    if (err != cudaSuccess) {
      if (ws) cudaFree(ws);
      for (RankWorkspace* w : workspaces_) cudaFree(w);
      workspaces_.clear();
      gpu::check(err, "allocating rank workspaces");
    }
    workspaces_.push_back(ws);
  }
  gpu::check(cudaDeviceSynchronize(), "zeroing rank workspaces");
}

VirtualRankGroup::~VirtualRankGroup() {
  cudaDeviceSynchronize();  // kernels may still use the workspaces
  for (RankWorkspace* ws : workspaces_) cudaFree(ws);
}

int VirtualRankGroup::blocks_for(const void* kernel, int threads, size_t smem, int count) const {
  const auto key = std::make_tuple(kernel, count, smem);
  if (auto it = blocks_cache_.find(key); it != blocks_cache_.end()) return it->second;
  int per_sm = 0;
  gpu::check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "occupancy");
  const int resident = per_sm * num_sms_ / count;  // all ranks' blocks must fit at once
  if (resident < 1) {
    throw std::runtime_error("omniep: " + std::to_string(count) +
                             " virtual ranks cannot all be resident on this GPU at once");
  }
  const int want = blocks_per_rank_ > 0 ? blocks_per_rank_ : kMaxBlocksPerRank;
  const int blocks = want < resident ? want : resident;
  blocks_cache_[key] = blocks;
  return blocks;
}

P2PTransport VirtualRankGroup::transport(int first_rank) const {
  P2PTransport tr = {};
  tr.first_rank = first_rank;
  tr.group_size = num_ranks_;
  tr.wait_timeout_ns = timeout_ns_;
  for (int r = 0; r < num_ranks_; ++r) tr.workspaces.p[r] = workspaces_[r];
  return tr;
}

void VirtualRankGroup::layout(const LayoutArgs& args, int first_rank, int count, cudaStream_t stream) {
  const size_t smem = checked_smem(args);
  launch(layout_kernel_for<P2PTransport>(args.index_bytes), 1, kLayoutThreads, smem, args, first_rank, count, stream,
         "layout");
}

void VirtualRankGroup::dispatch(const DispatchArgs& args, int first_rank, int count, cudaStream_t stream) {
  launch(dispatch_kernel<P2PTransport>, 0, kDispatchThreads, checked_smem(args), args, first_rank, count, stream,
         "dispatch");
}

void VirtualRankGroup::combine(const CombineArgs& args, int first_rank, int count, cudaStream_t stream) {
  checked_smem(args);
  const bool vec = vec16(args, first_rank, count, num_ranks_);
  const auto kernel = typed_kernel<CombineK, P2PTransport>(args.dtype, vec, "combine");
  const void* k = reinterpret_cast<const void*>(kernel);
  const size_t smem = combine_ring_smem(combine_ring_, k, vec, most_tokens(args, first_rank, count),
                                        [&](size_t s) { return blocks_for(k, kCombineThreads, s, count); });
  launch(kernel, 0, kCombineThreads, smem, args, first_rank, count, stream, "combine");
}

std::vector<Status> VirtualRankGroup::read_errors() const {
  gpu::check(cudaDeviceSynchronize(), "synchronising before reading the statuses");
  std::vector<Status> out(workspaces_.size());
  for (size_t r = 0; r < workspaces_.size(); ++r) {
    gpu::check(cudaMemcpy(&out[r], &workspaces_[r]->fatal, sizeof(Status), cudaMemcpyDeviceToHost),
               "reading the statuses");
  }
  return out;
}

void VirtualRankGroup::reset() {
  gpu::check(cudaDeviceSynchronize(), "synchronising before reset");
  for (RankWorkspace* ws : workspaces_) gpu::check(cudaMemset(ws, 0, sizeof(RankWorkspace)), "reset");
  gpu::check(cudaDeviceSynchronize(), "reset");
}

}  // namespace omniep
