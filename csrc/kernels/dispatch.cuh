// Rank-major dispatch: every source PUSHES its rows into the receivers' buffers.
//
// Row t of source s lands at row send_offset_s[r] + send_pos_s[t, r] of receiver r, i.e. rows are
// ordered by (source rank, source token) — the contract order of DESIGN §2 — and rows at or past
// the capacity C are the ones dropped. One warp moves one token to each rank it goes to, taking its
// next token from the rank's queue when it is done (kernels/token_queue.cuh).
// The receiver meanwhile zero-fills its padding rows [min(sum(recv_counts), C), C), which no source
// writes.
// A receiver's own rows go to a.own_x / a.own_x2 instead when given (the caller's result tensors;
// the copy-out then skips them, kernels/copy_rows.cuh). With a.copy_rows the kernel does that
// copy-out itself after the end barrier (small ops: one launch fewer).
// Per-expert receive counts: each block counts the (token, local expert) pairs it delivered in
// shared memory and adds them to the receiver's counters once at the end; the receiver zeroed those
// counters before the start barrier and reads them after the end barrier.
//
// Remote receivers (a transport with kHasRemote: nvshmem or GIN across nodes, OMNIEP_FORCE_REMOTE=1):
// the warp stores the row, the scales row and the routing entries into MY mirror for that receiver
// at the same slot (omniep/transport.h: the data buffer's layout once per rank), and the block adds
// its delivered pairs to my sent_expert counters. My rows at a receiver are contiguous (slots
// [send_offset[r], + kept)), so at the end barrier the thread that signals receiver r first puts
// each region's block of rows, then my sent_expert[r's experts] into r's remote_expert[me]: a few
// bulk puts per peer, from registered memory, no atomics (GIN has none). The receiver adds those
// counts to its expert_counter. On p2p those branches compile away.
//
// Barriers: start (receivers are ready: counters zeroed, earlier users of the buffers done), end
// (all rows have arrived). The kernel completes on a rank only when its rows are all there, so
// stream order is enough for whatever runs next on that rank.
//
// With a.route.on (static capacity) the kernel routes itself (layout.cuh, rank_layout: its blocks split
// the tokens, or block 0 alone for few), then the start barrier also carries the count rows and judges the
// ids; after it every block reads the count matrix, which no peer rewrites before the end barrier.
#pragma once

#include "kernels/args.h"
#include "kernels/copy_rows.cuh"
#include "kernels/layout.cuh"
#include "kernels/rows.cuh"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"
#include "kernels/token_queue.cuh"

