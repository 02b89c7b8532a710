// Expert-major dispatch and combine_bwd: every source PUSHES one row per kept copy (t, k) into slot
// copy_slot[t, k] of local expert l = e - r*L at receiver r = e / L (em_args.h has the layout).
//
// dispatch moves the row's bytes unchanged (bf16, fp16, fp32 or fp8 + its scales as a second
// payload) and writes recv_topk_idx[l, c] = l and recv_topk_weights[l, c] = w[t, k].
// combine_bwd writes g_y[l, c] = round(fp32(w[t, k]) * fp32(g_out[t])) — the product rounded to
// fp32 (mul_rn), then once to the dtype — and, with_topk_grad, g_topk_weights[t, k] = <g_out[t],
// y[l, c]> accumulated in fp32 (a reduction over H, in no order DESIGN fixes: tests match it to rounding, omniep/testing/bounds.py).
// In both, the receiver meanwhile zero-fills its padding slots [recv_expert_count[l], C), which no
// source writes (recv_topk_idx -1, weights 0).
//
// One warp per copy (t, k): a low-latency batch (128 tokens, top-8) is 1024 rows per rank, enough
// to keep every warp of 24 blocks busy, where one warp per token would leave most idle.
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
#include "kernels/rows.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kEMDispatchThreads = 512;
// The remote path stages per warp as combine does: the scratch the host sized for combine's warps
// (kCombineThreads per block) serves these kernels' warps.
static_assert(kEMDispatchThreads <= kCombineThreads, "em stages come from combine's per-warp scratch");

// Zero rows [count[l], C) of every local expert of `buf[L, C, row_bytes]` (whole rank, by warps).
OMNIEP_DEVICE void em_zero_padding(uint8_t* buf, const int32_t* count, int L, int C, int64_t row_bytes,
                                   int unit) {
  const int warps = gpu::warps_per_block();
  const int64_t slots = static_cast<int64_t>(L) * C;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id(); j < slots;
       j += static_cast<int64_t>(gridDim.x) * warps) {
    if (j % C >= count[j / C]) warp_zero_row(buf + j * row_bytes, row_bytes, unit);
  }
}

