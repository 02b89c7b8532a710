// Host-side launch helpers shared by both launchers: VirtualRankGroup (several virtual ranks in one
// launch) and OneRankLauncher (one rank per process). Argument checks, the choice of a kernel
// instance (index type; element type and 16-byte vectors), and the alignment tests behind that
// choice, written once. Builds with nvcc and with hipcc; the one runtime call (CUDA only) is
// combine_ring_smem's, which asks for the combine's shared memory.
#pragma once

#include <type_traits>

#include <stdint.h>

#include <map>
#include <stdexcept>
#include <string>

#include "kernels/combine.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/em_combine.cuh"
#include "kernels/em_dispatch.cuh"
#include "kernels/em_layout.cuh"
#include "kernels/layout.cuh"

namespace omniep {

inline constexpr size_t kMaxDynamicSmem = 48 * 1024;

// num_experts: a positive multiple of the group size, at most kMaxLocalExperts per rank; capacity >= 0.
inline void check_group_shape(int num_experts, int capacity, int num_ranks) {
  if (num_experts < num_ranks || num_experts % num_ranks != 0 || num_experts / num_ranks > kMaxLocalExperts) {
    throw std::invalid_argument("omniep: num_experts=" + std::to_string(num_experts) + " must be a positive multiple of " +
                                std::to_string(num_ranks) + " ranks with at most " +
                                std::to_string(kMaxLocalExperts) + " experts per rank");
  }
  if (capacity < 0) throw std::invalid_argument("omniep: capacity must be >= 0");
}

// ---- argument checks: throw on what no kernel instance can run; return the dynamic shared memory ----
// `arrays` int arrays of num_experts entries each.
// `reserved`: the kernel's own static shared memory, which counts against the same limit.
inline size_t per_expert_smem(int num_experts, const char* what, int arrays = 1, size_t reserved = 0) {
  const size_t per_expert = sizeof(int) * static_cast<size_t>(arrays);
  const size_t smem = per_expert * static_cast<size_t>(num_experts);
  if (smem + reserved > kMaxDynamicSmem) {
    throw std::invalid_argument(std::string("omniep: ") + what + ": at most " +
                                std::to_string((kMaxDynamicSmem - reserved) / per_expert) + " experts");
  }
  return smem;
}

inline size_t checked_smem(const LayoutArgs& a) {
  return per_expert_smem(a.num_experts, "layout", 1, kLayoutStaticSmem);
}

inline size_t checked_smem(const DispatchArgs& a) {
  if (a.row_bytes < 0 || a.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
  if (a.route.on) {
    if (!a.with_routing) throw std::invalid_argument("omniep: a dispatch that routes itself moves the routing");
    if (a.route.index_bytes != 4 && a.route.index_bytes != 8) {
      throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
    }
    // delivered pairs, the layout's counts
    return per_expert_smem(a.num_experts, "dispatch", /*arrays=*/2, kDispatchStaticSmem);
  }
  return a.with_routing ? per_expert_smem(a.num_experts, "dispatch", 1, kDispatchStaticSmem) : 0;
}

inline size_t no_smem_if_rows_ok(int hidden, int num_bias) {  // combine-like kernels use static smem only
  if (hidden < 0) throw std::invalid_argument("omniep: negative hidden size");
  if (num_bias < 0 || num_bias > 2) throw std::invalid_argument("omniep: num_bias must be 0, 1 or 2");
  return 0;
}

inline size_t checked_smem(const CombineArgs& a) { return no_smem_if_rows_ok(a.hidden, a.num_bias); }

inline size_t checked_smem(const EMLayoutArgs& a) {
  if (a.expert_alignment < 1) throw std::invalid_argument("omniep: expert_alignment must be >= 1");
  return per_expert_smem(a.num_experts, "expert-major layout");
}

inline size_t checked_smem(const EMDispatchArgs& a) {
  if (a.row_bytes < 0 || a.row2_bytes < 0) throw std::invalid_argument("omniep: negative row size");
  if (!a.route.on) return 0;
  if (a.route.expert_alignment < 1) throw std::invalid_argument("omniep: expert_alignment must be >= 1");
  return per_expert_smem(a.num_experts, "expert-major dispatch", /*arrays=*/2,  // the routing front's two
                         kEMDispatchStaticSmem);
}

inline size_t checked_smem(const EMCombineArgs& a) { return no_smem_if_rows_ok(a.hidden, a.num_bias); }

inline size_t checked_smem(const EMCombineBwdArgs& a) { return no_smem_if_rows_ok(a.hidden, 0); }

// The dynamic shared memory the runtime grants `kernel` (asked once, `bytes`; 0 where the GPU has not the room).
inline size_t granted_smem(std::map<const void*, size_t>& granted, const void* kernel, size_t bytes) {
#if defined(OMNIEP_CUDA)
  auto it = granted.find(kernel);
  if (it == granted.end()) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky) a GPU without the room: the register path
      bytes = 0;
    }
    it = granted.emplace(kernel, bytes).first;
  }
  return it->second;
