// Signals, waits with timeouts and the rank-wide barrier, for any Transport.
//
// A rank runs as gridDim.x blocks (all co-resident: the launcher guarantees it). A barrier is
//   1. every block: __syncthreads, then thread 0 orders the block's writes (fence.acq_rel.sys) and
//      arrives on the rank's `arrive` counter;
//   2. block 0 waits for all arrivals, then thread s < R signals peer s (release add on
//      signals[me] in s's workspace) and waits until its own signals[s] reaches expected[s] + 1;
//   3. block 0 bumps the rank's `release` generation; the other blocks (if they must wait) spin on it.
// Release cumulativity carries every block's writes (to local or peer memory) to the peers that
// acquire the signal. A remote peer (omniep/transport.h) is signalled with the transport's signal
// op, by the thread that first issued this barrier's puts to it (the `puts` hook: rows the blocks
// staged in the mirror before arriving), so the peer sees the rows once it sees the signal; that
// thread then waits until those puts have read their sources (quiet; a barrier without a hook has
// no such puts and skips it), which the rank may rewrite after the barrier. On a transport with one-sided gets (the expert-major kernels'
// remote path, kHasGets) every thread first completes its own puts (quiet).
// Every wait has a timeout; the first failure is written into the rank's ErrorRecord (naming the
// rank, the peer and the phase) and from then on the rank skips its work
// and waits, so a missing peer turns into an error, never into a hang.
#pragma once

#include <type_traits>

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

// Kernels give lane r of a warp rank r's data (r < R <= kMaxRanks).
static_assert(gpu::kWarpSize >= kMaxRanks, "a warp must have a lane per rank");

OMNIEP_DEVICE bool has_error(RankWorkspace* ws) {
  return gpu::load_acquire_sys(&ws->error.code) != kErrNone;
}

OMNIEP_DEVICE void record_error(RankWorkspace* ws, int32_t code, int rank, int peer, int phase) {
  if (gpu::cas_relaxed_sys(&ws->error.code, kErrNone, code) == kErrNone) {
    ws->error.rank = rank;
    ws->error.peer = peer;
    ws->error.phase = phase;
    gpu::fence_acq_rel_sys();
  }
}

// Add 1 to signals[me] in `peer`'s workspace: a release add through its pointer, or, for a peer the
// transport reaches only by puts (remote path), the transport's signal op, ordered after this
// thread's puts to the peer. Either way whatever this rank wrote to the peer before (ordered to this
// thread by the barrier) is visible once the peer sees it.
template <typename Tr>
OMNIEP_DEVICE void signal_peer(const Tr& tr, int peer, int me) {
  gpu::fence_acq_rel_sys();
  if constexpr (Tr::kHasRemote) {
    if (tr.is_remote(peer)) {
      tr.signal_remote(peer);
      return;
    }
  }
  gpu::add_release_sys(&tr.workspace(peer)->signals[me], uint64_t{1});
}

// Poll `load()` until it reaches `target` (compared as a signed difference so the counter may
// wrap). Returns false on timeout.
template <typename U, typename Load>
OMNIEP_DEVICE bool wait_for(Load load, U target, uint64_t timeout_ns) {
  using S = typename std::conditional<sizeof(U) == 8, int64_t, int32_t>::type;
  if (static_cast<S>(load() - target) >= 0) return true;
  const uint64_t start = gpu::global_timer_ns();
  while (true) {
    if (static_cast<S>(load() - target) >= 0) return true;
    if (gpu::global_timer_ns() - start > timeout_ns) return false;
  }
}

template <typename U>
OMNIEP_DEVICE bool wait_at_least(const U* counter, U target, uint64_t timeout_ns) {
  return wait_for([counter] { return gpu::load_acquire_sys(counter); }, target, timeout_ns);
}

// My count of the barriers peer s has signalled: my workspace's counter, or the transport's for a
// remote peer (GIN keeps its signals outside window memory).
template <typename Tr>
OMNIEP_DEVICE uint64_t signals_from(const Tr& tr, const RankWorkspace* ws, int s) {
  if constexpr (Tr::kHasRemote) {
    if (tr.is_remote(s)) return tr.remote_signals(ws, s);
  }
  return gpu::load_acquire_sys(&ws->signals[s]);
}

