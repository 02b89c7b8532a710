// nccl_ep_lib's device side: tagging the rows it hands to NCCL EP, and mapping the slots NCCL EP
// fills to omniep's contract order and back (the mapping is nccl_ep_lib_order.h's, documented there).
// Kernels are small and memory-bound: a warp per row (or per order key), 16-byte copies where the row
// allows. Nothing here waits on the host; every launch is on the op's stream.
#include <cub/device/device_scan.cuh>

#include "backends/nccl_ep_lib.h"
#include "backends/nccl_ep_lib_order.h"
#include "omniep/gpu.h"

namespace omniep::nccl_ep_lib {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

int blocks_for(int64_t items, int per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > (1 << 16) ? (1 << 16) : b));  // grid-stride loops cover the rest
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw CallError(std::string("nccl_ep_lib: launching ") + what + ": " + cudaGetErrorString(err));
}

// n bytes from src to dst by the lanes of one warp, in the widest unit both ends and n allow.
__device__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t n, int lane) {
  const auto align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n);
  if (align % 16 == 0) {
    for (int64_t i = lane; i < n / 16; i += 32) reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else if (align % 4 == 0) {
    for (int64_t i = lane; i < n / 4; i += 32) reinterpret_cast<int32_t*>(dst)[i] = reinterpret_cast<const int32_t*>(src)[i];
  } else {
    for (int64_t i = lane; i < n; i += 32) dst[i] = src[i];
  }
}

__device__ void warp_zero(uint8_t* dst, int64_t n, int lane) {
  if ((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(n)) % 4 == 0) {
    for (int64_t i = lane; i < n / 4; i += 32) reinterpret_cast<int32_t*>(dst)[i] = 0;
  } else {
    for (int64_t i = lane; i < n; i += 32) dst[i] = 0;
  }
}

__device__ float load_as_float(const uint8_t* row, int64_t i, int dtype) {
  if (dtype == static_cast<int>(DType::kFloat32)) return reinterpret_cast<const float*>(row)[i];
  if (dtype == static_cast<int>(DType::kFloat16)) return __half2float(reinterpret_cast<const __half*>(row)[i]);
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[i]);
}

__device__ void store_rounded(uint8_t* row, int64_t i, float v, int dtype) {
  if (dtype == static_cast<int>(DType::kFloat32)) {
    reinterpret_cast<float*>(row)[i] = v;
  } else if (dtype == static_cast<int>(DType::kFloat16)) {
    reinterpret_cast<__half*>(row)[i] = __float2half_rn(v);
  } else {
    reinterpret_cast<__nv_bfloat16*>(row)[i] = __float2bfloat16_rn(v);
  }
}

__device__ int warp_global() { return static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32); }
__device__ int warp_count() { return static_cast<int>(gridDim.x * blockDim.x / 32); }

// ---- send side ----------------------------------------------------------------------------------

__global__ void stage_rows_kernel(const uint8_t* x, int64_t num_tokens, int64_t payload, int64_t row, int64_t tag_at,
                                  const int32_t* ids, const float* weights, int K, bool em, int rank, uint8_t* staged) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t t = warp_global(); t < num_tokens; t += warp_count()) {
    uint8_t* dst = staged + t * row;
    warp_copy(dst, x + t * payload, payload, lane);
    warp_zero(dst + payload, row - payload, lane);  // pad and tag area: deterministic bytes on the wire
    __syncwarp();
    if (lane == 0) {
      const int32_t* row_ids = em ? ids + t * K : nullptr;
      const int32_t* row_w = em ? reinterpret_cast<const int32_t*>(weights + t * K) : nullptr;
      write_tag(reinterpret_cast<int32_t*>(dst + tag_at), rank, static_cast<int32_t>(t), row_ids, row_w, K, em);
    }
  }
}

// ---- receive side: the order ---------------------------------------------------------------------

__global__ void mark_kernel(const uint8_t* recv, int64_t row, int64_t tag_at, const int32_t* counts, int groups,
                            int64_t slots, int num_ranks, int64_t max_tokens, int32_t* flags, int32_t* slot_of,
                            int32_t* bad_tag) {
  const int64_t n = static_cast<int64_t>(groups) * slots;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int g = static_cast<int>(i / slots);
    const int64_t s = i % slots;
    const int64_t filled = counts[g] < slots ? counts[g] : slots;
    if (s >= filled) continue;
    const auto* tag = reinterpret_cast<const int32_t*>(recv + i * row + tag_at);
    const int64_t keys = static_cast<int64_t>(num_ranks) * max_tokens;
    if (!mark_slot(tag, static_cast<int32_t>(s), num_ranks, max_tokens, flags + g * keys, slot_of + g * keys)) {
      atomicAdd(bad_tag, 1);
    }
  }
}

