// Rank-major combine (and dispatch_bwd): every source PULLS its rows back from the receivers.
//
// out[t] = sum over ranks r in ASCENDING order of y_r[send_offset[r] + send_pos[t, r]] (rows past
// the capacity were dropped and contribute nothing), accumulated in fp32 from +0.0 with
// round-to-nearest adds (__fadd_rn: never contracted or reassociated), then the bias terms in the
// order given, rounded once to the output dtype. This is exactly omniep.ep_core.reference.combine.
// With with_topk_grad (dispatch_bwd) the same pass reads back g_topk_weights[t, k] from the slot
// that carried it: g_recv_topk_weights of the owning rank, or 0 when not routed or dropped.
//
// Remote ranks (a transport with kHasRemote: nvshmem across nodes, or OMNIEP_FORCE_REMOTE=1): the
// warp GETS each chunk of the row it needs into its stage in the transport's symmetric scratch
// (blocking) and reads it from there; the sum is the same, in the same order (bitwise unchanged).
// On p2p those branches compile away.
//
// A rank's own rows come from a.own_y when given (the caller's y; the copy-in skipped them).
//
// Barriers: start (every rank's y is complete: its producer ran before this kernel on that rank's
// stream), end (peers finished reading my y, so my stream may free or overwrite it afterwards).
#pragma once

#include "kernels/args.h"
#include "kernels/rows.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kCombineThreads = 512;
inline constexpr int kPacks = 4;  // packs per lane per step (loads in flight per rank)
// Remote path: bytes of one rank's chunk of a row in a warp's stage (16-byte packs), and a warp's
// stage (two ranks per round). The host sizes the transport's scratch as blocks * warps * this.
inline constexpr int kCombineChunkBytes = gpu::kWarpSize * kPacks * 16;
inline constexpr int kCombineStageBytesPerWarp = 2 * kCombineChunkBytes;

// Rank r's y as this rank reads it: my own rows from the caller's y when given (the copy-in skipped
// them), everything else from the symmetric buffer.
template <typename Tr>
OMNIEP_DEVICE const void* y_of(const Tr& tr, const CombineArgs& a, int r) {
  const void* own = r == tr.rank() ? tr.local(a.own_y) : nullptr;
  return own != nullptr ? own : tr.peer(a.y, r);
}

// Packs of row `slot` of rank r's y, indexable by pack number p in [base, base + kWarpSize * kPacks):
// through r's pointer, or (a remote rank) after the warp GETS that chunk into `stage` (this warp's
// staging area in the transport's symmetric scratch). Warp-uniform arguments: all lanes call it.
template <typename Pack, typename Scalar, typename Tr>
OMNIEP_DEVICE const Pack* y_row(const Tr& tr, const CombineArgs& a, int r, int64_t slot, int H,
                                int base, int num_packs, Pack* stage) {
  if constexpr (Tr::kHasRemote) {
    if (tr.is_remote(r)) {
      const Pack* mine = reinterpret_cast<const Pack*>(static_cast<const Scalar*>(tr.local(a.y)) + slot * H);
      return get_packs(tr, mine, r, base, min(num_packs - base, gpu::kWarpSize * kPacks), stage);
    }
  }
  return reinterpret_cast<const Pack*>(static_cast<const Scalar*>(y_of(tr, a, r)) + slot * H);
}

