// The Transport concept and the small types shared by every transport and kernel.
//
// Kernels in csrc/kernels are templated on a Transport `Tr`. A Transport is a trivially copyable
// struct passed to the kernel by value that provides:
//
//   int  Tr::rank() const           this block's EP rank (a virtual-rank launch derives it from
//                                   blockIdx.y; one-rank-per-process transports hold a constant)
//   int  Tr::num_ranks() const      the EP group size R
//   T*   Tr::local(PerRank<T>) const          this rank's own copy of a per-rank buffer
//   T*   Tr::peer(PerRank<T>, int r) const    an address through which this thread can load/store
//                                   rank r's copy of a SYMMETRIC buffer (p2p: a table entry;
//                                   nvshmem: nvshmem_ptr)
//   RankWorkspace* Tr::workspace(int r) const  rank r's workspace, reachable like a peer buffer
//   uint64_t Tr::timeout_ns() const  how long a wait on a peer may take before it is an error
//   static constexpr bool Tr::kHasRemote   whether some peer may lack a load/store path
//   bool Tr::is_remote(int r) const        peer r is reached by puts and signals only
//
// The remote path (transports with kHasRemote: nvshmem, nccl_dev's GIN, rocshmem), inside
// `if constexpr (Tr::kHasRemote)` branches, for peers with is_remote(r). Peer-side addresses are MY
// address of the symmetric buffer plus the peer's rank. Every operation is issued by ONE thread, and
// that thread's later signal to the same peer is ordered after its puts (NVSHMEM fence, GIN's
// per-context order), so a peer that sees the signal sees the data:
//   any_remote()                          some peer is remote (host and device)
//   put_block(dst, src, bytes, r)         non-blocking put of `bytes` from my symmetric `src` (GIN
//                                         reads only registered memory) to r's copy of `dst`
//   put_i32(dst, v, r)                    a 4-byte value put
//   signal_remote(r)                      after my puts to r: adds 1 to r's signal counter of source me
//   remote_signals(ws, s)                 my counter of signals from remote peer s (a load, or GIN's)
//   reset_remote_signals(s)               zero that counter (after the host zeroed the workspace)
//   quiet()                               my puts have read their sources (they may be reused)
//   mirror(p, r)                          MY copy of data-buffer address p reserved for peer r: the
//                                         data buffer's layout repeated once per rank (R x its size),
//                                         where rows bound to / coming back from remote peer r wait
// The rank-major kernels need only these: dispatch stages rows for remote peers in the mirror and puts
// each peer's rows as one block at the end barrier; combine has the expert ranks put the rows back
// into the sources' mirrors (kernels/dispatch.cuh, kernels/combine.cuh).
// What the remote transports share (rank(), local(), is_remote, any_remote, mirror and the members
// behind them) is written once, in RemoteTransportBase (omniep/remote_transport.h, device-aware: this
// header stays includable by host-only C++).
// The expert-major kernels still use NVSHMEM's one-sided model (kHasGets): put_warp, put_f32,
// get_warp, get_f32 and a symmetric `scratch` staging area (transports/nvshmem.cuh).
// Transports without them (nccl_dev: GIN has no gets) refuse expert-major ops
// with remote peers on the host.
// p2p has kHasRemote = false: those branches compile away.
//
// Signals and waits (kernels/sync.cuh) are built on these: a signal is a system-scope release add
// on a counter in the PEER's workspace (a remote peer: signal_remote); a wait polls the local counter
// with acquire loads until it reaches the expected count, or records a timeout status and gives up.
// Counters only grow, so no reset is needed between calls (CUDA-graph safe: nothing on the host
// changes per call).
#pragma once

#include <stdint.h>

#include "omniep/status.h"

