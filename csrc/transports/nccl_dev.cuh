// nccl_dev transport: symmetric buffers registered as NCCL windows, peers through the NCCL device API.
//
// Needs NCCL >= 2.28 (nccl_device.h, the nvidia-nccl-cu13 wheel). The host side (backends/nccl_rank.cu)
// allocates the workspace and the data buffer with ncclMemAlloc, registers each as a window with
// ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC) (collective: same size on every rank), and
// creates an ncclDevComm with ncclDevCommCreate. The kernels (csrc/kernels, unchanged) see:
//
//   peer(a, r)      a.p[me] is my address inside the data window; r's copy is
//                   ncclGetPeerPointer(window, offset, r): an LSA (load/store accessible: NVLink, the
//                   same node) address of rank r's memory. Valid only for LSA peers.
//   workspace(r)    the same over the workspace window.
//   signals, waits  kernels/sync.cuh as for p2p: system-scope atomics on the peers' workspaces through
//                   the LSA pointers, the same timeouts and ErrorRecord. (The NCCL LSA barrier is not
//                   used: it has no timeout, and a missing peer must become an error, not a hang.)
//
// GIN (GPU-initiated networking, peers outside the LSA team): gin_put_warp() / gin_signal_add() /
// gin_signal_value() below are compiled against ncclGin and selected (`gin` true) when the team has
// non-LSA peers. They have NOT run anywhere: the machines we test on have no network cards, and
// today's kernels move rows only with stores through peer(). The host refuses a group with non-LSA
// peers until kernels that call these hooks exist.
// Launches run one rank per process or per device (gridDim.y == 1).
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "omniep/gpu.h"
#include "omniep/transport.h"

namespace omniep {

// First NCCL version with the device API (LSA windows, ncclDevComm, GIN) as used here.
inline constexpr int kMinNcclVersion = 22800;

struct NcclDevTransport {
  // Kernels' remote branches (`if constexpr (Tr::kHasRemote)`: put_i32, get_warp, atomic_add_i32, ...
  // on MY address of a symmetric buffer) assume NVSHMEM's one-sided model. GIN has window-to-window
  // puts and dedicated signals, but no gets and no remote atomics on window memory, so nccl_dev does
  // not claim that contract: its remote branches compile away, and the GIN hooks below are its own.
  static constexpr bool kHasRemote = false;

  int me;           // my EP rank == my rank in the NCCL communicator
  int group_size;   // R == communicator size
  uint64_t wait_timeout_ns;
  PerRank<RankWorkspace> workspaces;  // entry [me]: my workspace (base of ws_window)
  ncclWindow_t ws_window;             // the workspace, registered symmetric
  ncclWindow_t data_window;           // the data buffer, registered symmetric (null before allocation)
  const char* data_base;              // my local address of data_window's offset 0
  int gin;                            // 1: some peer is outside the LSA team (GIN hooks below)
  ncclDevComm dev_comm;               // for GIN contexts and signals

  OMNIEP_DEVICE int rank() const { return me; }
  OMNIEP_DEVICE int num_ranks() const { return group_size; }
  OMNIEP_DEVICE uint64_t timeout_ns() const { return wait_timeout_ns; }

  template <typename T>
  OMNIEP_DEVICE T* local(const PerRank<T>& a) const { return a.p[me]; }
  // Rank r's copy of a symmetric data-buffer address (LSA peers only; r == me: my own).
  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const {
    T* mine = a.p[me];
    if (r == me || mine == nullptr) return mine;
    const size_t offset = reinterpret_cast<const char*>(mine) - data_base;
    return static_cast<T*>(ncclGetPeerPointer(data_window, offset, r));
  }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const {
    if (r == me) return workspaces.p[me];
    return static_cast<RankWorkspace*>(ncclGetPeerPointer(ws_window, 0, r));
  }
  OMNIEP_DEVICE bool is_remote(int) const { return false; }  // the host admits LSA peers only

  // ---- GIN path (peers outside the LSA team); compiled, never run here, no kernel calls it yet ----
  // Window and offset of my address `p` inside the workspace or the data buffer.
  OMNIEP_DEVICE void window_of(const void* p, ncclWindow_t* win, size_t* offset) const {
    const char* c = static_cast<const char*>(p);
    const char* ws = reinterpret_cast<const char*>(workspaces.p[me]);
    if (c >= ws && c < ws + sizeof(RankWorkspace)) {
      *win = ws_window;
      *offset = c - ws;
    } else {
      *win = data_window;
      *offset = c - data_base;
    }
  }
  // The whole warp copies `bytes` from my symmetric `src` (in the workspace or the data buffer: GIN
  // reads only registered memory) to rank r's copy of my symmetric `dst`. Non-blocking; lane 0 posts it.
  OMNIEP_DEVICE void gin_put_warp(void* dst, const void* src, size_t bytes, int r) const {
    if ((threadIdx.x & (gpu::kWarpSize - 1)) == 0) {
      ncclWindow_t dst_win, src_win;
      size_t dst_off, src_off;
      window_of(dst, &dst_win, &dst_off);
      window_of(src, &src_win, &src_off);
      ncclGin net{dev_comm, 0};
      net.put(ncclTeamWorld(dev_comm), r, dst_win, dst_off, src_win, src_off, bytes);
    }
    __syncwarp();
  }
  // Adds `v` to rank r's GIN signal number `index` after my earlier puts to r on this context
  // (GIN orders a signal after the payloads before it). Signals are GIN's, not workspace memory:
  // a wait reads them with gin_signal_value().
  OMNIEP_DEVICE void gin_signal_add(uint32_t index, uint64_t v, int r) const {
    ncclGin net{dev_comm, 0};
    net.signal(ncclTeamWorld(dev_comm), r, ncclGin_SignalAdd{index, v});
  }
  OMNIEP_DEVICE uint64_t gin_signal_value(uint32_t index) const {
    ncclGin net{dev_comm, 0};
    return net.readSignal(index);
  }
};

}  // namespace omniep
