// Launchers of the kernels over the p2p transport for virtual ranks (see virtual_rank_group.h).
#include "backends/virtual_rank_group.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/combine.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/layout.cuh"
#include "transports/p2p.cuh"

namespace omniep {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

constexpr int kMaxBlocksPerRank = 24;  // the SM budget for communication (issue 4)
constexpr size_t kMaxDynamicSmem = 48 * 1024;

template <typename Kernel, typename Args>
void launch_cooperative(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                        const Args& args, const P2PTransport& tr, const char* what) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, args, tr), what);
}

}  // namespace

VirtualRankGroup::VirtualRankGroup(int num_ranks, uint64_t timeout_ns)
    : num_ranks_(num_ranks), timeout_ns_(timeout_ns) {
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    throw std::invalid_argument("omniep: num_ranks=" + std::to_string(num_ranks) + " must be in [1, " +
                                std::to_string(kMaxRanks) + "] for the p2p transport");
  }
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "SM count");
  int coop = 0;
  check_cuda(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device_), "cooperative attr");
  if (!coop) throw std::runtime_error("omniep: device does not support cooperative launches");
  for (int r = 0; r < num_ranks; ++r) {
    RankWorkspace* ws = nullptr;
    cudaError_t err = cudaMalloc(&ws, sizeof(RankWorkspace));
    if (err == cudaSuccess) err = cudaMemset(ws, 0, sizeof(RankWorkspace));
    if (err != cudaSuccess) {
      if (ws) cudaFree(ws);
      for (RankWorkspace* w : workspaces_) cudaFree(w);
      workspaces_.clear();
      check_cuda(err, "allocating rank workspaces");
    }
    workspaces_.push_back(ws);
  }
  check_cuda(cudaDeviceSynchronize(), "zeroing rank workspaces");
}

VirtualRankGroup::~VirtualRankGroup() {
  cudaDeviceSynchronize();  // kernels may still use the workspaces
  for (RankWorkspace* ws : workspaces_) cudaFree(ws);
}

void VirtualRankGroup::check_range(int first_rank, int count) const {
  if (first_rank < 0 || count < 1 || first_rank + count > num_ranks_) {
    throw std::invalid_argument("omniep: rank range [" + std::to_string(first_rank) + ", " +
                                std::to_string(first_rank + count) + ") is not inside the group of " +
                                std::to_string(num_ranks_) + " ranks");
  }
}

void VirtualRankGroup::check_group_shape(int num_experts, int capacity) const {
  if (num_experts < num_ranks_ || num_experts % num_ranks_ != 0 || num_experts / num_ranks_ > kMaxLocalExperts) {
    throw std::invalid_argument("omniep: num_experts=" + std::to_string(num_experts) + " must be a positive multiple of " +
                                std::to_string(num_ranks_) + " ranks with at most " +
                                std::to_string(kMaxLocalExperts) + " experts per rank");
  }
  if (capacity < 0) throw std::invalid_argument("omniep: capacity must be >= 0");
}

int VirtualRankGroup::blocks_for(const void* kernel, int threads, size_t smem, int count) const {
  const auto key = std::make_tuple(kernel, count, smem);
  if (auto it = blocks_cache_.find(key); it != blocks_cache_.end()) return it->second;
  int per_sm = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "occupancy");
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

static P2PTransport make_transport(const std::vector<RankWorkspace*>& ws, int first_rank, uint64_t timeout) {
  P2PTransport tr = {};
  tr.first_rank = first_rank;
  tr.group_size = static_cast<int>(ws.size());
  tr.wait_timeout_ns = timeout;
  for (size_t r = 0; r < ws.size(); ++r) tr.workspaces.p[r] = ws[r];
  return tr;
}

