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
//   bool Tr::is_remote(int r) const        peer r is reached by puts / gets / signals only
//
// Transports with kHasRemote (nvshmem) also provide the remote path that kernels use, inside
// `if constexpr (Tr::kHasRemote)` branches, for peers with is_remote(r): put_warp, put_i32, put_f32,
// atomic_add_i32, get_warp, get_f32, quiet, signal_add, any_remote() and a symmetric `scratch`
// staging area (transports/nvshmem.cuh). Peer-side addresses there are MY address of the symmetric
// buffer plus the peer's rank. p2p has kHasRemote = false: those branches compile away.
//
// Signals and waits (kernels/sync.cuh) are built on these: a signal is a system-scope release add
// on a counter in the PEER's workspace (a remote peer: a signal op after quiet + fence); a wait polls the local counter with acquire loads until it
// reaches the expected count, or writes an ErrorRecord and gives up. Counters only grow, so no
// reset is needed between calls (CUDA-graph safe: nothing on the host changes per call).
#pragma once

#include <stdint.h>

namespace omniep {

// Largest EP group one p2p table serves (NVLink domains of 8 GPUs, virtual ranks for tests).
inline constexpr int kMaxRanks = 16;
// Largest number of experts on one rank (sizes the per-expert receive counters).
inline constexpr int kMaxLocalExperts = 1024;
// Largest number of experts of a group.
inline constexpr int kMaxExperts = kMaxRanks * kMaxLocalExperts;

// Per-rank pointers to one logical buffer. Entry r is where THIS process reaches rank r's copy
// (nullptr where it cannot). Local-only buffers fill just the entries of ranks run here.
template <typename T>
struct PerRank {
  T* p[kMaxRanks];
};

// Error codes of ErrorRecord::code (0 = no error). Mirrored in omniep/native/__init__.py.
enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrPeerTimeout = 1,   // a peer rank never signalled: `peer` names it
  kErrLocalTimeout = 2,  // blocks of this rank never met at a barrier (not co-resident?)
};

// Which barrier a wait belonged to (ErrorRecord::phase), for the error message.
enum Phase : int32_t {
  kPhaseLayoutExchange = 1,
  kPhaseLayoutDone = 2,
  kPhaseDispatchStart = 3,
  kPhaseDispatchDone = 4,
  kPhaseCombineStart = 5,
  kPhaseCombineDone = 6,
  kPhaseBarrier = 7,  // a bare barrier over the group (barrier_kernel: benchmarks align ranks with it)
};

// The first error a rank hit. Sticky: once `code` is set the rank's kernels skip all work and all
// waits until the host resets the workspace (its counters no longer agree with the peers').
struct ErrorRecord {
  int32_t code;
  int32_t rank;
  int32_t peer;
  int32_t phase;
};

// One rank's communication state, in device memory reachable by every peer (a symmetric buffer).
// Zero-initialised once; afterwards only the kernels touch it.
struct alignas(128) RankWorkspace {
  uint64_t signals[kMaxRanks];   // signals[s]: barriers rank s has signalled to me (peers add)
  uint64_t expected[kMaxRanks];  // expected[s]: barriers from s I have consumed (mine only)
  uint32_t arrive;               // blocks of this rank that arrived at the current barrier
  uint32_t release;              // generation of this rank's barrier, bumped by block 0
  ErrorRecord error;
  int32_t counts[kMaxRanks * kMaxRanks];         // counts[s*kMaxRanks + r]: tokens s sends to r
  int32_t expert_counter[kMaxLocalExperts];      // kept (token, k) pairs per local expert
  // Expert-major prepare (kernels/em_layout.cuh): expert_counts[s * E + e] = copies source s sends to
  // expert e (E = num_experts), the whole [R, E] matrix: every source writes its row into every
  // rank's workspace, so each rank reads what it needs locally (1 MiB at the largest R and E).
  int32_t expert_counts[kMaxRanks * kMaxExperts];
};

}  // namespace omniep
