// Launchers of the kernels for ONE rank per process over CUDA IPC (see ipc_rank.h). Also built by
// hipcc for AMD (HIP IPC): omniep/runtime.h maps the CUDA runtime names used here to HIP.
#include "backends/ipc_rank.h"

#include "omniep/runtime.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "backends/one_rank_launch.cuh"
#include "backends/rank_ops.cuh"
#include "transports/p2p.cuh"

namespace omniep {
namespace {

std::string to_bytes(const cudaIpcMemHandle_t& h) { return std::string(h.reserved, sizeof(h.reserved)); }

cudaIpcMemHandle_t from_bytes(const std::string& s, int r) {
  cudaIpcMemHandle_t h;
  if (s.size() != sizeof(h.reserved)) {
    throw std::invalid_argument("omniep: IPC handle of rank " + std::to_string(r) + " has " +
                                std::to_string(s.size()) + " bytes, expected " + std::to_string(sizeof(h.reserved)));
  }
  std::memcpy(h.reserved, s.data(), sizeof(h.reserved));
  return h;
}

}  // namespace

IpcRank::IpcRank(int rank, int num_ranks, uint64_t timeout_ns)
    : rank_(rank), num_ranks_(num_ranks), timeout_ns_(timeout_ns),
      workspaces_(num_ranks, nullptr), data_(num_ranks, nullptr) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("omniep: rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) +
                                ": need 0 <= rank < num_ranks <= " + std::to_string(kMaxRanks));
  }
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  launcher_ = std::make_unique<OneRankLauncher>(device_, rank_, num_ranks_);
  RankWorkspace* ws = nullptr;
  check_cuda(cudaMalloc(&ws, sizeof(RankWorkspace)), "allocating the rank workspace");
  workspaces_[rank_] = ws;
  check_cuda(cudaMemset(ws, 0, sizeof(RankWorkspace)), "zeroing the rank workspace");
  check_cuda(cudaDeviceSynchronize(), "zeroing the rank workspace");
}

IpcRank::~IpcRank() {
  (void)cudaDeviceSynchronize();  // kernels may still use the buffers
  close_peer_data();
  close_peer_workspaces();
  if (data_[rank_]) (void)cudaFree(data_[rank_]);
  if (workspaces_[rank_]) (void)cudaFree(workspaces_[rank_]);
}

void IpcRank::set_blocks(int n) { launcher_->set_blocks(n); }

std::string IpcRank::workspace_handle() const {
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, workspaces_[rank_]), "exporting the workspace");
  return to_bytes(h);
}

std::string IpcRank::data_handle() const {
  if (!data_[rank_]) throw std::runtime_error("omniep: no data buffer allocated");
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, data_[rank_]), "exporting the data buffer");
  return to_bytes(h);
}

void IpcRank::open_workspaces(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != num_ranks_) throw std::invalid_argument("omniep: one handle per rank");
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_ || workspaces_[r]) continue;
    void* p = nullptr;
    // Lazy peer access: across GPUs it enables NVLink peer access; on the same GPU it is a no-op.
    check_cuda(cudaIpcOpenMemHandle(&p, from_bytes(handles[r], r), cudaIpcMemLazyEnablePeerAccess),
               ("opening the workspace of rank " + std::to_string(r)).c_str());
    workspaces_[r] = static_cast<RankWorkspace*>(p);
  }
}

void IpcRank::close_peer_data() {
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && data_[r]) {
      if (!linked_) (void)cudaIpcCloseMemHandle(data_[r]);
      data_[r] = nullptr;
    }
  }
}

void IpcRank::close_peer_workspaces() {
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && workspaces_[r]) {
      if (!linked_) (void)cudaIpcCloseMemHandle(workspaces_[r]);
      workspaces_[r] = nullptr;
    }
  }
}

void IpcRank::allocate_data(size_t bytes) {
  check_cuda(cudaDeviceSynchronize(), "synchronising before re-allocating the data buffer");
  if (data_[rank_]) {
    check_cuda(cudaFree(data_[rank_]), "freeing the data buffer");
    data_[rank_] = nullptr;
    data_bytes_ = 0;
  }
  if (bytes == 0) return;
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), ("allocating a " + std::to_string(bytes) + "-byte data buffer").c_str());
  data_[rank_] = p;
  data_bytes_ = bytes;
  check_cuda(cudaMemset(p, 0, bytes), "zeroing the data buffer");
  check_cuda(cudaDeviceSynchronize(), "zeroing the data buffer");
}

