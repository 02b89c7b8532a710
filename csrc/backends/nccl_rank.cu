// NcclRank / NcclLocalGroup (see nccl_rank.h): communicators, symmetric windows, the device
// communicator and the launchers over the NCCL device API.
#include "backends/nccl_rank.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "backends/one_rank_launch.cuh"
#include "backends/rank_ops.cuh"
#include "transports/nccl_dev.cuh"

namespace omniep {

struct NcclDevCommBox {
  ncclDevComm comm;
};

namespace {

void check_nccl(ncclResult_t status, const char* what, ncclComm_t comm = nullptr) {
  if (status == ncclSuccess) return;
  std::string msg = std::string("omniep: ") + what + " failed: " + ncclGetErrorString(status);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  throw std::runtime_error(msg);
}

// Registered sizes: whole 2 MiB granules (the symmetric-window granularity on the GPUs we target).
size_t granule(size_t bytes) { return (bytes + (size_t{1} << 21) - 1) >> 21 << 21; }

// The loaded libnccl has the device API (windows, ncclDevComm) these ranks are built on.
void require_device_api() {
  const int v = NcclRank::runtime_version();
  if (v < kMinNcclVersion) {
    throw std::runtime_error("omniep: NCCL " + std::to_string(v) + " has no device API (need >= " +
                             std::to_string(kMinNcclVersion) + ")");
  }
}

bool force_remote() {
  const char* v = std::getenv("OMNIEP_FORCE_REMOTE");
  return v && std::strcmp(v, "1") == 0;
}

// Runs `step` for every rank inside one NCCL group (one thread driving several communicators).
template <typename Ranks, typename Step>
void grouped(Ranks& ranks, const char* what, Step step) {
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  try {
    for (auto& r : ranks) step(*r);
  } catch (...) {
    ncclGroupEnd();
    throw;
  }
  check_nccl(ncclGroupEnd(), what);
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    restore_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool restore_ = false;
};

// Freed after the windows are gone (teardown) and before the communicator is destroyed (if it is ours).
void free_and_destroy(ncclComm_t& comm, bool owned, RankWorkspace*& ws, void*& data, void*& mirrors) {
  if (data) ncclMemFree(data);
  if (mirrors) ncclMemFree(mirrors);
  if (ws) ncclMemFree(ws);
  data = mirrors = nullptr;
  ws = nullptr;
  if (comm && owned) {
    ncclCommFinalize(comm);
    ncclCommDestroy(comm);
  }
  comm = nullptr;
}

}  // namespace

std::string NcclRank::unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

int NcclRank::runtime_version() {
  int v = 0;
  check_nccl(ncclGetVersion(&v), "ncclGetVersion");
  return v;
}

template <typename F>
void NcclRank::on_device(F&& f) const {
  DeviceGuard guard(device_);
  f();
}

NcclRank::NcclRank(ncclComm_t comm, int device, uint64_t timeout_ns)
    : SymmetricDataRank(0, timeout_ns), comm_(comm), device_(device) {
  adopt();
}

void NcclRank::adopt() {
  check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
  check_nccl(ncclCommCount(comm_, &num_ranks_), "ncclCommCount", comm_);
  if (num_ranks_ > kMaxRanks) {
    throw std::invalid_argument("omniep: " + std::to_string(num_ranks_) + " ranks; at most " +
                                std::to_string(kMaxRanks));
  }
  // Peers outside my LSA team (no load/store path: other nodes) go through GIN; OMNIEP_FORCE_REMOTE=1
  // (on every rank) sends every peer there, to run the internode algorithm inside one node.
  const ncclTeam_t lsa = ncclTeamLsa(comm_), world = ncclTeamWorld(comm_);
  remote_mask_ = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && (force_remote() || !ncclTeamRankIsMember(lsa, world, r))) remote_mask_ |= 1u << r;
  }
  DeviceGuard guard(device_);
  launcher_ = std::make_unique<OneRankLauncher>(device_, rank_, num_ranks_);
}

void NcclRank::open_windows() {
  alloc_workspace();
  register_workspace();
  create_dev_comm();
  require_gin();
}

NcclRank::NcclRank(int rank, int num_ranks, const std::string& uid, uint64_t timeout_ns)
    : SymmetricDataRank(0, timeout_ns) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("omniep: rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) +
                                ": need 0 <= rank < num_ranks <= " + std::to_string(kMaxRanks));
  }
  require_device_api();
  ncclUniqueId id;
  if (uid.size() != sizeof(id)) throw std::invalid_argument("omniep: NCCL unique id has the wrong size");
  std::memcpy(&id, uid.data(), sizeof(id));
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  check_nccl(ncclCommInitRank(&comm_, num_ranks, id, rank), "ncclCommInitRank");
  try {
    adopt();  // rank, size and LSA checks
  } catch (...) {
    ncclCommDestroy(comm_);
    throw;
  }
  open_windows();
}

