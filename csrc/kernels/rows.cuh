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

// Loads in flight per lane before the stores, in the row copies: the communication kernels run on a
// budget of SMs (24), so each warp must keep much in flight to cover HBM and NVLink latency (4 per
// lane moved a one-rank HT dispatch at 40 % of the copy rate); then half as many for the rest.
inline constexpr int kCopyUnroll = 8;

template <int kUnroll, typename Unit>
OMNIEP_DEVICE int64_t warp_copy_chunks(Unit* __restrict__ dst, const Unit* __restrict__ src, int64_t i, int64_t n) {
  for (; i + (kUnroll - 1) * gpu::kWarpSize < n; i += kUnroll * gpu::kWarpSize) {
    Unit v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * gpu::kWarpSize];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * gpu::kWarpSize] = v[u];
  }
  return i;
}

template <typename Unit>
OMNIEP_DEVICE void warp_copy_units(Unit* __restrict__ dst, const Unit* __restrict__ src, int64_t n) {
  int64_t i = warp_copy_chunks<kCopyUnroll>(dst, src, gpu::lane_id(), n);
  i = warp_copy_chunks<kCopyUnroll / 2>(dst, src, i, n);
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
// Full chunks of kUnroll units per lane from `base` (warp-uniform: the shuffles need every lane);
// returns where they stop.
template <int kUnroll, typename Unit>
OMNIEP_DEVICE int64_t warp_copy_chunks_multi(unsigned long long mine, gpu::lane_mask_t dests,
                                             const Unit* __restrict__ src, int64_t base, int64_t n) {
  const int lane = gpu::lane_id();
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
  return base;
}

template <typename Unit>
OMNIEP_DEVICE void warp_copy_units_multi(Unit* my_dst, gpu::lane_mask_t dests, const Unit* __restrict__ src,
                                         int64_t n) {
  const int lane = gpu::lane_id();
  const unsigned long long mine = reinterpret_cast<uintptr_t>(my_dst);
  // Full chunks (long, then short), then a ragged tail.
  int64_t base = warp_copy_chunks_multi<kCopyUnroll>(mine, dests, src, 0, n);
  base = warp_copy_chunks_multi<kCopyUnroll / 2>(mine, dests, src, base, n);
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

// ---- remote path of the rank-major kernels (call only inside `if constexpr (Tr::kHasRemote)`) ----

// Rank r's copy of the symmetric buffer `a` as this rank reaches it: through r's pointer, or (a
// remote peer) my mirror for r, where rows bound for r are staged and rows from r arrive.
template <typename Tr, typename T>
OMNIEP_DEVICE T* copy_of(const Tr& tr, const PerRank<T>& a, int r, bool remote) {
  if constexpr (Tr::kHasRemote) {
    if (remote) return tr.mirror(tr.local(a), r);
  }
  return tr.peer(a, r);
}

// Block 0, every thread: s_rows[r] = how many of my rows remote rank r keeps. send_pos is an ordered
// prefix count, so I send r (largest entry of column r) + 1 rows, kept up to r's capacity C from my
// first slot there, first[r]. 0 for the other ranks.
template <typename Tr>
__device__ void remote_send_rows(const Tr& tr, const int32_t* send_pos, const int* first, int T, int C, int* s_rows) {
  const int R = tr.num_ranks();
  if (static_cast<int>(threadIdx.x) < R) s_rows[threadIdx.x] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(T) * R; i += blockDim.x) {
    const int r = static_cast<int>(i % R);
    if (tr.is_remote(r) && send_pos[i] >= 0) atomicMax(&s_rows[r], send_pos[i] + 1);
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < R) {
    const int r = threadIdx.x;
    const int room = C - first[r] > 0 ? C - first[r] : 0;
    s_rows[r] = s_rows[r] < room ? s_rows[r] : room;
  }
  __syncthreads();
}

// Puts rows [first, first + rows) of the symmetric region at my address `base` (rows of `row_bytes`)
// from my mirror for rank r into r's copy of the region (one thread; non-blocking).
template <typename Tr, typename T>
OMNIEP_DEVICE void put_rows(const Tr& tr, T* base, int64_t row_bytes, int64_t first, int64_t rows, int r) {
  uint8_t* dst = reinterpret_cast<uint8_t*>(base) + first * row_bytes;
  tr.put_block(dst, tr.mirror(dst, r), static_cast<size_t>(rows * row_bytes), r);
}

// Expert-major remote path (a transport with kHasGets; call only inside `if constexpr (Tr::kHasGets)`): the
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

// ---- DeepEP's low-latency fp8 cast, as torch computes it (omniep.backends.torch_group.quantize_fp8) ----
inline constexpr int kFp8Block = 128;  // channels per scale

// fp32 -> float8_e4m3fn bits exactly as torch converts (c10's fp8e4m3fn_from_fp32_value, written out):
// round to nearest even, subnormals included; |f| >= 480 and NaN become 0x7F with f's sign.
OMNIEP_DEVICE uint8_t fp8_e4m3_bits(float f) {
  constexpr uint32_t kFirstOut = 1087u << 20;  // 480.0f, the first magnitude e4m3fn cannot hold
  constexpr uint32_t kDenormMagic = 141u << 23;
  uint32_t bits = gpu::float_as_uint(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t out;
  if (bits >= kFirstOut) {
    out = 0x7fu;
  } else if (bits < (121u << 23)) {  // below 2^-6: the adder rounds to a multiple of 2^-9
    out = gpu::float_as_uint(gpu::add_rn(gpu::uint_as_float(bits), gpu::uint_as_float(kDenormMagic))) - kDenormMagic;
  } else {
    const uint32_t odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + odd;
    out = bits >> 20;
  }
  return static_cast<uint8_t>(out | (sign >> 24));
}

// max(a, b) as torch's amax takes it: a NaN on either side wins.
OMNIEP_DEVICE float max_nan(float a, float b) {
  if (b != b) return b;
  return a != a || a > b ? a : b;
}

// The least power of two >= v, for v > 0 (DeepEP's round_scale: exponent + 1 unless the mantissa is
// zero); NaN stays NaN, +inf stays +inf.
OMNIEP_DEVICE float pow2_ceil(float v) {
  if (v != v) return v;
  const uint32_t bits = gpu::float_as_uint(v);
  return gpu::uint_as_float((((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u)) << 23);
}

// Cast row t of x [T, H] bf16 to x8 [T, H] e4m3 and scales [T, H / 128] fp32:
// amax over each block of 128 channels (NaN propagates), scale = max(amax, 1e-4) / 448 (round_scale:
// then rounded up to a power of two), x8 = e4m3(x / scale) — each step one IEEE rounding, as torch does
// it. Half a warp per (token, block of 128): 8 channels per lane, one 16-byte load and one 8-byte store
// (element loads where x is not 16-byte aligned), so a warp casts two blocks per round and a decode
// batch (128 tokens x 56 blocks) takes under two rounds of 132 x 16 warps, where a warp per block
// with 2-byte loads took four. (The max is exact, so the lanes' order of it does not change a bit.)
// Rows [t0, t1), by the warps first_warp, first_warp + warps, ... (grid_cast_fp8: every row, every warp of
// the grid; the expert-major dispatch's routing front: a block its own tokens, while its barrier's signals
// travel).
OMNIEP_DEVICE void cast_fp8_rows(const gpu::bfloat16* x, uint8_t* x8, float* scales, int64_t t0, int64_t t1, int H,
                                 bool round_scale, int64_t first_warp, int64_t warps) {
  constexpr int kLanes = 16;                 // lanes per block of 128 channels
  constexpr int kPer = kFp8Block / kLanes;   // channels per lane
  struct alignas(16) In { gpu::bfloat16 v[kPer]; };
  struct alignas(8) Out { uint8_t v[kPer]; };
  const int nb = H / kFp8Block, lane = gpu::lane_id();
  const int half = lane / kLanes, sub = lane % kLanes;
  const int64_t items = (t1 - t0) * nb;
  x += t0 * H;
  x8 += t0 * H;
  scales += t0 * nb;
  const bool vec = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;  // (x8 is the kernel's own staging)
  for (int64_t pair = first_warp; 2 * pair < items; pair += warps) {
    const int64_t item = 2 * pair + half;  // (t - t0, b): x[t * H + b * 128 + c]
    const bool on = item < items;          // (both halves shuffle; only a real item stores)
    const int64_t at = item * kFp8Block + sub * kPer;
    float v[kPer];
    if (on && vec) {
      const In in = *reinterpret_cast<const In*>(x + at);
#pragma unroll
      for (int u = 0; u < kPer; ++u) v[u] = gpu::bf16_to_float(in.v[u]);
    } else {
#pragma unroll
      for (int u = 0; u < kPer; ++u) v[u] = on ? gpu::bf16_to_float(x[at + u]) : 0.0f;
    }
    float m = 0.0f;
#pragma unroll
    for (int u = 0; u < kPer; ++u) m = max_nan(m, fabsf(v[u]));
    for (int d = kLanes / 2; d > 0; d /= 2) m = max_nan(m, gpu::shfl(m, lane ^ d));  // within the half
    float scale = gpu::div_rn(m < 1e-4f ? 1e-4f : m, 448.0f);  // (NaN < 1e-4 is false: NaN stays)
    if (round_scale) scale = pow2_ceil(scale);
    if (!on) continue;
    Out out;
#pragma unroll
    for (int u = 0; u < kPer; ++u) out.v[u] = fp8_e4m3_bits(gpu::div_rn(v[u], scale));
    *reinterpret_cast<Out*>(x8 + at) = out;
    if (sub == 0) scales[item] = scale;
  }
}

OMNIEP_DEVICE void grid_cast_fp8(const gpu::bfloat16* x, uint8_t* x8, float* scales, int T, int H, bool round_scale) {
  cast_fp8_rows(x, x8, scales, 0, T, H, round_scale, gpu::grid_warp_spread(),
                static_cast<int64_t>(gridDim.x) * gpu::warps_per_block());
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
