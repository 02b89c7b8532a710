// Launchers of the kernels for ONE rank per process (gridDim.y == 1), for any Transport whose
// rank() is a constant: shared by IpcRank (p2p over CUDA IPC) and NvshmemRank (nvshmem). Builds with
// nvcc and with hipcc: the runtime calls go through omniep/runtime.h (CUDA names, mapped to HIP there).
#pragma once

#include "omniep/runtime.h"

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "kernels/combine.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/layout.cuh"

namespace omniep {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

class OneRankLauncher {
 public:
  static constexpr int kMaxBlocks = 24;  // the SM budget for communication (issue 4)
  static constexpr size_t kMaxDynamicSmem = 48 * 1024;

  explicit OneRankLauncher(int device) {
    check_cuda(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device), "SM count");
    int coop = 0;
    check_cuda(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device), "cooperative attr");
    if (!coop) throw std::runtime_error("omniep: device does not support cooperative launches");
  }
  void set_blocks(int n) { blocks_ = n; cache_.clear(); }

  template <typename Tr>
  void layout(const LayoutArgs& a, const Tr& tr, cudaStream_t stream) {
    const size_t smem = sizeof(int) * static_cast<size_t>(a.num_experts);
    if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: at most 12288 experts");
    if (a.index_bytes == 8) {
      launch(layout_kernel<Tr, int64_t>, 1, kLayoutThreads, smem, stream, a, tr, "layout");
    } else if (a.index_bytes == 4) {
      launch(layout_kernel<Tr, int32_t>, 1, kLayoutThreads, smem, stream, a, tr, "layout");
    } else {
      throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
    }
  }

  template <typename Tr>
  void barrier(const Tr& tr, cudaStream_t stream) {
    launch(barrier_kernel<Tr>, 1, gpu::kWarpSize, 0, stream, 0, tr, "barrier");
  }

  template <typename Tr>
  void dispatch(const DispatchArgs& a, const Tr& tr, cudaStream_t stream) {
    if (a.row_bytes < 0 || a.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
    const size_t smem = a.with_routing ? sizeof(int) * static_cast<size_t>(a.num_experts) : 0;
    if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: too many experts for dispatch");
    auto kernel = dispatch_kernel<Tr>;
    launch(kernel, blocks_for(reinterpret_cast<const void*>(kernel), kDispatchThreads, smem), kDispatchThreads, smem,
           stream, a, tr, "dispatch");
  }

  // `vec`: every row of y (all ranks) and of out starts 16-byte aligned and H * elem % 16 == 0.
  template <typename Tr>
  void combine(const CombineArgs& a, const Tr& tr, bool vec, cudaStream_t stream) {
    if (a.hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
    if (a.num_bias < 0 || a.num_bias > 2) throw std::invalid_argument("omniep: num_bias must be 0, 1 or 2");
    auto pick = [&](auto k16, auto k1) {
      if (vec) {
        launch(k16, blocks_for(reinterpret_cast<const void*>(k16), kCombineThreads, 0), kCombineThreads, 0, stream,
               a, tr, "combine");
      } else {
        launch(k1, blocks_for(reinterpret_cast<const void*>(k1), kCombineThreads, 0), kCombineThreads, 0, stream,
               a, tr, "combine");
      }
    };
    switch (a.dtype) {
      case kFloat32: pick(combine_kernel<Tr, float, 4>, combine_kernel<Tr, float, 1>); break;
      case kBFloat16: pick(combine_kernel<Tr, gpu::bfloat16, 8>, combine_kernel<Tr, gpu::bfloat16, 1>); break;
      case kFloat16: pick(combine_kernel<Tr, gpu::float16, 8>, combine_kernel<Tr, gpu::float16, 1>); break;
      default: throw std::invalid_argument("omniep: combine dtype must be float32, bfloat16 or float16");
    }
  }

 private:
  // Cooperative: all blocks of the rank are co-resident or the launch fails, so the rank's own
  // blocks can wait on each other at a barrier without deadlock.
  template <typename Kernel, typename Args, typename Tr>
  static void launch(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream, const Args& args,
                     const Tr& tr, const char* what) {
    // CUDA: cudaLaunchKernelEx with the cooperative attribute; HIP: hipLaunchCooperativeKernel.
    check_cuda(gpu::launch_cooperative(kernel, dim3(blocks, 1), dim3(threads), smem, stream, args, tr), what);
  }

  int blocks_for(const void* kernel, int threads, size_t smem) {
    const auto key = std::make_tuple(kernel, smem);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    int per_sm = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "occupancy");
    const int resident = per_sm * num_sms_;
    if (resident < 1) throw std::runtime_error("omniep: kernel cannot be resident on this GPU");
    const int want = blocks_ > 0 ? blocks_ : kMaxBlocks;
    return cache_[key] = want < resident ? want : resident;
  }

  int num_sms_ = 0;
  int blocks_ = 0;
  std::map<std::tuple<const void*, size_t>, int> cache_;
};

}  // namespace omniep