#else
  (void)granted;
  (void)kernel;
  (void)bytes;
  return 0;
#endif
}

// The dynamic shared memory a combine launch of `kernel` takes: the bulk path's ring (combine.cuh) for the
// 16-byte-pack instances on CUDA where the GPU grants it (sm_90: up to 227 KB a block) and a launched rank has
// more tokens than the launch's warps — the only case the kernel takes that path, and a launch that asks for
// 192 KB for nothing still pays for it (the SMs' L1 / shared split is set per launch); else none, and the
// kernel sums from registers (it checks what it was given). The grant is asked of the runtime once per
// kernel: `granted` is the launcher's (a launcher serves one device, and the grant is the device's).
// `most_tokens`: the largest token count of the launched ranks; `blocks_for(smem)`: the launch's blocks per
// rank with that much shared memory.
template <typename BlocksFor>
size_t combine_ring_smem(std::map<const void*, size_t>& granted, const void* kernel, bool vec, int most_tokens,
                         BlocksFor&& blocks_for) {
#if defined(OMNIEP_CUDA)
  if (!vec) return 0;
  const size_t bytes = granted_smem(granted, kernel, kCombineRingBytes);
  return bytes > 0 && most_tokens > blocks_for(bytes) * (kCombineThreads / gpu::kWarpSize) ? bytes : 0;
#else
  (void)granted;
  (void)kernel;
  (void)vec;
  (void)most_tokens;
  (void)blocks_for;
  return 0;
#endif
}

// The dynamic shared memory of an expert-major combine launch: the push sums' stages (em_combine.cuh) for a
// 16-byte-pack instance on CUDA that may push (push buffers given; whether it does, the dispatch decided on the
// device), where the GPU grants them; else none, and the kernel sums from registers (it checks what it got).
inline size_t em_sum_smem(std::map<const void*, size_t>& granted, const void* kernel, bool vec, bool may_push) {
  return vec && may_push ? granted_smem(granted, kernel, kEMSumSmemBytes) : 0;
}

// The dynamic shared memory of an expert-major dispatch launch: the routing front's arrays (`route_smem`), or,
// where the kernel fills separate results whose rows fit a stage in 16-byte units, the results copy's bulk stages
// (em_dispatch.cuh em_dispatch_results) where the GPU grants them — whichever is larger (the stages reuse the
// front's arrays once it is done).
inline size_t em_dispatch_smem(std::map<const void*, size_t>& granted, const void* kernel, const EMDispatchArgs& a,
                               int rank, size_t route_smem) {
#if defined(OMNIEP_CUDA)
  // (the send half of a hook copies no results: no stages, which would also cost its pushes the L1 / shared split)
  const bool fits = a.phase != kEMSend && a.out_x.p[rank] != nullptr && em_results_fit_stage(a);
  const size_t stages = fits ? granted_smem(granted, kernel, kEMResultsSmemBytes) : 0;
  return stages > route_smem ? stages : route_smem;
#else
  (void)granted;
  (void)kernel;
  (void)a;
  (void)rank;
  return route_smem;
#endif
}

// The largest token count of the launched ranks [first, first + count).
template <typename Args>
int most_tokens(const Args& a, int first, int count) {
  int most = 0;
  for (int r = first < 0 ? 0 : first; r < first + count && r < kMaxRanks; ++r) {
    most = a.num_tokens[r] > most ? a.num_tokens[r] : most;
  }
  return most;
}

// ---- kernel instances ----
// The layout kernel for the routing's index type (LayoutArgs::index_bytes).
template <typename Tr>
auto layout_kernel_for(int index_bytes) {
  if (index_bytes == 4) return layout_kernel<Tr, int32_t>;
  if (index_bytes != 8) throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
  return layout_kernel<Tr, int64_t>;
}

// The expert-major dispatch kernel for its routing front's index type (int32 without the front).
template <typename Tr>
auto em_dispatch_kernel_for(const EMDispatchArgs& a) {
  if (!a.route.on || a.route.index_bytes == 4) return em::dispatch_kernel<Tr, int32_t>;
  if (a.route.index_bytes != 8) throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
  return em::dispatch_kernel<Tr, int64_t>;
}

