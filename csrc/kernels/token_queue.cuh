// Tokens handed to a rank's warps as they come free, instead of a fixed stride (token t to warp t mod W).
//
// Two H200s, DeepEP's normal shape (4096 tokens on 384 warps): with the fixed stride the rank-major
// kernels' warps finished their pushes / pulls up to 60 µs apart (phase stamps, benchmarks/RESULTS.md
// 2026-11-27, eighteenth session) although each had 10 or 11 tokens — some SMs move bytes over NVLink
// slower than others — so the kernel took as long as its slowest warp. A warp that takes its next token
// from the rank's counter when it is free evens that out. Which warp moves a token changes nothing of
// what lands where (rows go to their slots, sums are per token): results are bitwise the same.
//
// The counter lives in the rank's workspace (work_next[queue], one per kernel kind). Block 0 zeroes it
// before the op's first barrier with every block waiting (an all_wait rank_barrier: its arrivals and
// signals carry the store to every block of the rank before any takes a token).
#pragma once

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

// Thread 0 of block 0, before the kernel's first all_wait rank_barrier.
OMNIEP_DEVICE void token_queue_reset(RankWorkspace* ws, int queue) {
  if (blockIdx.x == 0 && threadIdx.x == 0) ws->work_next[queue] = 0;
}

// A warp's view of the queue: one lane always holds one ticket taken ahead, so the atomic's round trip runs
// while the warp moves its current token. Every lane calls next() together, with the counter the constructor
// got (passed again, not kept: a kernel at its register cap reads it from shared memory instead of holding a
// pointer across its loop).
class TokenQueue {
 public:
  OMNIEP_DEVICE explicit TokenQueue(uint32_t* counter) { take(counter); }
  // The warp's next token; >= T: none left (the warp then takes no more tickets).
  OMNIEP_DEVICE int next(uint32_t* counter, int T) {
    const int t = static_cast<int>(gpu::shfl(ahead_, static_cast<int>(holder_)));
    if (t < T) take(counter);
    return t;
  }

 private:
  // One lane (holder_, the same in every lane) takes the next ticket. On sm_90 ptxas turns one lane's
  // atomicAdd into a warp-aggregated atomic whose result the warp reads at once (its round trip exposed at
  // every token: SASS, 2026-11-27); a lane elected in the same instruction as its predicated atom leaves the
  // result in flight until the next shfl reads it.
  OMNIEP_DEVICE void take(uint32_t* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n\t.reg .pred p;\n\telect.sync %0|p, 0xffffffff;\n\t@p atom.relaxed.gpu.global.add.u32 %1, [%2], 1;\n\t}"
        : "=r"(holder_), "+r"(ahead_)
        : "l"(counter));  // (no memory clobber: the counter is read by nothing else in the kernel)
#else
    if (gpu::lane_id() == 0) ahead_ = atomicAdd(counter, 1u);
#endif
  }

  uint32_t ahead_ = 0;
  uint32_t holder_ = 0;
};

}  // namespace omniep
