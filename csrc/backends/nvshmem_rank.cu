// NvshmemRank (see nvshmem_rank.h): bootstrap, symmetric buffers and launchers over NVSHMEM.
#include "backends/nvshmem_rank.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "backends/one_rank_launch.cuh"
#include "backends/rank_ops.cuh"
#include "transports/nvshmem.cuh"

namespace omniep {
namespace {

void check_nvshmem(int status, const char* what) {
  if (status != 0) throw std::runtime_error(std::string("omniep: ") + what + " failed (NVSHMEM status " +
                                            std::to_string(status) + ")");
}

}  // namespace

std::string NvshmemRank::unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  check_nvshmem(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

NvshmemRank::NvshmemRank(int rank, int num_ranks, const std::string& uid, uint64_t timeout_ns)
    : SymmetricDataRank(rank, timeout_ns), num_ranks_(num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("omniep: rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) +
                                ": need 0 <= rank < num_ranks <= " + std::to_string(kMaxRanks));
  }
  nvshmemx_uniqueid_t id;
  if (uid.size() != sizeof(id)) throw std::invalid_argument("omniep: NVSHMEM unique id has the wrong size");
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  check_nvshmem(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  check_nvshmem(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), "nvshmemx_init_attr");
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks) {
    throw std::runtime_error("omniep: NVSHMEM PE numbering does not match the EP ranks");
  }
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  launcher_ = std::make_unique<OneRankLauncher>(device, rank_, num_ranks_);
  workspace_ = static_cast<RankWorkspace*>(nvshmem_malloc(sizeof(RankWorkspace)));
  if (!workspace_) throw std::runtime_error("omniep: nvshmem_malloc of the workspace failed");
  check_cuda(cudaMemset(workspace_, 0, sizeof(RankWorkspace)), "zeroing the workspace");
  check_cuda(cudaDeviceSynchronize(), "zeroing the workspace");
  // Peers without a load/store path, or every peer with OMNIEP_FORCE_REMOTE=1, take the remote path.
  const char* force = std::getenv("OMNIEP_FORCE_REMOTE");
  const bool force_remote = force && std::strcmp(force, "1") == 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (r != rank && (force_remote || !nvshmem_ptr(workspace_, r))) remote_mask_ |= 1u << r;
  }
  // The scratch allocation below is collective: every PE must take the same branch. Reachability is
  // symmetric (across nodes every PE has remote peers) and OMNIEP_FORCE_REMOTE must be the same on
  // every rank (omniep.native.ipc_rank.NvshmemRankState checks that before constructing).
  if (remote_mask_ != 0) {
    // Expert-major staging: one stage per warp of every block a launch may have (resident limit: at
    // most 2048 threads per SM, so 2048 / kCombineThreads blocks per SM). Same size on every PE
    // (same GPU model), as nvshmem_malloc needs.
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    const int max_blocks = sms * (2048 / kCombineThreads);
    scratch_bytes_ = static_cast<int64_t>(max_blocks) * (kCombineThreads / gpu::kWarpSize) * kCombineStageBytesPerWarp;
    scratch_ = static_cast<uint8_t*>(nvshmem_malloc(static_cast<size_t>(scratch_bytes_)));
    if (!scratch_) throw std::runtime_error("omniep: nvshmem_malloc of the remote-path scratch failed");
  }
  nvshmem_barrier_all();  // every workspace is zero before anyone signals
}

NvshmemRank::~NvshmemRank() {
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  if (data_) nvshmem_free(data_);
  if (mirrors_) nvshmem_free(mirrors_);
  if (scratch_) nvshmem_free(scratch_);
  if (workspace_) nvshmem_free(workspace_);
  nvshmem_finalize();
}

void NvshmemRank::set_blocks(int n) { launcher_->set_blocks(n); }

void NvshmemRank::allocate_data(size_t bytes) {
  check_cuda(cudaDeviceSynchronize(), "synchronising before re-allocating the data buffer");
  nvshmem_barrier_all();  // nobody still reads or writes the old buffer
  if (data_) nvshmem_free(data_);
  if (mirrors_) nvshmem_free(mirrors_);
  data_ = nullptr;
  mirrors_ = nullptr;
  data_bytes_ = 0;
  if (bytes == 0) return;
  data_ = nvshmem_malloc(bytes);
  if (!data_) throw std::runtime_error("omniep: nvshmem_malloc of " + std::to_string(bytes) + " bytes failed "
                                       "(raise NVSHMEM_SYMMETRIC_SIZE)");
  data_bytes_ = bytes;
  check_cuda(cudaMemset(data_, 0, bytes), "zeroing the data buffer");
  if (remote_mask_ != 0) {  // every PE has remote peers or none (see the constructor): collective
    const size_t mirror_bytes = bytes * static_cast<size_t>(num_ranks_);
    mirrors_ = static_cast<uint8_t*>(nvshmem_malloc(mirror_bytes));
    if (!mirrors_) throw std::runtime_error("omniep: nvshmem_malloc of the remote-path mirrors (" +
                                            std::to_string(mirror_bytes) + " bytes) failed (raise NVSHMEM_SYMMETRIC_SIZE)");
  }
  check_cuda(cudaDeviceSynchronize(), "zeroing the data buffer");
}

NvshmemTransport NvshmemRank::transport() const {
  NvshmemTransport tr = {};
  tr.me = rank_;
  tr.group_size = num_ranks_;
  tr.wait_timeout_ns = timeout_ns_;
  tr.workspaces.p[rank_] = workspace_;
  tr.remote_mask = remote_mask_;
  tr.scratch = scratch_;
  tr.scratch_bytes = scratch_bytes_;
  tr.data_base = static_cast<const uint8_t*>(data_);
  tr.mirrors = mirrors_;
  tr.data_bytes = static_cast<int64_t>(data_bytes_);
  return tr;
}

template class OneRankOps<NvshmemRank>;

}  // namespace omniep
