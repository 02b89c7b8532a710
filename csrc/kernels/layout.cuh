// prepare(): per-rank routing layout and the count exchange, in one kernel of one block per rank.
//
// send_pos[t, r] is an ordered exclusive prefix count over tokens (the receive order of DESIGN §2
// is "source token ascending", so this scan is what makes that order hold): chunks of blockDim
// tokens, a warp ballot per destination rank, then a scan of the per-warp totals.
// After the local layout every rank writes its num_tokens_per_rank row into every peer's count
// matrix (stores, or puts for a remote peer) and signals; after the barrier each rank knows all
// counts, hence how many rows it receives and where its own rows start at every receiver (sum over
// lower source ranks).
// A second barrier keeps a fast peer's NEXT prepare from overwriting counts still being read; the
// whole matrix is copied out (count_matrix) before it, inside the kernel: once this kernel is done a
// peer's next prepare may already be writing its new row here, so nothing may read it afterwards.
//
// The first barrier also exchanges the op descriptors (kernels/sync.cuh): an expert id outside
// [-1, E) sets this rank's input status (the id is reported to every rank, nothing moves). After it,
// every rank knows every rank's receive size: an overflow of a static capacity is recorded as a
// pending CAPACITY status (rows are dropped and counted), and with a mailbox the kernel tells the
// host its receive size and the largest one (HostMailbox), whatever happened.
//
// A static-capacity rank-major dispatch runs the same steps inside the dispatch kernel (dispatch.cuh,
// DispatchArgs::route): its start barrier carries the counts, its end barrier keeps them from being
// rewritten too early; one launch and two barriers fewer.
#pragma once

#include "kernels/args.h"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kLayoutThreads = 1024;
inline constexpr int kLayoutIdsAhead = 8;  // a thread's expert ids loaded together (DeepEP's top-8: one load round)
// Fewest tokens for which the layout is split over the blocks (route_layout): below, one block's chunks
// take less than the split's barrier of the blocks (one H100: 128 tokens 12.0 µs on one block, 16.2 on
// 24; 4096 tokens 41.0 µs on one block, 18.2 on 24).
inline constexpr int kRouteMinTokens = 1024;
// A bound on layout_kernel's static shared memory (~2.4 KB: the scan's per-warp bases, the barrier's and
// the kernel's own arrays), which shares the 48 KB with the per-expert counts.
inline constexpr size_t kLayoutStaticSmem = 4096;

// One thread: the host's copy of this prepare's outcome, `ticket` last (system scope: the host polls it).
OMNIEP_DEVICE void publish(HostMailbox* mailbox, int32_t ticket, int32_t rows, int32_t max_rows, bool stopped,
                           const RankWorkspace* ws) {
  mailbox->rows = rows;
  mailbox->max_rows = max_rows;
  mailbox->stopped = stopped ? 1 : 0;
  mailbox->fatal = ws->fatal.w[kStCode];
  mailbox->pending = ws->pending.w[kStCode];
  gpu::fence_acq_rel_sys();
  mailbox->ticket = ticket;
}

