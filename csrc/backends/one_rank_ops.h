// OneRankOps: the ops that every one-rank-per-process class shares (IpcRank over CUDA IPC, NvshmemRank
// over NVSHMEM, NcclRank over the NCCL device API), written once over the little each class provides:
// the EpRank interface (backends/ep_rank.h: the data path, descriptors, statuses, growth) and the
// single-kernel launches it is made of.
//
// A class `Rank` derives from OneRankOps<Rank> (CRTP) and gives OneRankOps (a friend) access to:
//   OneRankLauncher& launcher();                 its launcher (backends/one_rank_launch.cuh)
//   <transport> transport() const;               the kernels' view of this rank; throws if not ready
//   RankWorkspace* my_workspace() const;         its own workspace
//   template <typename F> void on_device(F&&) const;   runs f with the rank's device current
//   PerRank<T> sym<T>(offset), uintptr_t data_ptr()    its symmetric data buffer
//   void grow_data(size_t bytes, cudaStream_t)   re-allocate that buffer, collectively (all ranks, same bytes)
// and the public rank() / num_ranks() / data_bytes().
//
// The definitions are in backends/one_rank_launch.cuh and backends/rank_ops.cuh (device code); each
// class's .cu instantiates them once (`template class OneRankOps<Rank>;`), and its header declares
// that instance extern. Host-only header: the pybind modules and the XLA FFI handlers include it
// without CUDA headers.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <variant>

#include "backends/ep_rank.h"
#include "kernels/args.h"
#include "kernels/em_args.h"

#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace omniep {

struct BarrierArgs;

// What the classes over ONE symmetric data buffer (NvshmemRank, NcclRank) keep alike: the buffer
// (sym<T>(), data_ptr()), the peers reached by puts + signals, the wait limit. IpcRank keeps one
// buffer per peer instead.
class SymmetricDataRank {
 public:
  uint64_t timeout_ns() const { return timeout_ns_; }
  void set_timeout_ns(uint64_t ns) { timeout_ns_ = ns; }
  uint32_t remote_mask() const { return remote_mask_; }  // bit r: peer r is reached by puts + signals
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(data_); }
  // Entry [me] = my data buffer + offset (the transport derives the peers' entries).
  template <typename T>
  PerRank<T> sym(int64_t offset) const {
    PerRank<T> out = {};
    out.p[rank_] = data_ ? reinterpret_cast<T*>(static_cast<char*>(data_) + offset) : nullptr;
    return out;
  }

 protected:
  SymmetricDataRank(int rank, uint64_t timeout_ns) : rank_(rank), timeout_ns_(timeout_ns) {}
  int rank_;
  uint64_t timeout_ns_;
  void* data_ = nullptr;
  size_t data_bytes_ = 0;
  uint32_t remote_mask_ = 0;
};

template <typename Rank>
class OneRankOps : public EpRank {
 public:
  ~OneRankOps() override;

  // ---- EpRank (backends/rank_ops.cuh) ----
  PrepareResult prepare(const PrepareCall& c, OpDesc& d, cudaStream_t s) override;
  void dispatch(const DispatchCall& c, OpDesc& d, cudaStream_t s) override;
  void combine(const CombineCall& c, OpDesc& d, cudaStream_t s) override;
  void em_dispatch(const EMDispatchCall& c, OpDesc& d, cudaStream_t s) override;
  void em_combine(const EMCombineCall& c, OpDesc& d, cudaStream_t s) override;
  void em_combine_bwd(const EMCombineBwdCall& c, OpDesc& d, cudaStream_t s) override;
  void reject(OpDesc& d, cudaStream_t s) override;
  void barrier(cudaStream_t s) override;
  void statuses(Status* fatal, Status* pending, bool clear_pending) override;
  void take_status(Status* out, cudaStream_t s) override;
  void receive(cudaStream_t s) override;
  // Whether the ops may grow the data buffer themselves (collectively, inside an op). The JAX states
  // size it while tracing instead and turn this off: an op that needs more then fails.
  void set_grow_in_ops(bool on) { grow_in_ops_ = on; }

