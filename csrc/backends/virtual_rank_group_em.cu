// Launchers of the expert-major kernels over the p2p transport for virtual ranks (see
// virtual_rank_group.h). Kept apart from virtual_rank_group.cu so each layout's launchers stay
// short; the few launch helpers below mirror that file's (an anonymous namespace per file).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "backends/virtual_rank_group.h"
#include "kernels/em_combine.cuh"
#include "kernels/em_dispatch.cuh"
#include "kernels/em_layout.cuh"
#include "transports/p2p.cuh"

namespace omniep {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

constexpr size_t kMaxDynamicSmem = 48 * 1024;

// Cooperative: every block of every launched rank co-resident, or no launch at all (ranks wait on
// each other inside the kernel).
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

P2PTransport make_transport(const std::vector<RankWorkspace*>& ws, int first_rank, uint64_t timeout) {
  P2PTransport tr = {};
  tr.first_rank = first_rank;
  tr.group_size = static_cast<int>(ws.size());
  tr.wait_timeout_ns = timeout;
  for (size_t r = 0; r < ws.size(); ++r) tr.workspaces.p[r] = ws[r];
  return tr;
}

// 16-byte packs need whole 16-byte rows and 16-byte aligned row starts in every buffer they touch.
bool rows16(int hidden, int dtype) { return (static_cast<int64_t>(hidden) * dtype_size(dtype)) % 16 == 0; }

template <typename T>
bool all_aligned16(const PerRank<T>& table, int first, int count) {
  for (int r = first; r < first + count; ++r) {
    if (reinterpret_cast<uintptr_t>(table.p[r]) % 16 != 0) return false;
  }
  return true;
}

// Picks the kernel instance for `dtype` and the vector width, launches it cooperatively.
template <template <typename, typename, int> class Kernel, typename Args>
void launch_typed(const Args& args, int dtype, bool vec, int count, int threads, const P2PTransport& tr,
                  cudaStream_t stream, const char* what,
                  int (*blocks_for)(const void*, int, const void* self), const void* self) {
  auto go = [&](auto k16, auto k1) {
    const void* kernel = vec ? reinterpret_cast<const void*>(k16) : reinterpret_cast<const void*>(k1);
    const int blocks = blocks_for(kernel, count, self);
    if (vec) {
      launch_cooperative(k16, dim3(blocks, count), threads, 0, stream, args, tr, what);
    } else {
      launch_cooperative(k1, dim3(blocks, count), threads, 0, stream, args, tr, what);
    }
  };
  switch (dtype) {
    case kFloat32: go(Kernel<P2PTransport, float, 4>::fn, Kernel<P2PTransport, float, 1>::fn); break;
    case kBFloat16: go(Kernel<P2PTransport, gpu::bfloat16, 8>::fn, Kernel<P2PTransport, gpu::bfloat16, 1>::fn); break;
    case kFloat16: go(Kernel<P2PTransport, gpu::float16, 8>::fn, Kernel<P2PTransport, gpu::float16, 1>::fn); break;
    default: throw std::invalid_argument(std::string("omniep: ") + what + " dtype must be float32, bfloat16 or float16");
  }
}

// Kernel templates as class templates, so launch_typed can take them as template template arguments.
template <typename Tr, typename S, int V>
struct CombineK {
  static constexpr auto fn = em_combine_kernel<Tr, S, V>;
};
template <typename Tr, typename S, int V>
struct CombineBwdK {
  static constexpr auto fn = em_combine_bwd_kernel<Tr, S, V>;
};

}  // namespace

void VirtualRankGroup::em_layout(const EMLayoutArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.expert_alignment < 1) throw std::invalid_argument("omniep: expert_alignment must be >= 1");
  const size_t smem = sizeof(int) * static_cast<size_t>(args.num_experts);
  if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: at most 12288 experts");
  launch_cooperative(em_layout_kernel<P2PTransport>, dim3(1, count), kLayoutThreads, smem, stream, args,
                     make_transport(workspaces_, first_rank, timeout_ns_), "expert-major layout");
}

void VirtualRankGroup::em_dispatch(const EMDispatchArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.row_bytes < 0 || args.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
  auto kernel = em_dispatch_kernel<P2PTransport>;
  const int blocks = blocks_for(reinterpret_cast<const void*>(kernel), kEMDispatchThreads, 0, count);
  launch_cooperative(kernel, dim3(blocks, count), kEMDispatchThreads, 0, stream, args,
                     make_transport(workspaces_, first_rank, timeout_ns_), "expert-major dispatch");
}

void VirtualRankGroup::em_combine(const EMCombineArgs& args, int first_rank, int count, cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
  if (args.num_bias < 0 || args.num_bias > 2) throw std::invalid_argument("omniep: num_bias must be 0, 1 or 2");
  const bool vec = rows16(args.hidden, args.dtype) && all_aligned16(args.y, 0, num_ranks_) &&
                   all_aligned16(args.out, first_rank, count);
  auto blocks = [](const void* kernel, int n, const void* self) {
    return static_cast<const VirtualRankGroup*>(self)->blocks_for(kernel, kEMCombineThreads, 0, n);
  };
  launch_typed<CombineK>(args, args.dtype, vec, count, kEMCombineThreads,
                         make_transport(workspaces_, first_rank, timeout_ns_), stream, "expert-major combine",
                         blocks, this);
}

void VirtualRankGroup::em_combine_bwd(const EMCombineBwdArgs& args, int first_rank, int count,
                                      cudaStream_t stream) {
  check_range(first_rank, count);
  check_group_shape(args.num_experts, args.capacity);
  if (args.hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
  const bool vec = rows16(args.hidden, args.dtype) && all_aligned16(args.g_y, 0, num_ranks_) &&
                   all_aligned16(args.y, 0, num_ranks_) && all_aligned16(args.g_out, first_rank, count);
  auto blocks = [](const void* kernel, int n, const void* self) {
    return static_cast<const VirtualRankGroup*>(self)->blocks_for(kernel, kEMDispatchThreads, 0, n);
  };
  launch_typed<CombineBwdK>(args, args.dtype, vec, count, kEMDispatchThreads,
                            make_transport(workspaces_, first_rank, timeout_ns_), stream,
                            "expert-major combine_bwd", blocks, this);
}

}  // namespace omniep