// The default `puts` hook of rank_barrier: nothing to send.
struct NoPuts {
  OMNIEP_DEVICE void operator()(int) const {}
};

// The barrier described above. `all_wait`: every block leaves only after the peers signalled
// (use before reading peer data); otherwise only block 0 waits for the peers (use at the end of a
// kernel: the kernel completes only when block 0 does). Returns false if this rank is in error.
// `puts(peer)`: called for each REMOTE peer by the thread that signals it, after every block arrived
// and before the signal (the barrier's bulk puts to that peer). Must be called by every thread of
// every block of the rank.
template <typename Tr, typename Puts = NoPuts>
__device__ bool rank_barrier(const Tr& tr, int phase, bool all_wait, Puts puts = NoPuts{}) {
  __shared__ int s_ok;
  __shared__ uint32_t s_gen;
  const int me = tr.rank();
  RankWorkspace* ws = tr.workspace(me);
  if constexpr (Tr::kHasGets) {
    if (tr.any_remote()) tr.quiet();  // this thread's puts / atomics to remote peers have landed
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s_ok = !has_error(ws);
    s_gen = gpu::load_acquire_sys(&ws->release);  // read before arriving: cannot change until all arrive
    if (s_ok) {
      gpu::fence_acq_rel_sys();
      gpu::add_release_sys(&ws->arrive, 1u);
    }
  }
  __syncthreads();
  if (!s_ok) return false;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      if (!wait_at_least(&ws->arrive, static_cast<uint32_t>(gridDim.x), tr.timeout_ns())) {
        record_error(ws, kErrLocalTimeout, me, -1, phase);
        s_ok = 0;
      }
    }
    __syncthreads();
    const int R = tr.num_ranks();
    if (s_ok && static_cast<int>(threadIdx.x) < R) {
      const int peer = threadIdx.x;
      bool far = false;
      if constexpr (Tr::kHasRemote) far = tr.is_remote(peer);
      if (far) puts(peer);
      signal_peer(tr, peer, me);
      if constexpr (Tr::kHasRemote && !std::is_same<Puts, NoPuts>::value) {
        if (far) tr.quiet();  // the hook's puts have read their sources: the rank may rewrite them afterwards
      }
      const uint64_t target = ws->expected[peer] + 1;
      ws->expected[peer] = target;
      if (!wait_for([&] { return signals_from(tr, ws, peer); }, target, tr.timeout_ns())) {
        record_error(ws, kErrPeerTimeout, me, peer, phase);
        s_ok = 0;  // benign race: every writer stores 0
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      ws->arrive = 0;  // nobody arrives again before the release below
      gpu::fence_acq_rel_sys();
      gpu::store_release_sys(&ws->release, s_gen + 1);
    }
  } else if (all_wait) {
    if (threadIdx.x == 0) {
      if (!wait_at_least(&ws->release, s_gen + 1, tr.timeout_ns())) {
        record_error(ws, kErrLocalTimeout, me, -1, phase);
      }
      s_ok = !has_error(ws);
    }
  }
  __syncthreads();
  return s_ok != 0;
}

// One thread: zero the transport's counters of signals from remote peers (after a reset of the
// workspace; GIN keeps them outside it).
template <typename Tr>
__global__ void reset_remote_signals_kernel(Tr tr) {
  if constexpr (Tr::kHasRemote) {
    for (int s = 0; s < tr.num_ranks(); ++s) {
      if (tr.is_remote(s)) tr.reset_remote_signals(s);
    }
  }
}

// A bare barrier over the group, one block per rank: on return of the kernel every rank has reached
// it (block 0 waits for the peers' signals). Benchmarks launch it right before a timed region so that
// the ranks' streams start that region together (launch skew is not counted in the region).
template <typename Tr>
__global__ void barrier_kernel(int /*unused*/, Tr tr) {
  rank_barrier(tr, kPhaseBarrier, /*all_wait=*/false);
}

}  // namespace omniep