  // ---- single kernels: launch this rank's slice on `stream` (gridDim.y == 1); no host sync ----
  // Each checks the group shape (num_experts, capacity) against the group size first. Argument
  // structs: entries [rank()] of local fields, symmetric fields as the class's sym<T>() fills them.
  void launch_layout(const LayoutArgs& args, cudaStream_t stream);
  void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);  // args.unit / unit2 are chosen here
  void launch_combine(const CombineArgs& args, cudaStream_t stream);
  // Expert-major layout (kernels/em_*.cuh): em_layout runs after layout() on the same stream;
  // dispatch_bwd is em_combine with null topk_weights and with_topk_grad = 1.
  void launch_em_layout(const EMLayoutArgs& args, cudaStream_t stream);
  void launch_em_dispatch(const EMDispatchArgs& args, cudaStream_t stream);  // args.unit / unit2 chosen here
  void launch_em_combine(const EMCombineArgs& args, cudaStream_t stream);
  void launch_em_combine_bwd(const EMCombineBwdArgs& args, cudaStream_t stream);
  // A barrier over the group on `stream` (every rank, in op order); with args.exchange it carries the
  // descriptors (kernels/sync.cuh barrier_kernel).
  void launch_barrier(const BarrierArgs& args, cudaStream_t stream);

  // Async device-to-device copies on `stream` (into / out of the data buffer): `bytes`, or `height`
  // rows of `width` bytes at the given pitches.
  void memcpy(uintptr_t dst, uintptr_t src, size_t bytes, cudaStream_t stream) const;
  void memcpy2d(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width, size_t height,
                cudaStream_t stream) const;

  // dst[i] = src[i] for rows i in [0, rows) outside [*skip_begin, *skip_begin + *skip_count) (device
  // int32 scalars, 0 = skip nothing), a plain launch over every SM (kernels/copy_rows.cuh): the
  // copy-out / copy-in of the rank-major data path, minus the rows the kernels wrote / read directly.
  void copy_rows_except(uintptr_t dst, uintptr_t src, int64_t row_bytes, int64_t rows, uintptr_t skip_begin,
                        uintptr_t skip_count, cudaStream_t stream);

  // Synchronises the device and zeroes my workspace. Only meaningful if every rank resets.
  void reset();

 private:
  template <typename F>
  void run(F&& launch);  // launch(launcher, transport) on the rank's device
  // Makes the data buffer at least `bytes` (rank_ops.cuh). Growing is collective and starts with the
  // op's descriptor exchange, so ranks that disagree stop instead of growing apart; false: the op
  // stopped (on every rank).
  // `regions_end`: where the op's regions end if not at `bytes` (the push combine's buffers lie past them).
  bool ensure_data(size_t bytes, OpDesc& d, cudaStream_t s, int64_t regions_end = -1);
  bool stopped(const OpDesc& d) const;  // after a sync: the op stopped at an exchange (or the rank failed)
  HostMailbox* mailbox();               // pinned, host-mapped (allocated at the first exact dispatch)
  HostMailbox* mailbox_ = nullptr;
  int32_t ticket_ = 0;
  // Where the ops' regions of the data buffer lie, for the push combine's receive buffers (rank_ops.cuh
  // em_combine), alike on every rank (the same ops, the same sizes): the highest end of any op's regions
  // (ensure_data, which every op with regions calls), and where the push buffers are (-1: none yet) and the
  // bytes of each parity's half.
  int64_t regions_high_ = 0;
  int64_t back_at_ = -1, back_half_ = 0;
  bool grow_in_ops_ = true;
  // The second half of a send_only op (EpRank::receive): its arguments, phase kEMReceive.
  std::variant<std::monostate, EMDispatchArgs, EMCombineArgs> pending_;
  template <typename Args>
  void keep_receive(Args a, const OpDesc& d);  // after the send half of d's op was launched with `a`
  void copy2d(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width, size_t height,
              cudaStream_t stream, const char* what) const;
  Rank& self() { return static_cast<Rank&>(*this); }
  const Rank& self() const { return static_cast<const Rank&>(*this); }
};

}  // namespace omniep
