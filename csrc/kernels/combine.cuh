// Rank-major combine (and dispatch_bwd): every source PULLS its rows back from the receivers.
//
// out[t] = sum over ranks r in ASCENDING order of y_r[send_offset[r] + send_pos[t, r]] (rows past
// the capacity were dropped and contribute nothing), accumulated in fp32 from +0.0 with
// round-to-nearest adds (__fadd_rn: never contracted or reassociated), then the bias terms in the
// order given, rounded once to the output dtype. This is exactly omniep.ep_core.reference.combine.
// With with_topk_grad (dispatch_bwd) the same pass reads back g_topk_weights[t, k] from the slot
// that carried it: g_recv_topk_weights of the owning rank, or 0 when not routed or dropped.
//
// Remote ranks (a transport with kHasRemote: nvshmem or GIN across nodes, OMNIEP_FORCE_REMOTE=1) are
// not read: they PUT my rows back. At the start barrier I put (first slot, rows kept) of mine to each
// remote rank r (its push_rows[me]); after it, a second barrier (kPhaseCombinePush) in which r puts
// that block of its y (and of g_recv_topk_weights) into my mirror for r, at the same slots
// (omniep/transport.h). I then read r's rows from my mirror: the sum is the same, in the same order
// (bitwise unchanged). On p2p those branches compile away.
//
// A rank's own rows come from a.own_y when given (the caller's y; the copy-in skipped them). With
// a.copy_rows the kernel does that copy-in itself before the start barrier (small ops).
//
// Barriers: start (every rank's y is complete: its producer ran before this kernel on that rank's
// stream), end (peers finished reading my y, so my stream may free or overwrite it afterwards).
#pragma once

#include "kernels/args.h"
#include "kernels/bulk.cuh"
#include "kernels/copy_rows.cuh"
#include "kernels/rows.cuh"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"
#include "kernels/token_queue.cuh"

