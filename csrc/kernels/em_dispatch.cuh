// Expert-major dispatch and combine_bwd: every source PUSHES one row per kept copy (t, k) into slot
// copy_slot[t, k] of local expert l = e - r*L at receiver r = e / L (em_args.h has the layout).
//
// dispatch moves the row's bytes unchanged (bf16, fp16, fp32 or fp8 + its scales as a second
// payload) and writes recv_topk_idx[l, c] = l and recv_topk_weights[l, c] = w[t, k].
// combine_bwd writes g_y[l, c] = round(fp32(w[t, k]) * fp32(g_out[t])) — the product rounded to
// fp32 (mul_rn), then once to the dtype — and, with_topk_grad, g_topk_weights[t, k] = <g_out[t],
// y[l, c]> accumulated in fp32 (a reduction over H, in no order DESIGN fixes: tests match it to rounding, tests/harness/bounds.py).
// No source writes the padding slots [recv_expert_count[l], C). dispatch fills its results after the
// end barrier with the counted slots only (their routing -1 / 0 on padding, the rows' padding left as
// it is unless zero_padding: DESIGN §2), so its cost follows the routed copies, not L * C * H; a
// rank's copies of its own tokens skip the symmetric buffer and go straight into its results.
// combine_bwd, a cached dispatch of g_out, likewise: g_y's padding is zeroed only with zero_padding (the
// dispatch that made the handle asked for it), else left as it is.
//
// One warp per copy (t, k): a low-latency batch (128 tokens, top-8) is 1024 rows per rank, where one
// warp per token would leave most warps idle.
// Barriers: start (receivers done with earlier users of the buffers; their y is complete), end
// (every row has arrived, and peers finished reading my y). No host synchronisation.
//
// Remote receivers (a transport with kHasGets: nvshmem across nodes, or OMNIEP_FORCE_REMOTE=1):
// dispatch PUTS the row, the scales row and the slot's routing entries; combine_bwd computes each
// chunk of the g_y row into the warp's stage in the transport's symmetric scratch and puts it from
// there (quieted before the stage is rewritten), reading y's chunk with a get. The values and the
// order of every sum are those of the direct path. On p2p and nccl_dev those branches compile away.
#pragma once

#include "kernels/combine.cuh"  // the remote path's staging sizes
#include "kernels/em_args.h"
#include "kernels/em_layout.cuh"
#include "kernels/em_slots.cuh"
#include "kernels/rows.cuh"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kEMDispatchThreads = 512;
// A bound on the dispatch kernel's static shared memory (ptxas, sm_90: 4,960 B), which the routing
// front's dynamic shared memory [2 * E ints] must leave room for (launch_common.cuh checked_smem).
inline constexpr size_t kEMDispatchStaticSmem = 6144;
// The routing entry a rank's push of its OWN copy leaves in its symmetric recv_topk_idx when the kernel
// fills separate results (out_x): the copy's rows already are in the result, the results copy moves only
// the slot's routing (l = slot / C, the weight).
inline constexpr int32_t kEMSlotInResult = -2;
// The results copy's bulk path (em_dispatch_results): a stage per warp for a row and its scales row (an fp8
// row of DeepEP's H = 7168 and its 56 scales: 7,392 B), and the dynamic shared memory a launch needs for them.
inline constexpr int kEMResultsStageBytes = 8192;
inline constexpr size_t kEMResultsSmemBytes =
    static_cast<size_t>(kEMResultsStageBytes) * (kEMDispatchThreads / gpu::kWarpSize);
// The remote path stages per warp as combine does: the scratch the host sized for combine's warps
// (kCombineThreads per block) serves these kernels' warps.
static_assert(kEMDispatchThreads <= kCombineThreads, "em stages come from combine's per-warp scratch");

