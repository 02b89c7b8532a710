// Row movement and element conversion shared by the kernels.
//
// Rows are moved as raw bytes (dispatch never interprets them: bf16, fp16, fp32 and fp8 rows are all
// just bytes). The widest unit that divides the row size and both addresses' alignment is chosen
// once per launch by the host (row_copy_unit), so DeepEP-shaped rows move as 16-byte vectors and odd
// shapes (H = 3 in bf16) still work.
#pragma once

#include "kernels/args.h"
#include "omniep/gpu.h"

namespace omniep {

OMNIEP_HOST_DEVICE int dtype_size(int dtype) { return dtype == kFloat32 ? 4 : 2; }

template <typename Unit>
OMNIEP_DEVICE void warp_copy_units(Unit* __restrict__ dst, const Unit* __restrict__ src, int64_t n) {
  // Four independent loads in flight per lane before the stores: enough to cover NVLink latency
  // with a few warps per SM.
  constexpr int kUnroll = 4;
  const int lane = gpu::lane_id();
  int64_t i = lane;
  for (; i + (kUnroll - 1) * gpu::kWarpSize < n; i += kUnroll * gpu::kWarpSize) {
    Unit v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * gpu::kWarpSize];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * gpu::kWarpSize] = v[u];
  }
  for (; i < n; i += gpu::kWarpSize) dst[i] = src[i];
}

// Copy `bytes` from src to dst with the whole warp, in units of `unit` bytes (16, 8, 4, 2 or 1;
// both addresses and `bytes` are multiples of it).
OMNIEP_DEVICE void warp_copy_row(void* dst, const void* src, int64_t bytes, int unit) {
  switch (unit) {
    case 16: warp_copy_units(static_cast<int4*>(dst), static_cast<const int4*>(src), bytes / 16); break;
    case 8: warp_copy_units(static_cast<int2*>(dst), static_cast<const int2*>(src), bytes / 8); break;
    case 4: warp_copy_units(static_cast<int*>(dst), static_cast<const int*>(src), bytes / 4); break;
    case 2: warp_copy_units(static_cast<short*>(dst), static_cast<const short*>(src), bytes / 2); break;
    default: warp_copy_units(static_cast<char*>(dst), static_cast<const char*>(src), bytes); break;
  }
}

// Copy one source row to several destinations with the whole warp, reading the source ONCE: lane d
// (d < kWarpSize) holds destination d's address in `my_dst`; bit d of `dests` says whether it is used.
// Each chunk is loaded once and stored to every destination (a token bound for R ranks costs one
// read of its row instead of R).
template <typename Unit>
OMNIEP_DEVICE void warp_copy_units_multi(Unit* my_dst, gpu::lane_mask_t dests, const Unit* __restrict__ src,
                                         int64_t n) {
  constexpr int kUnroll = 4;
  const int lane = gpu::lane_id();
  const unsigned long long mine = reinterpret_cast<uintptr_t>(my_dst);
  // Warp-uniform trip counts (the shuffles need every lane): full chunks, then a ragged tail.
  int64_t base = 0;
  for (; base + kUnroll * gpu::kWarpSize <= n; base += kUnroll * gpu::kWarpSize) {
    const int64_t i = base + lane;
    Unit v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * gpu::kWarpSize];
    for (gpu::lane_mask_t m = dests; m; m &= m - 1) {
      Unit* dst = reinterpret_cast<Unit*>(static_cast<uintptr_t>(gpu::shfl(mine, gpu::lowest_lane(m))));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[i + u * gpu::kWarpSize] = v[u];
    }
  }
  for (; base < n; base += gpu::kWarpSize) {
    const int64_t j = base + lane;
    Unit v{};
    if (j < n) v = src[j];
    for (gpu::lane_mask_t m = dests; m; m &= m - 1) {
      Unit* dst = reinterpret_cast<Unit*>(static_cast<uintptr_t>(gpu::shfl(mine, gpu::lowest_lane(m))));
      if (j < n) dst[j] = v;
    }
  }
}