// Block-wide: the layout of tokens [t0, t1) — idx32 and the check of every id (the first bad one into
// *s_bad / *s_bad_id), the per-expert counts added to s_per_expert (unless null), and send_pos[t, r] for
// each t of the range: its position among the range's tokens bound for r (an ordered prefix count: the
// receive order of DESIGN §2), -1 if it sends r nothing; s_running[r] (zeroed by the caller) ends as the
// range's rows to r. idx: [T, K] int32 or int64 (index_bytes 4 or 8: a runtime choice, so that a kernel
// holds one copy of the shared arrays). blockDim.x <= kLayoutThreads.
template <typename Tr>
OMNIEP_DEVICE void layout_range(const Tr& tr, const void* idx, int index_bytes, int32_t* idx32, int32_t* send_pos,
                                int t0, int t1, int K, int E, int* s_per_expert, int* s_running, int* s_bad,
                                long long* s_bad_id) {
  __shared__ int s_warp_base[kLayoutThreads / gpu::kWarpSize][kMaxRanks];
  const int R = tr.num_ranks(), L = E / R;
  const int warp = gpu::warp_id(), nwarps = gpu::warps_per_block();
  for (int base = t0; base < t1; base += blockDim.x) {  // uniform trip count: ballots stay convergent
    const int t = base + threadIdx.x;
    uint32_t dest_mask = 0;
    if (t < t1) {
      for (int k0 = 0; k0 < K; k0 += kLayoutIdsAhead) {
        // Every load of the group first, so that the shared atomics below do not order each load after
        // the one before (measured alone it moved nothing; splitting the tokens over the blocks did:
        // route_layout, benchmarks/RESULTS.md 2026-11-27).
        int64_t ids[kLayoutIdsAhead];
#pragma unroll
        for (int u = 0; u < kLayoutIdsAhead; ++u) {
          const int64_t i = static_cast<int64_t>(t) * K + k0 + u;
          if (k0 + u < K) {
            ids[u] = index_bytes == 8 ? static_cast<const int64_t*>(idx)[i]
                                      : static_cast<int64_t>(static_cast<const int32_t*>(idx)[i]);
          }
        }
#pragma unroll
        for (int u = 0; u < kLayoutIdsAhead; ++u) {
          if (k0 + u >= K) continue;  // (not break: clang then leaves the loop rolled)
          const int64_t e64 = ids[u];
          const int e = (e64 >= 0 && e64 < E) ? static_cast<int>(e64) : -1;
          if (e64 < -1 || e64 >= E) {
            if (atomicCAS(s_bad, 0, 1) == 0) *s_bad_id = static_cast<long long>(e64);
          }
          idx32[static_cast<int64_t>(t) * K + k0 + u] = e;
          if (e >= 0) {
            if (s_per_expert != nullptr) atomicAdd(&s_per_expert[e], 1);
            dest_mask |= 1u << (e / L);
          }
        }
      }
    }
    gpu::lane_mask_t ballots[kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      ballots[r] = gpu::ballot((dest_mask >> r) & 1u);
      if (r < R && gpu::lane_id() == 0) s_warp_base[warp][r] = gpu::popc(ballots[r]);
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < R) {  // exclusive scan of warp totals, one thread per rank
      const int r = threadIdx.x;
      int run = s_running[r];
      for (int w = 0; w < nwarps; ++w) {
        const int v = s_warp_base[w][r];
        s_warp_base[w][r] = run;
        run += v;
      }
      s_running[r] = run;
    }
    __syncthreads();
    if (t < t1) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if (r < R) {
          const bool sent = (dest_mask >> r) & 1u;
          const int pos = s_warp_base[warp][r] + gpu::popc(ballots[r] & gpu::lanes_below());
          send_pos[static_cast<int64_t>(t) * R + r] = sent ? pos : -1;
        }
      }
    }
    __syncthreads();  // s_warp_base is rewritten by the next chunk
  }
}

// Block-wide: this rank's row of every peer's count matrix (`rows[r]`: what it sends rank r; stores, or
// puts for a remote peer: the barrier quiets and signals) and num_tokens_per_rank; the verdict on its
// ids into *s_desc. Before the count exchange.
template <typename Tr>
OMNIEP_DEVICE void layout_publish(const Tr& tr, const int* rows, int32_t* num_tokens_per_rank, bool bad,
                                  long long bad_id, OpDesc* s_desc) {
  const int me = tr.rank(), R = tr.num_ranks();
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    num_tokens_per_rank[r] = rows[r];
    bool remote = false;
    if constexpr (Tr::kHasRemote) remote = tr.is_remote(r);
    if (!remote) {
      int32_t* row = &tr.workspace(r)->counts[me * kMaxRanks];  // my row of peer r's count matrix
      for (int j = 0; j < R; ++j) row[j] = rows[j];
    } else if constexpr (Tr::kHasRemote) {  // remote path: put the row (the barrier quiets and signals)
      int32_t* row = &tr.workspace(me)->counts[me * kMaxRanks];  // same offset in r's workspace
      for (int j = 0; j < R; ++j) tr.put_i32(row + j, rows[j], r);
    }
  }
  if (threadIdx.x == 0 && bad) {
    s_desc->w[kDescInputStatus] = kInputBadExpertId;  // reported as int32 (clamped): the message names a bad id
    s_desc->w[kDescInputDetail] =
        static_cast<int32_t>(bad_id > INT32_MAX ? INT32_MAX : bad_id < INT32_MIN ? INT32_MIN : bad_id);
  }
  __syncthreads();
}