namespace {

// Peer access from the current device to `peer` (NVLink loads and stores); a no-op for the same
// device, and fine if an earlier call enabled it already.
void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  if (!can) {
    throw std::runtime_error("omniep: device " + std::to_string(device) + " cannot access device " +
                             std::to_string(peer) + " as a peer (no NVLink / PCIe P2P between them)");
  }
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clear the (non-sticky) error so that later checks do not report it
    return;
  }
  check_cuda(err, "cudaDeviceEnablePeerAccess");
}

void check_local_group(const std::vector<IpcRank*>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == nullptr || ranks[i]->rank() != static_cast<int>(i) ||
        ranks[i]->num_ranks() != static_cast<int>(ranks.size())) {
      throw std::invalid_argument("omniep: link_*(): ranks[i] must be rank i of a group of ranks.size()");
    }
  }
}

}  // namespace

void IpcRank::link_workspaces(const std::vector<IpcRank*>& ranks) {
  check_local_group(ranks);
  int prev = 0;
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
  for (IpcRank* me : ranks) {
    check_cuda(cudaSetDevice(me->device_), "cudaSetDevice");
    for (IpcRank* peer : ranks) {
      if (peer == me) continue;
      enable_peer_access(me->device_, peer->device_);
      me->workspaces_[peer->rank_] = peer->workspaces_[peer->rank_];
    }
    me->linked_ = true;
  }
  check_cuda(cudaSetDevice(prev), "cudaSetDevice");
}

void IpcRank::link_data(const std::vector<IpcRank*>& ranks) {
  check_local_group(ranks);
  for (IpcRank* me : ranks) {
    if (!me->linked_) throw std::runtime_error("omniep: link_data() before link_workspaces()");
    for (IpcRank* peer : ranks) {
      if (peer != me) me->data_[peer->rank_] = peer->data_[peer->rank_];
    }
  }
}

void IpcRank::open_data(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != num_ranks_) throw std::invalid_argument("omniep: one handle per rank");
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    if (data_[r]) (void)cudaIpcCloseMemHandle(data_[r]);
    void* p = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&p, from_bytes(handles[r], r), cudaIpcMemLazyEnablePeerAccess),
               ("opening the data buffer of rank " + std::to_string(r)).c_str());
    data_[r] = p;
  }
}

void IpcRank::grow_data(size_t bytes, cudaStream_t stream) {
  if (linked_) throw std::runtime_error("omniep: ranks linked in one process grow through their JAX state");
  const BarrierArgs plain = {};
  const auto all_here = [&](const char* what) {  // a device barrier, waited for on the host
    launch_barrier(plain, stream);
    check_cuda(cudaStreamSynchronize(stream), what);
  };
  close_peer_data();
  all_here("growing the data buffer (peers unmapped)");  // nobody maps anyone's old buffer any more
  allocate_data(bytes);
  const std::string mine = data_handle();
  check_cuda(cudaMemcpy(workspaces_[rank_]->data_handle, mine.data(), mine.size(), cudaMemcpyHostToDevice),
             "publishing the data buffer's IPC handle");
  all_here("growing the data buffer (handles published)");
  std::vector<std::string> handles(num_ranks_, mine);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    handles[r].assign(sizeof(RankWorkspace::data_handle), '\0');
    check_cuda(cudaMemcpy(&handles[r][0], workspaces_[r]->data_handle, handles[r].size(), cudaMemcpyDeviceToHost),
               "reading a peer's data buffer IPC handle");
  }
  open_data(handles);
}

P2PTransport IpcRank::transport() const {
  P2PTransport tr = {};
  tr.first_rank = rank_;  // gridDim.y == 1: every block is rank `rank_`
  tr.group_size = num_ranks_;
  tr.wait_timeout_ns = timeout_ns_;
  for (int r = 0; r < num_ranks_; ++r) {
    if (!workspaces_[r]) throw std::runtime_error("omniep: workspace of rank " + std::to_string(r) + " not opened");
    tr.workspaces.p[r] = workspaces_[r];
  }
  return tr;
}

template class OneRankOps<IpcRank>;

}  // namespace omniep
