// The launch step of VirtualRankGroup (virtual_rank_group.h) that both of its launcher files use
// (virtual_rank_group.cu: rank-major, virtual_rank_group_em.cu: expert-major). Argument checks and
// kernel instances are backends/launch_common.cuh's, shared with the one-rank-per-process launcher.
#pragma once

#include <stdexcept>
#include <string>

#include "backends/launch_common.cuh"
#include "backends/virtual_rank_group.h"
#include "omniep/runtime.h"
#include "transports/p2p.cuh"

namespace omniep {

// Cooperative: every block of every launched rank co-resident, or no launch at all (ranks wait on
// each other inside the kernel): gridDim = (blocks per rank, ranks).
template <typename Kernel, typename Args>
void VirtualRankGroup::launch(Kernel kernel, int blocks, int threads, size_t smem, const Args& args, int first_rank,
                              int count, cudaStream_t stream, const char* what) const {
  if (first_rank < 0 || count < 1 || first_rank + count > num_ranks_) {
    throw std::invalid_argument("omniep: rank range [" + std::to_string(first_rank) + ", " +
                                std::to_string(first_rank + count) + ") is not inside the group of " +
                                std::to_string(num_ranks_) + " ranks");
  }
  check_group_shape(args.num_experts, args.capacity, num_ranks_);
  if (blocks == 0) blocks = blocks_for(reinterpret_cast<const void*>(kernel), threads, smem, count);
  gpu::check(gpu::launch_cooperative(kernel, dim3(blocks, count), dim3(threads), smem, stream, args,
                                     transport(first_rank)),
             what);
}

}  // namespace omniep
