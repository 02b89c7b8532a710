// Expert-major combine (and dispatch_bwd): every source PULLS its copies back from the receivers.
//
// out[t] = sum over k in ASCENDING order of w[t, k] * y_r[l][copy_slot[t, k]] (r = e / L,
// l = e - r*L), unrouted or dropped k contributing nothing; accumulated in fp32 from +0.0, each
// product rounded to fp32 on its own (mul_rn) before the round-to-nearest add (add_rn) — no fused
// multiply-add, no reassociation — then the bias terms in the order given, rounded once to the
// output dtype. This is exactly omniep.ep_core.reference.combine for Layout.EXPERT_MAJOR.
// dispatch_bwd is the same pass with every weight 1 (1 * y is exact, so the unweighted sum of the
// reference comes out bit for bit) that also reads back g_topk_weights[t, k] from the slot that
// carried it (0 when unrouted or dropped).
//
// Work item = (token, chunk of H): a low-latency batch has only 128 tokens per rank, so one warp
// per token would leave most of the warps idle; chunks of kWarpSize * kEMPacks packs, and the packs
// of kEMGroup copies loaded before any is summed, keep kEMGroup * kEMPacks independent loads per lane
// in flight.
// Before the start barrier the kernel copies the caller's y (the counted slots) into the rank's buffer
// unless y already is that buffer — in a whole (unsplit) op only the slots the peers pull: the rank
// reads its own copies from the caller's y. Barriers: start (every rank's y is complete), end (peers finished
// reading my y). The end must WAIT (block 0), not only signal: besides my buffer, it protects the
// descriptor this combine's start barrier left in my peers' workspaces (sync.cuh: a peer judges it
// late, in the receive half of a hook). A signal-only end let a fast rank write its next op's
// descriptor into the same slot before a slow rank judged this one — RankMismatchError on two H100s,
// 2026-11-26 (tests/gpu/test_recv_hook.py::test_hook_loop_with_a_slow_rank).
//
// The push combine (EMCombineArgs::back given and the dispatch's push_ok set — alike on every rank): each rank
// writes the rows of its counted slots straight from the caller's y into their sources' receive buffers,
// back[p][t * K + k] (the slot's em_src_code; p: the parity of the op's one barrier), then ONE barrier (which
// carries the descriptor), then every source sums its own buffer in k order — the same operands, the same
// order: bitwise the pull's result. No copy of y, no start / end pair: a peer writes into my buffer only
// before the barrier of its op and I read it only after; the next op's writes go to the other parity (a peer
// is at most one barrier ahead), where the host also keeps them clear of the previous op's regions. A whole
// op reads its own copies from the caller's y; a split one pushes them too (its receive half must not read y).
//
// Remote ranks (a transport with kHasGets: nvshmem across nodes, or OMNIEP_FORCE_REMOTE=1): the
// warp GETS each chunk of a copy's row into its stage in the transport's symmetric scratch and reads
// it from there, and gets g_recv_topk_weights one value at a time; the sum is the same, in the same
// order (bitwise unchanged). On p2p and nccl_dev those branches compile away.
#pragma once

#include <type_traits>

#include "kernels/bulk.cuh"
#include "kernels/combine.cuh"  // the remote path's staging sizes
#include "kernels/em_args.h"
#include "kernels/em_slots.cuh"
#include "kernels/rows.cuh"
#include "kernels/stamps.cuh"
#include "kernels/sync.cuh"

