// Launchers of the kernels for ONE rank per process over CUDA IPC (see ipc_rank.h).
#include "backends/ipc_rank.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/combine.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/layout.cuh"
#include "transports/p2p.cuh"

namespace omniep {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

constexpr int kMaxBlocks = 24;  // the SM budget for communication (issue 4)
constexpr size_t kMaxDynamicSmem = 48 * 1024;

template <typename Kernel, typename Args>
void launch_cooperative(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream,
                        const Args& args, const P2PTransport& tr, const char* what) {
  // Cooperative: all blocks of the rank are co-resident or the launch fails, so the rank's own
  // blocks can wait on each other at a barrier without deadlock.
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks, 1);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, args, tr), what);
}

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
  check_cuda(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_), "SM count");
  int coop = 0;
  check_cuda(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device_), "cooperative attr");
  if (!coop) throw std::runtime_error("omniep: device does not support cooperative launches");
  RankWorkspace* ws = nullptr;
  check_cuda(cudaMalloc(&ws, sizeof(RankWorkspace)), "allocating the rank workspace");
  workspaces_[rank_] = ws;
  check_cuda(cudaMemset(ws, 0, sizeof(RankWorkspace)), "zeroing the rank workspace");
  check_cuda(cudaDeviceSynchronize(), "zeroing the rank workspace");
}

IpcRank::~IpcRank() {
  cudaDeviceSynchronize();  // kernels may still use the buffers
  close_peer_data();
  close_peer_workspaces();
  if (data_[rank_]) cudaFree(data_[rank_]);
  if (workspaces_[rank_]) cudaFree(workspaces_[rank_]);
}

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
      cudaIpcCloseMemHandle(data_[r]);
      data_[r] = nullptr;
    }
  }
}

void IpcRank::close_peer_workspaces() {
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && workspaces_[r]) {
      cudaIpcCloseMemHandle(workspaces_[r]);
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
    if (data_[r]) cudaIpcCloseMemHandle(data_[r]);
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

int IpcRank::blocks_for(const void* kernel, int threads, size_t smem) const {
  const auto key = std::make_tuple(kernel, smem);
  if (auto it = blocks_cache_.find(key); it != blocks_cache_.end()) return it->second;
  int per_sm = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "occupancy");
  const int resident = per_sm * num_sms_;
  if (resident < 1) throw std::runtime_error("omniep: kernel cannot be resident on this GPU");
  const int want = blocks_ > 0 ? blocks_ : kMaxBlocks;
  const int blocks = want < resident ? want : resident;
  blocks_cache_[key] = blocks;
  return blocks;
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
  const size_t smem = sizeof(int) * static_cast<size_t>(args.num_experts);
  if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: at most 12288 experts");
  const P2PTransport tr = make_transport(workspaces_, rank_, timeout_ns_);
  if (args.index_bytes == 8) {
    launch_cooperative(layout_kernel<P2PTransport, int64_t>, 1, kLayoutThreads, smem, stream, args, tr, "layout");
  } else if (args.index_bytes == 4) {
    launch_cooperative(layout_kernel<P2PTransport, int32_t>, 1, kLayoutThreads, smem, stream, args, tr, "layout");
  } else {
    throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
  }
}

void IpcRank::dispatch(DispatchArgs args, cudaStream_t stream) {
  check_shape(args.num_experts, args.capacity);
  if (args.row_bytes < 0 || args.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
  // The copy unit must suit my source rows and every rank's receive rows.
  uintptr_t addrs[1 + kMaxRanks];
  addrs[0] = reinterpret_cast<uintptr_t>(args.x.p[rank_]);
  for (int r = 0; r < num_ranks_; ++r) addrs[1 + r] = reinterpret_cast<uintptr_t>(args.recv_x.p[r]);
  args.unit = row_copy_unit(args.row_bytes, addrs, 1 + num_ranks_);
  addrs[0] = reinterpret_cast<uintptr_t>(args.x2.p[rank_]);
  for (int r = 0; r < num_ranks_; ++r) addrs[1 + r] = reinterpret_cast<uintptr_t>(args.recv_x2.p[r]);
  args.unit2 = row_copy_unit(args.row2_bytes, addrs, 1 + num_ranks_);
  const size_t smem = args.with_routing ? sizeof(int) * static_cast<size_t>(args.num_experts) : 0;
  if (smem > kMaxDynamicSmem) throw std::invalid_argument("omniep: too many experts for dispatch");
  auto kernel = dispatch_kernel<P2PTransport>;
  const int blocks = blocks_for(reinterpret_cast<const void*>(kernel), kDispatchThreads, smem);
  launch_cooperative(kernel, blocks, kDispatchThreads, smem, stream, args,
                     make_transport(workspaces_, rank_, timeout_ns_), "dispatch");
}

void IpcRank::combine(const CombineArgs& args, cudaStream_t stream) {
  check_shape(args.num_experts, args.capacity);
  if (args.hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
  if (args.num_bias < 0 || args.num_bias > 2) throw std::invalid_argument("omniep: num_bias must be 0, 1 or 2");
  const P2PTransport tr = make_transport(workspaces_, rank_, timeout_ns_);
  // 16-byte packs when my out rows and every rank's y rows start 16-byte aligned; 1 element otherwise.
  const int elem = dtype_size(args.dtype);
  bool vec = (static_cast<int64_t>(args.hidden) * elem) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(args.out.p[rank_]) % 16 == 0;
  for (int r = 0; vec && r < num_ranks_; ++r) vec = reinterpret_cast<uintptr_t>(args.y.p[r]) % 16 == 0;
  auto pick = [&](auto k16, auto k1) {
    const void* kernel = vec ? reinterpret_cast<const void*>(k16) : reinterpret_cast<const void*>(k1);
    const int blocks = blocks_for(kernel, kCombineThreads, 0);
    if (vec) {
      launch_cooperative(k16, blocks, kCombineThreads, 0, stream, args, tr, "combine");
    } else {
      launch_cooperative(k1, blocks, kCombineThreads, 0, stream, args, tr, "combine");
    }
  };
  switch (args.dtype) {
    case kFloat32: pick(combine_kernel<P2PTransport, float, 4>, combine_kernel<P2PTransport, float, 1>); break;
    case kBFloat16:
      pick(combine_kernel<P2PTransport, gpu::bfloat16, 8>, combine_kernel<P2PTransport, gpu::bfloat16, 1>);
      break;
    case kFloat16:
      pick(combine_kernel<P2PTransport, gpu::float16, 8>, combine_kernel<P2PTransport, gpu::float16, 1>);
      break;
    default: throw std::invalid_argument("omniep: combine dtype must be float32, bfloat16 or float16");
  }
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