namespace omniep {

inline constexpr int kCombineThreads = 512;
inline constexpr int kPacks = 4;  // packs per lane per step (loads in flight per rank)
inline constexpr int kCombineStep = gpu::kWarpSize * kPacks;  // packs per step of a warp
// The bulk path (CUDA sm_90): units (a step of two ranks) per warp in its ring, one summed while the
// others load; the ring's bytes (dynamic shared memory of a launch that takes the path: combine_ring_smem).
inline constexpr int kCombineStages = 3;
inline constexpr size_t kCombineRingBytes =
    static_cast<size_t>(kCombineThreads / gpu::kWarpSize) * kCombineStages * 2 * kCombineStep * 16;
// Expert-major remote path (em_combine.cuh, em_dispatch.cuh): bytes of one chunk of a row in a warp's
// stage (16-byte packs), and a warp's stage (two chunks). The host sizes the transport's scratch as
// blocks * (kCombineThreads / warp size) * this.
inline constexpr int kCombineChunkBytes = gpu::kWarpSize * kPacks * 16;
inline constexpr int kCombineStageBytesPerWarp = 2 * kCombineChunkBytes;

// Rank r's y as this rank reads it: my own rows from the caller's y when given (the copy-in skipped
// them), a remote rank's from my mirror for it (it put them there), everything else from the
// symmetric buffer.
template <typename Tr>
OMNIEP_DEVICE const void* y_of(const Tr& tr, const CombineArgs& a, int r) {
  const void* own = r == tr.rank() ? tr.local(a.own_y) : nullptr;
  if (own != nullptr) return own;
  if constexpr (Tr::kHasRemote) {
    if (tr.is_remote(r)) return tr.mirror(tr.local(a.y), r);
  }
  return tr.peer(a.y, r);
}

// Scalar is the element type; Vec elements per lane per step (16 bytes when rows allow, else 1).
//
// A warp sums one token at a time (the next from the rank's queue when it is done: kernels/token_queue.cuh),
// a step (kCombineStep packs of the row) at a time, the ranks' rows of a step two at a time. Two ways to
// load them, the same sums in the same order (bitwise the same):
// - registers: each lane loads its packs of two ranks, then adds them (every lane of every instance);
// - bulk (CUDA sm_90, 16-byte packs, when the launch gave the ring: combine_ring_smem): lane 0 issues a
//   TMA bulk load of each rank's span of the step into this warp's ring in shared memory, kCombineStages
//   units (a step of two ranks) ahead of the one the lanes sum, so a warp keeps loads in flight while
//   it adds and the loads cost one instruction per span, not one per 16 bytes.
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineArgs a, Tr tr) {
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  constexpr int kWarps = kCombineThreads / gpu::kWarpSize;
  // Per warp and token in flight (a ring of kCombineStages: the bulk path's loads run ahead of the sums
  // by up to kCombineStages - 1 tokens): the token's row at rank r, or -1 / null.
  __shared__ int64_t s_slot[kWarps][kCombineStages][kMaxRanks];
  __shared__ const Pack* s_src[kWarps][kCombineStages][kMaxRanks];
  __shared__ const Scalar* s_y[kMaxRanks];     // rank r's y as this rank reads it (y_of)
  __shared__ const float* s_g[kMaxRanks];      // with_topk_grad: rank r's g_recv_topk_weights, likewise
  using Cvt = Elem<Scalar>;

  __shared__ int s_first[kMaxRanks];  // remote path: my first slot at rank r (send_offset)
  __shared__ int s_rows[kMaxRanks];   // remote path (block 0): my rows that remote rank r keeps

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity, H = a.hidden;
  const int32_t* send_pos = tr.local(a.send_pos);
  const int32_t* send_offset = tr.local(a.send_offset);
  OMNIEP_STAMPS_BEGIN();
  bool any_remote = false;
  if constexpr (Tr::kHasRemote) {
    any_remote = tr.any_remote();
    if (any_remote && blockIdx.x == 0) {
      if (static_cast<int>(threadIdx.x) < R) s_first[threadIdx.x] = send_offset[threadIdx.x];
      remote_send_rows(tr, send_pos, s_first, T, C, s_rows);  // syncs block 0 first
    }
  }
  RankWorkspace* my_ws = tr.workspace(me);
  token_queue_reset(my_ws, kQueueCombine);  // (the start barrier waits on every block)
  // Remote rank r learns where my rows are in its y (its push_rows[me]) ...
  const auto tell = [&](int r) {
    if constexpr (Tr::kHasRemote) {
      tr.put_i32(&my_ws->push_rows[2 * me], s_first[r], r);
      tr.put_i32(&my_ws->push_rows[2 * me + 1], s_rows[r], r);
    }
  };
  if (a.copy_rows > 0) {  // the fused copy-in: my y but my own rows (read from own_y directly)
    const int64_t b = send_offset[me], e = b + tr.local(a.recv_counts)[me];
    grid_copy_rows_except(static_cast<uint8_t*>(const_cast<void*>(tr.local(a.y))),
                          static_cast<const uint8_t*>(tr.local(a.own_y)), static_cast<int64_t>(H) * sizeof(Scalar),
                          a.copy_rows, b, e, a.copy_unit);
  }
  // (The start barrier orders the copy-in before any peer's reads: every block arrives after its
  // writes.)
  OMNIEP_STAMP("copy_in");
  if (!rank_barrier(tr, kPhaseCombineStart, /*all_wait=*/true, tell, &a.desc[me])) return;
  OMNIEP_STAMP("start_barrier");
  // ... and puts them into my mirror for it, as I put theirs into their mirrors for me.
  if constexpr (Tr::kHasRemote) {
    const auto push = [&](int s) {
      const int64_t first = my_ws->push_rows[2 * s], rows = my_ws->push_rows[2 * s + 1];
      const int64_t y_row = static_cast<int64_t>(H) * sizeof(Scalar);
      const uint8_t* y = static_cast<const uint8_t*>(tr.local(a.y)) + first * y_row;
      tr.put_block(const_cast<uint8_t*>(tr.mirror(y, me)), y, static_cast<size_t>(rows * y_row), s);
      if (a.with_topk_grad) {
        const float* g = tr.local(a.g_recv_topk_weights) + first * K;
        tr.put_block(const_cast<float*>(tr.mirror(g, me)), g, static_cast<size_t>(rows * K) * sizeof(float), s);
      }
    };
    if (any_remote && !rank_barrier(tr, kPhaseCombinePush, /*all_wait=*/true, push)) return;
  }

  Scalar* out = static_cast<Scalar*>(tr.local(a.out));
  const int lane = gpu::lane_id(), warp = gpu::warp_id();
  const int num_packs = H / Vec;
  const bool topk_grad = a.with_topk_grad != 0;

  // What the loops below read of `a`, in shared memory: a lambda that names `a` makes hipcc copy the
  // whole CombineArgs (2.3 KB) into every lane's scratch.
  __shared__ const void* s_bias[2];
  __shared__ int s_bias_dtype[2];
  if (threadIdx.x < 2) {
    s_bias[threadIdx.x] = static_cast<int>(threadIdx.x) < a.num_bias ? tr.local(a.bias[threadIdx.x]) : nullptr;
    s_bias_dtype[threadIdx.x] = a.bias_dtype[threadIdx.x];
  }
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    s_y[r] = static_cast<const Scalar*>(y_of(tr, a, r));
    bool far = false;
    if constexpr (Tr::kHasRemote) far = tr.is_remote(r);
    s_g[r] = topk_grad ? copy_of(tr, a.g_recv_topk_weights, r, far) : nullptr;  // far: my mirror for r
  }
  __shared__ const int32_t* s_idx32;  // with_topk_grad: the routing and the weights' gradient (out)
  __shared__ float* s_g_w;
  __shared__ uint32_t* s_queue;  // the rank's token queue (a shared load per token, not a register)
  if (threadIdx.x == 0) {
    s_idx32 = tr.local(a.topk_idx32);
    s_g_w = tr.local(a.g_topk_weights);
    s_queue = &my_ws->work_next[kQueueCombine];
  }
  const int num_bias = a.num_bias;
  __syncthreads();

  // Token t's row at every rank into this warp's ring entry q (lanes r < R), then visible to the warp.
  const auto fill = [&](int t, int q) {
    if (lane < R) {
      const int pos = send_pos[static_cast<int64_t>(t) * R + lane];
      const int64_t slot = static_cast<int64_t>(send_offset[lane]) + pos;
      const bool kept = pos >= 0 && slot < C;
      s_slot[warp][q][lane] = kept ? slot : -1;
      s_src[warp][q][lane] = kept ? reinterpret_cast<const Pack*>(s_y[lane] + slot * H) : nullptr;
    }
    gpu::syncwarp();
  };
  // with_topk_grad: token t's g_topk_weights, read back from the slots that carried them (ring entry q).
  const auto grad = [&](int t, int q) {
    const int32_t* idx32 = s_idx32;
    float* g_w = s_g_w;
    for (int k = lane; k < K; k += gpu::kWarpSize) {
      const int e = idx32[static_cast<int64_t>(t) * K + k];
      float g = 0.0f;
      if (e >= 0) {
        const int r = e / L;
        const int64_t slot = s_slot[warp][q][r];
        if (slot >= 0) g = s_g[r][slot * K + k];
      }
      g_w[static_cast<int64_t>(t) * K + k] = g;
    }
  };
  // The end of a step: the bias terms in the order given, then the lane's packs of out[t] rounded once.
  // `full`: every pack of the step is inside the row.
  const auto finish = [&](float (&acc)[kPacks][Vec], int64_t t, int base, bool full) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = base + lane + j * gpu::kWarpSize;
      if (!full && p >= num_packs) continue;
      for (int b = 0; b < num_bias; ++b) {
        const void* bias = s_bias[b];
#pragma unroll
        for (int i = 0; i < Vec; ++i) {
          const int64_t at = t * H + static_cast<int64_t>(p) * Vec + i;
          acc[j][i] = gpu::add_rn(acc[j][i], load_as_float(bias, s_bias_dtype[b], at));
        }
      }
      Pack o;