__global__ void gather_kernel(GatherArgs a, bool em, DispatchOut out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens;  // per group
  const int groups = em ? a.num_local_experts : 1;
  const int K = a.num_topk;
  auto* recv_x = static_cast<uint8_t*>(out.recv_x);
  for (int64_t i = warp_global(); i < groups * keys; i += warp_count()) {
    if (a.flags[i] == 0) continue;
    const int g = static_cast<int>(i / keys);
    const int64_t p = a.pos[i] - a.pos[g * keys];  // position among this group's rows: the contract order
    if (p >= a.capacity) continue;                   // dropped: the last rows in contract order
    const int64_t s = a.slot_of[i];
    const uint8_t* src = static_cast<const uint8_t*>(a.recv) + (g * a.slots_per_group + s) * a.row_bytes;
    const auto* tag = reinterpret_cast<const int32_t*>(src + a.tag_offset);
    uint8_t* dst = recv_x + (g * a.capacity + p) * a.payload_bytes;
    if (a.scale_weights != nullptr) {
      // Expert-major combine_bwd: g_y[e, c] = round(w[t, k] * g_out[t]), the product in fp32.
      const int k = copy_k(tag, K, a.rank * a.num_local_experts + g);
      const float w = k >= 0 ? __int_as_float(tag[2 + K + k]) : 0.0f;
      const int elt = a.dtype == static_cast<int>(DType::kFloat32) ? 4 : 2;
      for (int64_t j = lane; j < a.payload_bytes / elt; j += 32) {
        store_rounded(dst, j, __fmul_rn(w, load_as_float(src, j, a.dtype)), a.dtype);
      }
    } else {
      warp_copy(dst, src, a.payload_bytes, lane);
    }
    if (lane != 0 || out.recv_topk_idx == nullptr) continue;
    if (em) {
      const int k = copy_k(tag, K, a.rank * a.num_local_experts + g);
      out.recv_topk_idx[g * a.capacity + p] = g;
      out.recv_topk_weights[g * a.capacity + p] = k >= 0 ? __int_as_float(tag[2 + K + k]) : 0.0f;
    } else {
      for (int k = 0; k < K; ++k) {
        const int64_t id = a.slot_ids[s * K + k];
        const bool local = id >= 0 && id < a.num_local_experts;
        out.recv_topk_idx[p * K + k] = local ? static_cast<int32_t>(id) : -1;
        out.recv_topk_weights[p * K + k] = local ? a.slot_weights[s * K + k] : 0.0f;
      }
    }
  }
}

// Rank-major: rows at or past the kept count are padding (zeros, -1, 0); kept rows count per expert.
__global__ void finish_rank_major_kernel(GatherArgs a, DispatchOut out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens;
  const int64_t total = a.pos[keys];
  const int64_t kept = total < a.capacity ? total : a.capacity;
  const int K = a.num_topk;
  for (int64_t p = warp_global(); p < a.capacity; p += warp_count()) {
    if (p >= kept) {
      warp_zero(static_cast<uint8_t*>(out.recv_x) + p * a.payload_bytes, a.payload_bytes, lane);
      for (int k = lane; out.recv_topk_idx != nullptr && k < K; k += 32) {  // K may pass 32 (HT)
        out.recv_topk_idx[p * K + k] = -1;
        out.recv_topk_weights[p * K + k] = 0.0f;
      }
    } else if (out.num_recv_tokens_per_expert != nullptr) {
      for (int k = lane; k < K; k += 32) {
        const int32_t id = out.recv_topk_idx[p * K + k];
        if (id >= 0) atomicAdd(&out.num_recv_tokens_per_expert[id], 1);
      }
    }
  }
}

