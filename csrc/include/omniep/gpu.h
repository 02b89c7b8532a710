// Portable device dialect: the few GPU primitives omniep's kernels use, behind vendor-neutral names.
//
// Kernels include this header and never spell a CUDA or HIP intrinsic directly, so that one kernel
// source builds for NVIDIA (nvcc) and AMD (hipcc). Both mappings are compile-checked in CI:
// the CMake project under OMNIEP_COMPILE_CHECK=ON (nvcc, sm_90) and cmake/hip_compile_check.cmake (Debian's hipcc 5.2.3 /
// clang-15, gfx90a and gfx940). The HIP mapping has NOT run on AMD hardware yet.
//
// Vendor differences kept here (kernels use only the names below):
//   warp size        kWarpSize: 32 on NVIDIA, 64 on CDNA (gfx9: gfx90a, gfx940/942; wave32 RDNA is
//                    refused at compile time); lane masks (ballots) are lane_mask_t, 32 or 64 bits.
//   shuffles/ballots shfl / ballot / popc / lanes_below / lowest_lane / syncwarp; block_any (a barrier of the
//                    block that ORs a predicate: one bar.red on NVIDIA; on AMD ockl's workgroup reduction,
//                    three s_barriers and 256 B of static LDS).
//   atomics, fences  system-scope acquire/release (PTX .sys; HIP __HIP_MEMORY_SCOPE_SYSTEM).
//   timer            global_timer_ns: %globaltimer on NVIDIA, s_memrealtime (wall_clock64, 100 MHz on
//                    gfx9) on AMD.
//   fp32 rounding    add_rn / mul_rn / div_rn: __fadd_rn / __fmul_rn / __fdiv_rn on NVIDIA; on AMD plain fp32 ops inside
//                    `#pragma clang fp contract(off)` (HIP's own __fadd_rn is a plain `x + y` that
//                    hipcc's default -ffp-contract=fast-honor-pragmas may fuse into an FMA).
//   bf16 / fp16      bf16_to_float / float_to_bf16_rn / half_to_float / float_to_half_rn.
// Host-side differences (runtime API, cooperative launch) live in omniep/runtime.h.
//
// Memory-ordering vocabulary (PTX / HIP memory models):
//   *_acquire_sys / *_release_sys  acquire load / release store or add at SYSTEM scope: orders the
//                                  caller's memory operations against peers on other GPUs and the host.
//   *_gpu                          the same at device scope (other blocks of the same GPU).
//   fence_acq_rel_sys()            a full acquire-release fence at system scope.
// A release is cumulative: writes that happen-before it (e.g. other threads' writes ordered by a
// __syncthreads) become visible to whoever acquires the released value.
#pragma once

#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define OMNIEP_HIP 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64
#error "omniep: the HIP kernels assume 64-lane wavefronts (CDNA: gfx90a, gfx940, gfx942)"
#endif
#else
#define OMNIEP_CUDA 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#define OMNIEP_DEVICE __device__ __forceinline__
#define OMNIEP_HOST_DEVICE __host__ __device__ __forceinline__

namespace omniep::gpu {

#if defined(OMNIEP_CUDA)
inline constexpr int kWarpSize = 32;
using lane_mask_t = uint32_t;
using bfloat16 = __nv_bfloat16;
using float16 = __half;
#else
inline constexpr int kWarpSize = 64;
using lane_mask_t = uint64_t;
// omniep's own bf16 storage type on AMD: HIP's bf16 type changed across ROCm releases (hip_bfloat16
// in 5.x, __hip_bfloat16 from 6.0), and the kernels only load, store and convert it.
struct alignas(2) bfloat16 {
  uint16_t bits;
};
using float16 = __half;
#endif
static_assert(sizeof(lane_mask_t) * 8 == kWarpSize, "one ballot bit per lane");

OMNIEP_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }
OMNIEP_DEVICE int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }
OMNIEP_DEVICE int warps_per_block() { return static_cast<int>(blockDim.x) / kWarpSize; }
// This warp's index over the grid with the BLOCK varying fastest (warp 0 of every block, then warp 1,
// ...): a pass with fewer items than warps spreads them over every SM, where the block-major index
// (block * warps + warp) gave them all to the first blocks' SMs and left the rest idle.
OMNIEP_DEVICE int64_t grid_warp_spread() {
  return static_cast<int64_t>(warp_id()) * gridDim.x + blockIdx.x;
}