// Block-wide, before the count exchange: this rank's whole layout on one block (idx32, send_pos, the
// per-expert and per-rank counts), published (layout_publish). s_per_expert: E ints of shared memory;
// s_running: kMaxRanks ints of shared memory (out: the per-rank totals).
template <typename Tr>
OMNIEP_DEVICE void local_layout(const Tr& tr, const void* idx, int index_bytes, int32_t* idx32, int32_t* send_pos,
                                int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, int T, int K, int E,
                                int* s_per_expert, int* s_running, OpDesc* s_desc) {
  __shared__ int s_bad;  // an id outside [-1, E) was seen
  __shared__ long long s_bad_id;
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_per_expert[e] = 0;
  if (threadIdx.x < kMaxRanks) s_running[threadIdx.x] = 0;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  layout_range(tr, idx, index_bytes, idx32, send_pos, 0, T, K, E, s_per_expert, s_running, &s_bad, &s_bad_id);
  OMNIEP_STAMP("layout_scan");
  for (int e = threadIdx.x; e < E; e += blockDim.x) num_tokens_per_expert[e] = s_per_expert[e];
  layout_publish(tr, s_running, num_tokens_per_rank, s_bad != 0, s_bad_id, s_desc);
}

// Every block of the rank, before the count exchange: the layout local_layout makes, bit for bit, with
// the tokens split over the blocks (a static-capacity dispatch routes itself with it, dispatch.cuh; one
// block took ~37 µs for DeepEP's 4096 x top-8). Block b lays out its contiguous range of tokens with
// positions counted from the range's start and leaves its rows per rank in the workspace; after a barrier
// of the rank's blocks each block shifts its range's send_pos by the rows the lower blocks send each rank
// and adds its per-expert counts to num_tokens_per_expert (zeroed by block 0 before the barrier); block 0
// publishes the totals. s_per_expert: E ints of shared memory; s_running: kMaxRanks ints of shared memory.
// Returns false (on every block) when the barrier timed out (a LOCAL_TIMEOUT naming `phase` is recorded)
// or the rank is in error: the op then stops at its count exchange, whose caller routes nothing. Needs
// gridDim.x <= kMaxRouteBlocks.
template <typename Tr>
__device__ bool route_layout(const Tr& tr, const void* idx, int index_bytes, int32_t* idx32, int32_t* send_pos,
                             int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, int T, int K, int E,
                             int* s_per_expert, int* s_running, OpDesc* s_desc, int phase) {
  __shared__ int s_bad;
  __shared__ long long s_bad_id;
  __shared__ int s_base[kMaxRanks];
  const int me = tr.rank(), R = tr.num_ranks();
  const int b = blockIdx.x, G = gridDim.x;
  RankWorkspace* ws = tr.workspace(me);
  const int t0 = static_cast<int>(static_cast<int64_t>(T) * b / G);
  const int t1 = static_cast<int>(static_cast<int64_t>(T) * (b + 1) / G);
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_per_expert[e] = 0;
  if (threadIdx.x < kMaxRanks) s_running[threadIdx.x] = 0;
  if (threadIdx.x == 0) s_bad = 0;
  if (b == 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) num_tokens_per_expert[e] = 0;
  }
  __syncthreads();
  layout_range(tr, idx, index_bytes, idx32, send_pos, t0, t1, K, E, s_per_expert, s_running, &s_bad, &s_bad_id);
  if (static_cast<int>(threadIdx.x) < R) ws->route_rows[b * kMaxRanks + threadIdx.x] = s_running[threadIdx.x];
  if (threadIdx.x == 0 && s_bad && atomicCAS(&ws->route_bad, 0, 1) == 0) ws->route_bad_id = s_bad_id;
  // (a rank in error skips the shift: a block that timed out there has left, and block 0 overwrites
  // send_pos with "nothing" once the count exchange stops the op)
  if (!grid_barrier(tr, phase) || has_error(ws)) return false;
  OMNIEP_STAMP("layout_blocks");
  if (static_cast<int>(threadIdx.x) < R) {  // the rows of the lower blocks (my base) and of all (block 0)
    const int r = threadIdx.x;
    int below = 0, all = 0;
    for (int j = 0; j < G; ++j) {
      const int n = ws->route_rows[j * kMaxRanks + r];
      below += j < b ? n : 0;
      all += n;
    }
    s_base[r] = below;
    s_running[r] = all;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (s_per_expert[e] != 0) atomicAdd(&num_tokens_per_expert[e], s_per_expert[e]);
  }
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(t0) * R + threadIdx.x; i < static_cast<int64_t>(t1) * R; i += blockDim.x) {
    const int pos = send_pos[i];
    if (pos >= 0) send_pos[i] = pos + s_base[i % R];
  }
  if (b == 0) {
    // (no block writes route_bad again in this op: the next op's blocks find it cleared)
    const bool bad = ws->route_bad != 0;
    const long long bad_id = ws->route_bad_id;
    __syncthreads();
    if (threadIdx.x == 0) ws->route_bad = 0;
    layout_publish(tr, s_running, num_tokens_per_rank, bad, bad_id, s_desc);
  }
  return true;
}

