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
//                   the LSA pointers, the same timeouts and statuses. (The NCCL LSA barrier is not
//                   used: it has no timeout, and a missing peer must become an error, not a hang.)
//
// GIN (GPU-initiated networking) serves the peers outside the LSA team (other nodes; every peer with
// OMNIEP_FORCE_REMOTE=1): bit r of `remote_mask`. For them the kernels take the remote path of
// omniep/transport.h: put_block / put_i32 become ncclGin put / putValue on context 0 of the world
// team (window + offset of MY addresses: the workspace, the data buffer, or the mirrors, all
// registered), signal_remote is an ncclGin signal add on GIN signal `me` of the peer (signal s counts
// the barriers of source s, read by remote_signals), quiet is ncclGin flush. GIN has no gets and no
// remote atomics on window memory (kHasGets false): expert-major ops with remote peers are refused on
// the host. THIS PATH HAS NOT RUN ON A NETWORK: our GPU machines have no NICs (see NcclRank).
// Launches run one rank per process or per device (gridDim.y == 1).
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include "omniep/gpu.h"
#include "omniep/remote_transport.h"
#include "omniep/transport.h"

namespace omniep {

// First NCCL version with the device API (LSA windows, ncclDevComm, GIN) as used here.
inline constexpr int kMinNcclVersion = 22800;

// me == my rank in the NCCL communicator, group_size == its size; workspaces.p[me] is the base of
// ws_window, data_base data_window's offset 0, mirrors mirror_window's; bit r of remote_mask: peer r
// is outside the LSA team, reached through GIN.
struct NcclDevTransport : RemoteTransportBase {
  static constexpr bool kHasRemote = true;  // GIN peers (remote_mask); a pure LSA team tests one bit
  static constexpr bool kHasGets = false;

  ncclWindow_t ws_window;             // the workspace, registered symmetric
  ncclWindow_t data_window;           // the data buffer, registered symmetric (null before allocation)
  ncclWindow_t mirror_window;         // the mirrors (remote peers only), registered symmetric
  ncclDevComm dev_comm;               // GIN contexts and signals

  // Rank r's copy of a symmetric data-buffer address (LSA peers only; r == me: my own).
  template <typename T>
  OMNIEP_DEVICE T* peer(const PerRank<T>& a, int r) const {
    T* mine = a.p[me];
    if (r == me || mine == nullptr) return mine;
    const size_t offset = reinterpret_cast<const uint8_t*>(mine) - data_base;
    return static_cast<T*>(ncclGetPeerPointer(data_window, offset, r));
  }
  OMNIEP_DEVICE RankWorkspace* workspace(int r) const {
    if (r == me) return workspaces.p[me];
    return static_cast<RankWorkspace*>(ncclGetPeerPointer(ws_window, 0, r));
  }

  // ---- remote path over GIN (omniep/transport.h); compiled, NOT run on a network here ----
  // Window and offset of my address `p` inside the workspace, the data buffer or the mirrors.
  OMNIEP_DEVICE void window_of(const void* p, ncclWindow_t* win, size_t* offset) const {
    const uint8_t* c = static_cast<const uint8_t*>(p);
    const uint8_t* ws = reinterpret_cast<const uint8_t*>(workspaces.p[me]);
    if (c >= ws && c < ws + sizeof(RankWorkspace)) {
      *win = ws_window;
      *offset = c - ws;
    } else if (c >= mirrors && c < mirrors + group_size * data_bytes) {
      *win = mirror_window;
      *offset = c - mirrors;
    } else {
      *win = data_window;
      *offset = c - data_base;
    }
  }
  OMNIEP_DEVICE void put_block(void* dst, const void* src, size_t bytes, int r) const {
    if (bytes == 0) return;
    ncclWindow_t dst_win, src_win;
    size_t dst_off, src_off;
    window_of(dst, &dst_win, &dst_off);
    window_of(src, &src_win, &src_off);
    ncclGin net{dev_comm, 0};
    net.put(ncclTeamWorld(dev_comm), r, dst_win, dst_off, src_win, src_off, bytes);
  }
  OMNIEP_DEVICE void put_i32(int32_t* dst, int32_t v, int r) const {
    ncclWindow_t win;
    size_t off;
    window_of(dst, &win, &off);
    ncclGin net{dev_comm, 0};
    net.putValue(ncclTeamWorld(dev_comm), r, win, off, v);
  }
  // GIN orders a signal after this context's earlier puts to the same peer.
  OMNIEP_DEVICE void signal_remote(int r) const {
    ncclGin net{dev_comm, 0};
    net.signal(ncclTeamWorld(dev_comm), r, ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(me), uint64_t{1}});
  }
  // GIN's signals, not workspace memory (these hide RemoteTransportBase's).
  OMNIEP_DEVICE uint64_t remote_signals(const RankWorkspace*, int s) const {
    ncclGin net{dev_comm, 0};
    return net.readSignal(static_cast<ncclGinSignal_t>(s));
  }
  OMNIEP_DEVICE void reset_remote_signals(int s) const {
    ncclGin net{dev_comm, 0};
    net.resetSignal(static_cast<ncclGinSignal_t>(s));
  }
  OMNIEP_DEVICE void quiet() const {
    ncclGin net{dev_comm, 0};
    net.flush(ncclCoopThread{});
  }
};

}  // namespace omniep
