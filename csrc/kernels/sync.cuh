// Signals, waits with timeouts and the rank-wide barrier, for any Transport.
//
// A rank runs as gridDim.x blocks (all co-resident: the launcher guarantees it). Among peers reached by
// loads and stores the barrier is rank_barrier_flat (below: the last block to arrive signals, every
// block polls the peers itself). With a remote peer it is the gather:
//   1. every block: __syncthreads, then thread 0 arrives on the rank's `arrive` counter with a release
//      add (device scope: only the rank's own blocks read it), which carries the block's writes;
//   2. block 0 waits for all arrivals, then thread s < R signals peer s (release add on
//      signals[me] in s's workspace) and waits until its own signals[s] reaches expected[s] + 1;
//   3. block 0 bumps the rank's `release` generation (device scope); the other blocks (if they must
//      wait) spin on it.
// Release cumulativity carries every block's writes (to local or peer memory) to the peers that
// acquire the signal. A remote peer (omniep/transport.h) is signalled with the transport's signal
// op, by the thread that first issued this barrier's puts to it (the `puts` hook: rows the blocks
// staged in the mirror before arriving), so the peer sees the rows once it sees the signal; that
// thread then waits until those puts have read their sources (quiet; a barrier without a hook has
// no such puts and skips it), which the rank may rewrite after the barrier. On a transport with one-sided gets (the expert-major kernels'
// remote path, kHasGets) every thread first completes its own puts (quiet).
// Every wait has a timeout; the first failure is written into the rank's sticky status (naming the
// rank, the peer and the phase) and from then on the rank skips its work
// and waits, so a missing peer turns into an error, never into a hang.
//
// The op descriptor (omniep/status.h, DESIGN §9) rides on the FIRST barrier of every op: the thread
// that signals a peer first stores (or, to a remote peer, puts) this rank's descriptor into slot
// (barrier number & 1) of the peer's workspace, so the signal carries it; once every peer has
// signalled, thread 0 of block 0 compares every descriptor with its own. A difference is a sticky
// RANK_MISMATCH; a peer that reported bad input (an expert id out of range, or arguments its host
// refused) is a pending BAD_INPUT. Either way the op stops right after that barrier on EVERY rank
// (each sees every descriptor), so the ranks' barrier counts stay in step and nothing is moved that
// could not be placed. Later kernels of the same op (descriptor word kDescPart > 0) stop too.
// Two slots are enough because a rank writes barrier b + 2's descriptor only after it WAITED for every
// peer's signal b + 1, which a peer sends only after it judged barrier b: so every op whose descriptor
// barrier is judged late (a hook's receive half) must end with a waited barrier, and a hook's pending
// receive runs before the rank's next op is issued (EpRank::begin in backends/ep_rank.h; begin_op in
// torch_ops/native_ops.cpp launches it).
#pragma once

#include <type_traits>

#include "kernels/stamps.cuh"
#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

// Kernels give lane r of a warp rank r's data (r < R <= kMaxRanks).
static_assert(gpu::kWarpSize >= kMaxRanks, "a warp must have a lane per rank");

OMNIEP_DEVICE bool has_error(RankWorkspace* ws) {
  return gpu::load_acquire_sys(&ws->fatal.w[kStCode]) != kStatusOk;
}

// The first status of its kind wins (`fatal` or `pending` of the rank's workspace).
OMNIEP_DEVICE void record_status(Status* slot, const Status& st) {
  if (gpu::cas_relaxed_sys(&slot->w[kStCode], kStatusOk, st.w[kStCode]) == kStatusOk) {
    for (int i = 1; i < kStatusWords; ++i) slot->w[i] = st.w[i];
    gpu::fence_acq_rel_sys();
  }
}

OMNIEP_DEVICE Status new_status(int32_t code, int rank, int peer, const RankWorkspace* ws) {
  Status st = {};
  st.w[kStCode] = code;
  st.w[kStRank] = rank;
  st.w[kStPeer] = peer;
  st.w[kStOp] = ws->cur_op;
  st.w[kStSeq] = ws->cur_seq;
  return st;
}

OMNIEP_DEVICE void record_timeout(RankWorkspace* ws, int32_t code, int rank, int peer, int phase) {
  Status st = new_status(code, rank, peer, ws);
  st.w[kStFields] = phase;
  record_status(&ws->fatal, st);
}