// The routing front (a.route.on): prepare's expert-major work inside the dispatch kernel, so a
// dispatch is ONE launch with two barriers (the count exchange, the end). Every block counts the
// copies before its share [i0, i1) of the (t, k) pairs; block 0 also counts them all (its row of the
// count matrix, published before the exchange barrier, which also carries the op descriptor and the
// verdict on the ids; after its pushes, the receiver's side: em_route_counts). Every block ranks its
// own share among the rank's copies of each expert (step 3 over [i0, i1), from the earlier shares'
// counts, without the capacity: copy_slot holds each copy's rank j) while the exchange's signals travel;
// after the exchange only s_mem[e] = the copies of e from the lower source ranks is computed, and the
// push loop takes slot = s_mem[e] + j (-1 past C) and writes it back for the handle: the slots are those
// of em_layout_kernel, bit for bit. Returns false when the op stopped (the handle then routes nothing).
// Dynamic shared memory: 2 * E ints.
// With an fp8 cast (a.cast_src) and a barrier that splits (barrier_splits_here) the block also casts the
// tokens of its share (whole tokens: [i0 / K, i1 / K)) — after its arrival at the exchange barrier, while the
// signals travel, so the cast costs no time of its own where the exchange waits for a peer; the block's warps
// push only those tokens, so its own __syncthreads publishes them. (Otherwise the kernel cast before.)
template <typename Index, typename Tr>
OMNIEP_DEVICE bool em_route_front(const EMDispatchArgs& a, const Tr& tr, int64_t i0, int64_t i1) {
  extern __shared__ int s_mem[];  // [E] first slot of each expert for my share; block 0: [E] all my copies
  __shared__ OpDesc s_desc;       // mine, with the verdict on my ids (block 0's is the one exchanged)
  __shared__ int s_bad;
  __shared__ long long s_bad_id;
  const int me = tr.rank(), R = tr.num_ranks();
  const int E = a.num_experts, L = E / R;
  const int64_t n = static_cast<int64_t>(a.num_tokens[me]) * a.num_topk;
  const bool first = blockIdx.x == 0;
  int* s_next = s_mem;
  int* s_count = s_mem + E;
  const Index* raw = static_cast<const Index*>(tr.local(a.route.topk_idx));
  const auto id = [raw, E](int64_t i) {
    const int64_t e = static_cast<int64_t>(raw[i]);
    return e >= 0 && e < E ? static_cast<int>(e) : -1;
  };
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    s_next[e] = 0;
    s_count[e] = 0;
  }
  if (threadIdx.x == 0) {
    s_desc = a.desc[me];
    s_bad = 0;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < i0; i += blockDim.x) {
    const int e = id(i);
    if (e >= 0) atomicAdd(&s_next[e], 1);
  }
  if (first) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t e64 = static_cast<int64_t>(raw[i]);
      if ((e64 < -1 || e64 >= E) && atomicCAS(&s_bad, 0, 1) == 0) s_bad_id = static_cast<long long>(e64);
      if (e64 >= 0 && e64 < E) atomicAdd(&s_count[e64], 1);
    }
  }
  int32_t* idx32 = const_cast<int32_t*>(tr.local(a.topk_idx32));  // (outputs of the front: see EMRouteArgs)
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) idx32[i] = id(i);
  __syncthreads();
  if (first) {
    em_publish_counts(tr, s_count, E, a.num_tokens[me]);
    if (threadIdx.x == 0 && s_bad) {
      s_desc.w[kDescInputStatus] = kInputBadExpertId;
      const long long bad = s_bad_id;  // reported as int32 (clamped)
      s_desc.w[kDescInputDetail] = static_cast<int32_t>(bad > INT32_MAX ? INT32_MAX : bad < INT32_MIN ? INT32_MIN : bad);
    }
  }
  int32_t* copy_slot = const_cast<int32_t*>(tr.local(a.copy_slot));
  int32_t* count_out = first ? const_cast<int32_t*>(tr.local(a.recv_expert_count)) : nullptr;
  OMNIEP_STAMP("counted");
  // Split where it can be (the same barrier: the arrival and signals, then the wait), so that a block's
  // fp8 cast runs while the signals travel.
  const bool split = barrier_splits_here(tr);
  bool go = rank_barrier(tr, kPhaseLayoutExchange, /*all_wait=*/true, NoPuts{}, &s_desc,
                         split ? kBarrierSignalOnly : kBarrierFull);
  if (go) {
    if (split && tr.local(a.cast_src) != nullptr) {
      const int K = a.num_topk;
      cast_fp8_rows(reinterpret_cast<const gpu::bfloat16*>(tr.local(a.cast_src)),
                    const_cast<uint8_t*>(tr.local(a.x)), reinterpret_cast<float*>(const_cast<uint8_t*>(tr.local(a.x2))),
                    i0 / K, i1 / K, static_cast<int>(a.row_bytes), a.cast_round_scale != 0, gpu::warp_id(),
                    gpu::warps_per_block());
      OMNIEP_STAMP("cast");
    }
    em_scan_slots([idx32](int64_t i) { return idx32[i]; }, copy_slot, s_next, i0, i1, INT32_MAX);  // j
    if (split) go = rank_barrier(tr, kPhaseLayoutExchange, /*all_wait=*/true, NoPuts{}, &s_desc, kBarrierWaitHere);
  }
  if (!go) {
    em_route_nothing(copy_slot, i0, i1, count_out, tr.local(a.route.num_recv_tokens_per_expert), L,
                     tr.local(a.route.num_recv), tr.local(a.route.dropped), nullptr);
    if (first && threadIdx.x == 0) *tr.local(a.route.push_ok) = 0;
    return false;
  }
  OMNIEP_STAMP("exchanged");
  __syncthreads();  // every warp's ranks read s_next before it is rewritten
  em_first_slots(s_next, tr.workspace(me)->expert_counts, nullptr, me, E);  // [R, E]: every source's row
  __syncthreads();  // s_next complete: the copies of each expert from lower source ranks
  return true;
}

