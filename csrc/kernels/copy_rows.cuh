// copy_rows_except: dst[i] = src[i] for every row i in [0, rows) OUTSIDE one range [b, b + n) that
// lives on the device (b = *skip_begin, n = *skip_count, clamped to the rows).
//
// The rank-major data path around the communication kernels: a rank's OWN rows never pass through
// its symmetric buffer (dispatch writes them straight into the result, combine reads them straight
// from the caller's y), so the local pass that moves the rest between the caller's tensor and the
// symmetric buffer (dispatch: copy-out of the peers' rows and the padding; combine: copy-in of the
// rows peers will pull) skips them. The range is this rank's segment of the receive order:
// b = send_offset[me], n = recv_counts[me] (layout outputs, on the device: no host sync).
// A plain launch over every SM (local HBM traffic, not communication: no SM budget applies); for
// small ops the communication kernels do this pass themselves (rank_ops.cuh: fused_copy_bytes).
#pragma once

#include "kernels/rows.cuh"

namespace omniep {

inline constexpr int kCopyRowsThreads = 256;

struct CopyRowsArgs {
  uint8_t* dst;
  const uint8_t* src;
  const int32_t* skip_begin;  // device scalar (null: skip nothing)
  const int32_t* skip_count;  // device scalar
  int64_t row_bytes;
  int64_t rows;
  int unit;  // copy unit (row_copy_unit of row_bytes, dst and src)
};

// Every warp of the launch takes its share of rows [0, rows) outside [b, e) (blockIdx.x-strided): the
// copy_rows_except kernel's loop, and the fused copy-out / copy-in of the dispatch and combine kernels
// of small ops (one launch fewer per op: DispatchArgs / CombineArgs `copy_rows`). (Inlined: a separate
// function is compiled without the kernels' register bound under -rdc, which NVSHMEM builds need.)
OMNIEP_DEVICE void grid_copy_rows_except(uint8_t* dst, const uint8_t* src, int64_t row_bytes, int64_t rows,
                                         int64_t b, int64_t e, int unit) {
  const int warps = gpu::warps_per_block();
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id(); row < rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    if (row >= b && row < e) continue;
    warp_copy_row(dst + row * row_bytes, src + row * row_bytes, row_bytes, unit);
  }
}

// (A template: several translation units include this header.)
template <typename = void>
__global__ void __launch_bounds__(kCopyRowsThreads) copy_rows_except_kernel(CopyRowsArgs a) {
  int64_t b = 0, e = 0;
  if (a.skip_begin != nullptr) {
    b = *a.skip_begin;
    e = b + *a.skip_count;
  }
  grid_copy_rows_except(a.dst, a.src, a.row_bytes, a.rows, b, e, a.unit);
}

}  // namespace omniep