// A wait on this rank's own blocks timed out. Usually another block is still waiting on a peer (its
// timer started later) and is about to record that peer's timeout, the real cause: give it up to two
// more timeouts to do so, and only then record a LOCAL_TIMEOUT of its own.
OMNIEP_DEVICE void record_local_timeout(RankWorkspace* ws, int me, int phase, uint64_t timeout_ns) {
  const uint64_t start = gpu::global_timer_ns();
  while (gpu::global_timer_ns() - start <= 2 * timeout_ns) {
    if (has_error(ws)) return;
  }
  record_timeout(ws, kStatusLocalTimeout, me, -1, phase);
}

// Capacity overflow seen in a prepare (every rank sees the same count matrix, so every rank records
// the same first overflowing rank): rows were dropped and counted; the host raises CapacityError.
OMNIEP_DEVICE void record_overflow(RankWorkspace* ws, int me, int rank, int needed, int capacity) {
  Status st = new_status(kStatusCapacity, me, rank, ws);
  st.w[kStMine] = needed;
  st.w[kStTheirs] = capacity;
  record_status(&ws->pending, st);
}

// Thread 0 of block 0, once every peer's descriptor of this barrier (slot) has arrived: whether the op
// goes on. Records RANK_MISMATCH (sticky) or BAD_INPUT (pending) as described at the top.
// `agreed`: the block found every descriptor equal to mine and every verdict OK (descriptors_agree), so
// the loops below, a chain of dependent loads, would find nothing.
template <typename Tr>
OMNIEP_DEVICE bool exchange_verdict(const Tr& tr, RankWorkspace* ws, const OpDesc& mine, int slot, bool agreed) {
  const int me = tr.rank(), R = tr.num_ranks();
  const int32_t seq = mine.w[kDescSeq];
  ws->cur_op = mine.w[kDescOp];
  ws->cur_seq = seq;
  Status st = new_status(kStatusOk, me, -1, ws);
  uint32_t peers = 0, fields = 0;
  for (int s = 0; s < (agreed ? 0 : R); ++s) {
    const volatile int32_t* d = ws->desc[slot][s].w;
    // A rank whose host refused its arguments sends what it could fill in: only its verdict counts.
    if (d[kDescInputStatus] == kInputRejected || mine.w[kDescInputStatus] == kInputRejected) continue;
    uint32_t diff = 0;
    for (int i = 0; i < kDescCompared; ++i) diff |= static_cast<uint32_t>(d[i] != mine.w[i]) << i;
    if (diff == 0) continue;
    if (st.w[kStPeer] < 0) {
      const int field = __ffs(diff) - 1;
      st.w[kStPeer] = s;
      st.w[kStField] = field;
      st.w[kStMine] = mine.w[field];
      st.w[kStTheirs] = d[field];
    }
    if (s < 31) peers |= 1u << s;
    fields |= diff;
  }
  bool go_on = true;
  if (st.w[kStPeer] >= 0) {
    st.w[kStCode] = kStatusRankMismatch;
    st.w[kStPeers] = static_cast<int32_t>(peers);
    st.w[kStFields] = static_cast<int32_t>(fields);
    record_status(&ws->fatal, st);
    go_on = false;
  } else {
    for (int s = 0; s < (agreed ? 0 : R); ++s) {
      const volatile int32_t* d = ws->desc[slot][s].w;
      const int32_t verdict = d[kDescInputStatus];
      if (verdict == kInputOk) continue;
      go_on = false;
      // A rank whose host refused its arguments raised that error itself; the others report it.
      if (s == me && verdict == kInputRejected) continue;
      st.w[kStCode] = kStatusBadInput;
      st.w[kStPeer] = s;
      st.w[kStField] = verdict;
      st.w[kStMine] = d[kDescInputDetail];
      st.w[kStTheirs] = mine.w[kDescExperts];
      record_status(&ws->pending, st);
      break;
    }
  }
  if (mine.w[kDescPart] == 0) {
    ws->abort_seq = go_on ? 0 : seq + 1;
  } else if (ws->abort_seq == seq + 1) {
    go_on = false;  // an earlier kernel of this op stopped it (on every rank alike)
  } else if (!go_on) {
    ws->abort_seq = seq + 1;
  }
  return go_on;
}