// Block 0, after its pushes (nothing of the op reads them before the end barrier, which publishes them): the
// receiver's side of the routing front (em_layout step 2b) and whether the combine may push — every rank reads
// the same token counts, so the combine takes one path everywhere.
template <typename Tr>
OMNIEP_DEVICE void em_route_counts(const EMDispatchArgs& a, const Tr& tr) {
  const int me = tr.rank(), R = tr.num_ranks(), C = a.capacity;
  if (threadIdx.x == 0) {
    int ok = 1;
    for (int s = 0; s < R; ++s) ok &= tr.workspace(me)->em_tokens[s] <= em_push_tokens(C, R);
    *tr.local(a.route.push_ok) = ok;
  }
  em_receiver_counts(tr, tr.workspace(me)->expert_counts, a.num_experts, C, a.route.expert_alignment,
                     const_cast<int32_t*>(tr.local(a.recv_expert_count)), tr.local(a.route.num_recv_tokens_per_expert),
                     tr.local(a.route.num_recv), tr.local(a.route.dropped), nullptr, nullptr,
                     tr.local(a.route.recv_stats));
}

// Whether the results copy's rows fit its bulk path: a row and its scales row within a warp's stage, in 16-byte
// units. The launcher grants the stages (em_dispatch_smem) and the kernel takes the path on the same answer.
OMNIEP_HOST_DEVICE bool em_results_fit_stage(const EMDispatchArgs& a) {
  return a.row_bytes > 0 && a.unit == 16 && (a.row2_bytes == 0 || a.unit2 == 16) &&
         a.row_bytes + a.row2_bytes <= kEMResultsStageBytes;
}