template <typename Tr>
__global__ void __launch_bounds__(kEMDispatchThreads) em_dispatch_kernel(EMDispatchArgs a, Tr tr) {
  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity;
  if (!rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true, NoPuts{}, &a.desc[me])) return;

  const uint8_t* x = tr.local(a.x);
  const uint8_t* x2 = tr.local(a.x2);
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int32_t* copy_slot = tr.local(a.copy_slot);
  const int lane = gpu::lane_id(), warps = gpu::warps_per_block();
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id();
  const int64_t all_warps = static_cast<int64_t>(gridDim.x) * warps;

  // ---- push my copies ----
  const int64_t n = static_cast<int64_t>(T) * K;
  for (int64_t i = first_warp; i < n; i += all_warps) {
    const int slot = copy_slot[i];
    if (slot < 0) continue;  // unrouted or dropped
    const int e = idx32[i];
    const int r = e / L, l = e - r * L;
    const int64_t row = static_cast<int64_t>(l) * C + slot;
    const int64_t t = i / K;
    bool far = false;
    if constexpr (Tr::kHasGets) far = tr.is_remote(r);
    if (!far) {
      warp_copy_row(tr.peer(a.recv_x, r) + row * a.row_bytes, x + t * a.row_bytes, a.row_bytes, a.unit);
      if (a.row2_bytes > 0) {
        warp_copy_row(tr.peer(a.recv_x2, r) + row * a.row2_bytes, x2 + t * a.row2_bytes, a.row2_bytes, a.unit2);
      }
      if (lane == 0) {
        tr.peer(a.recv_topk_idx, r)[row] = l;
        tr.peer(a.recv_topk_weights, r)[row] = weights[i];
      }
    } else if constexpr (Tr::kHasGets) {  // MY addresses of the symmetric buffers; the end barrier quiets
      tr.put_warp(tr.local(a.recv_x) + row * a.row_bytes, x + t * a.row_bytes, static_cast<size_t>(a.row_bytes), r);
      if (a.row2_bytes > 0) {
        tr.put_warp(tr.local(a.recv_x2) + row * a.row2_bytes, x2 + t * a.row2_bytes,
                    static_cast<size_t>(a.row2_bytes), r);
      }
      if (lane == 0) {
        tr.put_i32(tr.local(a.recv_topk_idx) + row, l, r);
        tr.put_f32(tr.local(a.recv_topk_weights) + row, weights[i], r);
      }
    }
  }

  // ---- zero my padding slots ----
  const int32_t* count = tr.local(a.recv_expert_count);
  em_zero_padding(tr.local(a.recv_x), count, L, C, a.row_bytes, a.unit);
  if (a.row2_bytes > 0) em_zero_padding(tr.local(a.recv_x2), count, L, C, a.row2_bytes, a.unit2);
  {
    int32_t* recv_idx = tr.local(a.recv_topk_idx);
    float* recv_w = tr.local(a.recv_topk_weights);
    const int64_t slots = static_cast<int64_t>(L) * C;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < slots;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if (j % C >= count[j / C]) {
        recv_idx[j] = -1;
        recv_w[j] = 0.0f;
      }
    }
  }
  int32_t* out_idx = tr.local(a.out_topk_idx);
  float* out_w = tr.local(a.out_topk_weights);
  // With the routing to copy out, every block waits for the peers (their copies have arrived).
  if (!rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/out_idx != nullptr) || out_idx == nullptr) return;
  {
    const int32_t* idx_in = tr.local(a.recv_topk_idx);
    const float* w_in = tr.local(a.recv_topk_weights);
    const int64_t slots = static_cast<int64_t>(L) * C;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < slots;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      out_idx[j] = idx_in[j];
      out_w[j] = w_in[j];
    }
  }
}

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

// Scalar is the element type; Vec elements per lane per load (16 bytes when rows allow, else 1).
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kEMDispatchThreads) em_combine_bwd_kernel(EMCombineBwdArgs a, Tr tr) {
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity, H = a.hidden;
  if (!rank_barrier(tr, kPhaseDispatchStart, /*all_wait=*/true, NoPuts{}, &a.desc[me])) return;

  const Scalar* g_out = static_cast<const Scalar*>(tr.local(a.g_out));
  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);
  const int32_t* copy_slot = tr.local(a.copy_slot);
  const bool grad_w = a.with_topk_grad != 0;
  const int lane = gpu::lane_id(), warps = gpu::warps_per_block();
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id();
  const int64_t all_warps = static_cast<int64_t>(gridDim.x) * warps;
  const int num_packs = H / Vec;
  Pack* stage = nullptr;  // remote path: this warp's area of the transport's scratch
  if constexpr (Tr::kHasGets) stage = reinterpret_cast<Pack*>(tr.scratch + first_warp * kCombineStageBytesPerWarp);
  constexpr int kChunk = gpu::kWarpSize * kPacks;  // packs per remote chunk: at most kCombineChunkBytes

  const int64_t n = static_cast<int64_t>(T) * K;
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
      Pack* dst = reinterpret_cast<Pack*>(static_cast<Scalar*>(tr.peer(a.g_y, r)) + row);
      const Pack* y =
          grad_w ? reinterpret_cast<const Pack*>(static_cast<const Scalar*>(tr.peer(a.y, r)) + row) : nullptr;
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
  em_zero_padding(static_cast<uint8_t*>(tr.local(a.g_y)), tr.local(a.recv_expert_count), L, C,
                  static_cast<int64_t>(H) * sizeof(Scalar), sizeof(Scalar) * Vec);
  rank_barrier(tr, kPhaseDispatchDone, /*all_wait=*/false);
}

}  // namespace omniep