__global__ void scalars_rank_major_kernel(GatherArgs a, DispatchOut out) {
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens;
  const int64_t total = a.pos[keys];
  const int64_t kept = total < a.capacity ? total : a.capacity;
  const int t = static_cast<int>(threadIdx.x);
  if (t == 0) {
    *out.num_recv = static_cast<int32_t>(kept);
    *out.dropped = static_cast<int32_t>(total - kept);
  }
  for (int r = t; r < a.num_ranks; r += blockDim.x) {
    if (out.recv_counts != nullptr) out.recv_counts[r] = a.pos[(r + 1) * a.max_tokens] - a.pos[r * a.max_tokens];
  }
  for (int e = t; e < a.num_local_experts; e += blockDim.x) {
    const int32_t n = out.num_recv_tokens_per_expert[e];
    out.num_recv_tokens_per_expert[e] = (n + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
  }
}

// Expert-major: per expert, copies kept = min(count, capacity); slots past it are padding (index -1,
// weight 0; rows zeroed only for a cached dispatch, whose padding the contract fixes at 0).
__global__ void finish_expert_major_kernel(GatherArgs a, bool zero_rows, DispatchOut out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens;
  const int64_t n = static_cast<int64_t>(a.num_local_experts) * a.capacity;
  for (int64_t i = warp_global(); i < n; i += warp_count()) {
    const int e = static_cast<int>(i / a.capacity);
    const int64_t c = i % a.capacity;
    const int64_t count = a.pos[(e + 1) * keys] - a.pos[e * keys];
    if (c < count) continue;
    if (zero_rows) warp_zero(static_cast<uint8_t*>(out.recv_x) + i * a.payload_bytes, a.payload_bytes, lane);
    if (lane == 0 && out.recv_topk_idx != nullptr) {
      out.recv_topk_idx[i] = -1;
      out.recv_topk_weights[i] = 0.0f;
    }
  }
}

__global__ void scalars_expert_major_kernel(GatherArgs a, DispatchOut out) {
  __shared__ int64_t kept_sum, dropped_sum;
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens;
  if (threadIdx.x == 0) kept_sum = dropped_sum = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < a.num_local_experts; e += blockDim.x) {
    const int64_t count = a.pos[(e + 1) * keys] - a.pos[e * keys];
    const int64_t kept = count < a.capacity ? count : a.capacity;
    out.num_recv_tokens_per_expert[e] =
        static_cast<int32_t>((kept + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment);
    atomicAdd(reinterpret_cast<unsigned long long*>(&kept_sum), static_cast<unsigned long long>(kept));
    atomicAdd(reinterpret_cast<unsigned long long*>(&dropped_sum), static_cast<unsigned long long>(count - kept));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *out.num_recv = static_cast<int32_t>(kept_sum);
    *out.dropped = static_cast<int32_t>(dropped_sum);
  }
}

// ---- combine side ---------------------------------------------------------------------------------

__global__ void scatter_kernel(ScatterArgs a) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int K = a.num_topk;
  for (int64_t i = warp_global(); i < a.groups * a.keys_per_group; i += warp_count()) {
    if (a.flags[i] == 0) continue;
    const int g = static_cast<int>(i / a.keys_per_group);
    const int64_t p = a.pos[i] - a.pos[g * a.keys_per_group];
    const int64_t s = a.slot_of[i];
    uint8_t* dst = static_cast<uint8_t*>(a.dst) + (g * a.slots_per_group + s) * a.row_bytes;
    const bool kept = p < a.capacity;
    if (kept) {
      warp_copy(dst, static_cast<const uint8_t*>(a.rows) + (g * a.capacity + p) * a.payload_bytes, a.payload_bytes, lane);
      warp_zero(dst + a.payload_bytes, a.row_bytes - a.payload_bytes, lane);
    } else {
      warp_zero(dst, a.row_bytes, lane);  // a dropped row adds nothing
    }
    for (int k = lane; a.dst_weights != nullptr && k < K; k += 32) {  // K may pass 32 (HT)
      // Only the entries of this rank's experts carry a gradient back (DESIGN §2: read back from the
      // slot that carried it); the others are zero so that a sum over ranks leaves the owner's value.
      const bool local = kept && a.recv_topk_idx[p * K + k] >= 0;
      a.dst_weights[s * K + k] = local ? a.rows_weights[p * K + k] : 0.0f;
    }
  }
}