namespace omniep {

inline constexpr int kDispatchThreads = 512;
// A bound on dispatch_kernel's static shared memory (~2.5 KB: the layout scan's per-warp bases, the
// barrier's and the kernel's own arrays), which shares the 48 KB with the per-expert arrays.
inline constexpr size_t kDispatchStaticSmem = 4096;

template <typename Tr>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_kernel(DispatchArgs a, Tr tr) {
  extern __shared__ int s_delivered[];  // [E]: pairs this block delivered to each expert; route: [E] more
  __shared__ int s_offset[kMaxRanks];
  __shared__ int s_rows[kMaxRanks];  // remote path (block 0): my rows that remote rank r keeps
  __shared__ OpDesc s_desc;          // mine (route, block 0: with the verdict on my ids)

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, E = a.num_experts, L = E / R, C = a.capacity;
  const bool routing = a.with_routing != 0;
  RankWorkspace* my_ws = tr.workspace(me);

  bool any_remote = false;
  if constexpr (Tr::kHasRemote) any_remote = tr.any_remote();
  token_queue_reset(my_ws, kQueueDispatch);  // (the start barrier waits on every block)
  if (routing && blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) my_ws->expert_counter[l] = 0;
    if (any_remote) {
      for (int e = threadIdx.x; e < E; e += blockDim.x) my_ws->sent_expert[e] = 0;
    }
  }
  if (routing) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_delivered[e] = 0;
  }
  const bool route = a.route.on != 0;
  OMNIEP_STAMPS_BEGIN();
  if (threadIdx.x == 0) s_desc = a.desc[me];
  if (route) {  // the layout, before the barrier that exchanges its counts
    rank_layout(tr, tr.local(a.route.topk_idx), a.route.index_bytes, const_cast<int32_t*>(tr.local(a.topk_idx32)),
                const_cast<int32_t*>(tr.local(a.send_pos)), tr.local(a.route.num_tokens_per_rank),
                tr.local(a.route.num_tokens_per_expert), T, K, E, s_delivered + E, s_rows, &s_desc,
                kPhaseDispatchStart);
  }
  OMNIEP_STAMP("layout");
  if (!route && static_cast<int>(threadIdx.x) < R) s_offset[threadIdx.x] = tr.local(a.send_offset)[threadIdx.x];
  if (!rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true, NoPuts{}, &s_desc)) {
    if (route && blockIdx.x == 0) {
      layout_route_nothing(tr, const_cast<int32_t*>(tr.local(a.send_pos)),
                           const_cast<int32_t*>(tr.local(a.recv_counts)),
                           const_cast<int32_t*>(tr.local(a.send_offset)), tr.local(a.route.num_recv),
                           tr.local(a.route.dropped), T);
    }
    return;
  }
  OMNIEP_STAMP("start_barrier");
  if (route) {  // every block: where my rows start at each receiver, from the count matrix
    if (static_cast<int>(threadIdx.x) < R) {
      s_offset[threadIdx.x] = exchanged_offset_at(tr.workspace(me), me, static_cast<int>(threadIdx.x));
    }
    if (blockIdx.x == 0) {
      int64_t total = 0, largest = 0;
      layout_exchanged(tr, const_cast<int32_t*>(tr.local(a.recv_counts)), const_cast<int32_t*>(tr.local(a.send_offset)),
                       nullptr, tr.local(a.route.num_recv), tr.local(a.route.dropped), C, &total, &largest);
    }
    __syncthreads();
  }

  // ---- push my rows ----
  const uint8_t* x = tr.local(a.x);
  const uint8_t* x2 = tr.local(a.x2);
  const int32_t* send_pos = tr.local(a.send_pos);
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int lane = gpu::lane_id();
  const int warps = gpu::warps_per_block();
  uint32_t* const tokens = &my_ws->work_next[kQueueDispatch];
  TokenQueue queue(tokens);  // a warp takes its next token when it is free
  for (int t = queue.next(tokens, T); t < T; t = queue.next(tokens, T)) {
    // Lane r < R: where token t lands at rank r (or nowhere). The row is read once and stored to
    // every destination (warp_copy_row_multi).
    uint8_t* dst_x = nullptr;
    uint8_t* dst_x2 = nullptr;
    bool sent = false;
    bool remote = false;  // lane's rank is reached by puts (transport's remote path)
    int64_t slot = -1;    // lane r < R: the token's slot at rank r
    // Lane k < K: the token's k-th expert and weight, loaded before the row copy (the routing entries
    // after it would otherwise wait for them: 7.7 µs of a 4096-token static dispatch on one H100).
    int first_e = -1;
    float first_w = 0.0f;
    if (routing && lane < K) {
      first_e = idx32[static_cast<int64_t>(t) * K + lane];
      first_w = weights[static_cast<int64_t>(t) * K + lane];
    }
    if (lane < R) {
      const int pos = send_pos[static_cast<int64_t>(t) * R + lane];
      slot = static_cast<int64_t>(s_offset[lane]) + pos;
      sent = pos >= 0 && slot < C;  // slot >= C: dropped, past the receiver's capacity
      if constexpr (Tr::kHasRemote) remote = sent && tr.is_remote(lane);
      if (sent) {
        // My own rows go straight into my result when the caller gave one (no copy-out for them).
        uint8_t* own_x = lane == me ? tr.local(a.own_x) : nullptr;
        uint8_t* own_x2 = lane == me ? tr.local(a.own_x2) : nullptr;
        dst_x = (own_x ? own_x : copy_of(tr, a.recv_x, lane, remote)) + slot * a.row_bytes;
        if (a.row2_bytes > 0) dst_x2 = (own_x2 ? own_x2 : copy_of(tr, a.recv_x2, lane, remote)) + slot * a.row2_bytes;
      }
    }
    const gpu::lane_mask_t dests = gpu::ballot(sent);
    if (dests == 0) continue;
    warp_copy_row_multi(dst_x, dests, x + static_cast<int64_t>(t) * a.row_bytes, a.row_bytes, a.unit);
    if (a.row2_bytes > 0) {
      warp_copy_row_multi(dst_x2, dests, x2 + static_cast<int64_t>(t) * a.row2_bytes, a.row2_bytes, a.unit2);
    }
    if (routing) {
      for (gpu::lane_mask_t m = dests; m; m &= m - 1) {
        const int r = gpu::lowest_lane(m);
        const int64_t at = gpu::shfl(static_cast<long long>(slot), r);
        bool far = false;
        if constexpr (Tr::kHasRemote) far = tr.is_remote(r);
        int32_t* recv_idx = copy_of(tr, a.recv_topk_idx, r, far) + at * K;
        float* recv_w = copy_of(tr, a.recv_topk_weights, r, far) + at * K;
        for (int k = lane; k < K; k += gpu::kWarpSize) {
          const int e = k == lane ? first_e : idx32[static_cast<int64_t>(t) * K + k];
          const bool mine = e >= 0 && e / L == r;
          recv_idx[k] = mine ? e - r * L : -1;
          recv_w[k] = mine ? (k == lane ? first_w : weights[static_cast<int64_t>(t) * K + k]) : 0.0f;
          if (mine) atomicAdd(&s_delivered[e], 1);
        }
      }
    }
  }

  OMNIEP_STAMP_WARPS("pushed");
  // ---- zero my padding rows [rows received, C) ----
  {
    // (route: block 0 writes recv_counts after the start barrier, so the other blocks read the matrix)
    int64_t received = 0;
    if (route) {
      received = exchanged_rows_to(tr.workspace(me), me, R);
    } else {
      const int32_t* recv_counts = tr.local(a.recv_counts);
      for (int s = 0; s < R; ++s) received += recv_counts[s];
    }
    const int first = static_cast<int>(received < C ? received : C);
    uint8_t* recv_x = tr.local(a.recv_x);
    uint8_t* recv_x2 = tr.local(a.recv_x2);
    int32_t* recv_idx = tr.local(a.recv_topk_idx);
    float* recv_w = tr.local(a.recv_topk_weights);
    for (int64_t row = first + blockIdx.x * warps + gpu::warp_id(); row < C; row += gridDim.x * warps) {
      warp_zero_row(recv_x + row * a.row_bytes, a.row_bytes, a.unit);
      if (a.row2_bytes > 0) warp_zero_row(recv_x2 + row * a.row2_bytes, a.row2_bytes, a.unit2);
      if (routing) {
        for (int k = lane; k < K; k += gpu::kWarpSize) {
          recv_idx[row * K + k] = -1;
          recv_w[row * K + k] = 0.0f;
        }
      }
    }
  }

  if (routing) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      if (s_delivered[e] == 0) continue;
      bool far = false;
      if constexpr (Tr::kHasRemote) far = tr.is_remote(e / L);
      if (far) {
        atomicAdd(&my_ws->sent_expert[e], s_delivered[e]);  // put to the receiver at the end barrier
      } else {
        gpu::add_relaxed_sys(&tr.workspace(e / L)->expert_counter[e % L], s_delivered[e]);
      }
    }
  }
  if constexpr (Tr::kHasRemote) {
    if (any_remote && blockIdx.x == 0) remote_send_rows(tr, send_pos, s_offset, T, C, s_rows);
  }
  // The thread that signals remote rank r puts my rows there first: each region's block of rows
  // (slots [s_offset[r], + s_rows[r]), staged in my mirror for r) and my pairs for its experts.
  const auto puts = [&](int r) {
    if constexpr (Tr::kHasRemote) {
      const int64_t first = s_offset[r], rows = s_rows[r];
      put_rows(tr, tr.local(a.recv_x), a.row_bytes, first, rows, r);
      if (a.row2_bytes > 0) put_rows(tr, tr.local(a.recv_x2), a.row2_bytes, first, rows, r);
      if (routing) {
        put_rows(tr, tr.local(a.recv_topk_idx), K * 4, first, rows, r);
        put_rows(tr, tr.local(a.recv_topk_weights), K * 4, first, rows, r);
        tr.put_block(&my_ws->remote_expert[me * kMaxLocalExperts], &my_ws->sent_expert[r * L], L * sizeof(int32_t), r);
      }
    }
  };
  int32_t* out_idx = tr.local(a.out_topk_idx);
  float* out_w = tr.local(a.out_topk_weights);
  const bool copy_out = routing && out_idx != nullptr;
  // With anything to copy out, every block waits for the peers (their rows have arrived).
  OMNIEP_STAMP("padding_counts");
  if (!rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/copy_out || a.copy_rows > 0, puts)) return;
  OMNIEP_STAMP("end_barrier");
  if (a.copy_rows > 0) {  // the rows but my own (those went straight to own_x): the fused copy-out
    const int64_t b = s_offset[me], e = b + tr.local(a.recv_counts)[me];
    grid_copy_rows_except(tr.local(a.own_x), tr.local(a.recv_x), a.row_bytes, a.copy_rows, b, e, a.unit);
    if (a.row2_bytes > 0) {
      grid_copy_rows_except(tr.local(a.own_x2), tr.local(a.recv_x2), a.row2_bytes, a.copy_rows, b, e, a.unit2);
    }
  }
  if (copy_out) {
    const int32_t* idx_in = tr.local(a.recv_topk_idx);
    const float* w_in = tr.local(a.recv_topk_weights);
    const int64_t n = static_cast<int64_t>(a.out_rows) * K;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      out_idx[j] = idx_in[j];
      out_w[j] = w_in[j];
    }
  }
  OMNIEP_STAMP("copied_out");
  OMNIEP_STAMPS_END(route ? "dispatch_kernel(route)" : "dispatch_kernel", me);
  if (blockIdx.x != 0) return;

  if (routing) {
    const int align = a.expert_alignment;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int n = gpu::load_acquire_sys(&my_ws->expert_counter[l]);
      if constexpr (Tr::kHasRemote) {
        for (int r = 0; r < R && any_remote; ++r) {
          if (tr.is_remote(r)) n += my_ws->remote_expert[r * kMaxLocalExperts + l];
        }
      }
      tr.local(a.num_recv_tokens_per_expert)[l] = (n + align - 1) / align * align;
    }
  }
}

}  // namespace omniep