// Add 1 to signals[me] in `peer`'s workspace: a release add through its pointer, or, for a peer the
// transport reaches only by puts (remote path), the transport's signal op, ordered after this
// thread's puts to the peer. Either way whatever this rank wrote to the peer before (ordered to this
// thread by the barrier) is visible once the peer sees it.
template <typename Tr>
OMNIEP_DEVICE void signal_peer(const Tr& tr, int peer, int me) {
  if constexpr (Tr::kHasRemote) {
    if (tr.is_remote(peer)) {
      gpu::fence_acq_rel_sys();
      tr.signal_remote(peer);
      return;
    }
  }
  // A release add: it orders everything that happens-before it (cumulative, omniep/gpu.h) without a
  // fence of its own first (a system-scope fence costs ~0.7 µs on an H100, benchmarks/RESULTS.md).
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

// A barrier split over two kernels (DeepEP's receive hook: an op's sends, then later its receive):
// the first kernel signals the peers without waiting for them (kBarrierSignalOnly, `all_wait` must be
// false), the second waits for those signals without sending any (kBarrierWaitOnly). Each half keeps
// the counters the whole barrier keeps; the descriptor travels with the signals and is judged once
// they have all arrived. Within ONE kernel (rank_barrier_flat only: peers reached by loads and stores) a
// barrier may be split too, so that a block works while its signals travel: kBarrierSignalOnly, the block's
// own work, then kBarrierWaitHere, which waits for the targets and judges the descriptor slot the signalling
// half read (a later block's arrival has moved expected[] on by then: the wait half cannot read them again).
enum BarrierMode : int { kBarrierFull = 0, kBarrierSignalOnly = 1, kBarrierWaitOnly = 2, kBarrierWaitHere = 3 };

// The barrier with a remote peer (the scheme at the top of this file: block 0 gathers the blocks,
// signals and waits, then releases them), where a peer is reached by the transport's puts and signals.
template <typename Tr, typename Puts>
__device__ bool rank_barrier_gather(const Tr& tr, int phase, bool all_wait, Puts puts, const OpDesc* desc, int mode) {
  __shared__ int s_ok;
  __shared__ int s_slot;
  __shared__ uint32_t s_gen;
  const int me = tr.rank();
  RankWorkspace* ws = tr.workspace(me);
  if constexpr (Tr::kHasGets) {
    if (tr.any_remote()) tr.quiet();  // this thread's puts / atomics to remote peers have landed
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s_ok = !has_error(ws);
    // A later kernel of an op that stopped at its first exchange: every rank stopped it there, so no
    // rank takes part in this barrier (an earlier kernel on this stream wrote abort_seq).
    if (desc != nullptr && desc->w[kDescPart] > 0 && ws->abort_seq == desc->w[kDescSeq] + 1) s_ok = 0;
    s_gen = gpu::load_acquire_gpu(&ws->release);  // read before arriving: cannot change until all arrive
    // A release of device scope (the rank's own blocks meet here): the block's writes, ordered by the
    // __syncthreads above, go with it, and on to the peers with block 0's system-scope signal.
    if (s_ok) gpu::add_release_gpu(&ws->arrive, 1u);
  }
  __syncthreads();
  if (!s_ok) return false;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      if (!wait_for([ws] { return gpu::load_acquire_gpu(&ws->arrive); }, static_cast<uint32_t>(gridDim.x),
                    tr.timeout_ns())) {
        record_local_timeout(ws, me, phase, tr.timeout_ns());
        s_ok = 0;
      }
      if (desc != nullptr) {
        // Barriers with every peer are numbered alike on both sides (expected[] counts them; the
        // signalling half of a split barrier counted this one already).
        s_slot = static_cast<int>((ws->expected[me] + (mode == kBarrierWaitOnly ? 0 : 1)) & 1u);
        if (mode != kBarrierWaitOnly) ws->desc[s_slot][me] = *desc;  // my own entry, and the source of puts
      }
    }
    __syncthreads();
    const int R = tr.num_ranks();
    if (s_ok && static_cast<int>(threadIdx.x) < R) {
      const int peer = threadIdx.x;
      bool far = false;
      if constexpr (Tr::kHasRemote) far = tr.is_remote(peer);
      uint64_t target = ws->expected[peer];
      if (mode != kBarrierWaitOnly) {
        if (desc != nullptr && peer != me) {
          OpDesc* dst = &tr.workspace(far ? me : peer)->desc[s_slot][me];
          if (!far) {
            *dst = *desc;
          } else if constexpr (Tr::kHasRemote) {
            tr.put_block(dst, &ws->desc[s_slot][me], sizeof(OpDesc), peer);  // same offset in peer's workspace
          }
        }
        if (far) puts(peer);
        signal_peer(tr, peer, me);
        if constexpr (Tr::kHasRemote && !std::is_same<Puts, NoPuts>::value) {
          if (far) tr.quiet();  // the hook's puts have read their sources: the rank may rewrite them afterwards
        }
        ws->expected[peer] = ++target;
      }
      if (mode != kBarrierSignalOnly &&
          !wait_for([&] { return signals_from(tr, ws, peer); }, target, tr.timeout_ns())) {
        record_timeout(ws, kStatusPeerTimeout, me, peer, phase);
        s_ok = 0;  // benign race: every writer stores 0
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (s_ok && desc != nullptr && mode != kBarrierSignalOnly) {
        // The peers' descriptors arrived with their signals, which threads < R acquired before the
        // __syncthreads; a remote peer's came by puts, ordered by the transport's signal.
        if constexpr (Tr::kHasRemote) gpu::fence_acq_rel_sys();
        s_ok = exchange_verdict(tr, ws, *desc, s_slot, /*agreed=*/false);
      }
      ws->arrive = 0;  // nobody arrives again before the release below (a release store: it orders this)
      gpu::store_release_gpu(&ws->release, s_gen + 1);
    }
  } else if (all_wait) {
    if (threadIdx.x == 0) {
      if (!wait_for([ws] { return gpu::load_acquire_gpu(&ws->release); }, s_gen + 1, tr.timeout_ns())) {
        record_local_timeout(ws, me, phase, tr.timeout_ns());
      }
      s_ok = !has_error(ws);
      // Block 0 wrote the verdict before its release: a stopped op has abort_seq == seq + 1.
      if (s_ok && desc != nullptr && ws->abort_seq == desc->w[kDescSeq] + 1) s_ok = 0;
    }
  }
  __syncthreads();
  return s_ok != 0;
}