__global__ void unstage_rows_kernel(const uint8_t* staged, int64_t num_tokens, int64_t row, int64_t payload,
                                    uint8_t* out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t t = warp_global(); t < num_tokens; t += warp_count()) {
    warp_copy(out + t * payload, staged + t * row, payload, lane);
  }
}

__global__ void fill_kernel(float* dst, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

void launch_stage_rows(const void* x, int64_t num_tokens, int64_t payload_bytes, int64_t row_bytes, int64_t tag_offset,
                       const int32_t* ids, const float* weights, int num_topk, bool expert_major, int rank,
                       void* staged, cudaStream_t stream) {
  if (num_tokens == 0) return;
  stage_rows_kernel<<<blocks_for(num_tokens, kWarpsPerBlock), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(x), num_tokens, payload_bytes, row_bytes, tag_offset, ids, weights, num_topk,
      expert_major, rank, static_cast<uint8_t*>(staged));
  check_launch("stage_rows");
}

void launch_mark(const void* recv, int64_t row_bytes, int64_t tag_offset, const int32_t* counts, int groups,
                 int64_t slots_per_group, int num_ranks, int64_t max_tokens, int32_t* flags, int32_t* slot_of,
                 int32_t* bad_tag, cudaStream_t stream) {
  mark_kernel<<<blocks_for(groups * slots_per_group, kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(recv), row_bytes, tag_offset, counts, groups, slots_per_group, num_ranks, max_tokens,
      flags, slot_of, bad_tag);
  check_launch("mark");
}

size_t exclusive_scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                n);
  return bytes;
}

void launch_exclusive_scan(const int32_t* flags, int32_t* pos, int64_t n, void* temp, size_t temp_bytes,
                           cudaStream_t stream) {
  const cudaError_t err = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, flags, pos, n, stream);
  if (err != cudaSuccess) throw CallError(std::string("nccl_ep_lib: prefix sum: ") + cudaGetErrorString(err));
}

void launch_gather(const GatherArgs& a, bool expert_major, const DispatchOut& out, cudaStream_t stream) {
  const int64_t keys = static_cast<int64_t>(a.num_ranks) * a.max_tokens * (expert_major ? a.num_local_experts : 1);
  const bool cached = out.recv_topk_idx == nullptr;
  if (!cached && out.num_recv_tokens_per_expert != nullptr && !expert_major) {
    const cudaError_t err =
        cudaMemsetAsync(out.num_recv_tokens_per_expert, 0, sizeof(int32_t) * a.num_local_experts, stream);
    if (err != cudaSuccess) throw CallError(std::string("nccl_ep_lib: clearing counts: ") + cudaGetErrorString(err));
  }
  gather_kernel<<<blocks_for(keys, kWarpsPerBlock), kThreads, 0, stream>>>(a, expert_major, out);
  check_launch("gather");
  if (expert_major) {
    finish_expert_major_kernel<<<blocks_for(a.num_local_experts * a.capacity, kWarpsPerBlock), kThreads, 0, stream>>>(
        a, cached, out);
    check_launch("finish (expert-major)");
    if (!cached) {
      scalars_expert_major_kernel<<<1, kThreads, 0, stream>>>(a, out);
      check_launch("counts (expert-major)");
    }
    return;
  }
  finish_rank_major_kernel<<<blocks_for(a.capacity, kWarpsPerBlock), kThreads, 0, stream>>>(a, out);
  check_launch("finish (rank-major)");
  if (!cached) {
    scalars_rank_major_kernel<<<1, kThreads, 0, stream>>>(a, out);
    check_launch("counts (rank-major)");
  }
}

void launch_scatter(const ScatterArgs& a, cudaStream_t stream) {
  scatter_kernel<<<blocks_for(a.groups * a.keys_per_group, kWarpsPerBlock), kThreads, 0, stream>>>(a);
  check_launch("scatter");
}

void launch_unstage_rows(const void* staged, int64_t num_tokens, int64_t row_bytes, int64_t payload_bytes, void* out,
                         cudaStream_t stream) {
  if (num_tokens == 0) return;
  unstage_rows_kernel<<<blocks_for(num_tokens, kWarpsPerBlock), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(staged), num_tokens, row_bytes, payload_bytes, static_cast<uint8_t*>(out));
  check_launch("unstage_rows");
}

void launch_fill(float* dst, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(dst, n, value);
  check_launch("fill");
}

}  // namespace omniep::nccl_ep_lib