namespace omniep {

inline constexpr int kEMCombineThreads = 512;
inline constexpr int kEMPacks = 1;  // packs per lane per work item (token, chunk of H)
inline constexpr int kEMGroup = 8;  // copies of a token whose packs are loaded together
// The push combine's sums through bulk (TMA) loads (CUDA sm_90, 16-byte packs, the launch gave the shared
// memory): per item a copy's kEMSumPacks packs per lane, kEMGroup copies in flight per warp — 8 KB, where the
// register path holds 4 KB (kEMGroup * kEMPacks packs per lane) — so that each warp's item is one round trip.
inline constexpr int kEMSumPacks = 2;
inline constexpr int kEMSumStageBytes = kEMGroup * 32 * kEMSumPacks * 16;  // per warp (32 lanes, 16-byte packs)
inline constexpr size_t kEMSumSmemBytes = static_cast<size_t>(kEMSumStageBytes) * (kEMCombineThreads / 32);
// The remote path stages one chunk per warp in the scratch the host sized for combine's warps.
static_assert(kEMCombineThreads <= kCombineThreads && kEMPacks <= kPacks, "em stages come from combine's scratch");

namespace em {  // profilers show "omniep::em::combine_kernel": DeepEP's tests find kernels by "::combine"
template <typename Tr, typename Scalar, int Vec>
__global__ void __launch_bounds__(kEMCombineThreads) combine_kernel(EMCombineArgs a, Tr tr) {
  struct alignas(sizeof(Scalar) * Vec) Pack { Scalar v[Vec]; };
  using Cvt = Elem<Scalar>;

  const int me = tr.rank(), R = tr.num_ranks();
  const int T = a.num_tokens[me], K = a.num_topk, L = a.num_experts / R, C = a.capacity, H = a.hidden;
  OMNIEP_STAMPS_BEGIN();
  // The pull: the caller's y into my buffer, before the barrier that tells the peers it is complete (they
  // pull). Split in two launches (a.phase), the first copies (the push: pushes) and signals, the second waits
  // and pulls (sums).
  const void* own_y = tr.local(a.own_y);
  const int32_t* push_ok = tr.local(a.push_ok);
  const bool push = tr.local(a.back) != nullptr && push_ok != nullptr && *push_ok != 0;
  // A whole op that copies y reads its own copies from the caller's y, where they are, and copies only
  // the peers' slots (em_find_own_slots). A split op copies every slot: its receive half must not read
  // the caller's y, which DeepEP's hook contract lets the caller reuse once the send half has run.
  const bool own_direct = a.phase == kEMWhole && own_y != nullptr && (push || own_y != tr.local(a.y));
  __shared__ EMOwnSlots s_own;
  if (own_direct) {
    em_find_own_slots(s_own, tr.local(a.topk_idx32), tr.local(a.copy_slot), static_cast<int64_t>(T) * K, me, L);
  }
  // The push buffers' parity: that of the op's barrier (rank_barrier's descriptor slot), numbered alike on
  // every rank.
  const int64_t half =
      push ? ((tr.workspace(me)->expected[me] + (a.phase == kEMReceive ? 0 : 1)) & 1) * a.back_half : 0;
  const int64_t row_bytes = static_cast<int64_t>(H) * sizeof(Scalar);
  if (push && a.phase != kEMReceive) {  // my counted slots' rows to their sources (not my own, when own_direct)
    const int32_t* count = tr.local(a.recv_expert_count);
    const int32_t* src = tr.local(a.slot_src);
    const uint8_t* y_in = static_cast<const uint8_t*>(own_y);
    const float* g_in = tr.local(a.own_g_recv_topk_weights);
    em_for_each_peer_row(count, own_direct ? &s_own : nullptr, L, C, [&](int64_t j) {
      const int32_t code = src[j];
      const int s = code % R;
      const int64_t at = code / R;
      // (a code past the buffer: a handle of another op, which the barrier's descriptors stop)
      if (code < 0 || at >= a.back_rows) return;
      bool far = false;
      if constexpr (Tr::kHasGets) far = tr.is_remote(s);
      uint8_t* to = (far ? tr.local(a.back) : tr.peer(a.back, s)) + half;  // (far: MY address of s's buffer)
      float* to_g = reinterpret_cast<float*>(to + a.back_g_at) + at;
      if (!far) {
        warp_copy_row(to + at * row_bytes, y_in + j * row_bytes, row_bytes, a.copy_unit);
        if (g_in != nullptr && gpu::lane_id() == 0) *to_g = g_in[j];
      } else if constexpr (Tr::kHasGets) {  // the barrier quiets the puts
        tr.put_warp(to + at * row_bytes, y_in + j * row_bytes, static_cast<size_t>(row_bytes), s);
        if (g_in != nullptr && gpu::lane_id() == 0) tr.put_f32(to_g, g_in[j], s);
      }
    });
    OMNIEP_STAMP_WARPS("pushed");
  }
  if (!push && a.phase != kEMReceive && own_y != nullptr && own_y != tr.local(a.y)) {
    const int32_t* count = tr.local(a.recv_expert_count);
    uint8_t* dst = static_cast<uint8_t*>(const_cast<void*>(tr.local(a.y)));
    const uint8_t* src = static_cast<const uint8_t*>(own_y);
    em_copy_slots(dst, src, count, L, C, row_bytes, a.copy_unit, /*zero=*/0, own_direct ? &s_own : nullptr);
    if (const float* g_in = tr.local(a.own_g_recv_topk_weights)) {  // one warp per expert, lanes over slots
      float* g = const_cast<float*>(tr.local(a.g_recv_topk_weights));
      const int warps = gridDim.x * gpu::warps_per_block();
      for (int l = static_cast<int>(gpu::grid_warp_spread()); l < L; l += warps) {
        const int n = count == nullptr ? C : count[l];
        for (int c = gpu::lane_id(); c < n; c += gpu::kWarpSize) g[static_cast<int64_t>(l) * C + c] = g_in[static_cast<int64_t>(l) * C + c];
      }
    }
  }
  if (!push) OMNIEP_STAMP("y_copied");
  if (a.phase == kEMSend) {
    rank_barrier(tr, kPhaseCombineStart, /*all_wait=*/false, NoPuts{}, &a.desc[me], kBarrierSignalOnly);
    OMNIEP_STAMP("signalled");
    OMNIEP_STAMPS_END("em::combine_kernel(send)", me);
    return;
  }
  if (!rank_barrier(tr, kPhaseCombineStart, /*all_wait=*/true, NoPuts{}, &a.desc[me],
                    a.phase == kEMReceive ? kBarrierWaitOnly : kBarrierFull)) {
    return;
  }
  OMNIEP_STAMP("started");
  // Where each rank's y is read from (the transport's address of its symmetric buffer; my own copies
  // from the caller's y when own_direct).
  __shared__ const void* s_y_of[kMaxRanks];
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    s_y_of[r] = r == me && own_direct ? own_y : static_cast<const void*>(tr.peer(a.y, r));
  }
  __syncthreads();