// Every block of the rank, before the count exchange: the layout, split over the blocks (route_layout)
// where there are blocks to split over and more than kRouteMinTokens tokens, else on block 0 alone
// (local_layout). Block 0's *s_desc carries the verdict on the ids either way. A failed wait of the split
// stops the op at the count exchange that follows (the rank's status is set).
template <typename Tr>
__device__ void rank_layout(const Tr& tr, const void* idx, int index_bytes, int32_t* idx32, int32_t* send_pos,
                            int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, int T, int K, int E,
                            int* s_per_expert, int* s_running, OpDesc* s_desc, int phase) {
  if (gridDim.x > 1 && gridDim.x <= kMaxRouteBlocks && T > kRouteMinTokens) {
    route_layout(tr, idx, index_bytes, idx32, send_pos, num_tokens_per_rank, num_tokens_per_expert, T, K, E,
                 s_per_expert, s_running, s_desc, phase);
  } else if (blockIdx.x == 0) {
    local_layout(tr, idx, index_bytes, idx32, send_pos, num_tokens_per_rank, num_tokens_per_expert, T, K, E,
                 s_per_expert, s_running, s_desc);
  }
}

// Block-wide, when the op stopped at its count exchange (on every rank): a handle that routes nothing,
// so that a binding which cannot stop the ops after this one (XLA runs the whole program) moves nothing
// with it, instead of indexing peers' buffers with counts that were never exchanged.
template <typename Tr>
OMNIEP_DEVICE void layout_route_nothing(const Tr& tr, int32_t* send_pos, int32_t* recv_counts, int32_t* send_offset,
                                        int32_t* num_recv, int32_t* dropped, int T) {
  const int R = tr.num_ranks();
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(T) * R; i += blockDim.x) send_pos[i] = -1;
  if (static_cast<int>(threadIdx.x) < R) {
    recv_counts[threadIdx.x] = 0;
    send_offset[threadIdx.x] = 0;
  }
  if (threadIdx.x == 0) {
    *num_recv = 0;
    *dropped = 0;
  }
}

// From the count matrix in my workspace after the exchange (row s: what rank s sends every rank): the rows
// rank r receives, and where my rows start among them (what the lower sources send r).
OMNIEP_DEVICE int64_t exchanged_rows_to(const RankWorkspace* ws, int r, int R) {
  int64_t rows = 0;
  for (int s = 0; s < R; ++s) rows += ws->counts[s * kMaxRanks + r];
  return rows;
}