#pragma unroll
      for (int i = 0; i < Vec; ++i) o.v[i] = Cvt::from_float(acc[j][i]);
      reinterpret_cast<Pack*>(out + t * H)[p] = o;
    }
  };
  // acc += the lane's packs of one rank's span: v[j * stride] is pack base + lane + j * warp size of the
  // row (stride 1: the lane's registers; the warp size: the span in shared memory, from the lane's pack).
  const auto add = [&](float (&acc)[kPacks][Vec], const Pack* v, int stride, int base, bool full) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      if (full || base + lane + j * gpu::kWarpSize < num_packs) {
        const Pack pv = v[j * stride];
#pragma unroll
        for (int i = 0; i < Vec; ++i) acc[j][i] = gpu::add_rn(acc[j][i], Cvt::to_float(pv.v[i]));
      }
    }
  };
  const auto zero = [](float (&acc)[kPacks][Vec]) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
#pragma unroll
      for (int i = 0; i < Vec; ++i) acc[j][i] = 0.0f;
    }
  };

  bool summed = false;
#if defined(OMNIEP_BULK_LOADS)
  if constexpr (sizeof(Pack) == 16) {
    // (With at most one token per warp — 128 tokens on 384 warps — the ring's set-up cost more than it
    // saved: +1.1 µs on one H100, 2026-11-27. The launchers then give no ring: combine_ring_smem.)
    if (num_packs > 0 && T > static_cast<int>(gridDim.x) * gpu::warps_per_block() &&
        bulk::dynamic_smem_bytes() >= kCombineRingBytes) {
      summed = true;
      extern __shared__ __align__(128) uint8_t s_ring[];
      __shared__ __align__(8) uint64_t s_bar[kWarps][kCombineStages];
      __shared__ int s_tok[kWarps][kCombineStages];  // the token of each ring entry
      constexpr int kUnit = 2 * kCombineStep;  // packs of one unit: a step of two ranks
      Pack* ring = reinterpret_cast<Pack*>(s_ring) + static_cast<int64_t>(warp) * kCombineStages * kUnit;
      if (lane == 0) {
        for (int s = 0; s < kCombineStages; ++s) bulk::init(&s_bar[warp][s]);
        // The rows were written through the generic proxy (a fused copy-in, a remote rank's puts into my
        // mirror) and ordered before this point by the start barrier; the bulk loads read them through
        // the async proxy.
        bulk::proxy_fence_global();
      }
      gpu::syncwarp();
      // The loads' cursor (token pt, its ordinal pn among this warp's tokens, step pbase, ranks pr0, pr0 + 1,
      // ring stage ps) and the sums' (the cn-th token, cbase, cr0, stage cs, its barrier's phase cph) walk the
      // same units, the loads at most kCombineStages units ahead (the one summed included). A token's ring
      // entry (its number s_tok and its rows) is filled when its first unit is issued, so the loads are at
      // most kCombineStages - 1 tokens ahead: entries never collide with the sums' reads (grad's included: a
      // syncwarp closes them before the next fill, which may take the entry of a token whose last unit was
      // just summed).
      TokenQueue queue(s_queue);
      int pt = queue.next(s_queue, T), pn = 0, pbase = 0, pr0 = 0, ps = 0;
      int cn = 0, cbase = 0, cr0 = 0, cs = 0, in_flight = 0;
      uint32_t cph = 0;
      const auto issue = [&] {
        const int q = pn % kCombineStages;
        if (pbase == 0 && pr0 == 0) {
          if (lane == 0) s_tok[warp][q] = pt;
          fill(pt, q);  // (its syncwarp publishes s_tok too)
        }
        const int s = ps;
        if (lane == 0) {
          const int m = num_packs - pbase < kCombineStep ? num_packs - pbase : kCombineStep;
          const uint32_t bytes = static_cast<uint32_t>(m) * sizeof(Pack);
          const Pack* y0 = s_src[warp][q][pr0];
          const Pack* y1 = pr0 + 1 < R ? s_src[warp][q][pr0 + 1] : nullptr;
          Pack* st = ring + s * kUnit;
          uint64_t* bar = &s_bar[warp][s];
          bulk::proxy_fence();  // the lanes' reads of this stage (ordered by the sums' syncwarp) come first
          bulk::expect(bar, (y0 != nullptr ? bytes : 0u) + (y1 != nullptr ? bytes : 0u));
          if (y0 != nullptr) bulk::load(st, y0 + pbase, bytes, bar);
          if (y1 != nullptr) bulk::load(st + kCombineStep, y1 + pbase, bytes, bar);
        }
        ps = ps + 1 == kCombineStages ? 0 : ps + 1;
        ++in_flight;
        if ((pr0 += 2) >= R) {
          pr0 = 0;
          if ((pbase += kCombineStep) >= num_packs) {
            pbase = 0;
            pt = queue.next(s_queue, T);
            ++pn;
          }
        }
      };
      float acc[kPacks][Vec];
      for (;;) {
        while (pt < T && in_flight < kCombineStages) issue();  // (the next units load while this one is summed)
        if (in_flight == 0) break;
        const int q = cn % kCombineStages;
        const int ct = s_tok[warp][q];
        bulk::wait(&s_bar[warp][cs], cph);
        const Pack* st = ring + cs * kUnit + lane;
        const bool full = cbase + kCombineStep <= num_packs;
        if (cr0 == 0) zero(acc);
        if (s_src[warp][q][cr0] != nullptr) add(acc, st, gpu::kWarpSize, cbase, full);
        if (cr0 + 1 < R && s_src[warp][q][cr0 + 1] != nullptr) add(acc, st + kCombineStep, gpu::kWarpSize, cbase, full);
        if (cr0 + 2 >= R) finish(acc, ct, cbase, full);
        gpu::syncwarp();  // every lane has read the stage before it is loaded again
        --in_flight;
        if (++cs == kCombineStages) {
          cs = 0;
          cph ^= 1u;
        }
        if ((cr0 += 2) >= R) {
          cr0 = 0;
          if ((cbase += kCombineStep) >= num_packs) {
            cbase = 0;
            if (topk_grad) {
              grad(ct, q);
              gpu::syncwarp();  // (its reads of entry q before the next issue's fill may rewrite it)
            }
            ++cn;
          }
        }
      }
    }
  }