void VirtualRankGroup::layout(const LayoutArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  const size_t smem = sizeof(int) * static_cast<size_t>(args.num_experts);
  if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: at most 12288 experts");
  const P2PTransport tr = make_transport(workspaces_, first_rank, timeout_ns_);
  const dim3 grid(1, count);
  if (args.index_bytes == 8) {
    launch_cooperative(layout_kernel<P2PTransport, int64_t>, grid, kLayoutThreads, smem, stream, args, tr, "layout");
  } else if (args.index_bytes == 4) {
    launch_cooperative(layout_kernel<P2PTransport, int32_t>, grid, kLayoutThreads, smem, stream, args, tr, "layout");
  } else {
    throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
  }
}

void VirtualRankGroup::dispatch(const DispatchArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.row_bytes < 0 || args.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
  const size_t smem = args.with_routing ? sizeof(int) * static_cast<size_t>(args.num_experts) : 0;
  if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: too many experts for dispatch");
  auto kernel = dispatch_kernel<P2PTransport>;
  const int blocks = blocks_for(reinterpret_cast<const void*>(kernel), kDispatchThreads, smem, count);
  launch_cooperative(kernel, dim3(blocks, count), kDispatchThreads, smem, stream, args,
                     make_transport(workspaces_, first_rank, timeout_ns_), "dispatch");
}

void VirtualRankGroup::combine(const CombineArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
  const P2PTransport tr = make_transport(workspaces_, first_rank, timeout_ns_);
  // 16-byte packs when every row start of y and out is 16-byte aligned; 1 element otherwise.
  const int elem = dtype_size(args.dtype);
  bool vec = (static_cast<int64_t>(args.hidden) * elem) % 16 == 0;
  for (int r = first_rank; vec && r < first_rank + count; ++r) {
    vec = reinterpret_cast<uintptr_t>(args.out.p[r]) % 16 == 0;
  }
  for (int r = 0; vec && r < num_ranks_; ++r) vec = reinterpret_cast<uintptr_t>(args.y.p[r]) % 16 == 0;

  const void* kernel = nullptr;
  auto pick = [&](auto k16, auto k1) {
    kernel = vec ? reinterpret_cast<const void*>(k16) : reinterpret_cast<const void*>(k1);
    const int blocks = blocks_for(kernel, kCombineThreads, 0, count);
    if (vec) {
      launch_cooperative(k16, dim3(blocks, count), kCombineThreads, 0, stream, args, tr, "combine");
    } else {
      launch_cooperative(k1, dim3(blocks, count), kCombineThreads, 0, stream, args, tr, "combine");
    }
  };
  switch (args.dtype) {
    case kFloat32: pick(combine_kernel<P2PTransport, float, 4>, combine_kernel<P2PTransport, float, 1>); break;
    case kBFloat16:
      pick(combine_kernel<P2PTransport, gpu::bfloat16, 8>, combine_kernel<P2PTransport, gpu::bfloat16, 1>);
      break;
    case kFloat16:
      pick(combine_kernel<P2PTransport, gpu::float16, 8>, combine_kernel<P2PTransport, gpu::float16, 1>);
      break;
    default: throw std::invalid_argument("omniep: combine dtype must be float32, bfloat16 or float16");
  }
}

std::vector<ErrorRecord> VirtualRankGroup::read_errors() const {
  check_cuda(cudaDeviceSynchronize(), "synchronising before reading error records");
  std::vector<ErrorRecord> out(workspaces_.size());
  for (size_t r = 0; r < workspaces_.size(); ++r) {
    check_cuda(cudaMemcpy(&out[r], &workspaces_[r]->error, sizeof(ErrorRecord), cudaMemcpyDeviceToHost),
               "reading error records");
  }
  return out;
}

void VirtualRankGroup::reset() {
  check_cuda(cudaDeviceSynchronize(), "synchronising before reset");
  for (RankWorkspace* ws : workspaces_) check_cuda(cudaMemset(ws, 0, sizeof(RankWorkspace)), "reset");
  check_cuda(cudaDeviceSynchronize(), "reset");
}

}  // namespace omniep
