// Slot-wise passes over an expert-major buffer [L, C, ...] of one rank (whole grid of the rank):
// slot (l, c) holds a copy when c < count[l] (em_layout's recv_expert_count; null: every slot),
// the rest is padding. The expert-major kernels move the counted slots only, so their cost follows
// the routed copies, not L * C (DESIGN §2 leaves the padding unspecified unless zero_padding).
#pragma once

#include "kernels/rows.cuh"
#include "omniep/transport.h"

namespace omniep {

// Every thread of the block: s_upto[l] = rows_of(0) + ... + rows_of(l) for l < L (L <= kMaxLocalExperts),
// and the total is returned. A block-wide scan: each thread loads one count per round of blockDim.x
// experts, so the counts cost one memory latency per round, not one per expert or per warp's width
// of experts (a warp that walked them in series spent ~9 dependent loads at L = 288).
// Row counts fit int32: a pass has at most L * C rows of a buffer that exists.
template <typename RowsOf>
OMNIEP_DEVICE int block_rows_prefix(int* s_upto, int L, RowsOf rows_of) {
  __shared__ int s_warp[1024 / gpu::kWarpSize];  // a warp's total per round (at most 1024 threads a block)
  const int lane = gpu::lane_id(), warp = gpu::warp_id(), warps = gpu::warps_per_block();
  int carry = 0;  // rows of the rounds before (the same in every thread)
  for (int l0 = 0; l0 < L; l0 += blockDim.x) {
    const int l = l0 + static_cast<int>(threadIdx.x);
    int v = l < L ? rows_of(l) : 0;
    for (int d = 1; d < gpu::kWarpSize; d *= 2) {  // inclusive scan over the warp
      const int u = gpu::shfl(v, lane >= d ? lane - d : lane);
      if (lane >= d) v += u;
    }
    if (lane == gpu::kWarpSize - 1) s_warp[warp] = v;
    __syncthreads();
    int before = carry, round = 0;
    for (int w = 0; w < warps; ++w) {
      const int n = s_warp[w];
      if (w < warp) before += n;
      round += n;
    }
    if (l < L) s_upto[l] = before + v;
    carry += round;
    __syncthreads();  // s_warp read by every thread before the next round rewrites it; s_upto complete
  }
  return carry;
}

// fn(j) for every row j = l * C + slot_of(l, q), q < rows_of(l), of every local expert l, dealt
// round-robin over every warp of the rank in (l, q) order, blocks fastest (gpu::grid_warp_spread: a
// low-latency batch has fewer rows than warps, and every SM's share of the bandwidth is wanted), so the
// cost follows the rows moved, balanced however skewed the experts. fn is called by the whole warp
// (warp-uniform). Every thread of every block must call it (a block-wide scan, block_rows_prefix).
// One block-wide [kMaxLocalExperts] scratch for every em_for_each_slot pass of a kernel (a __shared__
// array inside the template would be one more 4 KB per instantiation, i.e. per lambda type).
OMNIEP_DEVICE int* em_rows_scratch() {
  __shared__ int s_upto[kMaxLocalExperts];
  return s_upto;
}

template <typename RowsOf, typename SlotOf, typename Fn>
OMNIEP_DEVICE void em_for_each_slot(int L, int C, RowsOf rows_of, SlotOf slot_of, Fn fn) {
  int* s_upto = em_rows_scratch();
  const int total = block_rows_prefix(s_upto, L, rows_of);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * gpu::warps_per_block();
  for (int64_t next = gpu::grid_warp_spread(); next < total; next += warps) {
    const int off = static_cast<int>(next);
    int lo = 0, hi = L - 1;  // the first expert whose inclusive prefix passes `off`
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (s_upto[mid] > off) hi = mid; else lo = mid + 1;
    }
    const int before = lo > 0 ? s_upto[lo - 1] : 0;
    fn(static_cast<int64_t>(lo) * C + slot_of(lo, off - before));
  }
  __syncthreads();  // s_upto is reused by the next pass
}

// One pass of em_for_each_slot — pass 0: the counted rows (c < count[l]), pass 1: the padding rows.
template <typename Fn>
OMNIEP_DEVICE void em_for_each_row(const int32_t* count, int L, int C, int pass, Fn fn) {
  em_for_each_slot(
      L, C,
      [count, C, pass](int l) {
        const int n = count == nullptr ? C : count[l];
        return pass == 0 ? n : C - n;
      },
      [count, C, pass](int l, int q) { return pass == 0 ? q : (count == nullptr ? C : count[l]) + q; }, fn);
}