// Scalar is the element type; Vec elements per lane per step (16 bytes when rows allow, else 1).
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a, Tr tr) {
  __shared__ int64_t s_slot[kCombineThreads / gpu::kWarpSize][kMaxRanks];  // per warp: row at rank r or -1
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  using Cvt = Elem<Scalar>;

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity, H = a.hidden;
  if (!rank_barrier(tr, kPhaseCombineStart, /*all_wait=*/true)) return;

  const int32_t* send_pos = tr.local(a.send_pos);
  const int32_t* send_offset = tr.local(a.send_offset);
  Scalar* out = static_cast<Scalar*>(tr.local(a.out));
  const int lane = gpu::lane_id(), warp = gpu::warp_id(), warps = gpu::warps_per_block();
  const int num_packs = H / Vec;
  Pack* stage = nullptr;  // remote path: this warp's two chunks in the transport's scratch
  if constexpr (Tr::kHasRemote) {
    stage = reinterpret_cast<Pack*>(tr.scratch + (static_cast<int64_t>(blockIdx.x) * warps + warp) *
                                                     kCombineStageBytesPerWarp);
  }

  for (int t = blockIdx.x * warps + warp; t < T; t += gridDim.x * warps) {
    if (lane < R) {
      const int pos = send_pos[static_cast<int64_t>(t) * R + lane];
      const int64_t slot = static_cast<int64_t>(send_offset[lane]) + pos;
      s_slot[warp][lane] = (pos >= 0 && slot < C) ? slot : -1;
    }
    gpu::syncwarp();
    // Each lane owns kPacks packs per step so that kPacks independent loads per rank are in flight.
    for (int base = 0; base < num_packs; base += gpu::kWarpSize * kPacks) {
      float acc[kPacks][Vec];
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
#pragma unroll
        for (int i = 0; i < Vec; ++i) acc[j][i] = 0.0f;
      }
      // Two ranks per round: the loads of rank r and r + 1 are in flight together (2 * kPacks per
      // lane), then added in ascending rank order (the contract's summation order, unchanged).
      for (int r = 0; r < R; r += 2) {
        const int64_t slot0 = s_slot[warp][r];
        const int64_t slot1 = r + 1 < R ? s_slot[warp][r + 1] : -1;
        if (slot0 < 0 && slot1 < 0) continue;
        Pack v0[kPacks], v1[kPacks];
        if (slot0 >= 0) {
          const Pack* y = Tr::kHasRemote
                              ? y_row<Pack, Scalar>(tr, a, r, slot0, H, base, num_packs, stage)
                              : reinterpret_cast<const Pack*>(static_cast<const Scalar*>(y_of(tr, a, r)) + slot0 * H);
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            const int p = base + lane + j * gpu::kWarpSize;
            if (p < num_packs) v0[j] = y[p];
          }
        }
        if (slot1 >= 0) {
          const Pack* y = Tr::kHasRemote
                              ? y_row<Pack, Scalar>(tr, a, r + 1, slot1, H, base, num_packs,
                                                    stage + kCombineChunkBytes / sizeof(Pack))
                              : reinterpret_cast<const Pack*>(static_cast<const Scalar*>(y_of(tr, a, r + 1)) + slot1 * H);
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            const int p = base + lane + j * gpu::kWarpSize;
            if (p < num_packs) v1[j] = y[p];
          }
        }
        if (slot0 >= 0) {
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            if (base + lane + j * gpu::kWarpSize < num_packs) {
#pragma unroll
              for (int i = 0; i < Vec; ++i) acc[j][i] = gpu::add_rn(acc[j][i], Cvt::to_float(v0[j].v[i]));
            }
          }
        }
        if (slot1 >= 0) {
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            if (base + lane + j * gpu::kWarpSize < num_packs) {
#pragma unroll
              for (int i = 0; i < Vec; ++i) acc[j][i] = gpu::add_rn(acc[j][i], Cvt::to_float(v1[j].v[i]));
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const int p = base + lane + j * gpu::kWarpSize;
        if (p >= num_packs) continue;
        for (int b = 0; b < a.num_bias; ++b) {  // bias terms last, in the order given
          const void* bias = tr.local(a.bias[b]);
#pragma unroll
          for (int i = 0; i < Vec; ++i) {
            acc[j][i] = gpu::add_rn(acc[j][i], load_as_float(bias, a.bias_dtype[b],
                                                             static_cast<int64_t>(t) * H + static_cast<int64_t>(p) * Vec + i));
          }
        }
        Pack o;
#pragma unroll
        for (int i = 0; i < Vec; ++i) o.v[i] = Cvt::from_float(acc[j][i]);
        reinterpret_cast<Pack*>(out + static_cast<int64_t>(t) * H)[p] = o;
      }
    }
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
            if (!far) {
              g = tr.peer(a.g_recv_topk_weights, r)[slot * K + k];
            } else if constexpr (Tr::kHasRemote) {
              g = tr.get_f32(tr.local(a.g_recv_topk_weights) + slot * K + k, r);
            }
          }
        }
        g_w[static_cast<int64_t>(t) * K + k] = g;
      }
    }
    gpu::syncwarp();  // s_slot is rewritten for the next token
  }
  rank_barrier(tr, kPhaseCombineDone, /*all_wait=*/false);
}

}  // namespace omniep