  const int32_t* idx32 = tr.local(a.topk_idx32);
  const float* weights = tr.local(a.topk_weights);  // null: weight 1 (dispatch_bwd)
  const int32_t* copy_slot = tr.local(a.copy_slot);
  const uint8_t* my_half = push ? tr.local(a.back) + half : nullptr;  // my push buffer, this op's parity
  const Scalar* back = reinterpret_cast<const Scalar*>(my_half);
  Scalar* out = static_cast<Scalar*>(tr.local(a.out));
  const int lane = gpu::lane_id(), warps = gpu::warps_per_block();
  // Blocks fastest: a batch's (token, chunk) items spread over every SM (the index also picks the
  // warp's stage on the remote path: any one-to-one warp index does).
  const int64_t first_warp = gpu::grid_warp_spread();
  const int64_t all_warps = static_cast<int64_t>(gridDim.x) * warps;
  const int num_packs = H / Vec;
  constexpr int kChunk = gpu::kWarpSize * kEMPacks;  // packs per work item
  Pack* stage = nullptr;  // remote path: this warp's area of the transport's scratch
  if constexpr (Tr::kHasGets) stage = reinterpret_cast<Pack*>(tr.scratch + first_warp * kCombineStageBytesPerWarp);
  const int chunks = num_packs > 0 ? (num_packs + kChunk - 1) / kChunk : 1;  // H = 0: still one item (g_w)

  // An item's end: the bias terms (last, in the order given), then its packs of out — pack base + lane + u * 32
  // of token t holds acc[u].
  const auto finish = [&](auto& acc, int64_t t, int base) {
    constexpr int kN = static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>>);
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      const int p = base + lane + u * gpu::kWarpSize;
      if (p >= num_packs) continue;
      for (int b = 0; b < a.num_bias; ++b) {
        const void* bias = tr.local(a.bias[b]);
#pragma unroll
        for (int q = 0; q < Vec; ++q) {
          const int64_t at = t * H + static_cast<int64_t>(p) * Vec + q;
          acc[u][q] = gpu::add_rn(acc[u][q], load_as_float(bias, a.bias_dtype[b], at));
        }
      }
      Pack o;
#pragma unroll
      for (int q = 0; q < Vec; ++q) o.v[q] = Cvt::from_float(acc[u][q]);
      reinterpret_cast<Pack*>(out + t * H)[p] = o;
    }
  };
  // Once per token (the warp of its first item): g_topk_weights[t, k] read back from the slot that carried it.
  const auto grad_w = [&](int64_t t) {
    float* g_w = tr.local(a.g_topk_weights);
    for (int k = lane; k < K; k += gpu::kWarpSize) {
      const int64_t i = t * K + k;
      const int slot = copy_slot[i];
      float g = 0.0f;
      if (slot >= 0) {
        const int e = idx32[i];
        const int r = e / L;
        const int64_t at = static_cast<int64_t>(e - r * L) * C + slot;
        bool far = false;
        if constexpr (Tr::kHasGets) far = !push && tr.is_remote(r);
        if (push) {
          g = r == me && own_direct ? tr.local(a.own_g_recv_topk_weights)[at]
                                    : reinterpret_cast<const float*>(my_half + a.back_g_at)[i];
        } else if (!far) {
          g = tr.peer(a.g_recv_topk_weights, r)[at];
        } else if constexpr (Tr::kHasGets) {
          g = tr.get_f32(tr.local(a.g_recv_topk_weights) + at, r);
        }
      }
      g_w[i] = g;
    }
  };

  bool summed = false;