// ---- warp collectives (all lanes of the warp must call them) ----
#if defined(OMNIEP_CUDA)
OMNIEP_DEVICE lane_mask_t ballot(bool pred) { return __ballot_sync(0xffffffffu, pred); }
template <typename T>
OMNIEP_DEVICE T shfl(T v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
OMNIEP_DEVICE int popc(lane_mask_t m) { return __popc(m); }
OMNIEP_DEVICE lane_mask_t lanes_below() {  // bits of the lanes with a smaller id than mine
  uint32_t m;
  asm volatile("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
OMNIEP_DEVICE void syncwarp() { __syncwarp(); }
OMNIEP_DEVICE int lowest_lane(lane_mask_t m) { return __ffs(m) - 1; }  // m != 0
#else
OMNIEP_DEVICE lane_mask_t ballot(bool pred) { return __ballot(pred); }
template <typename T>
OMNIEP_DEVICE T shfl(T v, int src_lane) { return __shfl(v, src_lane, kWarpSize); }
OMNIEP_DEVICE int popc(lane_mask_t m) { return __popcll(m); }
OMNIEP_DEVICE lane_mask_t lanes_below() { return (lane_mask_t(1) << lane_id()) - 1; }
// A wavefront runs in lockstep; the fences order LDS accesses of its lanes around the barrier (what
// __syncwarp guarantees on NVIDIA), the wave barrier keeps the compiler from moving code across it.
OMNIEP_DEVICE void syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
OMNIEP_DEVICE int lowest_lane(lane_mask_t m) {  // m != 0
  return static_cast<int>(__ffsll(static_cast<unsigned long long>(m))) - 1;
}
#endif
// Whether pred holds on any thread of the block; every thread of the block calls it (a barrier). (The same
// name on both vendors: HIP has __syncthreads_or too.)
OMNIEP_DEVICE bool block_any(bool pred) { return __syncthreads_or(pred) != 0; }

// ---- scoped loads, stores, atomics and fences ----
#if defined(OMNIEP_CUDA)
OMNIEP_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
OMNIEP_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
OMNIEP_DEVICE int32_t load_acquire_sys(const int32_t* p) {
  return static_cast<int32_t>(load_acquire_sys(reinterpret_cast<const uint32_t*>(p)));
}
OMNIEP_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
OMNIEP_DEVICE void add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
OMNIEP_DEVICE void add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Device scope: a rank's own blocks meeting each other (the arrival and release of rank_barrier). A
// release / acquire pair of this scope is cheaper than the system's, and happens-before stays
// transitive across scopes, so writes a block made anywhere (peers' memory included) still reach a
// peer through block 0's system-scope signal that follows.
OMNIEP_DEVICE uint32_t load_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
OMNIEP_DEVICE void store_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
OMNIEP_DEVICE void add_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
OMNIEP_DEVICE uint32_t fetch_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
OMNIEP_DEVICE void add_relaxed_sys(int32_t* p, int32_t v) { atomicAdd_system(p, v); }
OMNIEP_DEVICE int32_t cas_relaxed_sys(int32_t* p, int32_t expect, int32_t v) {
  return atomicCAS_system(p, expect, v);
}
OMNIEP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// Nanoseconds from a clock that all SMs share (for timeouts, not for measuring kernels).
OMNIEP_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
OMNIEP_DEVICE void pause() { __nanosleep(32); }
#else
OMNIEP_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE uint32_t load_acquire_sys(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE int32_t load_acquire_sys(const int32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE void add_release_sys(uint64_t* p, uint64_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE void add_release_sys(uint32_t* p, uint32_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE uint32_t load_acquire_gpu(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
OMNIEP_DEVICE void store_release_gpu(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
OMNIEP_DEVICE void add_release_gpu(uint32_t* p, uint32_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
OMNIEP_DEVICE uint32_t fetch_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
OMNIEP_DEVICE void add_relaxed_sys(int32_t* p, int32_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE int32_t cas_relaxed_sys(int32_t* p, int32_t expect, int32_t v) {
  __hip_atomic_compare_exchange_strong(p, &expect, v, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expect;
}
// "" = the system (agent-crossing) synchronisation scope of the AMDGPU memory model.
OMNIEP_DEVICE void fence_acq_rel_sys() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, ""); }
// s_memrealtime: a constant 100 MHz clock on gfx9 (MI200, MI300), shared by the device's CUs.
OMNIEP_DEVICE uint64_t global_timer_ns() {
#if defined(__HIP_DEVICE_COMPILE__)
  return static_cast<uint64_t>(wall_clock64()) * 10;
#else
  return 0;  // the host pass of a device function (HIP declares wall_clock64 for the device only)
#endif
}
OMNIEP_DEVICE void pause() { __builtin_amdgcn_s_sleep(1); }
#endif

// fp32 bits (both toolchains name these alike).
OMNIEP_DEVICE uint32_t float_as_uint(float v) { return __float_as_uint(v); }
OMNIEP_DEVICE float uint_as_float(uint32_t v) { return __uint_as_float(v); }

// ---- exact fp32 arithmetic: round-to-nearest, never contracted into FMA or reassociated ----
#if defined(OMNIEP_CUDA)
OMNIEP_DEVICE float add_rn(float a, float b) { return __fadd_rn(a, b); }
// The product rounded to fp32 on its own, so `add_rn(acc, mul_rn(w, y))` never becomes an FMA.
OMNIEP_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
OMNIEP_DEVICE float div_rn(float a, float b) { return __fdiv_rn(a, b); }
#else
// IEEE fp32 add / mul round to nearest even on AMD; contract(off) leaves the operations without
// LLVM's `contract` flag, so they are never fused into an FMA, also after inlining.
OMNIEP_DEVICE float add_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
OMNIEP_DEVICE float mul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
OMNIEP_DEVICE float div_rn(float a, float b) { return a / b; }  // IEEE: correctly rounded without fast-math
#endif

// ---- bf16 / fp16 <-> fp32 (exact widening; one round-to-nearest-even narrowing) ----
#if defined(OMNIEP_CUDA)
OMNIEP_DEVICE float bf16_to_float(bfloat16 v) { return __bfloat162float(v); }
OMNIEP_DEVICE bfloat16 float_to_bf16_rn(float v) { return __float2bfloat16_rn(v); }
#else
OMNIEP_DEVICE float bf16_to_float(bfloat16 v) { return __uint_as_float(static_cast<uint32_t>(v.bits) << 16); }
// Round to nearest even, NaN to the canonical 0x7fff (what cvt.rn.bf16.f32 gives on NVIDIA).
OMNIEP_DEVICE bfloat16 float_to_bf16_rn(float v) {
  const uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{0x7fff};
  return bfloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
#endif
OMNIEP_DEVICE float half_to_float(float16 v) { return __half2float(v); }
OMNIEP_DEVICE float16 float_to_half_rn(float v) { return __float2half_rn(v); }

}  // namespace omniep::gpu