OMNIEP_DEVICE int exchanged_offset_at(const RankWorkspace* ws, int me, int r) {
  int offset = 0;
  for (int s = 0; s < me; ++s) offset += ws->counts[s * kMaxRanks + r];
  return offset;
}

// Block-wide, after the count exchange: the receive side of the layout from the count matrix (every
// rank's row), read before the barrier that lets a peer's next op rewrite it. Returns (thread 0) this
// rank's received rows in *total and the largest receive in *largest.
template <typename Tr>
OMNIEP_DEVICE void layout_exchanged(const Tr& tr, int32_t* recv_counts, int32_t* send_offset, int32_t* count_matrix,
                                    int32_t* num_recv, int32_t* dropped, int capacity, int64_t* total,
                                    int64_t* largest) {
  const int me = tr.rank(), R = tr.num_ranks();
  RankWorkspace* ws = tr.workspace(me);
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    recv_counts[r] = ws->counts[r * kMaxRanks + me];
    send_offset[r] = exchanged_offset_at(ws, me, r);
  }
  if (count_matrix != nullptr) {
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) count_matrix[i] = ws->counts[(i / R) * kMaxRanks + i % R];
  }
  if (threadIdx.x == 0) {
    int64_t mine = 0, most = 0;
    for (int r = 0; r < R; ++r) {
      const int64_t rows = exchanged_rows_to(ws, r, R);
      if (r == me) mine = rows;
      if (rows > capacity) record_overflow(ws, me, r, static_cast<int>(rows), capacity);  // the first wins
      most = rows > most ? rows : most;
    }
    const int64_t kept = mine < capacity ? mine : capacity;
    *num_recv = static_cast<int32_t>(kept);
    *dropped = static_cast<int32_t>(mine - kept);
    *total = mine;
    *largest = most;
  }
}

template <typename Tr, typename Index>
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(LayoutArgs a, Tr tr) {
  extern __shared__ int s_per_expert[];  // [E]
  __shared__ int s_running[kMaxRanks];
  __shared__ OpDesc s_desc;  // mine, with the verdict on my ids

  const int me = tr.rank();
  const int T = a.num_tokens[me];
  OMNIEP_STAMPS_BEGIN();
  if (threadIdx.x == 0) s_desc = a.desc[me];
  // (virtual ranks launch one block; block 0 writes the outputs below either way)
  rank_layout(tr, tr.local(a.topk_idx), static_cast<int>(sizeof(Index)), tr.local(a.topk_idx32), tr.local(a.send_pos),
              tr.local(a.num_tokens_per_rank), tr.local(a.num_tokens_per_expert), T, a.num_topk, a.num_experts,
              s_per_expert, s_running, &s_desc, kPhaseLayoutExchange);
  RankWorkspace* ws = tr.workspace(me);
  HostMailbox* mailbox = tr.local(a.mailbox);
  if (!rank_barrier(tr, kPhaseLayoutExchange, /*all_wait=*/true, NoPuts{}, &s_desc)) {
    if (blockIdx.x != 0) return;
    layout_route_nothing(tr, tr.local(a.send_pos), tr.local(a.recv_counts), tr.local(a.send_offset),
                         tr.local(a.num_recv), tr.local(a.dropped), T);
    if (threadIdx.x == 0 && mailbox != nullptr) publish(mailbox, a.ticket, 0, 0, true, ws);
    return;
  }
  if (blockIdx.x == 0) {
    int64_t total = 0, largest = 0;
    layout_exchanged(tr, tr.local(a.recv_counts), tr.local(a.send_offset), tr.local(a.count_matrix),
                     tr.local(a.num_recv), tr.local(a.dropped), a.capacity, &total, &largest);
    if (threadIdx.x == 0 && mailbox != nullptr) {
      publish(mailbox, a.ticket, static_cast<int32_t>(total), static_cast<int32_t>(largest), false, ws);
    }
  }
  rank_barrier(tr, kPhaseLayoutDone, /*all_wait=*/false);
  OMNIEP_STAMP("end_barrier");
  OMNIEP_STAMPS_END("layout_kernel", me);
}

}  // namespace omniep