#if defined(OMNIEP_BULK_LOADS)
  if constexpr (sizeof(Pack) == 16) {
    if (push && num_packs > 0 && bulk::dynamic_smem_bytes() >= kEMSumSmemBytes) {
      summed = true;
      extern __shared__ __align__(128) uint8_t s_sum[];
      __shared__ __align__(8) uint64_t s_sum_bar[kEMCombineThreads / 32];
      static_assert(gpu::kWarpSize == 32, "the stages are sized for 32 lanes");
      const int warp = gpu::warp_id();
      Pack* st = reinterpret_cast<Pack*>(s_sum + static_cast<size_t>(warp) * kEMSumStageBytes);
      uint64_t* bar = &s_sum_bar[warp];
      if (lane == 0) bulk::init(bar);
      // The peers' rows came through the generic proxy, ordered before this point by the barrier; the bulk
      // loads read them through the async proxy (every lane may issue one).
      bulk::proxy_fence_global();
      gpu::syncwarp();
      uint32_t phase = 0;
      constexpr int kStep = gpu::kWarpSize * kEMSumPacks;  // packs of a copy per item
      const int steps = (num_packs + kStep - 1) / kStep;
      for (int64_t item = first_warp; item < static_cast<int64_t>(T) * steps; item += all_warps) {
        const int64_t t = item / steps;
        const int base = static_cast<int>(item % steps) * kStep;
        const int m = num_packs - base < kStep ? num_packs - base : kStep;
        const uint32_t bytes = static_cast<uint32_t>(m) * sizeof(Pack);
        float acc[kEMSumPacks][Vec];
#pragma unroll
        for (int u = 0; u < kEMSumPacks; ++u) {
#pragma unroll
          for (int q = 0; q < Vec; ++q) acc[u][q] = 0.0f;
        }
        for (int k0 = 0; k0 < K; k0 += gpu::kWarpSize) {
          // Lane k: copy k0 + k's row (null: unrouted or dropped) and weight.
          const Pack* my_row = nullptr;
          float my_w = 1.0f;
          if (k0 + lane < K) {
            const int64_t i = t * K + k0 + lane;
            const int slot = copy_slot[i];
            if (weights != nullptr) my_w = weights[i];
            if (slot >= 0) {
              const int e = idx32[i];
              const int r = e / L;
              my_row = reinterpret_cast<const Pack*>(
                  r == me && own_direct
                      ? static_cast<const Scalar*>(own_y) + (static_cast<int64_t>(e - r * L) * C + slot) * H
                      : back + i * H);
            }
          }
          const int kn = K - k0 < gpu::kWarpSize ? K - k0 : gpu::kWarpSize;
          for (int j0 = 0; j0 < kn; j0 += kEMGroup) {
            const int gn = kn - j0 < kEMGroup ? kn - j0 : kEMGroup;
            const bool load = lane >= j0 && lane < j0 + gn && my_row != nullptr;
            const gpu::lane_mask_t loaded = gpu::ballot(load);
            if (lane == 0) bulk::expect(bar, static_cast<uint32_t>(gpu::popc(loaded)) * bytes);
            gpu::syncwarp();  // the expectation is set before any load can complete it
            if (load) {
              bulk::proxy_fence();  // the lanes' reads of the stage (ordered by the last syncwarp) come first
              bulk::load(st + (lane - j0) * kStep, my_row + base, bytes, bar);
            }
            bulk::wait(bar, phase);
            phase ^= 1u;
            for (int g = 0; g < gn; ++g) {  // ascending k, the contract's order
              const float w = gpu::shfl(my_w, j0 + g);
              if (!((loaded >> (j0 + g)) & 1u)) continue;
#pragma unroll
              for (int u = 0; u < kEMSumPacks; ++u) {
                const int p = lane + u * gpu::kWarpSize;
                if (p >= m) continue;
                const Pack v = st[g * kStep + p];
#pragma unroll
                for (int q = 0; q < Vec; ++q) acc[u][q] = gpu::add_rn(acc[u][q], gpu::mul_rn(w, Cvt::to_float(v.v[q])));
              }
            }
            gpu::syncwarp();  // every lane has read the stage before the next group loads into it
          }
        }
        finish(acc, t, base);
        if (a.with_topk_grad && base == 0) grad_w(t);
      }
    }
  }