NcclRank::NcclRank(uintptr_t borrowed_comm, uint64_t timeout_ns)
    : SymmetricDataRank(0, timeout_ns), comm_(reinterpret_cast<ncclComm_t>(borrowed_comm)), owns_comm_(false) {
  if (comm_ == nullptr) {
    throw std::invalid_argument("omniep: the process group has no NCCL communicator yet (run one collective "
                                "on it first, or pass device_id to init_process_group)");
  }
  require_device_api();
  int comm_device = -1;
  check_nccl(ncclCommCuDevice(comm_, &comm_device), "ncclCommCuDevice", comm_);
  check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
  if (comm_device != device_) {
    throw std::invalid_argument("omniep: the NCCL communicator is on device " + std::to_string(comm_device) +
                                " but the current device is " + std::to_string(device_));
  }
  adopt();
  open_windows();
}

NcclRank::~NcclRank() {
  if (!comm_) return;  // NcclLocalGroup tore it down already
  try {
    teardown();
  } catch (...) {  // a destructor must not throw; the process is likely exiting
  }
  DeviceGuard guard(device_);
  free_and_destroy(comm_, owns_comm_, workspace_, data_, mirrors_);
}

void NcclRank::alloc_workspace() {
  on_device([&] {
    void* p = nullptr;
    check_nccl(ncclMemAlloc(&p, granule(sizeof(RankWorkspace))), "ncclMemAlloc (workspace)", comm_);
    workspace_ = static_cast<RankWorkspace*>(p);
    check_cuda(cudaMemset(workspace_, 0, sizeof(RankWorkspace)), "zeroing the workspace");
    check_cuda(cudaDeviceSynchronize(), "zeroing the workspace");
  });
}