// After the end barrier: the counted slots of the symmetric receive buffers into the caller's results
// (but those the rank's own pushes filled already: kEMSlotInResult).
// One pass over the counted rows moves each row's payload, its scales row and its routing entry
// together (one scan of the counts, the loads of both rows in flight at once); padding after it.
// Bulk path (CUDA sm_90, 16-byte units, a row and its scales row within a warp's stage, the launch gave the
// stages: em_dispatch_smem): lane 0 moves both rows through its warp's stage in shared memory with one bulk
// load each and one bulk store each — one round trip per row, where the register copy of a 7 KB fp8 row takes
// four dependent rounds (8, 4, then 1 and 1 loads per lane) and its scales row a fifth: the copy is on every
// rank's path after the end barrier (5.4 µs at DeepEP's LL shape, RESULTS twenty-first session).
template <typename Tr>
OMNIEP_DEVICE void em_dispatch_results(const EMDispatchArgs& a, const Tr& tr) {
  const int L = a.num_experts / tr.num_ranks(), C = a.capacity;
  const int32_t* count = tr.local(a.recv_expert_count);
  uint8_t* out_x = tr.local(a.out_x);
  uint8_t* out_x2 = tr.local(a.out_x2);
  const uint8_t* recv_x = tr.local(a.recv_x);
  const uint8_t* recv_x2 = tr.local(a.recv_x2);
  int32_t* out_idx = tr.local(a.out_topk_idx);
  float* out_w = tr.local(a.out_topk_weights);
  int32_t* out_src = tr.local(a.out_src);  // (then recv_idx holds each copy's em_src_code, not l)
  const int32_t* recv_idx = tr.local(a.recv_topk_idx);
  const float* recv_w = tr.local(a.recv_topk_weights);
  const int me = tr.rank(), R = tr.num_ranks();
  bool bulk_rows = false;
#if defined(OMNIEP_BULK_LOADS)
  __shared__ __align__(8) uint64_t s_row_bar[kEMDispatchThreads / gpu::kWarpSize];
  extern __shared__ __align__(128) uint8_t s_stages[];  // (the routing front's arrays before: done with by now)
  bulk_rows = em_results_fit_stage(a) && bulk::dynamic_smem_bytes() >= kEMResultsSmemBytes;
  uint32_t phase = 0;
  if (bulk_rows && gpu::lane_id() == 0) {
    bulk::init(&s_row_bar[gpu::warp_id()]);
    bulk::proxy_fence_global();  // the peers' rows came through generic stores (the end barrier ordered them)
    bulk::proxy_fence();  // and the stages are the routing front's arrays, written and read through generic accesses
  }
#endif
  em_for_each_row(count, L, C, 0, [&](int64_t j) {
    const int32_t v = recv_idx[j];  // (one load, every lane: the branch stays warp-uniform)
    const bool own = out_src != nullptr ? v % R == me : v == kEMSlotInResult;
    if (gpu::lane_id() == 0) {
      // (rows fit int32: em_slots.cuh)
      out_idx[j] = own || out_src != nullptr ? static_cast<int32_t>(j) / C : v;
      out_w[j] = recv_w[j];
      if (out_src != nullptr) out_src[j] = v;
    }
    if (own) return;  // a copy of my own: its rows are in the result already (the push)
#if defined(OMNIEP_BULK_LOADS)
    if (bulk_rows) {
      if (gpu::lane_id() == 0) {
        uint8_t* stage = s_stages + gpu::warp_id() * kEMResultsStageBytes;
        uint64_t* bar = &s_row_bar[gpu::warp_id()];
        const uint32_t b1 = static_cast<uint32_t>(a.row_bytes), b2 = static_cast<uint32_t>(a.row2_bytes);
        bulk::wait_read_all();  // this warp's previous row has left the stage
        bulk::expect(bar, b1 + b2);
        bulk::load(stage, recv_x + j * a.row_bytes, b1, bar);
        if (b2 > 0) bulk::load(stage + b1, recv_x2 + j * a.row2_bytes, b2, bar);
        bulk::wait(bar, phase);
        bulk::store(out_x + j * a.row_bytes, stage, b1);
        if (b2 > 0) bulk::store(out_x2 + j * a.row2_bytes, stage + b1, b2);
        bulk::commit();
      }
      phase ^= 1u;
      return;
    }
#endif
    if (a.row2_bytes > 0) warp_copy_row(out_x2 + j * a.row2_bytes, recv_x2 + j * a.row2_bytes, a.row2_bytes, a.unit2);
    warp_copy_row(out_x + j * a.row_bytes, recv_x + j * a.row_bytes, a.row_bytes, a.unit);
  });
#if defined(OMNIEP_BULK_LOADS)
  if (bulk_rows && gpu::lane_id() == 0) bulk::wait_all();  // the rows are in the results before the block ends
#endif
  (void)bulk_rows;
  if (a.zero_padding) {
    em_for_each_row(count, L, C, 1, [&](int64_t j) {
      if (a.row2_bytes > 0) warp_zero_row(out_x2 + j * a.row2_bytes, a.row2_bytes, a.unit2);
      warp_zero_row(out_x + j * a.row_bytes, a.row_bytes, a.unit);
    });
  }
  em_routing_padding(out_idx, out_w, nullptr, nullptr, count, L, C);  // the padding's routing: -1 / 0
}

