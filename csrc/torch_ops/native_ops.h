// Shared by the two files of omniep._native_torch (native_ops.cpp: contexts, argument checks and the
// CUDA kernels of the omniep_native::* ops; native_autograd.cpp: their Autograd kernels and the Python
// module). See native_ops.cpp for what the module does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backends/ep_rank.h"

namespace omniep_torch {

using at::Tensor;

struct Context {
  omniep::EpRank* rank;
  int world;
  int device;
  bool sync;              // OMNIEP_CHECKS=sync
  omniep::Status raised;  // the status behind the last exception an op threw (Python reads it)
  bool send_only_next = false;  // the next expert-major dispatch / combine launches its sends only
  // The next dispatch's (expert-major: its kernel adds the kept copies per local expert, [L] int32 on the
  // context's device; any other dispatch only clears it): DeepEP's cumulative_local_expert_recv_stats.
  int32_t* recv_stats_next = nullptr;
};

inline constexpr int kMaxContexts = 4096;
Context& context_of(int64_t id);
// Makes context `id` run its ops on `rank` (kept alive by the caller); nullptr forgets it.
void set_context(int64_t id, Context* c);

// The second half of the context's send_only op `seq` (DeepEP's receive hook), on the current stream;
// false when it is not pending (it ran already: any later op runs it first).
bool receive(int64_t ctx, int64_t seq);

// Host stamps (OMNIEP_HOST_STAMPS=1 when the module loads, or set_host_stamps): µs spent in each named
// step of the ops so far, and how often it ran; `reset` clears them.
struct HostStep {
  std::string name;
  double total_us;
  int64_t count;
};
std::vector<HostStep> host_steps(bool reset);
void set_host_stamps(bool on);

using DispatchOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>>;

// The CUDA kernels of the ops (the schemas: omniep/frontends/torch_ops.py).
// zero_padding (expert-major): the slots past the counts zeroed by the dispatch kernel (DESIGN §2).
DispatchOut dispatch_cuda(const Tensor& x, const std::optional<Tensor>& x_scales, const Tensor& topk_idx,
                          const Tensor& topk_weights, int64_t ctx, int64_t num_experts, int64_t layout,
                          int64_t capacity, int64_t expert_alignment, bool zero_padding);
// dispatch of DeepEP's fp8 cast of x (bf16), done by the expert-major dispatch kernel itself
// (round_scale: the scales rounded up to powers of two).
DispatchOut dispatch_fp8_cuda(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, bool round_scale,
                              int64_t ctx, int64_t num_experts, int64_t layout, int64_t capacity,
                              int64_t expert_alignment, bool zero_padding);
std::tuple<Tensor, Tensor> cached_dispatch_cuda(const Tensor& x, const std::optional<Tensor>& x_scales,
                                                at::TensorList handle, int64_t ctx, int64_t num_experts,
                                                int64_t layout, int64_t capacity, int64_t expert_alignment);
// zero_padding (combine, combine_bwd): the handle's dispatch had zero_padding; combine ignores it (its
// Autograd kernel passes it on to combine_bwd), the expert-major combine_bwd then zeroes g_y's padding.
Tensor combine_cuda(const Tensor& y, const std::optional<Tensor>& topk_weights, const std::optional<Tensor>& bias0,
                    const std::optional<Tensor>& bias1, at::TensorList handle, int64_t ctx, int64_t num_experts,
                    int64_t layout, int64_t capacity, int64_t expert_alignment, bool zero_padding);
std::tuple<Tensor, Tensor> dispatch_bwd_cuda(const Tensor& g_recv_x, const Tensor& g_recv_topk_weights,
                                             at::TensorList handle, int64_t ctx, int64_t num_experts,
                                             int64_t layout, int64_t capacity, int64_t expert_alignment);
std::tuple<Tensor, Tensor> combine_bwd_cuda(const Tensor& g_out, const std::optional<Tensor>& topk_weights,
                                            const std::optional<Tensor>& y, at::TensorList handle, int64_t ctx,
                                            int64_t num_experts, int64_t layout, int64_t capacity,
                                            int64_t expert_alignment, bool zero_padding);

}  // namespace omniep_torch
