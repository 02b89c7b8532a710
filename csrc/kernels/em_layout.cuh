// Expert-major prepare: the per-(source, expert) count exchange and each copy's slot, one block
// per rank, after layout_kernel on the same stream (see em_args.h for the layout itself).
//
//   1. every source writes its per-expert counts (its row of the [R, E] matrix) into EVERY rank's
//      workspace (RankWorkspace::expert_counts; stores, or puts for a remote peer), then a barrier:
//      afterwards each rank holds the whole matrix and reads only its own memory;
//   2. the source sums, for every expert e, the copies of e from LOWER source ranks: that is where its
//      own copies of e start; the receiver sums its experts' columns: kept copies per local expert,
//      num_recv, dropped; the matrix is copied out (expert_count_matrix, if asked for: every rank's
//      receive sizes, so the host can check every rank's capacity without another exchange);
//   3. an ordered scan of the source's (t, k) pairs in row-major order gives each copy its slot.
//      The scan must follow (t, k) order exactly, so it is done without atomics racing across
//      warps: expert e belongs to warp e % warps, and every warp walks all pairs 32 at a time,
//      ranking its own experts' pairs inside each batch with ballots (equal experts grouped one
//      group at a time, lowest lane first) and keeping the running count in shared memory that
//      only it touches;
//   4. a last barrier keeps a fast peer's NEXT prepare from overwriting the matrix while it is read.
// The first barrier is a later exchange of the layout kernel's op (descriptor part 1): if that op was
// stopped (a mismatch, a bad id), this kernel stops on every rank too. A static capacity that some
// expert of some rank overflows is recorded as a pending CAPACITY status (the same on every rank: the
// lowest such expert id), and its last copies are dropped and counted.
// Cost: R * E stores per source (a few thousand for DeepEP's shapes); every warp reads all T*K ids
// (L1 hits after the first warp): fine for the low-latency shapes (128 tokens/rank), linear in T*K
// otherwise.
#pragma once

#include "kernels/em_args.h"
#include "kernels/layout.cuh"
#include "kernels/sync.cuh"

namespace omniep {

template <typename Tr>
__global__ void __launch_bounds__(kLayoutThreads) em_layout_kernel(EMLayoutArgs a, Tr tr) {
  extern __shared__ int s_next[];  // [E]: next slot of each expert at its receiver
  __shared__ int s_kept, s_total, s_max;
  __shared__ int s_overflow;  // the lowest expert id (any rank) whose copies exceed the capacity

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, E = a.num_experts, L = E / R, C = a.capacity;
  const int32_t* per_expert = tr.local(a.num_tokens_per_expert);

  // 1. my row of every rank's count matrix
  for (int64_t j = threadIdx.x; j < static_cast<int64_t>(R) * E; j += blockDim.x) {
    const int r = static_cast<int>(j / E), e = static_cast<int>(j % E);
    bool remote = false;
    if constexpr (Tr::kHasGets) remote = tr.is_remote(r);
    if (!remote) {
      tr.workspace(r)->expert_counts[me * E + e] = per_expert[e];
    } else if constexpr (Tr::kHasGets) {  // same offset in r's workspace; the barrier quiets the puts
      tr.put_i32(&tr.workspace(me)->expert_counts[me * E + e], per_expert[e], r);
    }
  }
  if (threadIdx.x == 0) {
    s_kept = 0;
    s_total = 0;
    s_max = 0;
    s_overflow = E;
  }
  if (!rank_barrier(tr, kPhaseLayoutExchange, /*all_wait=*/true, NoPuts{}, &a.desc[me])) {
    // The op stopped on every rank: a handle that routes nothing (see layout_kernel).
    int32_t* copy_slot = tr.local(a.copy_slot);
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(T) * K; i += blockDim.x) copy_slot[i] = -1;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      tr.local(a.recv_expert_count)[l] = 0;
      tr.local(a.num_recv_tokens_per_expert)[l] = 0;
    }
    if (threadIdx.x == 0) {
      *tr.local(a.num_recv) = 0;
      *tr.local(a.dropped) = 0;
      if (int32_t* max_count = tr.local(a.max_expert_count)) *max_count = 0;
    }
    return;
  }
  const int32_t* counts = tr.workspace(me)->expert_counts;  // [R, E], every source's row

  // 2a. source: first slot of my copies of every expert (copies from lower source ranks)
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int base = 0;
    for (int s = 0; s < me; ++s) base += counts[s * E + e];
    s_next[e] = base;
  }
  // 2b. receiver: copies per local expert, kept under the capacity
  {
    const int align = a.expert_alignment;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int n = 0;
      for (int s = 0; s < R; ++s) n += counts[s * E + me * L + l];
      const int kept = n < C ? n : C;
      tr.local(a.recv_expert_count)[l] = kept;
      tr.local(a.num_recv_tokens_per_expert)[l] = (kept + align - 1) / align * align;
      atomicAdd(&s_kept, kept);
      atomicAdd(&s_total, n);
      atomicMax(&s_max, n);
    }
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // every rank's experts: the same verdict everywhere
    int n = 0;
    for (int s = 0; s < R; ++s) n += counts[s * E + e];
    if (n > C) atomicMin(&s_overflow, e);
  }
  if (int32_t* matrix = tr.local(a.expert_count_matrix)) {
    for (int64_t j = threadIdx.x; j < static_cast<int64_t>(R) * E; j += blockDim.x) matrix[j] = counts[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_overflow < E) {
      int n = 0;
      for (int s = 0; s < R; ++s) n += counts[s * E + s_overflow];
      record_overflow(tr.workspace(me), me, s_overflow / L, n, C);
    }
    *tr.local(a.num_recv) = s_kept;
    *tr.local(a.dropped) = s_total - s_kept;
    if (int32_t* max_count = tr.local(a.max_expert_count)) *max_count = s_max;  // optional
  }

  // 3. ordered scan over (t, k): slot of every copy
  const int32_t* idx = tr.local(a.topk_idx32);
  int32_t* copy_slot = tr.local(a.copy_slot);
  const int lane = gpu::lane_id(), warp = gpu::warp_id(), warps = gpu::warps_per_block();
  const int64_t n = static_cast<int64_t>(T) * K;
  for (int64_t base = 0; base < n; base += gpu::kWarpSize) {  // uniform trip count: ballots convergent
    const int64_t i = base + lane;
    const int e = i < n ? idx[i] : -1;
    if (i < n && e < 0 && warp == 0) copy_slot[i] = -1;  // unrouted: warp 0 answers for it
    bool pending = e >= 0 && e % warps == warp;
    while (true) {
      const gpu::lane_mask_t todo = gpu::ballot(pending);
      if (todo == 0) break;
      const int leader = gpu::popc((todo & (~todo + 1)) - 1);  // lowest pending lane
      const int group_e = gpu::shfl(e, leader);
      const bool in_group = pending && e == group_e;
      const gpu::lane_mask_t group = gpu::ballot(in_group);
      if (in_group) {
        const int slot = s_next[e] + gpu::popc(group & gpu::lanes_below());
        copy_slot[i] = slot < C ? slot : -1;
        pending = false;
      }
      gpu::syncwarp();  // every lane of the group read s_next[e] before the leader bumps it
      if (lane == leader) s_next[group_e] += gpu::popc(group);
      gpu::syncwarp();
    }
  }
  rank_barrier(tr, kPhaseLayoutDone, /*all_wait=*/false);
}

}  // namespace omniep
