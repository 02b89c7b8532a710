// Launchers of the expert-major kernels over the p2p transport for virtual ranks (see
// virtual_rank_group.h). Kept apart from virtual_rank_group.cu so each layout's launchers stay
// short; the launch step is virtual_rank_launch.cuh's, the checks and kernel choices
// launch_common.cuh's (shared with the one-rank-per-process launcher).
#include <cuda_runtime.h>

#include "backends/virtual_rank_group.h"
#include "backends/virtual_rank_launch.cuh"

namespace omniep {

void VirtualRankGroup::em_layout(const EMLayoutArgs& args, int first_rank, int count, cudaStream_t stream) {
  const size_t smem = checked_smem(args);
  launch(em_layout_kernel<P2PTransport>, 1, kLayoutThreads, smem, args, first_rank, count, stream,
         "expert-major layout");
}

void VirtualRankGroup::em_dispatch(const EMDispatchArgs& args, int first_rank, int count, cudaStream_t stream) {
  const size_t smem = checked_smem(args);
  launch(em_dispatch_kernel_for<P2PTransport>(args), 0, kEMDispatchThreads, smem, args, first_rank, count, stream,
         "expert-major dispatch");
}

void VirtualRankGroup::em_combine(const EMCombineArgs& args, int first_rank, int count, cudaStream_t stream) {
  const size_t smem = checked_smem(args);
  const char* what = "expert-major combine";
  const bool vec = vec16(args, first_rank, count, num_ranks_);
  launch(typed_kernel<EMCombineK, P2PTransport>(args.dtype, vec, what), 0, kEMCombineThreads, smem, args, first_rank,
         count, stream, what);
}

void VirtualRankGroup::em_combine_bwd(const EMCombineBwdArgs& args, int first_rank, int count,
                                      cudaStream_t stream) {
  const size_t smem = checked_smem(args);
  const char* what = "expert-major combine_bwd";
  const bool vec = vec16(args, first_rank, count, num_ranks_);
  launch(typed_kernel<EMCombineBwdK, P2PTransport>(args.dtype, vec, what), 0, kEMDispatchThreads, smem, args,
         first_rank, count, stream, what);
}

}  // namespace omniep
