// Slot-wise passes over an expert-major buffer [L, C, ...] of one rank (whole grid of the rank):
// slot (l, c) holds a copy when c < count[l] (em_layout's recv_expert_count; null: every slot),
// the rest is padding. The expert-major kernels move the counted slots only, so their cost follows
// the routed copies, not L * C (DESIGN §2 leaves the padding unspecified unless zero_padding).
#pragma once

#include "kernels/rows.cuh"

namespace omniep {

// Counted slots: dst[j] = src[j] (null src: left as they are); padding: zeroed when `zero`, else
// untouched. One warp per row, the rows dealt round-robin over every warp of the rank in (l, c)
// order — counted rows first, then (zero) the padding rows — so the cost follows the rows moved
// (balanced however skewed the experts), and no pass over L * C slots. The warp reads the counts a
// warp's width of experts at a time (one load, a scan over the lanes, a ballot per row): a loop over
// the experts one by one was a chain of L dependent loads in every warp (tens of µs at L = 144).
OMNIEP_DEVICE void em_copy_slots(uint8_t* dst, const uint8_t* src, const int32_t* count, int L, int C,
                                 int64_t row_bytes, int unit, int zero) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * gpu::warps_per_block();
  const int64_t me = static_cast<int64_t>(blockIdx.x) * gpu::warps_per_block() + gpu::warp_id();
  const int lane = gpu::lane_id();
  for (int pass = src != nullptr ? 0 : 1; pass < (zero ? 2 : 1); ++pass) {  // 0: counted rows, 1: padding
    int64_t base = 0;   // rows of this pass before expert l0 (the same in every warp)
    int64_t next = me;  // my next row of this pass (rows me, me + warps, ...)
    for (int l0 = 0; l0 < L; l0 += gpu::kWarpSize) {
      const int l = l0 + lane;
      const int n = l >= L ? 0 : count == nullptr ? C : count[l];
      const int rows = l >= L ? 0 : pass == 0 ? n : C - n;
      int64_t upto = rows;  // inclusive scan over the lanes: rows of experts l0 .. l
      for (int d = 1; d < gpu::kWarpSize; d *= 2) {
        const int64_t v = gpu::shfl(upto, lane >= d ? lane - d : lane);
        if (lane >= d) upto += v;
      }
      const int64_t end = base + gpu::shfl(upto, gpu::kWarpSize - 1);
      for (; next < end; next += warps) {  // (warp-uniform)
        const int64_t off = next - base;
        const int at = gpu::lowest_lane(gpu::ballot(upto > off));  // the expert holding row `off`
        const int64_t before = gpu::shfl(upto - rows, at);
        const int first = pass == 0 ? 0 : gpu::shfl(n, at);
        const int64_t j = static_cast<int64_t>(l0 + at) * C + first + (off - before);
        if (pass == 0) {
          warp_copy_row(dst + j * row_bytes, src + j * row_bytes, row_bytes, unit);
        } else {
          warp_zero_row(dst + j * row_bytes, row_bytes, unit);
        }
      }
      base = end;
    }
  }
}

// Zero rows [0, rows) of dst. One warp per row.
OMNIEP_DEVICE void em_zero_rows(uint8_t* dst, int64_t rows, int64_t row_bytes, int unit) {
  const int warps = gpu::warps_per_block();
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id(); j < rows;
       j += static_cast<int64_t>(gridDim.x) * warps) {
    warp_zero_row(dst + j * row_bytes, row_bytes, unit);
  }
}

// The routing of every slot (one warp per expert, its lanes over the slots): counted slots from
// idx_in / w_in (null: left as they are), padding -1 / 0. Here a null `count` means NO slot holds a
// copy (an op that stopped).
OMNIEP_DEVICE void em_routing_padding(int32_t* idx, float* w, const int32_t* idx_in, const float* w_in,
                                      const int32_t* count, int L, int C) {
  const int warps = gridDim.x * gpu::warps_per_block();
  for (int l = blockIdx.x * gpu::warps_per_block() + gpu::warp_id(); l < L; l += warps) {
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