// Every thread of the block, once every peer's descriptor of this barrier (slot) has arrived: whether every
// descriptor's compared words equal mine and every verdict is OK — the common case, judged with one load per
// thread (R * (kDescCompared + 1) words) instead of one thread's chain of dependent loads (~0.15 µs each:
// 1.8–3.3 µs at two ranks, the phase stamps of 2026-11-27, twenty-third session). Every thread of the block
// calls it (block_any is a barrier); the readers see the descriptors through the same chain thread 0 relied
// on: the peer's release, thread s's acquire of its signal, the block's barrier.
template <typename Tr>
OMNIEP_DEVICE bool descriptors_agree(const Tr& tr, const RankWorkspace* ws, const OpDesc& mine, int slot) {
  constexpr int kWords = kDescCompared + 1;  // the compared words, then the verdict
  bool odd = false;
  for (int i = static_cast<int>(threadIdx.x); i < tr.num_ranks() * kWords; i += static_cast<int>(blockDim.x)) {
    const int s = i / kWords, w = i % kWords;
    const volatile int32_t* d = ws->desc[slot][s].w;
    odd |= w < kDescCompared ? d[w] != mine.w[w] : d[kDescInputStatus] != kInputOk;
  }
  return !gpu::block_any(odd);
}

// Thread 0 of a block other than 0, once every peer's descriptor of this barrier (slot) has arrived:
// the verdict of exchange_verdict without recording it (block 0 records it): the op goes on when
// every descriptor agrees with mine and reports good input (`agreed`: descriptors_agree found it so), and
// no earlier kernel of it stopped it.
template <typename Tr>
OMNIEP_DEVICE bool exchange_goes_on(const Tr& tr, const RankWorkspace* ws, const OpDesc& mine, int slot,
                                    bool agreed) {
  for (int s = 0; s < (agreed ? 0 : tr.num_ranks()); ++s) {
    const volatile int32_t* d = ws->desc[slot][s].w;
    if (d[kDescInputStatus] != kInputOk) return false;
    for (int i = 0; i < kDescCompared; ++i) {
      if (d[i] != mine.w[i]) return false;
    }
  }
  return !(mine.w[kDescPart] > 0 && ws->abort_seq == mine.w[kDescSeq] + 1);
}