void NcclRank::register_workspace() {
  on_device([&] {
    check_nccl(ncclCommWindowRegister(comm_, workspace_, granule(sizeof(RankWorkspace)), &ws_window_,
                                      NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister (workspace)", comm_);
  });
}

void NcclRank::create_dev_comm() {
  on_device([&] {
    dev_comm_ = std::make_unique<NcclDevCommBox>();
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
    // Our barriers are kernels/sync.cuh (with timeouts), so no NCCL barrier resources. GIN peers: one
    // context, and one signal per source rank (signal s counts the barriers s signalled to me).
    if (remote_mask_ != 0) {
      reqs.ginForceEnable = true;
      reqs.ginContextCount = 1;
      reqs.ginSignalCount = num_ranks_;
    }
    check_nccl(ncclDevCommCreate(comm_, &reqs, &dev_comm_->comm), dev_comm_what(), comm_);
  });
}

const char* NcclRank::dev_comm_what() const {
  return remote_mask_ ? "ncclDevCommCreate with GIN (peers outside the LSA team need a network with GPU-initiated "
                        "networking)"
                      : "ncclDevCommCreate";
}

void NcclRank::require_gin() const {
  if (remote_mask_ != 0 && dev_comm_->comm.ginContextCount < 1) {
    throw std::runtime_error("omniep: nccl_ep rank " + std::to_string(rank_) + ": peers outside the LSA team need "
                             "GIN, but NCCL gave the device communicator no GIN context (no GIN-capable network)");
  }
}

void NcclRank::release_data() {
  on_device([&] {
    if (data_window_) check_nccl(ncclCommWindowDeregister(comm_, data_window_), "ncclCommWindowDeregister", comm_);
    if (mirror_window_) check_nccl(ncclCommWindowDeregister(comm_, mirror_window_), "ncclCommWindowDeregister", comm_);
    data_window_ = mirror_window_ = nullptr;
  });
}

void NcclRank::alloc_data(size_t bytes) {
  on_device([&] {
    if (data_) check_nccl(ncclMemFree(data_), "ncclMemFree (data)", comm_);
    if (mirrors_) check_nccl(ncclMemFree(mirrors_), "ncclMemFree (mirrors)", comm_);
    data_ = mirrors_ = nullptr;
    data_bytes_ = 0;
    if (bytes == 0) return;
    check_nccl(ncclMemAlloc(&data_, granule(bytes)), "ncclMemAlloc (data)", comm_);
    data_bytes_ = granule(bytes);
    check_cuda(cudaMemset(data_, 0, data_bytes_), "zeroing the data buffer");
    if (remote_mask_ != 0) {
      check_nccl(ncclMemAlloc(&mirrors_, data_bytes_ * num_ranks_), "ncclMemAlloc (remote-path mirrors)", comm_);
    }
    check_cuda(cudaDeviceSynchronize(), "zeroing the data buffer");
  });
}

void NcclRank::register_data() {
  on_device([&] {
    if (!data_) return;
    check_nccl(ncclCommWindowRegister(comm_, data_, data_bytes_, &data_window_, NCCL_WIN_COLL_SYMMETRIC),
               "ncclCommWindowRegister (data)", comm_);
    if (mirrors_) {
      check_nccl(ncclCommWindowRegister(comm_, mirrors_, data_bytes_ * num_ranks_, &mirror_window_,
                                        NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister (mirrors)", comm_);
    }
  });
}

void NcclRank::allocate_data(size_t bytes) {
  on_device([&] { check_cuda(cudaDeviceSynchronize(), "synchronising before re-allocating the data buffer"); });
  release_data();  // collective: nobody reaches the old buffer afterwards
  alloc_data(bytes);
  register_data();
}

void NcclRank::teardown() {
  on_device([&] {
    cudaDeviceSynchronize();
    if (dev_comm_) check_nccl(ncclDevCommDestroy(comm_, &dev_comm_->comm), "ncclDevCommDestroy", comm_);
    dev_comm_.reset();
    if (data_window_) check_nccl(ncclCommWindowDeregister(comm_, data_window_), "ncclCommWindowDeregister", comm_);
    if (mirror_window_) check_nccl(ncclCommWindowDeregister(comm_, mirror_window_), "ncclCommWindowDeregister", comm_);
    if (ws_window_) check_nccl(ncclCommWindowDeregister(comm_, ws_window_), "ncclCommWindowDeregister", comm_);
    data_window_ = mirror_window_ = ws_window_ = nullptr;
  });
}

void NcclRank::set_blocks(int n) { launcher_->set_blocks(n); }

NcclDevTransport NcclRank::transport() const {
  NcclDevTransport tr;
  std::memset(&tr, 0, sizeof(tr));
  tr.me = rank_;
  tr.group_size = num_ranks_;
  tr.wait_timeout_ns = timeout_ns_;
  tr.workspaces.p[rank_] = workspace_;
  tr.ws_window = ws_window_;
  tr.data_window = data_window_;
  tr.data_base = static_cast<const uint8_t*>(data_);
  tr.remote_mask = remote_mask_;
  tr.mirror_window = mirror_window_;
  tr.mirrors = static_cast<uint8_t*>(mirrors_);
  tr.data_bytes = static_cast<int64_t>(data_bytes_);
  tr.dev_comm = dev_comm_->comm;
  return tr;
}

template class OneRankOps<NcclRank>;

// ---- one process, several GPUs ----

NcclLocalGroup::NcclLocalGroup(const std::vector<int>& devices, uint64_t timeout_ns) {
  const int n = static_cast<int>(devices.size());
  if (n < 1 || n > kMaxRanks) throw std::invalid_argument("omniep: a local NCCL group needs 1.." +
                                                          std::to_string(kMaxRanks) + " devices");
  require_device_api();
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  int prev = 0;
  check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int i = 0; i < n; ++i) {
    check_cuda(cudaSetDevice(devices[i]), "cudaSetDevice");
    check_nccl(ncclCommInitRank(&comms[i], n, id, i), "ncclCommInitRank");
  }
  check_nccl(ncclGroupEnd(), "grouped ncclCommInitRank");
  check_cuda(cudaSetDevice(prev), "cudaSetDevice");
  for (int i = 0; i < n; ++i) ranks_.emplace_back(new NcclRank(comms[i], devices[i], timeout_ns));
  for (auto& r : ranks_) r->alloc_workspace();
  grouped(ranks_, "grouped ncclCommWindowRegister (workspace)", [](NcclRank& r) { r.register_workspace(); });
  grouped(ranks_, ranks_[0]->dev_comm_what(), [](NcclRank& r) { r.create_dev_comm(); });
  for (auto& r : ranks_) r->require_gin();  // the devComms are filled in once the group has ended
}

NcclLocalGroup::~NcclLocalGroup() {
  try {
    grouped(ranks_, "grouped teardown", [](NcclRank& r) { r.teardown(); });
  } catch (...) {
  }
  for (auto& r : ranks_) {
    DeviceGuard guard(r->device_);
    free_and_destroy(r->comm_, r->owns_comm_, r->workspace_, r->data_, r->mirrors_);
  }
}

NcclRank& NcclLocalGroup::rank(int i) {
  if (i < 0 || i >= size()) throw std::out_of_range("omniep: local rank " + std::to_string(i));
  return *ranks_[i];
}

void NcclLocalGroup::allocate_data(size_t bytes) {
  for (auto& r : ranks_) {
    DeviceGuard guard(r->device_);
    check_cuda(cudaDeviceSynchronize(), "synchronising before re-allocating the data buffer");
  }
  grouped(ranks_, "grouped ncclCommWindowDeregister (data)", [](NcclRank& r) { r.release_data(); });
  for (auto& r : ranks_) r->alloc_data(bytes);
  grouped(ranks_, "grouped ncclCommWindowRegister (data)", [](NcclRank& r) { r.register_data(); });
}

}  // namespace omniep