OMNIEP_DEVICE void warp_copy_row_multi(void* my_dst, gpu::lane_mask_t dests, const void* src, int64_t bytes,
                                       int unit) {
  switch (unit) {
    case 16: warp_copy_units_multi(static_cast<int4*>(my_dst), dests, static_cast<const int4*>(src), bytes / 16); break;
    case 8: warp_copy_units_multi(static_cast<int2*>(my_dst), dests, static_cast<const int2*>(src), bytes / 8); break;
    case 4: warp_copy_units_multi(static_cast<int*>(my_dst), dests, static_cast<const int*>(src), bytes / 4); break;
    case 2: warp_copy_units_multi(static_cast<short*>(my_dst), dests, static_cast<const short*>(src), bytes / 2); break;
    default: warp_copy_units_multi(static_cast<char*>(my_dst), dests, static_cast<const char*>(src), bytes); break;
  }
}

// Zero `bytes` at dst with the whole warp, in units of `unit` bytes.
OMNIEP_DEVICE void warp_zero_row(void* dst, int64_t bytes, int unit) {
  const int lane = gpu::lane_id();
  char* d = static_cast<char*>(dst);
  for (int64_t i = static_cast<int64_t>(lane) * unit; i < bytes; i += static_cast<int64_t>(gpu::kWarpSize) * unit) {
    switch (unit) {
      case 16: *reinterpret_cast<int4*>(d + i) = make_int4(0, 0, 0, 0); break;
      case 8: *reinterpret_cast<int2*>(d + i) = make_int2(0, 0); break;
      case 4: *reinterpret_cast<int*>(d + i) = 0; break;
      case 2: *reinterpret_cast<short*>(d + i) = 0; break;
      default: d[i] = 0; break;
    }
  }
}

// Remote path (a transport with kHasRemote; call only inside `if constexpr (Tr::kHasRemote)`): the
// whole warp GETS packs [base, base + n) of peer r's copy of a symmetric row (`mine`: MY address of
// it) into `stage` (this warp's area of the transport's symmetric scratch) and returns a pointer
// indexable by pack number p in [base, base + n). Blocking: the packs are there when it returns.
template <typename Pack, typename Tr>
OMNIEP_DEVICE const Pack* get_packs(const Tr& tr, const Pack* mine, int r, int base, int n, Pack* stage) {
  gpu::syncwarp();  // every lane is done with the stage's previous contents
  if (n > 0) tr.get_warp(stage, mine + base, static_cast<size_t>(n) * sizeof(Pack), r);
  gpu::syncwarp();  // every lane's part is there
  return stage - base;
}

// ---- element conversion (exact widening to fp32; one round-to-nearest-even narrowing) ----
template <typename T> struct Elem;
template <> struct Elem<float> {
  static OMNIEP_DEVICE float to_float(float v) { return v; }
  static OMNIEP_DEVICE float from_float(float v) { return v; }
};
template <> struct Elem<gpu::bfloat16> {
  static OMNIEP_DEVICE float to_float(gpu::bfloat16 v) { return gpu::bf16_to_float(v); }
  static OMNIEP_DEVICE gpu::bfloat16 from_float(float v) { return gpu::float_to_bf16_rn(v); }
};
template <> struct Elem<gpu::float16> {
  static OMNIEP_DEVICE float to_float(gpu::float16 v) { return gpu::half_to_float(v); }
  static OMNIEP_DEVICE gpu::float16 from_float(float v) { return gpu::float_to_half_rn(v); }
};

// Load element i of a tensor whose dtype is known only at run time (bias terms).
OMNIEP_DEVICE float load_as_float(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case kBFloat16: return gpu::bf16_to_float(static_cast<const gpu::bfloat16*>(p)[i]);
    case kFloat16: return gpu::half_to_float(static_cast<const gpu::float16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

}  // namespace omniep
