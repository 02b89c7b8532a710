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
// The same steps, as device functions, are the routing front of the one-kernel dispatch
// (em_dispatch.cuh), which runs step 3 in every block over its own range of copies.
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

// The steps below are shared by em_layout_kernel (one block: prepare of the JAX and virtual-rank
// bindings) and the routing front of em::dispatch_kernel (every block: the one-kernel dispatch of the
// torch ops, kernels/em_dispatch.cuh). Each is called by every thread of the block(s) named.

// Step 1 (one block): my per-expert counts `per_expert[E]` as my row of EVERY rank's count matrix, and
// my token count T beside it (em_tokens: the push combine's bound, em_push_ok).
template <typename Tr>
OMNIEP_DEVICE void em_publish_counts(const Tr& tr, const int* per_expert, int E, int T) {
  const int me = tr.rank(), R = tr.num_ranks();
  for (int64_t j = threadIdx.x; j < static_cast<int64_t>(R) * (E + 1); j += blockDim.x) {
    const int r = static_cast<int>(j / (E + 1)), e = static_cast<int>(j % (E + 1));
    const auto word = [&](RankWorkspace* ws) { return e < E ? &ws->expert_counts[me * E + e] : &ws->em_tokens[me]; };
    const int32_t v = e < E ? per_expert[e] : T;
    bool remote = false;
    if constexpr (Tr::kHasGets) remote = tr.is_remote(r);
    if (!remote) {
      *word(tr.workspace(r)) = v;
    } else if constexpr (Tr::kHasGets) {  // same offset in r's workspace; the barrier quiets the puts
      tr.put_i32(word(tr.workspace(me)), v, r);
    }
  }
}

// An op that stopped at its exchange (one block, or every block for its own range of copy_slot):
// a handle that routes nothing.
OMNIEP_DEVICE void em_route_nothing(int32_t* copy_slot, int64_t i0, int64_t i1, int32_t* recv_expert_count,
                                    int32_t* per_expert_aligned, int L, int32_t* num_recv, int32_t* dropped,
                                    int32_t* max_count) {
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) copy_slot[i] = -1;
  if (recv_expert_count == nullptr) return;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    recv_expert_count[l] = 0;
    per_expert_aligned[l] = 0;
  }
  if (threadIdx.x == 0) {
    *num_recv = 0;
    *dropped = 0;
    if (max_count != nullptr) *max_count = 0;
  }
}

// Step 2a (any block): s_next[e] = copies of e from LOWER source ranks (where my copies of e start)
// plus `add[e]` (null: 0); counts = the [R, E] matrix after the exchange.
OMNIEP_DEVICE void em_first_slots(int* s_next, const int32_t* counts, const int* add, int me, int E) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int base = add != nullptr ? add[e] : 0;
    for (int s = 0; s < me; ++s) base += counts[s * E + e];
    s_next[e] = base;
  }
}

// Step 2b (one block): the receiver's side — copies per local expert kept under the capacity C,
// rounded up to the alignment, num_recv, dropped, the optional max / matrix outputs, and a pending
// CAPACITY status if any expert of any rank overflows (the same verdict on every rank). `recv_stats`
// (optional, [L]): the kept copies are added to it (DeepEP's cumulative_local_expert_recv_stats).
template <typename Tr>
OMNIEP_DEVICE void em_receiver_counts(const Tr& tr, const int32_t* counts, int E, int C, int align,
                                      int32_t* recv_expert_count, int32_t* per_expert_aligned, int32_t* num_recv,
                                      int32_t* dropped, int32_t* max_count, int32_t* matrix,
                                      int32_t* recv_stats = nullptr) {
  __shared__ int s_kept, s_total, s_max;
  __shared__ int s_overflow;  // the lowest expert id (any rank) whose copies exceed the capacity
  const int me = tr.rank(), R = tr.num_ranks(), L = E / R;
  if (threadIdx.x == 0) {
    s_kept = 0;
    s_total = 0;
    s_max = 0;
    s_overflow = E;
  }
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int n = 0;
    for (int s = 0; s < R; ++s) n += counts[s * E + me * L + l];
    const int kept = n < C ? n : C;
    recv_expert_count[l] = kept;
    if (recv_stats != nullptr) recv_stats[l] += kept;  // (one thread per l: the stream orders the calls)
    per_expert_aligned[l] = (kept + align - 1) / align * align;
    atomicAdd(&s_kept, kept);
    atomicAdd(&s_total, n);
    atomicMax(&s_max, n);
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // every rank's experts: the same verdict everywhere
    int n = 0;
    for (int s = 0; s < R; ++s) n += counts[s * E + e];
    if (n > C) atomicMin(&s_overflow, e);
  }
  if (matrix != nullptr) {
    for (int64_t j = threadIdx.x; j < static_cast<int64_t>(R) * E; j += blockDim.x) matrix[j] = counts[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_overflow < E) {
      int n = 0;
      for (int s = 0; s < R; ++s) n += counts[s * E + s_overflow];
      record_overflow(tr.workspace(me), me, s_overflow / L, n, C);
    }
    *num_recv = s_kept;
    *dropped = s_total - s_kept;
    if (max_count != nullptr) *max_count = s_max;
  }
}

