// Portable device dialect: the few GPU primitives omniep's kernels use, behind vendor-neutral names.
//
// Kernels include this header and never spell a CUDA or HIP intrinsic directly, so that one kernel
// source builds for NVIDIA (nvcc) and AMD (hipcc). The CUDA mapping is compile-checked in CI
// (scripts/check_cuda_compile.sh); the HIP mapping is written against the HIP atomic builtins and
// is not compile-checked yet (no hipcc on the CI machine).
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
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
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
using bfloat16 = __hip_bfloat16;
using float16 = __half;
#endif

OMNIEP_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }
OMNIEP_DEVICE int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }
OMNIEP_DEVICE int warps_per_block() { return static_cast<int>(blockDim.x) / kWarpSize; }

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
OMNIEP_DEVICE T shfl(T v, int src_lane) { return __shfl(v, src_lane); }
OMNIEP_DEVICE int popc(lane_mask_t m) { return __popcll(m); }
OMNIEP_DEVICE lane_mask_t lanes_below() { return (lane_mask_t(1) << lane_id()) - 1; }
OMNIEP_DEVICE void syncwarp() { __builtin_amdgcn_wave_barrier(); }
OMNIEP_DEVICE int lowest_lane(lane_mask_t m) { return __ffsll(static_cast<unsigned long long>(m)) - 1; }  // m != 0
#endif

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
OMNIEP_DEVICE void add_relaxed_sys(int32_t* p, int32_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
OMNIEP_DEVICE int32_t cas_relaxed_sys(int32_t* p, int32_t expect, int32_t v) {
  __hip_atomic_compare_exchange_strong(p, &expect, v, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expect;
}
OMNIEP_DEVICE void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
OMNIEP_DEVICE uint64_t global_timer_ns() { return wall_clock64() * 10; }  // 100 MHz on gfx9
OMNIEP_DEVICE void pause() { __builtin_amdgcn_s_sleep(1); }
#endif

// ---- exact fp32 arithmetic: round-to-nearest, never contracted into FMA or reassociated ----
// (__fadd_rn and __fmul_rn exist under both CUDA and HIP.)
OMNIEP_DEVICE float add_rn(float a, float b) { return __fadd_rn(a, b); }
// The product rounded to fp32 on its own, so `add_rn(acc, mul_rn(w, y))` never becomes an FMA.
OMNIEP_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }

}  // namespace omniep::gpu