// The slots of this rank's own copies, per local expert: every thread of the block gets [lo[l], hi[l])
// (empty: lo > hi), the slots of local expert l that hold copies of the rank's own tokens — one range,
// since a source's copies of an expert take consecutive slots (em_args.h). From the rank's routing
// (idx32 [n], copy_slot [n], n = T * K), by every block on its own (a scan of the n pairs: cheaper than a
// grid-wide exchange). Every thread of the block must call it.
struct EMOwnSlots {
  int lo[kMaxLocalExperts];
  int hi[kMaxLocalExperts];
  OMNIEP_DEVICE int size(int l) const { return hi[l] > lo[l] ? hi[l] - lo[l] : 0; }
};

OMNIEP_DEVICE void em_find_own_slots(EMOwnSlots& own, const int32_t* idx32, const int32_t* copy_slot, int64_t n,
                                     int me, int L) {
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    own.lo[l] = 0x7fffffff;
    own.hi[l] = 0;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int slot = copy_slot[i], l = idx32[i] - me * L;
    if (slot < 0 || l < 0 || l >= L) continue;
    atomicMin(&own.lo[l], slot);
    atomicMax(&own.hi[l], slot + 1);
  }
  __syncthreads();
}

// fn(j) for every counted row j (c < count[l]) that does NOT hold one of the rank's own copies (own:
// em_find_own_slots; null: every counted row), as em_for_each_row deals them.
template <typename Fn>
OMNIEP_DEVICE void em_for_each_peer_row(const int32_t* count, const EMOwnSlots* own, int L, int C, Fn fn) {
  em_for_each_slot(
      L, C, [count, own, C](int l) { return (count == nullptr ? C : count[l]) - (own == nullptr ? 0 : own->size(l)); },
      [own](int l, int q) { return own == nullptr || q < own->lo[l] ? q : q + own->size(l); }, fn);
}

// Counted slots: dst[j] = src[j] (null src: left as they are) — but the rank's own copies' slots when
// `skip_own` is given (em_for_each_peer_row); padding: zeroed when `zero`, else untouched. One warp per
// row. Every thread of every block must call it.
OMNIEP_DEVICE void em_copy_slots(uint8_t* dst, const uint8_t* src, const int32_t* count, int L, int C,
                                 int64_t row_bytes, int unit, int zero, const EMOwnSlots* skip_own = nullptr) {
  if (src != nullptr) {
    em_for_each_peer_row(count, skip_own, L, C, [&](int64_t j) {
      warp_copy_row(dst + j * row_bytes, src + j * row_bytes, row_bytes, unit);
    });
  }
  if (zero) em_for_each_row(count, L, C, 1, [&](int64_t j) { warp_zero_row(dst + j * row_bytes, row_bytes, unit); });
}

// Zero rows [0, rows) of dst. One warp per row.
OMNIEP_DEVICE void em_zero_rows(uint8_t* dst, int64_t rows, int64_t row_bytes, int unit) {
  const int warps = gpu::warps_per_block();
  for (int64_t j = gpu::grid_warp_spread(); j < rows; j += static_cast<int64_t>(gridDim.x) * warps) {
    warp_zero_row(dst + j * row_bytes, row_bytes, unit);
  }
}

// The routing of every slot (one warp per expert, its lanes over the slots): counted slots from
// idx_in / w_in (null: left as they are), padding -1 / 0. Here a null `count` means NO slot holds a
// copy (an op that stopped).
OMNIEP_DEVICE void em_routing_padding(int32_t* idx, float* w, const int32_t* idx_in, const float* w_in,
                                      const int32_t* count, int L, int C) {
  const int warps = gridDim.x * gpu::warps_per_block();
  for (int l = static_cast<int>(gpu::grid_warp_spread()); l < L; l += warps) {
    const int n = count == nullptr ? 0 : count[l];
    for (int c = gpu::lane_id(); c < C; c += gpu::kWarpSize) {
      const int64_t j = static_cast<int64_t>(l) * C + c;
      if (c < n) {
        if (idx_in != nullptr) {
          idx[j] = idx_in[j];
          w[j] = w_in[j];
        }
      } else {
        idx[j] = -1;
        w[j] = 0.0f;
      }
    }
  }
}

}  // namespace omniep