// Kernel templates over (Transport, element type, elements per pack) as class templates, so that
// typed_kernel (and kernels/instantiate_all.cu) can take them as template template arguments.
template <typename Tr, typename S, int V>
struct CombineK {
  static constexpr auto fn = combine_kernel<Tr, S, V>;
};
template <typename Tr, typename S, int V>
struct EMCombineK {
  static constexpr auto fn = em::combine_kernel<Tr, S, V>;
};
template <typename Tr, typename S, int V>
struct EMCombineBwdK {
  static constexpr auto fn = em::combine_bwd_kernel<Tr, S, V>;
};

// The instance of K for `dtype` (args.h DType): 16-byte packs if `vec`, one element per lane otherwise.
template <template <typename, typename, int> class K, typename Tr>
auto typed_kernel(int dtype, bool vec, const char* what) {
  if (dtype == kBFloat16) return vec ? K<Tr, gpu::bfloat16, 8>::fn : K<Tr, gpu::bfloat16, 1>::fn;
  if (dtype == kFloat16) return vec ? K<Tr, gpu::float16, 8>::fn : K<Tr, gpu::float16, 1>::fn;
  if (dtype != kFloat32) {
    throw std::invalid_argument(std::string("omniep: ") + what + " dtype must be float32, bfloat16 or float16");
  }
  return vec ? K<Tr, float, 4>::fn : K<Tr, float, 1>::fn;
}

// ---- 16-byte packs and copy units ----
// Launches cover ranks [first, first + count) of a group of num_ranks: their own buffers are
// entries [first, first + count) of a table, the symmetric ones every entry (one-rank transports
// that fill only their own entry leave the others null, which passes every test).
inline bool rows16(int hidden, int dtype) { return (static_cast<int64_t>(hidden) * dtype_size(dtype)) % 16 == 0; }

// (Entries outside the table are skipped: the launchers reject such a rank range before launching.)
template <typename T>
bool all_aligned16(const PerRank<T>& table, int first, int count) {
  for (int r = first < 0 ? 0 : first; r < first + count && r < kMaxRanks; ++r) {
    if (reinterpret_cast<uintptr_t>(table.p[r]) % 16 != 0) return false;
  }
  return true;
}

// combine / em_combine: 16-byte packs when every rank's y rows, and the launched ranks' out rows and own
// rows (read from the caller's y, own_y, when given), start 16-byte aligned.
template <typename CombineLike>
bool vec16(const CombineLike& a, int first, int count, int num_ranks) {
  return rows16(a.hidden, a.dtype) && all_aligned16(a.y, 0, num_ranks) && all_aligned16(a.out, first, count) &&
         all_aligned16(a.own_y, first, count);
}

inline bool vec16(const EMCombineBwdArgs& a, int first, int count, int num_ranks) {
  return rows16(a.hidden, a.dtype) && all_aligned16(a.g_y, 0, num_ranks) && all_aligned16(a.y, 0, num_ranks) &&
         all_aligned16(a.g_out, first, count) && all_aligned16(a.own_y, first, count) &&
         all_aligned16(a.out_g_y, first, count);
}

// dispatch / em_dispatch: the widest copy unit suiting the launched ranks' source rows and every
// rank's receive rows (args.h row_copy_unit), for the rows and for the second payload.
// Rank-major dispatch also stores the launched ranks' own rows to own_x / own_x2, expert-major dispatch
// its results to out_x / out_x2 (when given).
template <typename DispatchLike>
void set_copy_units(DispatchLike& a, int first, int count, int num_ranks) {
  auto unit = [&](int64_t bytes, const auto& src, const auto& dst, const auto* own) {
    uintptr_t addrs[3 * kMaxRanks];
    int n = 0;
    for (int r = first; r < first + count; ++r) addrs[n++] = reinterpret_cast<uintptr_t>(src.p[r]);
    for (int r = 0; r < num_ranks; ++r) addrs[n++] = reinterpret_cast<uintptr_t>(dst.p[r]);
    for (int r = first; own != nullptr && r < first + count; ++r) addrs[n++] = reinterpret_cast<uintptr_t>(own->p[r]);
    return row_copy_unit(bytes, addrs, n);
  };
  if constexpr (std::is_same_v<DispatchLike, DispatchArgs>) {
    a.unit = unit(a.row_bytes, a.x, a.recv_x, &a.own_x);
    a.unit2 = unit(a.row2_bytes, a.x2, a.recv_x2, &a.own_x2);
  } else {
    a.unit = unit(a.row_bytes, a.x, a.recv_x, &a.out_x);
    a.unit2 = unit(a.row2_bytes, a.x2, a.recv_x2, &a.out_x2);
  }
}

}  // namespace omniep
