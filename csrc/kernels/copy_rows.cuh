// copy_rows_except: dst[i] = src[i] for every row i in [0, rows) OUTSIDE one range [b, b + n) that
// lives on the device (b = *skip_begin, n = *skip_count, clamped to the rows).
//
// The rank-major data path around the communication kernels: a rank's OWN rows never pass through
// its symmetric buffer (dispatch writes them straight into the result, combine reads them straight
// from the caller's y), so the local pass that moves the rest between the caller's tensor and the
// symmetric buffer (dispatch: copy-out of the peers' rows and the padding; combine: copy-in of the
// rows peers will pull) skips them. The range is this rank's segment of the receive order:
// b = send_offset[me], n = recv_counts[me] (layout outputs, on the device: no host sync).
// A plain launch over every SM (local HBM traffic, not communication: no SM budget applies).
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

__global__ void __launch_bounds__(kCopyRowsThreads) copy_rows_except_kernel(CopyRowsArgs a) {
  int64_t b = 0, e = 0;
  if (a.skip_begin != nullptr) {
    b = *a.skip_begin;
    e = b + *a.skip_count;
  }
  const int warps = kCopyRowsThreads / gpu::kWarpSize;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + gpu::warp_id(); row < a.rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    if (row >= b && row < e) continue;
    warp_copy_row(a.dst + row * a.row_bytes, a.src + row * a.row_bytes, a.row_bytes, a.unit);
  }
}

}  // namespace omniep