// The barrier among peers reached by loads and stores (no remote peer): no gather on block 0 and no
// release broadcast. Every block reads its targets (expected[s] + 1) and arrives with an acq_rel add of
// device scope; the LAST block to arrive (the add's acquire makes every block's writes its own) records
// the new expected[] and signals every peer itself; then every block that must wait polls the peers'
// signals directly. Two hops from the slowest block's arrival to every waiting block of every peer,
// where the gather took four (arrive, block 0's signal, block 0's release, the blocks' poll) —
// benchmarks/RESULTS.md, 2026-11-26. Block 0's descriptor is the op's (routing fronts put their verdict
// on the ids there): block 0 stores it into every peer's slot before it arrives, so the last block's
// signal carries it; every waiting block then judges the descriptors itself, block 0 recording the
// verdict (exchange_verdict). The counters are the gather's (one signal per barrier per peer), so both
// schemes count alike. A wait for my own signal that times out is my own blocks' (LOCAL_TIMEOUT).
template <typename Tr>
__device__ bool rank_barrier_flat(const Tr& tr, int phase, bool all_wait, const OpDesc* desc, int mode) {
  __shared__ int s_ok;
  __shared__ int s_slot;
  __shared__ int s_last;
  __shared__ uint64_t s_target[kMaxRanks];
  const int me = tr.rank(), R = tr.num_ranks();
  const int t = static_cast<int>(threadIdx.x);
  RankWorkspace* ws = tr.workspace(me);
  const bool here = mode == kBarrierWaitHere;  // s_target / s_slot: the signalling half's, kept
  __syncthreads();  // the block's work is done: thread 0's arrival below carries it
  // expected[] as this barrier found it: the last block rewrites it only after every block arrived.
  if (t < R && !here) s_target[t] = ws->expected[t] + (mode == kBarrierWaitOnly ? 0 : 1);
  if (t == 0) {
    s_ok = !has_error(ws);
    // A later kernel of an op that stopped at its first exchange: no rank takes part in this barrier.
    if (desc != nullptr && desc->w[kDescPart] > 0 && ws->abort_seq == desc->w[kDescSeq] + 1) s_ok = 0;
    if (!here) s_slot = static_cast<int>((ws->expected[me] + (mode == kBarrierWaitOnly ? 0 : 1)) & 1u);
    s_last = 0;
  }
  __syncthreads();
  if (!s_ok) return false;
  if (mode == kBarrierFull || mode == kBarrierSignalOnly) {
    if (desc != nullptr && blockIdx.x == 0 && t < R) tr.workspace(t)->desc[s_slot][me] = *desc;  // mine too
    __syncthreads();  // (block 0: the descriptor's stores go with the arrival)
    if (t == 0) s_last = gpu::fetch_add_acq_rel_gpu(&ws->arrive, 1u) + 1 == gridDim.x;
    __syncthreads();
    if (s_last) {  // (block-uniform)
      // No block arrives again before it acquired the signals below (an all_wait barrier), or before
      // the kernel ended (one that is not: the last of its kernel), so the reset cannot be lost.
      if (t == 0) ws->arrive = 0;
      if (t < R) ws->expected[t] = s_target[t];
      // The reset and EVERY expected[] entry go with every signal, my own included: a block of this
      // rank that acquired my signal may read them at its next barrier (thread s's signal alone would
      // carry only expected[s]).
      __syncthreads();
      if (t < R) signal_peer(tr, t, me);  // a release add: every block's writes (acquired above) go with it
    }
  }
  if (!here) OMNIEP_STAMP(s_last ? "arrived(last)" : "arrived");
  if (mode == kBarrierSignalOnly || (!all_wait && blockIdx.x != 0)) return true;
  if (t < R && !wait_for([&] { return signals_from(tr, ws, t); }, s_target[t], tr.timeout_ns())) {
    if (t == me) {
      record_local_timeout(ws, me, phase, tr.timeout_ns());
    } else {
      record_timeout(ws, kStatusPeerTimeout, me, t, phase);
    }
    s_ok = 0;  // benign race: every writer stores 0
  }
  __syncthreads();
  OMNIEP_STAMP("signalled");  // (every peer's signal seen; the descriptors' judgment follows)
  if (s_ok && desc != nullptr) {  // (block-uniform)
    const bool agreed = descriptors_agree(tr, ws, *desc, s_slot);
    if (t == 0) {
      s_ok = blockIdx.x == 0 ? exchange_verdict(tr, ws, *desc, s_slot, agreed)
                             : exchange_goes_on(tr, ws, *desc, s_slot, agreed);
    }
  }
  __syncthreads();
  return s_ok != 0;
}

