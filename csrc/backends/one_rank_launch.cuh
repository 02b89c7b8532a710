// Launchers of the kernels for ONE rank per process (gridDim.y == 1), for any Transport whose rank() is
// a constant, and the definitions of OneRankOps (backends/one_rank_ops.h) over them: shared by IpcRank
// (p2p over CUDA IPC), NvshmemRank (nvshmem) and NcclRank (nccl_dev). Argument checks and the choice of
// kernel instances are backends/launch_common.cuh's, shared with the virtual-rank launchers. Builds
// with nvcc and with hipcc: the runtime calls go through omniep/runtime.h (CUDA names, mapped to HIP).
#pragma once

#include "omniep/runtime.h"

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "backends/launch_common.cuh"
#include "backends/one_rank_ops.h"
#include "kernels/copy_rows.cuh"

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

  // Rank `rank` of `num_ranks`, launching on `device`.
  OneRankLauncher(int device, int rank, int num_ranks) : rank_(rank), num_ranks_(num_ranks) {
    check_cuda(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device), "SM count");
    int coop = 0;
    check_cuda(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device), "cooperative attr");
    if (!coop) throw std::runtime_error("omniep: device does not support cooperative launches");
  }
  void set_blocks(int n) { blocks_ = n; cache_.clear(); }

  template <typename Tr>
  void layout(const LayoutArgs& a, const Tr& tr, cudaStream_t stream) {
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    // Many tokens: over the communication blocks, which split them (one block took ~41 µs for DeepEP's
    // 4096 x top-8, benchmarks/RESULTS.md 2026-11-27); few: one block (kRouteMinTokens).
    const auto kernel = layout_kernel_for<Tr>(a.index_bytes);
    const size_t smem = checked_smem(a);
    int blocks = 1;
    if (a.num_tokens[rank_] > kRouteMinTokens) {
      blocks = blocks_for(reinterpret_cast<const void*>(kernel), kLayoutThreads, smem, false);
      blocks = blocks < kMaxRouteBlocks ? blocks : kMaxRouteBlocks;
    }
    launch(kernel, blocks, kLayoutThreads, smem, stream, a, tr, "layout");
  }

  template <typename Tr>
  void barrier(const BarrierArgs& a, const Tr& tr, cudaStream_t stream) {
    launch(barrier_kernel<Tr>, 1, gpu::kWarpSize, 0, stream, a, tr, "barrier");
  }

  template <typename Tr>
  void dispatch(DispatchArgs a, const Tr& tr, cudaStream_t stream) {
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    const size_t smem = checked_smem(a);
    set_copy_units(a, rank_, 1, num_ranks_);
    launch_wide(dispatch_kernel<Tr>, kDispatchThreads, smem, stream, a, tr, "dispatch");
  }

  template <typename Tr>
  void combine(const CombineArgs& a, const Tr& tr, cudaStream_t stream) {
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    checked_smem(a);
    const bool vec = vec16(a, rank_, 1, num_ranks_);
    const auto kernel = typed_kernel<CombineK, Tr>(a.dtype, vec, "combine");
    const void* k = reinterpret_cast<const void*>(kernel);
    const size_t smem = combine_ring_smem(ring_, k, vec, most_tokens(a, rank_, 1),
                                          [&](size_t s) { return blocks_for(k, kCombineThreads, s, false); });
    launch_wide(kernel, kCombineThreads, smem, stream, a, tr, "combine");
  }

  // Local rows, not communication: every SM may take part (no SM budget), a plain launch.
  void copy_rows_except(const CopyRowsArgs& a, cudaStream_t stream) {
    if (a.rows <= 0 || a.row_bytes <= 0) return;
    const int warps = kCopyRowsThreads / gpu::kWarpSize;
    const int64_t want = (a.rows + warps - 1) / warps;
    const int blocks = static_cast<int>(want < 4 * num_sms_ ? want : 4 * num_sms_);
    copy_rows_except_kernel<><<<blocks, kCopyRowsThreads, 0, stream>>>(a);
    check_cuda(cudaGetLastError(), "copy_rows_except");
  }

  // After the host zeroed the workspace: the transport's own signal counters too (GIN's).
  template <typename Tr>
  void reset_remote_signals(const Tr& tr) {
    if constexpr (Tr::kHasRemote) {
      if (tr.any_remote()) {
        reset_remote_signals_kernel<<<1, 1>>>(tr);
        check_cuda(cudaGetLastError(), "resetting the remote signals");
        check_cuda(cudaDeviceSynchronize(), "resetting the remote signals");
      }
    }
  }

  template <typename Tr>
  void em_layout(const EMLayoutArgs& a, const Tr& tr, cudaStream_t stream) {
    require_gets(tr, "expert-major prepare");
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    launch(em_layout_kernel<Tr>, 1, kLayoutThreads, checked_smem(a), stream, a, tr, "expert-major layout");
  }

  template <typename Tr>
  void em_dispatch(EMDispatchArgs a, const Tr& tr, cudaStream_t stream) {
    require_gets(tr, "expert-major dispatch");
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    set_copy_units(a, rank_, 1, num_ranks_);
    const auto kernel = em_dispatch_kernel_for<Tr>(a);
    const size_t smem = em_dispatch_smem(ring_, reinterpret_cast<const void*>(kernel), a, rank_, checked_smem(a));
    launch_wide(kernel, kEMDispatchThreads, smem, stream, a, tr, "expert-major dispatch", /*whole_gpu=*/true);
  }

  template <typename Tr>
  void em_combine(const EMCombineArgs& a, const Tr& tr, cudaStream_t stream) {
    require_gets(tr, "expert-major combine");
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    checked_smem(a);
    const char* what = "expert-major combine";
    const bool vec = vec16(a, rank_, 1, num_ranks_);
    const auto kernel = typed_kernel<EMCombineK, Tr>(a.dtype, vec, what);
    const size_t smem = em_sum_smem(ring_, reinterpret_cast<const void*>(kernel), vec, a.back.p[rank_] != nullptr);
    launch_wide(kernel, kEMCombineThreads, smem, stream, a, tr, what, /*whole_gpu=*/true);
  }

  template <typename Tr>
  void em_combine_bwd(const EMCombineBwdArgs& a, const Tr& tr, cudaStream_t stream) {
    require_gets(tr, "expert-major combine_bwd");
    check_group_shape(a.num_experts, a.capacity, num_ranks_);
    const size_t smem = checked_smem(a);
    const char* what = "expert-major combine_bwd";
    launch_wide(typed_kernel<EMCombineBwdK, Tr>(a.dtype, vec16(a, rank_, 1, num_ranks_), what), kEMDispatchThreads,
                smem, stream, a, tr, what, /*whole_gpu=*/true);
  }

 private:
  // The expert-major kernels reach remote peers with one-sided gets (kHasGets); a
  // transport without them (nccl_dev's GIN) cannot run them for a group with remote peers.
  template <typename Tr>
  static void require_gets(const Tr& tr, const char* what) {
    if constexpr (Tr::kHasRemote && !Tr::kHasGets) {
      if (tr.any_remote()) {
        throw std::runtime_error(std::string("omniep: ") + what + " with peers outside the load/store domain "
                                 "needs one-sided gets, which GIN does not have; use the "
                                 "rank-major layout (dispatch / combine) for this group");
      }
    }
  }

  // Cooperative: all blocks of the rank are co-resident or the launch fails, so the rank's own
  // blocks can wait on each other at a barrier without deadlock.
  template <typename Kernel, typename Args, typename Tr>
  static void launch(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream, const Args& args,
                     const Tr& tr, const char* what) {
    // CUDA: cudaLaunchKernelEx with the cooperative attribute; HIP: hipLaunchCooperativeKernel.
    check_cuda(gpu::launch_cooperative(kernel, dim3(blocks, 1), dim3(threads), smem, stream, args, tr), what);
  }

  // As many blocks as the budget allows (set_blocks, else kMaxBlocks — or, `whole_gpu`, one per SM:
  // the expert-major ("low-latency") kernels, which like DeepEP's take the GPU for their few µs and
  // are latency-bound, not bandwidth-bound) and the GPU keeps resident.
  template <typename Kernel, typename Args, typename Tr>
  void launch_wide(Kernel kernel, int threads, size_t smem, cudaStream_t stream, const Args& args, const Tr& tr,
                   const char* what, bool whole_gpu = false) {
    launch(kernel, blocks_for(reinterpret_cast<const void*>(kernel), threads, smem, whole_gpu), threads, smem,
           stream, args, tr, what);
  }

  int blocks_for(const void* kernel, int threads, size_t smem, bool whole_gpu) {
    const auto key = std::make_tuple(kernel, smem);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    int per_sm = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "occupancy");
    const int resident = per_sm * num_sms_;
    if (resident < 1) throw std::runtime_error("omniep: kernel cannot be resident on this GPU");
    const int want = blocks_ > 0 ? blocks_ : whole_gpu ? num_sms_ : kMaxBlocks;
    return cache_[key] = want < resident ? want : resident;
  }

  int rank_, num_ranks_;
  int num_sms_ = 0;
  int blocks_ = 0;
  std::map<std::tuple<const void*, size_t>, int> cache_;
  std::map<const void*, size_t> ring_;  // the shared memory granted per kernel (combine_ring_smem, em_sum_smem)
};

