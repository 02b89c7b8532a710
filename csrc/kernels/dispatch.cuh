// Rank-major dispatch: every source PUSHES its rows into the receivers' buffers.
//
// Row t of source s lands at row send_offset_s[r] + send_pos_s[t, r] of receiver r, i.e. rows are
// ordered by (source rank, source token) — the contract order of DESIGN §2 — and rows at or past
// the capacity C are the ones dropped. One warp moves one token to each rank it goes to.
// The receiver meanwhile zero-fills its padding rows [num_recv, C), which no source writes.
// A receiver's own rows go to a.own_x / a.own_x2 instead when given (the caller's result tensors;
// the copy-out then skips them, kernels/copy_rows.cuh).
// Per-expert receive counts: each block counts the (token, local expert) pairs it delivered in
// shared memory and adds them to the receiver's counters once at the end; the receiver zeroed those
// counters before the start barrier and reads them after the end barrier.
//
// Remote receivers (a transport with kHasRemote, e.g. nvshmem across nodes or OMNIEP_FORCE_REMOTE=1):
// the warp PUTS the row, the scales row and the routing entries to the same slot, and adds to the
// receiver's counters with the transport's atomics; the end barrier completes them (quiet) before
// it signals. On p2p those branches compile away.
//
// Barriers: start (receivers are ready: counters zeroed, earlier users of the buffers done), end
// (all rows have arrived). The kernel completes on a rank only when its rows are all there, so
// stream order is enough for whatever runs next on that rank.
#pragma once

#include "kernels/args.h"
#include "kernels/rows.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kDispatchThreads = 512;