// A barrier of this rank's own blocks, no peer: on return every block of the rank has reached it and
// their writes before it are visible (thread 0's arrival and release carry its block's writes, at device
// scope: only the rank's blocks read them). A generation count, never reset: the last block to arrive
// rewinds the arrivals and bumps the generation the others wait on. Returns false on every block if a
// wait timed out (recorded as the rank's LOCAL_TIMEOUT, naming `phase`). Every thread of every block.
template <typename Tr>
__device__ bool grid_barrier(const Tr& tr, int phase) {
  __shared__ int s_ok;
  const int me = tr.rank();
  RankWorkspace* ws = tr.workspace(me);
  __syncthreads();
  if (threadIdx.x == 0) {
    // (read before arriving: the generation moves only once every block, this one included, arrived)
    const uint32_t gen = gpu::load_acquire_gpu(&ws->grid_release);
    bool ok = true;
    if (gpu::fetch_add_acq_rel_gpu(&ws->grid_arrive, 1u) + 1 == gridDim.x) {
      ws->grid_arrive = 0;  // before the bump: no block arrives at the next barrier before it saw the bump
      gpu::add_release_gpu(&ws->grid_release, 1u);
    } else {
      ok = wait_for([ws] { return gpu::load_acquire_gpu(&ws->grid_release); }, gen + 1u, tr.timeout_ns());
      if (!ok) record_local_timeout(ws, me, phase, tr.timeout_ns());
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

// Whether this rank's barriers are rank_barrier_flat's (peers reached by loads and stores), which may also be
// split inside one kernel (kBarrierSignalOnly, then kBarrierWaitHere) — not the gather's (a remote peer), whose
// block 0 signals only once every block arrived.
template <typename Tr>
OMNIEP_DEVICE bool barrier_splits_here(const Tr& tr) {
  if constexpr (Tr::kHasRemote) return !tr.any_remote();
  return true;
}

// The barrier of a rank with every peer: on return the peers have reached it too. `all_wait`: every
// block leaves only after the peers signalled (use before reading peer data); otherwise only block 0
// waits for the peers (use at the end of a kernel: the kernel completes only when block 0 does).
// Returns false if this rank is in error or the op stopped at this barrier. `puts(peer)`: called for
// each REMOTE peer by the thread that signals it, after every block arrived and before the signal
// (the barrier's bulk puts to that peer). `desc`: this rank's op descriptor, exchanged and compared at
// this barrier (the op's first; block 0's is the one sent). `mode`: the whole barrier, or one of its
// halves (BarrierMode). Must be called by every thread of every block of the rank. Without a remote
// peer it is rank_barrier_flat, else rank_barrier_gather (the same counters: a group uses one or the
// other on every rank, as it has remote peers or not).
template <typename Tr, typename Puts = NoPuts>
__device__ bool rank_barrier(const Tr& tr, int phase, bool all_wait, Puts puts = NoPuts{},
                             const OpDesc* desc = nullptr, int mode = kBarrierFull) {
  if constexpr (Tr::kHasRemote) {  // (the gather is compiled only for transports that can reach remote peers)
    if (!barrier_splits_here(tr)) return rank_barrier_gather(tr, phase, all_wait, puts, desc, mode);
  }
  return rank_barrier_flat(tr, phase, all_wait, desc, mode);
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

// One thread, stream-ordered after an op's kernels: the rank's status as that op left it (the sticky one
// if set, else the pending one, which is then cleared: the next op reports its own). The XLA FFI
// handlers return it as the op's `status` output. A capacity overflow is not reported: with static
// shapes (XLA's) rows that do not fit are a result, counted in `dropped` (DESIGN §2), not a failure.
template <int kUnused = 0>  // a template: defined in every translation unit that includes this header
__global__ void take_status_kernel(RankWorkspace* ws, Status* out) {
  const bool fatal = ws->fatal.w[kStCode] != kStatusOk;
  Status st = fatal ? ws->fatal : ws->pending;
  // OK reads as all zero (a cleared pending status keeps its other words).
  if (st.w[kStCode] == kStatusOk || (!fatal && st.w[kStCode] == kStatusCapacity)) st = Status{};
  *out = st;
  if (!fatal) ws->pending.w[kStCode] = kStatusOk;
}

// A bare barrier over the group, one block per rank: on return of the kernel every rank has reached
// it (block 0 waits for the peers' signals). Benchmarks launch it right before a timed region so that
// the ranks' streams start that region together (launch skew is not counted in the region). With
// `exchange`, it carries the descriptor: a rank whose host refused an op's arguments runs it in the
// op's place (descriptor input status kInputRejected), so the peers stop that op promptly.
struct BarrierArgs {
  OpDesc desc[kMaxRanks];
  int exchange;
};

template <typename Tr>
__global__ void barrier_kernel(BarrierArgs a, Tr tr) {
  rank_barrier(tr, kPhaseBarrier, /*all_wait=*/false, NoPuts{}, a.exchange ? &a.desc[tr.rank()] : nullptr);
}

}  // namespace omniep
