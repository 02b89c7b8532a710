// Phase stamps: where a kernel's time goes when several ranks wait on each other, which a profiler's
// kernel replay cannot show (ncu replays one rank's kernel while its peers have moved on: it deadlocks
// or times out). Built only with OMNIEP_STAMPS=ON (a profiling build: `OMNIEP_STAMPS=ON pip install
// -e .`); otherwise every macro below is empty and the kernels are unchanged.
//
// Thread 0 of the first and the last block reads the device's global timer (ns) at each mark and, at
// the end, prints one line per mark. A warp mark (OMNIEP_STAMP_WARPS, one per kernel: every warp of the
// block at a point each reaches on its own, e.g. the end of its share of a loop) is thread 0's mark plus
// the first and the last warp's time: `<mark>(first_warp)` and `<mark>(last_warp)` — thread 0 is warp 0.
//   omniep-stamp <kernel> rank=<r> block=<b> start=<ns> <mark>=<ns since start>
// `start` is the block's first stamp in the device's timer (it tells calls apart; two GPUs' timers are
// not aligned). scripts/stamps_table.py turns a run's lines into a table of medians.
// printf at the end delays the next kernel by a few µs: compare phases, not the kernel's total, with a
// stamped build.
#pragma once

#include "omniep/gpu.h"

#ifdef OMNIEP_STAMPS
#include <cstdio>

namespace omniep {

inline constexpr int kMaxStamps = 12;

struct PhaseStamps {
  uint64_t t[kMaxStamps];
  const char* name[kMaxStamps];
  int n;
  // The warp mark: since the start, the first and the last warp (unsigned long long for atomicMin / Max);
  // no name: none was met.
  unsigned long long warp_first, warp_last;
  const char* warp_name;
  OMNIEP_DEVICE bool on() const {
    return threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x + 1 == gridDim.x);
  }
  OMNIEP_DEVICE void begin() {
    if (on()) {  // (only the stamping thread touches n: another warp may start after its first mark)
      n = 0;
      warp_first = ~0ull;
      warp_last = 0;
      warp_name = nullptr;
      mark("start");
    }
  }
  // Every warp of a stamping block, lane 0 counting (the block's threads synchronised at least once since
  // begin(), which every kernel's barriers do); thread 0 also takes it as its own mark.
  OMNIEP_DEVICE void warp_mark(const char* what) {
    if ((blockIdx.x == 0 || blockIdx.x + 1 == gridDim.x) && gpu::lane_id() == 0) {
      const unsigned long long at = gpu::global_timer_ns() - t[0];
      atomicMin(&warp_first, at);
      atomicMax(&warp_last, at);
      warp_name = what;
    }
    mark(what);
  }
  OMNIEP_DEVICE void mark(const char* what) {
    if (on() && n < kMaxStamps) {
      name[n] = what;
      t[n++] = gpu::global_timer_ns();
    }
  }
  OMNIEP_DEVICE void print(const char* kernel, int rank) const {
    if (!on()) return;
    for (int i = 1; i < n; ++i) {
      printf("omniep-stamp %s rank=%d block=%d start=%llu %s=%llu\n", kernel, rank, static_cast<int>(blockIdx.x),
             static_cast<unsigned long long>(t[0]), name[i], static_cast<unsigned long long>(t[i] - t[0]));
    }
    if (warp_name != nullptr) {  // (the kernel's barriers ordered every warp's mark before this)
      printf("omniep-stamp %s rank=%d block=%d start=%llu %s(first_warp)=%llu\n", kernel, rank,
             static_cast<int>(blockIdx.x), static_cast<unsigned long long>(t[0]), warp_name, warp_first);
      printf("omniep-stamp %s rank=%d block=%d start=%llu %s(last_warp)=%llu\n", kernel, rank,
             static_cast<int>(blockIdx.x), static_cast<unsigned long long>(t[0]), warp_name, warp_last);
    }
  }
};

// The block's stamps (one per block and kernel: a __shared__ variable of a device function is static),
// so that a mark can sit in any function the kernel calls.
OMNIEP_DEVICE PhaseStamps& phase_stamps() {
  __shared__ PhaseStamps s;
  return s;
}

}  // namespace omniep

#define OMNIEP_STAMPS_BEGIN() ::omniep::phase_stamps().begin()
#define OMNIEP_STAMP(what) ::omniep::phase_stamps().mark(what)
#define OMNIEP_STAMP_WARPS(what) ::omniep::phase_stamps().warp_mark(what)
#define OMNIEP_STAMPS_END(kernel, rank) ::omniep::phase_stamps().print(kernel, rank)
#else
#define OMNIEP_STAMPS_BEGIN() \
  do {                        \
  } while (0)
#define OMNIEP_STAMP(what) \
  do {                     \
  } while (0)
#define OMNIEP_STAMP_WARPS(what) \
  do {                           \
  } while (0)
#define OMNIEP_STAMPS_END(kernel, rank) \
  do {                                  \
  } while (0)
#endif