#endif
  if (!summed) {
    TokenQueue queue(s_queue);
    for (int t = queue.next(s_queue, T); t < T; t = queue.next(s_queue, T)) {
      fill(t, 0);
      const Pack* const* src = s_src[warp][0];
      for (int base = 0; base < num_packs; base += kCombineStep) {
        const bool full = base + kCombineStep <= num_packs;
        float acc[kPacks][Vec];
        zero(acc);
        // Two ranks per round: the loads of rank r and r + 1 are in flight together (2 * kPacks per lane),
        // then added in ascending rank order (the contract's summation order, unchanged).
        for (int r = 0; r < R; r += 2) {
          const Pack* y0 = src[r];
          const Pack* y1 = r + 1 < R ? src[r + 1] : nullptr;
          if (y0 == nullptr && y1 == nullptr) continue;
          Pack v0[kPacks], v1[kPacks];
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            const int p = base + lane + j * gpu::kWarpSize;
            if (y0 != nullptr && (full || p < num_packs)) v0[j] = y0[p];
            if (y1 != nullptr && (full || p < num_packs)) v1[j] = y1[p];
          }
          if (y0 != nullptr) add(acc, v0, 1, base, full);
          if (y1 != nullptr) add(acc, v1, 1, base, full);
        }
        finish(acc, t, base, full);
      }
      if (topk_grad) grad(t, 0);
      gpu::syncwarp();  // the ring entry is rewritten for the next token
    }
  }
  OMNIEP_STAMP_WARPS("summed");
  rank_barrier(tr, kPhaseCombineDone, /*all_wait=*/false);
  OMNIEP_STAMP("end_barrier");
  OMNIEP_STAMPS_END("combine_kernel", me);
}

}  // namespace omniep
