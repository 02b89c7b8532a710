// Bulk (TMA) loads from global into shared memory that complete on an mbarrier, and bulk stores back: CUDA sm_90 only
// (OMNIEP_BULK_LOADS is defined in the device passes that have them). One lane issues a whole span
// (up to the span's bytes in flight for one instruction); every lane of the warp waits on the barrier's
// phase and reads the span from shared memory. The combine uses them (combine.cuh): a copy-like loop
// of 16-byte register loads keeps only a few spans in flight per warp on 24 SMs and spends most of its
// issue slots on addresses (benchmarks/RESULTS.md, 2026-11-27: copy_rate.cu, Nsight Compute).
#pragma once

#include <stdint.h>

#include "omniep/gpu.h"

#if defined(OMNIEP_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define OMNIEP_BULK_LOADS 1

namespace omniep::bulk {

OMNIEP_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Bytes of dynamic shared memory the launch gave this block.
OMNIEP_DEVICE uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

// An mbarrier for one arriving thread; the fence makes the initialisation visible to the async proxy
// (the bulk copies complete on it) before the first copy is issued.
OMNIEP_DEVICE void init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive on `bar` expecting `bytes` (0: the phase completes at once), by the one issuing lane.
OMNIEP_DEVICE void expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// counted on `bar`. Before reusing a span that lanes read with plain loads, order those reads first
// (syncwarp) and call proxy_fence().
OMNIEP_DEVICE void load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared `src` to global `dst`, in the issuing
// thread's current bulk group; commit() closes the group. Before the span is written again, wait_read_all()
// (every committed group has read its shared memory); before the thread's block may end, wait_all().
OMNIEP_DEVICE void store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
OMNIEP_DEVICE void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
OMNIEP_DEVICE void wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
OMNIEP_DEVICE void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

OMNIEP_DEVICE void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Global memory the thread has seen written through the generic proxy (plain stores, ordered by a barrier)
// before bulk loads read it through the async proxy.
OMNIEP_DEVICE void proxy_fence_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Wait until the barrier's phase `parity` (0, 1, 0, ... for its 1st, 2nd, 3rd use) has completed.
OMNIEP_DEVICE void wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
}

}  // namespace omniep::bulk
#endif