#endif
  if (!summed) {  // the sums from registers: HIP, element packs, the pull, or no shared memory given
    for (int64_t item = first_warp; item < static_cast<int64_t>(T) * chunks; item += all_warps) {
      const int64_t t = item / chunks;
      const int base = static_cast<int>(item % chunks) * kChunk;
      float acc[kEMPacks][Vec];
#pragma unroll
      for (int j = 0; j < kEMPacks; ++j) {
#pragma unroll
        for (int v = 0; v < Vec; ++v) acc[j][v] = 0.0f;
      }
      // Lane k holds copy k's (slot, expert, weight); the loop broadcasts them in k order.
      for (int k0 = 0; k0 < K; k0 += gpu::kWarpSize) {
        int my_slot = -1, my_e = 0;
        float my_w = 1.0f;
        if (k0 + lane < K) {
          const int64_t i = t * K + k0 + lane;
          my_slot = copy_slot[i];
          my_e = idx32[i];
          if (weights != nullptr) my_w = weights[i];
        }
        const int kn = K - k0 < gpu::kWarpSize ? K - k0 : gpu::kWarpSize;
        // kEMGroup copies at a time: their loads are all issued before the first is summed (one memory
        // latency per group, not per copy); the sum still runs in ascending k, the contract's order.
        for (int j0 = 0; j0 < kn; j0 += kEMGroup) {
          Pack v[kEMGroup][kEMPacks];
          float wj[kEMGroup];
          bool have[kEMGroup];
#pragma unroll
          for (int g = 0; g < kEMGroup; ++g) {
            const int j = j0 + g < kn ? j0 + g : kn - 1;  // (shfl needs every lane: clamp, then drop)
            const int slot = gpu::shfl(my_slot, j);
            const int e = gpu::shfl(my_e, j);
            wj[g] = gpu::shfl(my_w, j);
            have[g] = j0 + g < kn && slot >= 0;
            if (!have[g]) continue;
            const int r = e / L, l = e - r * L;
            const int64_t row = (static_cast<int64_t>(l) * C + slot) * H;
            bool far = false;
            if constexpr (Tr::kHasGets) far = !push && tr.is_remote(r);
            const Pack* y = nullptr;
            if (push) {  // my own copies in the caller's y (own_direct), the rest in my push buffer
              y = reinterpret_cast<const Pack*>(r == me && own_direct ? static_cast<const Scalar*>(own_y) + row
                                                                      : back + (t * K + k0 + j) * H);
            } else if (!far) {
              y = reinterpret_cast<const Pack*>(static_cast<const Scalar*>(s_y_of[r]) + row);
            } else if constexpr (Tr::kHasGets) {  // (one stage: its packs go to registers before the next get)
              const Pack* mine = reinterpret_cast<const Pack*>(static_cast<const Scalar*>(tr.local(a.y)) + row);
              y = get_packs(tr, mine, r, base, num_packs - base < kChunk ? num_packs - base : kChunk, stage);
            }
#pragma unroll
            for (int u = 0; u < kEMPacks; ++u) {
              const int p = base + lane + u * gpu::kWarpSize;
              if (p < num_packs) v[g][u] = y[p];
            }
          }
#pragma unroll
          for (int g = 0; g < kEMGroup; ++g) {
            if (!have[g]) continue;
#pragma unroll
            for (int u = 0; u < kEMPacks; ++u) {
              if (base + lane + u * gpu::kWarpSize < num_packs) {
#pragma unroll
                for (int q = 0; q < Vec; ++q) {
                  acc[u][q] = gpu::add_rn(acc[u][q], gpu::mul_rn(wj[g], Cvt::to_float(v[g][u].v[q])));
                }
              }
            }
          }
        }
      }
      finish(acc, t, base);
      if (a.with_topk_grad && base == 0) grad_w(t);
    }
  }
  OMNIEP_STAMP_WARPS(push ? "summed" : "pulled");
  if (!push) {
    rank_barrier(tr, kPhaseCombineDone, /*all_wait=*/false);
    OMNIEP_STAMP("end_barrier");
  }
  OMNIEP_STAMPS_END(a.phase == kEMReceive ? "em::combine_kernel(receive)" : "em::combine_kernel", me);
}
}  // namespace em

}  // namespace omniep