// Step 3 (one block): the slot of every copy i in [i0, i1), in (t, k) order, from s_next (the first
// slot of each expert for this range; advanced here). `id(i)` is copy i's expert or -1. The scan
// follows (t, k) order exactly without atomics racing across warps: expert e belongs to warp
// e % warps, and every warp walks the range 32 at a time, ranking its own experts' copies inside
// each batch with ballots (equal experts one group at a time, lowest lane first) and keeping the
// running count in shared memory only it touches. Slots >= C are dropped (-1).
template <typename Id>
OMNIEP_DEVICE void em_scan_slots(Id id, int32_t* copy_slot, int* s_next, int64_t i0, int64_t i1, int C) {
  const int lane = gpu::lane_id(), warp = gpu::warp_id(), warps = gpu::warps_per_block();
  for (int64_t base = i0; base < i1; base += gpu::kWarpSize) {  // uniform trip count: ballots convergent
    const int64_t i = base + lane;
    const int e = i < i1 ? id(i) : -1;
    if (i < i1 && e < 0 && warp == 0) copy_slot[i] = -1;  // unrouted: warp 0 answers for it
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
}

template <typename Tr>
__global__ void __launch_bounds__(kLayoutThreads) em_layout_kernel(EMLayoutArgs a, Tr tr) {
  extern __shared__ int s_next[];  // [E]: next slot of each expert at its receiver
  const int me = tr.rank();
  const int T = a.num_tokens[me], K = a.num_topk, E = a.num_experts, L = E / tr.num_ranks(), C = a.capacity;
  const int64_t n = static_cast<int64_t>(T) * K;
  int32_t* copy_slot = tr.local(a.copy_slot);

  em_publish_counts(tr, tr.local(a.num_tokens_per_expert), E, T);
  if (!rank_barrier(tr, kPhaseLayoutExchange, /*all_wait=*/true, NoPuts{}, &a.desc[me])) {
    em_route_nothing(copy_slot, 0, n, tr.local(a.recv_expert_count), tr.local(a.num_recv_tokens_per_expert), L,
                     tr.local(a.num_recv), tr.local(a.dropped), tr.local(a.max_expert_count));
    return;
  }
  const int32_t* counts = tr.workspace(me)->expert_counts;  // [R, E], every source's row
  em_first_slots(s_next, counts, nullptr, me, E);
  em_receiver_counts(tr, counts, E, C, a.expert_alignment, tr.local(a.recv_expert_count),
                     tr.local(a.num_recv_tokens_per_expert), tr.local(a.num_recv), tr.local(a.dropped),
                     tr.local(a.max_expert_count), tr.local(a.expert_count_matrix));
  __syncthreads();  // s_next complete
  const int32_t* idx = tr.local(a.topk_idx32);
  em_scan_slots([idx](int64_t i) { return idx[i]; }, copy_slot, s_next, 0, n, C);
  rank_barrier(tr, kPhaseLayoutDone, /*all_wait=*/false);
}

}  // namespace omniep