template <typename Tr>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_kernel(DispatchArgs a, Tr tr) {
  extern __shared__ int s_delivered[];  // [E]: pairs this block delivered to each expert
  __shared__ int s_offset[kMaxRanks];

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, E = a.num_experts, L = E / R, C = a.capacity;
  const bool routing = a.with_routing != 0;
  RankWorkspace* my_ws = tr.workspace(me);

  if (routing && blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) my_ws->expert_counter[l] = 0;
  }
  if (routing) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_delivered[e] = 0;
  }
  if (static_cast<int>(threadIdx.x) < R) s_offset[threadIdx.x] = tr.local(a.send_offset)[threadIdx.x];
  if (!rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true)) return;

  // ---- push my rows ----
  const uint8_t* x = tr.local(a.x);
  const uint8_t* x2 = tr.local(a.x2);
  const int32_t* send_pos = tr.local(a.send_pos);
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int lane = gpu::lane_id();
  const int warps = gpu::warps_per_block();
  for (int t = blockIdx.x * warps + gpu::warp_id(); t < T; t += gridDim.x * warps) {
    // Lane r < R: where token t lands at rank r (or nowhere). The row is read once and stored to
    // every destination (warp_copy_row_multi).
    uint8_t* dst_x = nullptr;
    uint8_t* dst_x2 = nullptr;
    bool sent = false;
    bool remote = false;  // lane's rank is reached by puts (transport's remote path)
    if (lane < R) {
      const int pos = send_pos[static_cast<int64_t>(t) * R + lane];
      const int64_t slot = static_cast<int64_t>(s_offset[lane]) + pos;
      sent = pos >= 0 && slot < C;  // slot >= C: dropped, past the receiver's capacity
      if constexpr (Tr::kHasRemote) remote = sent && tr.is_remote(lane);
      if (sent && !remote) {
        // My own rows go straight into my result when the caller gave one (no copy-out for them).
        uint8_t* own_x = lane == me ? tr.local(a.own_x) : nullptr;
        uint8_t* own_x2 = lane == me ? tr.local(a.own_x2) : nullptr;
        dst_x = (own_x ? own_x : tr.peer(a.recv_x, lane)) + slot * a.row_bytes;
        if (a.row2_bytes > 0) dst_x2 = (own_x2 ? own_x2 : tr.peer(a.recv_x2, lane)) + slot * a.row2_bytes;
      }
    }
    const gpu::lane_mask_t dests = gpu::ballot(sent);
    if (dests == 0) continue;
    gpu::lane_mask_t direct = dests;
    if constexpr (Tr::kHasRemote) {
      // Remote destinations: the warp puts the row (and the scales row) into the receiver's buffer at
      // the same slot as a store would; the end barrier quiets the puts before it signals.
      const gpu::lane_mask_t far = gpu::ballot(remote);
      direct = dests & ~far;
      for (gpu::lane_mask_t m = far; m; m &= m - 1) {
        const int r = gpu::lowest_lane(m);
        const int64_t slot = static_cast<int64_t>(s_offset[r]) + send_pos[static_cast<int64_t>(t) * R + r];
        tr.put_warp(tr.local(a.recv_x) + slot * a.row_bytes, x + static_cast<int64_t>(t) * a.row_bytes,
                    static_cast<size_t>(a.row_bytes), r);
        if (a.row2_bytes > 0) {
          tr.put_warp(tr.local(a.recv_x2) + slot * a.row2_bytes, x2 + static_cast<int64_t>(t) * a.row2_bytes,
                      static_cast<size_t>(a.row2_bytes), r);
        }
      }
    }
    if (!Tr::kHasRemote || direct != 0) {
      warp_copy_row_multi(dst_x, direct, x + static_cast<int64_t>(t) * a.row_bytes, a.row_bytes, a.unit);
      if (a.row2_bytes > 0) {
        warp_copy_row_multi(dst_x2, direct, x2 + static_cast<int64_t>(t) * a.row2_bytes, a.row2_bytes, a.unit2);
      }
    }
    if (routing) {
      for (gpu::lane_mask_t m = dests; m; m &= m - 1) {
        const int r = gpu::lowest_lane(m);
        const int pos = send_pos[static_cast<int64_t>(t) * R + r];
        const int64_t slot = static_cast<int64_t>(s_offset[r]) + pos;
        bool far = false;
        if constexpr (Tr::kHasRemote) far = tr.is_remote(r);
        // Remote rank: MY address of the symmetric buffers, the puts below name the rank.
        int32_t* recv_idx = (far ? tr.local(a.recv_topk_idx) : tr.peer(a.recv_topk_idx, r)) + slot * K;
        float* recv_w = (far ? tr.local(a.recv_topk_weights) : tr.peer(a.recv_topk_weights, r)) + slot * K;
        for (int k = lane; k < K; k += gpu::kWarpSize) {
          const int e = idx32[static_cast<int64_t>(t) * K + k];
          const bool mine = e >= 0 && e / L == r;
          if (!far) {
            recv_idx[k] = mine ? e - r * L : -1;
            recv_w[k] = mine ? weights[static_cast<int64_t>(t) * K + k] : 0.0f;
          } else if constexpr (Tr::kHasRemote) {
            tr.put_i32(recv_idx + k, mine ? e - r * L : -1, r);
            tr.put_f32(recv_w + k, mine ? weights[static_cast<int64_t>(t) * K + k] : 0.0f, r);
          }
          if (mine) atomicAdd(&s_delivered[e], 1);
        }
      }
    }
  }

  // ---- zero my padding rows [num_recv, C) ----
  {
    const int first = *tr.local(a.num_recv);
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
      if constexpr (Tr::kHasRemote) {
        if (tr.is_remote(e / L)) {  // remote receiver: an atomic add through the transport
          tr.atomic_add_i32(&tr.workspace(me)->expert_counter[e % L], s_delivered[e], e / L);
          continue;
        }
      }
      gpu::add_relaxed_sys(&tr.workspace(e / L)->expert_counter[e % L], s_delivered[e]);
    }
  }
  if (!rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/false) || blockIdx.x != 0) return;

  if (routing) {
    const int align = a.expert_alignment;
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      const int n = gpu::load_acquire_sys(&my_ws->expert_counter[l]);
      tr.local(a.num_recv_tokens_per_expert)[l] = (n + align - 1) / align * align;
    }
  }
}

}  // namespace omniep