// ---- OneRankOps (backends/one_rank_ops.h) ----

template <typename Rank>
template <typename F>
void OneRankOps<Rank>::run(F&& launch) {
  Rank& r = self();
  r.on_device([&] { launch(r.launcher(), r.transport()); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_layout(const LayoutArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.layout(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.dispatch(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_combine(const CombineArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.combine(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_em_layout(const EMLayoutArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.em_layout(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_em_dispatch(const EMDispatchArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.em_dispatch(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_em_combine(const EMCombineArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.em_combine(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_em_combine_bwd(const EMCombineBwdArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.em_combine_bwd(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::launch_barrier(const BarrierArgs& args, cudaStream_t stream) {
  run([&](OneRankLauncher& l, const auto& tr) { l.barrier(args, tr, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::copy2d(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width,
                              size_t height, cudaStream_t stream, const char* what) const {
  self().on_device([&] {
    check_cuda(cudaMemcpy2DAsync(reinterpret_cast<void*>(dst), dst_pitch, reinterpret_cast<const void*>(src),
                                 src_pitch, width, height, cudaMemcpyDeviceToDevice, stream),
               what);
  });
}

template <typename Rank>
void OneRankOps<Rank>::memcpy(uintptr_t dst, uintptr_t src, size_t bytes, cudaStream_t stream) const {
  self().on_device([&] {
    check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                               cudaMemcpyDeviceToDevice, stream),
               "copying rows to / from the data buffer");
  });
}

template <typename Rank>
void OneRankOps<Rank>::memcpy2d(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width,
                                size_t height, cudaStream_t stream) const {
  copy2d(dst, dst_pitch, src, src_pitch, width, height, stream, "copying rows to / from the data buffer");
}

template <typename Rank>
void OneRankOps<Rank>::copy_rows_except(uintptr_t dst, uintptr_t src, int64_t row_bytes, int64_t rows,
                                        uintptr_t skip_begin, uintptr_t skip_count, cudaStream_t stream) {
  CopyRowsArgs a;
  a.dst = reinterpret_cast<uint8_t*>(dst);
  a.src = reinterpret_cast<const uint8_t*>(src);
  a.skip_begin = reinterpret_cast<const int32_t*>(skip_begin);
  a.skip_count = reinterpret_cast<const int32_t*>(skip_count);
  if ((a.skip_begin == nullptr) != (a.skip_count == nullptr)) {
    throw std::invalid_argument("omniep: copy_rows_except needs both skip_begin and skip_count, or neither");
  }
  a.row_bytes = row_bytes;
  a.rows = rows;
  const uintptr_t addrs[2] = {dst, src};
  a.unit = row_copy_unit(row_bytes, addrs, 2);
  Rank& r = self();
  r.on_device([&] { r.launcher().copy_rows_except(a, stream); });
}

template <typename Rank>
void OneRankOps<Rank>::reset() {
  self().on_device([&] {
    check_cuda(cudaDeviceSynchronize(), "synchronising before reset");
    check_cuda(cudaMemset(self().my_workspace(), 0, sizeof(RankWorkspace)), "reset");
    check_cuda(cudaDeviceSynchronize(), "reset");
  });
  run([&](OneRankLauncher& l, const auto& tr) { l.reset_remote_signals(tr); });
}

}  // namespace omniep
