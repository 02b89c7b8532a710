// OneRankOps: the ops that every one-rank-per-process class shares (IpcRank over CUDA IPC, NvshmemRank
// over NVSHMEM, NcclRank over the NCCL device API), written once over the little each class provides.
//
// A class `Rank` derives from OneRankOps<Rank> (CRTP) and gives OneRankOps (a friend) access to:
//   OneRankLauncher& launcher();                 its launcher (backends/one_rank_launch.cuh)
//   <transport> transport() const;               the kernels' view of this rank; throws if not ready
//   RankWorkspace* my_workspace() const;         its own workspace
//   template <typename F> void on_device(F&&) const;   runs f with the rank's device current
// and the public rank() / num_ranks().
//
// The definitions are in backends/one_rank_launch.cuh (device code); each class's .cu instantiates
// them once (`template class OneRankOps<Rank>;`), and its header declares that instance extern.
// Host-only header: the pybind modules and the XLA FFI handlers include it without CUDA headers.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kernels/args.h"
#include "kernels/em_args.h"

#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace omniep {

template <typename Rank>
class OneRankOps {
 public:
  // ---- ops: launch this rank's slice on `stream` (gridDim.y == 1); no host synchronisation ----
  // Each checks the group shape (num_experts, capacity) against the group size first. Argument
  // structs: entries [rank()] of local fields, symmetric fields as the class's sym<T>() fills them.
  void layout(const LayoutArgs& args, cudaStream_t stream);
  void dispatch(const DispatchArgs& args, cudaStream_t stream);  // args.unit / unit2 are chosen here
  void combine(const CombineArgs& args, cudaStream_t stream);
  // Expert-major layout (kernels/em_*.cuh): em_layout runs after layout() on the same stream;
  // dispatch_bwd is em_combine with null topk_weights and with_topk_grad = 1.
  void em_layout(const EMLayoutArgs& args, cudaStream_t stream);
  void em_dispatch(const EMDispatchArgs& args, cudaStream_t stream);  // args.unit / unit2 chosen here
  void em_combine(const EMCombineArgs& args, cudaStream_t stream);
  void em_combine_bwd(const EMCombineBwdArgs& args, cudaStream_t stream);
  // A bare barrier over the group on `stream` (every rank must call it, in the same order as the ops).
  void barrier(cudaStream_t stream);

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

  // Synchronises the device; my ErrorRecord (code 0 = fine).
  ErrorRecord read_error() const;
  // Synchronises the device and zeroes my workspace. Only meaningful if every rank resets.
  void reset();

 private:
  template <typename F>
  void run(F&& launch);  // launch(launcher, transport) on the rank's device
  void copy2d(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width, size_t height,
              cudaStream_t stream, const char* what) const;
  Rank& self() { return static_cast<Rank&>(*this); }
  const Rank& self() const { return static_cast<const Rank&>(*this); }
};

}  // namespace omniep
