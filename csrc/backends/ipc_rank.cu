// Launchers of the kernels for ONE rank per process over CUDA IPC (see ipc_rank.h). Also built by
// hipcc for AMD (HIP IPC): omniep/runtime.h maps the CUDA runtime names used here to HIP.
#include "backends/ipc_rank.h"

#include "omniep/runtime.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "backends/one_rank_launch.cuh"
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
  launcher_ = std::make_unique<OneRankLauncher>(device_);
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
      (void)cudaIpcCloseMemHandle(data_[r]);
      data_[r] = nullptr;
    }
  }
}

void IpcRank::close_peer_workspaces() {
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && workspaces_[r]) {
      (void)cudaIpcCloseMemHandle(workspaces_[r]);
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

void IpcRank::check_shape(int num_experts, int capacity) const {
  if (num_experts < num_ranks_ || num_experts % num_ranks_ != 0 || num_experts / num_ranks_ > kMaxLocalExperts) {
    throw std::invalid_argument("omniep: num_experts=" + std::to_string(num_experts) + " must be a positive multiple of " +
                                std::to_string(num_ranks_) + " ranks with at most " +
                                std::to_string(kMaxLocalExperts) + " experts per rank");
  }
  if (capacity < 0) throw std::invalid_argument("omniep: capacity must be >= 0");
  for (int r = 0; r < num_ranks_; ++r) {
    if (!workspaces_[r]) throw std::runtime_error("omniep: workspace of rank " + std::to_string(r) + " not opened");
  }
}

static P2PTransport make_transport(const std::vector<RankWorkspace*>& ws, int me, uint64_t timeout) {
  P2PTransport tr = {};
  tr.first_rank = me;  // gridDim.y == 1: every block is rank `me`
  tr.group_size = static_cast<int>(ws.size());
  tr.wait_timeout_ns = timeout;
  for (size_t r = 0; r < ws.size(); ++r) tr.workspaces.p[r] = ws[r];
  return tr;
}

void IpcRank::layout(const LayoutArgs& args, cudaStream_t stream) {
  check_shape(args.num_experts, args.capacity);
  launcher_->layout(args, make_transport(workspaces_, rank_, timeout_ns_), stream);
}

void IpcRank::dispatch(DispatchArgs args, cudaStream_t stream) {
  check_shape(args.num_experts, args.capacity);
  // The copy unit must suit my source rows and every rank's receive rows.
  uintptr_t addrs[1 + kMaxRanks];
  addrs[0] = reinterpret_cast<uintptr_t>(args.x.p[rank_]);
  for (int r = 0; r < num_ranks_; ++r) addrs[1 + r] = reinterpret_cast<uintptr_t>(args.recv_x.p[r]);
  args.unit = row_copy_unit(args.row_bytes, addrs, 1 + num_ranks_);
  addrs[0] = reinterpret_cast<uintptr_t>(args.x2.p[rank_]);
  for (int r = 0; r < num_ranks_; ++r) addrs[1 + r] = reinterpret_cast<uintptr_t>(args.recv_x2.p[r]);
  args.unit2 = row_copy_unit(args.row2_bytes, addrs, 1 + num_ranks_);
  launcher_->dispatch(args, make_transport(workspaces_, rank_, timeout_ns_), stream);
}

void IpcRank::combine(const CombineArgs& args, cudaStream_t stream) {
  check_shape(args.num_experts, args.capacity);
  // 16-byte packs when my out rows and every rank's y rows start 16-byte aligned; 1 element otherwise.
  bool vec = (static_cast<int64_t>(args.hidden) * dtype_size(args.dtype)) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(args.out.p[rank_]) % 16 == 0;
  for (int r = 0; vec && r < num_ranks_; ++r) vec = reinterpret_cast<uintptr_t>(args.y.p[r]) % 16 == 0;
  launcher_->combine(args, make_transport(workspaces_, rank_, timeout_ns_), vec, stream);
}

void IpcRank::barrier(cudaStream_t stream) {
  for (int r = 0; r < num_ranks_; ++r) {
    if (!workspaces_[r]) throw std::runtime_error("omniep: workspace of rank " + std::to_string(r) + " not opened");
  }
  launcher_->barrier(make_transport(workspaces_, rank_, timeout_ns_), stream);
}

void IpcRank::copy_counts(int32_t* dst, cudaStream_t stream) const {
  const RankWorkspace* ws = workspaces_[rank_];
  check_cuda(cudaMemcpy2DAsync(dst, sizeof(int32_t) * num_ranks_, ws->counts, sizeof(int32_t) * kMaxRanks,
                               sizeof(int32_t) * num_ranks_, num_ranks_, cudaMemcpyDeviceToDevice, stream),
             "copying the count matrix");
}

void IpcRank::memcpy(uintptr_t dst, uintptr_t src, size_t bytes, cudaStream_t stream) const {
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                             cudaMemcpyDeviceToDevice, stream),
             "copying rows to / from the data buffer");
}

ErrorRecord IpcRank::read_error() const {
  check_cuda(cudaDeviceSynchronize(), "synchronising before reading the error record");
  ErrorRecord out;
  check_cuda(cudaMemcpy(&out, &workspaces_[rank_]->error, sizeof(ErrorRecord), cudaMemcpyDeviceToHost),
             "reading the error record");
  return out;
}

void IpcRank::reset() {
  check_cuda(cudaDeviceSynchronize(), "synchronising before reset");
  check_cuda(cudaMemset(workspaces_[rank_], 0, sizeof(RankWorkspace)), "reset");
  check_cuda(cudaDeviceSynchronize(), "reset");
}

}  // namespace omniep