namespace em {  // profilers show "omniep::em::dispatch_kernel": DeepEP's tests find kernels by "::dispatch"
// Index: the routing front's id type (unused without it).
template <typename Tr, typename Index>
__global__ void __launch_bounds__(kEMDispatchThreads) dispatch_kernel(EMDispatchArgs a, Tr tr) {
  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity;
  const int64_t n = static_cast<int64_t>(T) * K;
  const int warps = gpu::warps_per_block();
  OMNIEP_STAMPS_BEGIN();
  if (a.phase == kEMReceive) {
    // The send half stopped at the count exchange on every rank (and filled the results then): no
    // peer signals the end barrier.
    if (tr.workspace(me)->abort_seq == a.desc[me].w[kDescSeq] + 1) return;
    if (rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/true, NoPuts{}, nullptr, kBarrierWaitOnly)) {
      OMNIEP_STAMP("end_barrier");
      em_dispatch_results(a, tr);
      OMNIEP_STAMP("results");
    }
    OMNIEP_STAMPS_END("em::dispatch_kernel(receive)", me);
    return;
  }
  // fp8: x, x2 are this kernel's own staging — cast by the routing front's blocks, each its own tokens, while
  // the exchange's signals travel; else here, by the grid (the barrier publishes them).
  const bool cast_in_front = a.route.on && barrier_splits_here(tr);
  if (const uint8_t* src = cast_in_front ? nullptr : tr.local(a.cast_src)) {
    grid_cast_fp8(reinterpret_cast<const gpu::bfloat16*>(src), const_cast<uint8_t*>(tr.local(a.x)),
                  reinterpret_cast<float*>(const_cast<uint8_t*>(tr.local(a.x2))), T, static_cast<int>(a.row_bytes),
                  a.cast_round_scale != 0);
    OMNIEP_STAMP("cast");
  }
  // The copies this block's warps push: its own share with the routing front (whose slots it ranked),
  // else all of them, grid-strided.
  int64_t first_warp = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id(), end = n;
  int64_t all_warps = static_cast<int64_t>(gridDim.x) * warps;
  bool go;
  if (a.route.on) {
    const int64_t per = (T + gridDim.x - 1) / gridDim.x * K;  // whole tokens (the front's fp8 cast)
    const int64_t at = static_cast<int64_t>(blockIdx.x) * per;
    const int64_t i0 = at < n ? at : n;
    end = i0 + per < n ? i0 + per : n;
    first_warp = i0 + gpu::warp_id();
    all_warps = warps;
    go = em_route_front<Index>(a, tr, i0, end);
    OMNIEP_STAMP("slots");
  } else {
    go = rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true, NoPuts{}, &a.desc[me]);
  }
  if (!go) {
    // The op stopped on every rank: results that hold nothing (every slot padding).
    const bool sym = tr.local(a.out_x) == nullptr;
    if (a.zero_padding) {
      const int64_t slots = static_cast<int64_t>(L) * C;
      em_zero_rows(sym ? tr.local(a.recv_x) : tr.local(a.out_x), slots, a.row_bytes, a.unit);
      if (a.row2_bytes > 0) em_zero_rows(sym ? tr.local(a.recv_x2) : tr.local(a.out_x2), slots, a.row2_bytes, a.unit2);
    }
    em_routing_padding(sym ? tr.local(a.recv_topk_idx) : tr.local(a.out_topk_idx),
                       sym ? tr.local(a.recv_topk_weights) : tr.local(a.out_topk_weights), nullptr, nullptr, nullptr,
                       L, C);
    return;
  }

  const uint8_t* x = tr.local(a.x);
  const uint8_t* x2 = tr.local(a.x2);
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int32_t* copy_slot = tr.local(a.copy_slot);
  const int lane = gpu::lane_id();
  // Where a copy for rank r goes: r's symmetric buffers — or, for my own copies when the kernel fills
  // separate results, straight into those (their symmetric routing entry marked: the results copy after
  // the end barrier then moves only the slot's routing; one pass over the row instead of two).
  __shared__ uint8_t* s_to[kMaxRanks];
  __shared__ uint8_t* s_to2[kMaxRanks];
  const bool has_out = tr.local(a.out_x) != nullptr;
  const bool has_src = tr.local(a.out_src) != nullptr;  // the routing entry carries the source (em_src_code)
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    s_to[r] = r == me && has_out ? tr.local(a.out_x) : tr.peer(a.recv_x, r);
    s_to2[r] = r == me && has_out ? tr.local(a.out_x2) : tr.peer(a.recv_x2, r);
  }
  __syncthreads();

  // ---- push my copies ----
  extern __shared__ int s_lower[];  // the routing front's: the copies of each expert from lower source ranks
  for (int64_t i = first_warp; i < end; i += all_warps) {
    int slot = copy_slot[i];
    if (slot < 0) continue;  // unrouted (or, without the routing front, dropped)
    const int e = idx32[i];
    if (a.route.on) {  // the front left my rank j among my copies of e: the slot, kept for the handle
      slot += s_lower[e];
      gpu::syncwarp();  // every lane has read j before lane 0 replaces it
      if (lane == 0) const_cast<int32_t*>(copy_slot)[i] = slot < C ? slot : -1;
      if (slot >= C) continue;  // dropped
    }
    const int r = e / L, l = e - r * L;
    const int64_t row = static_cast<int64_t>(l) * C + slot;
    const int64_t t = i / K;
    bool far = false;
    if constexpr (Tr::kHasGets) far = tr.is_remote(r);
    if (!far) {
      warp_copy_row(s_to[r] + row * a.row_bytes, x + t * a.row_bytes, a.row_bytes, a.unit);
      if (a.row2_bytes > 0) warp_copy_row(s_to2[r] + row * a.row2_bytes, x2 + t * a.row2_bytes, a.row2_bytes, a.unit2);
      if (lane == 0) {
        tr.peer(a.recv_topk_idx, r)[row] = has_src ? em_src_code(i, me, R) : r == me && has_out ? kEMSlotInResult : l;
        tr.peer(a.recv_topk_weights, r)[row] = weights[i];
      }
    } else if constexpr (Tr::kHasGets) {  // MY addresses of the symmetric buffers; the end barrier quiets
      tr.put_warp(tr.local(a.recv_x) + row * a.row_bytes, x + t * a.row_bytes, static_cast<size_t>(a.row_bytes), r);
      if (a.row2_bytes > 0) {
        tr.put_warp(tr.local(a.recv_x2) + row * a.row2_bytes, x2 + t * a.row2_bytes,
                    static_cast<size_t>(a.row2_bytes), r);
      }
      if (lane == 0) {
        tr.put_i32(tr.local(a.recv_topk_idx) + row, has_src ? em_src_code(i, me, R) : l, r);
        tr.put_f32(tr.local(a.recv_topk_weights) + row, weights[i], r);
      }
    }
  }

  OMNIEP_STAMP_WARPS("pushed");
  if (a.route.on && blockIdx.x == 0) em_route_counts(a, tr);
  // ---- results ----
  // The counted slots [0, recv_expert_count[l]) of every local expert are the result; the rest is
  // padding, which no source writes and nothing here touches unless zero_padding asks for zeros.
  const int32_t* count = tr.local(a.recv_expert_count);
  uint8_t* out_x = tr.local(a.out_x);
  if (out_x == nullptr) {  // the symmetric buffers are the results: define their padding now (mine only)
    if (a.zero_padding) {
      em_copy_slots(tr.local(a.recv_x), nullptr, count, L, C, a.row_bytes, a.unit, 1);
      if (a.row2_bytes > 0) em_copy_slots(tr.local(a.recv_x2), nullptr, count, L, C, a.row2_bytes, a.unit2, 1);
    }
    em_routing_padding(tr.local(a.recv_topk_idx), tr.local(a.recv_topk_weights), nullptr, nullptr, count, L, C);
  }
  // With results to fill, every block waits for the peers (their copies have arrived) — or, sending
  // only, signals them and leaves the wait and the results to the receive half.
  const bool send_only = a.phase == kEMSend;
  const bool arrived = rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/out_x != nullptr && !send_only, NoPuts{},
                                    nullptr, send_only ? kBarrierSignalOnly : kBarrierFull);
  OMNIEP_STAMP("end_barrier");
  if (arrived && out_x != nullptr && !send_only) {
    em_dispatch_results(a, tr);
    OMNIEP_STAMP("results");
  }
  OMNIEP_STAMPS_END(send_only                          ? "em::dispatch_kernel(send)"
                    : tr.local(a.cast_src) != nullptr ? "em::dispatch_kernel(fp8 cast)"
                                                      : "em::dispatch_kernel",
                    me);
}
}  // namespace em

