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
#include "kernels/copy_rows.cuh"
#include "kernels/rows.cuh"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kCombineThreads = 512;
inline constexpr int kPacks = 4;  // packs per lane per step (loads in flight per rank)
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
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a, Tr tr) {
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  __shared__ int64_t s_slot[kCombineThreads / gpu::kWarpSize][kMaxRanks];  // per warp: row at rank r or -1
  __shared__ const Pack* s_src[kCombineThreads / gpu::kWarpSize][kMaxRanks];  // per warp: that row, or null
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
  const int lane = gpu::lane_id(), warp = gpu::warp_id(), warps = gpu::warps_per_block();
  const int num_packs = H / Vec;

  // The bias terms as the step reads them: a lambda that names `a` makes hipcc copy the whole
  // CombineArgs (2.3 KB) into every lane's scratch.
  __shared__ const void* s_bias[2];
  __shared__ int s_bias_dtype[2];
  if (threadIdx.x < 2) {
    s_bias[threadIdx.x] = static_cast<int>(threadIdx.x) < a.num_bias ? tr.local(a.bias[threadIdx.x]) : nullptr;
    s_bias_dtype[threadIdx.x] = a.bias_dtype[threadIdx.x];
  }
  const int num_bias = a.num_bias;
  __syncthreads();
  // One step: the lane's kPacks packs from base on, summed over the ranks (src[r]: the token's row at
  // rank r as this rank reads it, or null). `full`: every pack of the step is inside the row.
  const auto step = [&](const Pack* const* src, int64_t t, int base) {
    const bool full = base + gpu::kWarpSize * kPacks <= num_packs;
    float acc[kPacks][Vec];
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
#pragma unroll
      for (int i = 0; i < Vec; ++i) acc[j][i] = 0.0f;
    }
    // Two ranks per round: the loads of rank r and r + 1 are in flight together (2 * kPacks per lane),
    // then added in ascending rank order (the contract's summation order, unchanged).
    for (int r = 0; r < R; r += 2) {
      const Pack* y0 = src[r];
      const Pack* y1 = r + 1 < R ? src[r + 1] : nullptr;
      if (y0 == nullptr && y1 == nullptr) continue;
      Pack v0[kPacks], v1[kPacks];
      if (y0 != nullptr) {
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const int p = base + lane + j * gpu::kWarpSize;
          if (full || p < num_packs) v0[j] = y0[p];
        }
      }
      if (y1 != nullptr) {
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          const int p = base + lane + j * gpu::kWarpSize;
          if (full || p < num_packs) v1[j] = y1[p];
        }
      }
      if (y0 != nullptr) {
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          if (full || base + lane + j * gpu::kWarpSize < num_packs) {
#pragma unroll
            for (int i = 0; i < Vec; ++i) acc[j][i] = gpu::add_rn(acc[j][i], Cvt::to_float(v0[j].v[i]));
          }
        }
      }
      if (y1 != nullptr) {
#pragma unroll
        for (int j = 0; j < kPacks; ++j) {
          if (full || base + lane + j * gpu::kWarpSize < num_packs) {
#pragma unroll
            for (int i = 0; i < Vec; ++i) acc[j][i] = gpu::add_rn(acc[j][i], Cvt::to_float(v1[j].v[i]));
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = base + lane + j * gpu::kWarpSize;
      if (!full && p >= num_packs) continue;
      for (int b = 0; b < num_bias; ++b) {  // bias terms last, in the order given
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

  constexpr int kStep = gpu::kWarpSize * kPacks;  // packs per step of a warp
  for (int t = blockIdx.x * warps + warp; t < T; t += gridDim.x * warps) {
    // Lane r < R: token t's row at rank r (its slot, and where this rank reads it), or none.
    if (lane < R) {
      const int pos = send_pos[static_cast<int64_t>(t) * R + lane];
      const int64_t slot = static_cast<int64_t>(send_offset[lane]) + pos;
      const bool kept = pos >= 0 && slot < C;
      s_slot[warp][lane] = kept ? slot : -1;
      s_src[warp][lane] = kept ? reinterpret_cast<const Pack*>(static_cast<const Scalar*>(y_of(tr, a, lane)) + slot * H)
                               : nullptr;
    }
    gpu::syncwarp();
    for (int base = 0; base < num_packs; base += kStep) step(s_src[warp], t, base);
    if (a.with_topk_grad) {
      const int32_t* idx32 = tr.local(a.topk_idx32);
      float* g_w = tr.local(a.g_topk_weights);
      for (int k = lane; k < K; k += gpu::kWarpSize) {
        const int e = idx32[static_cast<int64_t>(t) * K + k];
        float g = 0.0f;
        if (e >= 0) {
          const int r = e / L;
          const int64_t slot = s_slot[warp][r];
          if (slot >= 0) {
            bool far = false;
            if constexpr (Tr::kHasRemote) far = tr.is_remote(r);
            g = copy_of(tr, a.g_recv_topk_weights, r, far)[slot * K + k];  // far: my mirror for r
          }
        }
        g_w[static_cast<int64_t>(t) * K + k] = g;
      }
    }
    gpu::syncwarp();  // s_slot is rewritten for the next token
  }
  OMNIEP_STAMP("summed");
  rank_barrier(tr, kPhaseCombineDone, /*all_wait=*/false);
  OMNIEP_STAMP("end_barrier");
  OMNIEP_STAMPS_END("combine_kernel", me);
}

}  // namespace omniep