namespace omniep {

// Largest EP group one p2p table serves (NVLink domains of 8 GPUs, virtual ranks for tests).
inline constexpr int kMaxRanks = 16;
// Largest number of experts on one rank (sizes the per-expert receive counters).
inline constexpr int kMaxLocalExperts = 1024;
// Largest number of experts of a group.
inline constexpr int kMaxExperts = kMaxRanks * kMaxLocalExperts;
// Most blocks a static dispatch spreads its layout over (kernels/layout.cuh, route_layout: the workspace
// keeps each block's rows per rank); a dispatch launched on more lays out on one block.
inline constexpr int kMaxRouteBlocks = 64;

// Per-rank pointers to one logical buffer. Entry r is where THIS process reaches rank r's copy
// (nullptr where it cannot). Local-only buffers fill just the entries of ranks run here.
template <typename T>
struct PerRank {
  T* p[kMaxRanks];
};

// Which barrier a wait belonged to (the `fields` word of a timeout status), for the error message.
enum Phase : int32_t {
  kPhaseLayoutExchange = 1,
  kPhaseLayoutDone = 2,
  kPhaseDispatchStart = 3,
  kPhaseDispatchDone = 4,
  kPhaseCombineStart = 5,
  kPhaseCombineDone = 6,
  kPhaseBarrier = 7,  // a bare barrier over the group (barrier_kernel: benchmarks align ranks with it)
  kPhaseCombinePush = 8,  // combine's remote path: expert ranks put rows back to remote sources
};

// The phase as error messages name it (omniep/ep_core/descriptor.py PHASES keeps the same names).
inline const char* phase_name(int phase) {
  switch (phase) {
    case kPhaseLayoutExchange: return "prepare (count exchange)";
    case kPhaseLayoutDone: return "prepare (end)";
    case kPhaseDispatchStart: return "dispatch (start)";
    case kPhaseDispatchDone: return "dispatch (end)";
    case kPhaseCombineStart: return "combine (start)";
    case kPhaseCombineDone: return "combine (end)";
    case kPhaseBarrier: return "barrier";
    case kPhaseCombinePush: return "combine (remote rows)";
    default: return "communication";
  }
}

// One rank's communication state, in device memory reachable by every peer (a symmetric buffer).
// Zero-initialised once; afterwards only the kernels touch it.
struct alignas(128) RankWorkspace {
  uint64_t signals[kMaxRanks];   // signals[s]: barriers rank s has signalled to me (peers add)
  uint64_t expected[kMaxRanks];  // expected[s]: barriers from s I have consumed (mine only)
  uint32_t arrive;               // blocks of this rank that arrived at the current barrier
  uint32_t release;              // generation of this rank's barrier, bumped by block 0
  // Statuses (omniep/status.h): `fatal` is sticky (the rank's kernels skip all work and all waits
  // until the host resets the workspace: its counters no longer agree with the peers'); `pending`
  // (bad input, capacity) is read and cleared by the host. The first of each kind wins.
  Status fatal;
  Status pending;
  int32_t abort_seq;  // seq + 1 of the op the last exchange stopped (0: none): its later kernels stop too
  int32_t cur_op, cur_seq;  // the op of the last exchange, for timeout statuses
  // desc[b & 1][s]: source s's descriptor at our b-th barrier (two slots: a peer that leaves an
  // aborted op early may already send its NEXT descriptor while this one is being read).
  OpDesc desc[2][kMaxRanks];
  uint8_t data_handle[64];  // IPC transport: my data buffer's handle, read by peers when it grows
  int32_t counts[kMaxRanks * kMaxRanks];         // counts[s*kMaxRanks + r]: tokens s sends to r
  int32_t expert_counter[kMaxLocalExperts];      // kept (token, k) pairs per local expert
  // Expert-major prepare (kernels/em_layout.cuh): expert_counts[s * E + e] = copies source s sends to
  // expert e (E = num_experts), the whole [R, E] matrix: every source writes its row into every
  // rank's workspace, so each rank reads what it needs locally (1 MiB at the largest R and E).
  int32_t expert_counts[kMaxRanks * kMaxExperts];
  int32_t em_tokens[kMaxRanks];  // em_tokens[s]: source s's token count T, published with its row above
  // Remote path of the rank-major kernels (kernels/dispatch.cuh, combine.cuh):
  int32_t sent_expert[kMaxExperts];  // dispatch: my (token, k) pairs delivered to remote experts (mine only)
  int32_t remote_expert[kMaxRanks * kMaxLocalExperts];  // [s * kMaxLocalExperts + l]: remote s's pairs for l
  int32_t push_rows[kMaxRanks * 2];  // combine: remote source s's rows here are [push_rows[2s], + push_rows[2s+1])
  // A barrier of the rank's own blocks (kernels/sync.cuh, grid_barrier; mine only): arrivals at the
  // current one, and its generation, bumped by the last block to arrive.
  uint32_t grid_arrive;
  uint32_t grid_release;
  // The static dispatch's layout over the rank's blocks (kernels/layout.cuh, route_layout; mine only):
  // route_rows[b * kMaxRanks + r] = rows block b's tokens send rank r; route_bad: some block saw an
  // expert id out of range (route_bad_id, the first recorded), cleared by block 0 once read.
  int32_t route_rows[kMaxRouteBlocks * kMaxRanks];
  int32_t route_bad;
  int64_t route_bad_id;
  // Tokens taken so far by the rank's warps in the current rank-major dispatch / combine
  // (kernels/token_queue.cuh; mine only): zeroed by block 0 before the kernel's start barrier.
  uint32_t work_next[2];
};

// work_next's queues.
enum WorkQueue : int { kQueueDispatch = 0, kQueueCombine = 1 };

}  // namespace omniep