// Sum of v over the warp, in the same butterfly order on every lane (all lanes get the result).
OMNIEP_DEVICE float warp_sum(float v) {
  for (int m = gpu::kWarpSize / 2; m > 0; m /= 2) v = gpu::add_rn(v, gpu::shfl(v, gpu::lane_id() ^ m));
  return v;
}

// One pack of g_y = round(w * g_out) into *dst (the product rounded to fp32, then once to the dtype);
// with y, the dot product's terms g_out * y added to `dot` in element order.
template <typename Scalar, int Vec, typename Pack>
OMNIEP_DEVICE float scale_pack(const Pack& gv, float w, Pack* dst, const Pack* y, float dot) {
  using Cvt = Elem<Scalar>;
  Pack o;
#pragma unroll
  for (int j = 0; j < Vec; ++j) o.v[j] = Cvt::from_float(gpu::mul_rn(w, Cvt::to_float(gv.v[j])));
  *dst = o;
  if (y != nullptr) {
    const Pack yv = *y;
#pragma unroll
    for (int j = 0; j < Vec; ++j) dot = fmaf(Cvt::to_float(gv.v[j]), Cvt::to_float(yv.v[j]), dot);
  }
  return dot;
}

namespace em {
// Scalar is the element type; Vec elements per lane per load (16 bytes when rows allow, else 1).
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kEMDispatchThreads) combine_bwd_kernel(EMCombineBwdArgs a, Tr tr) {
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity, H = a.hidden;
  const int64_t n = static_cast<int64_t>(T) * K;
  const int64_t row_bytes = static_cast<int64_t>(H) * sizeof(Scalar);
  const int32_t* count = tr.local(a.recv_expert_count);
  const bool grad_w = a.with_topk_grad != 0;
  // With the caller's result (out_g_y) and y (own_y): own copies straight there, the rest through the
  // symmetric buffers (EMCombineBwdArgs).
  const bool direct = tr.local(a.out_g_y) != nullptr;
  __shared__ EMOwnSlots s_own;
  if (direct) em_find_own_slots(s_own, tr.local(a.topk_idx32), tr.local(a.copy_slot), n, me, L);
  if (grad_w && tr.local(a.own_y) != nullptr) {  // the peers read my y at their copies' slots
    uint8_t* dst = static_cast<uint8_t*>(const_cast<void*>(tr.local(a.y)));
    const uint8_t* src = static_cast<const uint8_t*>(tr.local(a.own_y));
    em_copy_slots(dst, src, count, L, C, row_bytes, sizeof(Pack), /*zero=*/0, direct ? &s_own : nullptr);
  }
  // (An op that stops here leaves g_y as it was — undefined, as the stale buffer it used to get copied:
  // the error word says why. Zeroing it here made the kernel spill.)
  if (!rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true, NoPuts{}, &a.desc[me])) return;

  // Where a copy for rank r goes and where its y is read (my own: the caller's tensors when direct).
  __shared__ void* s_g_y[kMaxRanks];
  __shared__ const void* s_y[kMaxRanks];
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    const bool own = r == me && direct;
    s_g_y[r] = own ? tr.local(a.out_g_y) : tr.peer(a.g_y, r);
    s_y[r] = own && tr.local(a.own_y) != nullptr ? tr.local(a.own_y) : static_cast<const void*>(tr.peer(a.y, r));
    // (without direct, own_y only fills the symmetric y above, and every copy is read there)
  }
  __syncthreads();

  const Scalar* g_out = static_cast<const Scalar*>(tr.local(a.g_out));
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int32_t* copy_slot = tr.local(a.copy_slot);
  const int lane = gpu::lane_id(), warps = gpu::warps_per_block();
  const int64_t first_warp = gpu::grid_warp_spread();  // (also picks the warp's stage: one-to-one)
  const int64_t all_warps = static_cast<int64_t>(gridDim.x) * warps;
  const int num_packs = H / Vec;
  Pack* stage = nullptr;  // remote path: this warp's area of the transport's scratch
  if constexpr (Tr::kHasGets) stage = reinterpret_cast<Pack*>(tr.scratch + first_warp * kCombineStageBytesPerWarp);
  constexpr int kChunk = gpu::kWarpSize * kPacks;  // packs per remote chunk: at most kCombineChunkBytes

  for (int64_t i = first_warp; i < n; i += all_warps) {
    const int slot = copy_slot[i];
    if (slot < 0) {
      if (grad_w && lane == 0) tr.local(a.g_topk_weights)[i] = 0.0f;
      continue;
    }
    const int e = idx32[i];
    const int r = e / L, l = e - r * L;
    const int64_t row = (static_cast<int64_t>(l) * C + slot) * H;
    const float w = weights[i];
    const Pack* g = reinterpret_cast<const Pack*>(g_out + (i / K) * H);
    bool far = false;
    if constexpr (Tr::kHasGets) far = tr.is_remote(r);
    float dot = 0.0f;
    if (!far) {
      Pack* dst = reinterpret_cast<Pack*>(static_cast<Scalar*>(s_g_y[r]) + row);
      const Pack* y = grad_w ? reinterpret_cast<const Pack*>(static_cast<const Scalar*>(s_y[r]) + row) : nullptr;
      for (int p = lane; p < num_packs; p += gpu::kWarpSize) {
        dot = scale_pack<Scalar, Vec>(g[p], w, dst + p, y != nullptr ? y + p : nullptr, dot);
      }
    } else if constexpr (Tr::kHasGets) {
      // Chunks of whole warps of packs: each lane meets the same packs in the same order as above.
      Scalar* dst = static_cast<Scalar*>(tr.local(a.g_y)) + row;  // MY address of r's row
      const Pack* y_mine =
          grad_w ? reinterpret_cast<const Pack*>(static_cast<const Scalar*>(tr.local(a.y)) + row) : nullptr;
      for (int base = 0; base < num_packs; base += kChunk) {
        const int m = num_packs - base < kChunk ? num_packs - base : kChunk;
        const Pack* y = grad_w ? get_packs(tr, y_mine, r, base, m, stage + kChunk) : nullptr;
        for (int p = base + lane; p < base + m; p += gpu::kWarpSize) {
          dot = scale_pack<Scalar, Vec>(g[p], w, stage + (p - base), y != nullptr ? y + p : nullptr, dot);
        }
        gpu::syncwarp();  // the chunk is complete in the stage
        tr.put_warp(dst + static_cast<int64_t>(base) * Vec, stage, static_cast<size_t>(m) * sizeof(Pack), r);
        tr.quiet();  // the put has read the stage before the next chunk rewrites it
        gpu::syncwarp();
      }
    }
    if (grad_w) {
      dot = warp_sum(dot);
      if (lane == 0) tr.local(a.g_topk_weights)[i] = dot;
    }
  }
  // The padding of the result: exactly 0 with zero_padding (DESIGN §2), else not written (no pass that
  // grows with L * C * H). Direct: in the caller's g_y, whose peers' rows arrive in my symmetric g_y and
  // are copied out once every peer has pushed (the end barrier, waited).
  uint8_t* result = static_cast<uint8_t*>(direct ? tr.local(a.out_g_y) : tr.local(a.g_y));
  em_copy_slots(result, nullptr, count, L, C, row_bytes, sizeof(Pack), a.zero_padding);
  if (!rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/direct) || !direct) return;
  em_copy_slots(result, static_cast<const uint8_t*>(tr.local(a.g_y)), count, L, C, row_bytes, sizeof(Pack),
                /*zero=*/0, &s_own);
}
}  // namespace em

}  // namespace omniep
