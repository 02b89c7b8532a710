// The exported XLA FFI handlers of the native JAX backends (defined by ffi/jax_ops.h's
// OMNIEP_JAX_HANDLERS), eleven per backend under a name prefix (six rank-major, five expert-major):
//   omniep_jax_*       cuda_nvshmem (IpcRank: CUDA IPC peers one process per GPU, or peer access in one
//                      process driving every local GPU), omniep._native_jax
//   omniep_nccl_jax_*  nccl_ep (NcclRank: NCCL windows; one process per GPU or one for all), omniep._native_nccl
// Every handler takes the attribute `state` (a JaxGroup<rank type>, ffi/jax_group.h), runs on XLA's
// stream for the rank of the device it runs on, with no host synchronisation. Registered from Python
// with jax.ffi.register_ffi_target (platform "CUDA") under the names of OMNIEP_JAX_HANDLER_TABLE.
//
// Operands (all int32 unless said):
// prepare:       topk_idx[T, K] s32/s64 -> topk_idx32[T, K], send_pos[T, R], num_tokens_per_rank[R],
//                num_tokens_per_expert[E], recv_counts[R], send_offset[R], num_recv[], dropped[].
//                Attrs: state, num_experts, capacity.
// dispatch:      x[T, H], x2[T, H2] (f32 scales; H2 = 0 for none), topk_idx32, topk_weights[T, K] f32,
//                send_pos, send_offset, recv_counts, num_recv -> recv_x[C, H], recv_x2[C, H2], recv_topk_idx[C, K],
//                recv_topk_weights[C, K], num_recv_tokens_per_expert[L]. Attrs: state, num_experts,
//                expert_alignment.
// routed_dispatch: prepare + dispatch as one launch (the dispatch kernel routes itself; a capacity is
//                needed): x, x2, topk_idx[T, K] s32/s64, topk_weights -> the eight prepare outputs, then the
//                five dispatch outputs and status. Attrs: state, num_experts, capacity, expert_alignment.
// dispatch_rows: rows only (combine_bwd: a cached dispatch of g_out): x[T, H], send_pos, send_offset,
//                recv_counts, num_recv -> recv_x[C, H] (padding rows 0). Attrs: state, num_experts.
// combine:       y[C, H], topk_idx32, send_pos, send_offset, recv_counts, biases... ([T, H] each, 0-2)
//                -> out[T, H]. Attrs: state, num_experts.
// dispatch_bwd:  g_recv_x[C, H], g_recv_topk_weights[C, K] f32, topk_idx32, send_pos, send_offset,
//                recv_counts -> g_x[T, H], g_topk_weights[T, K] f32. Attrs: state, num_experts.
// (recv_counts: prepare's [R]; entry [me] with send_offset[me] bounds my own rows, which the kernels
// move directly instead of through the symmetric buffer.)
// Expert-major (recv_x[L, C, H], C = the static capacity; kernels/em_*.cuh):
// em_prepare:    topk_idx -> the eight prepare outputs (capacity unbounded), then copy_slot[T, K],
//                recv_expert_count[L], num_recv_tokens_per_expert[L], num_recv[], dropped[],
//                max_expert_count[]. Attrs: state, num_experts, capacity, expert_alignment.
// em_dispatch:   x, x2 (f32 scales, H2 = 0 for none), topk_idx32, topk_weights f32, copy_slot,
//                recv_expert_count -> recv_x[L, C, H], recv_x2[L, C, H2], recv_topk_idx[L, C],
//                recv_topk_weights[L, C]. Attrs: state, num_experts.
// em_combine:    y[L, C, H], topk_idx32, topk_weights, copy_slot, biases... -> out[T, H].
// em_dispatch_bwd: g_recv_x[L, C, H], g_recv_topk_weights[L, C] f32, topk_idx32, copy_slot
//                -> g_x[T, H], g_topk_weights[T, K] f32.
// em_combine_bwd: g_out[T, H], y[L, C, H], topk_idx32, topk_weights, copy_slot, recv_expert_count
//                -> g_y[L, C, H], g_topk_weights[T, K] f32 (<g_out[t], y[copy]>). Attrs: state,
//                num_experts, zero_padding (nonzero: g_y's padding slots zeroed; 0: unwritten).
#pragma once

#include "xla/ffi/api/c_api.h"

#define OMNIEP_DECLARE_JAX_HANDLERS(prefix)                            \
  extern "C" {                                                         \
  XLA_FFI_Error* prefix##_prepare(XLA_FFI_CallFrame* call_frame);      \
  XLA_FFI_Error* prefix##_dispatch(XLA_FFI_CallFrame* call_frame);     \
  XLA_FFI_Error* prefix##_routed_dispatch(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_Error* prefix##_dispatch_rows(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_Error* prefix##_combine(XLA_FFI_CallFrame* call_frame);      \
  XLA_FFI_Error* prefix##_dispatch_bwd(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_Error* prefix##_em_prepare(XLA_FFI_CallFrame* call_frame);   \
  XLA_FFI_Error* prefix##_em_dispatch(XLA_FFI_CallFrame* call_frame);  \
  XLA_FFI_Error* prefix##_em_combine(XLA_FFI_CallFrame* call_frame);   \
  XLA_FFI_Error* prefix##_em_dispatch_bwd(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_Error* prefix##_em_combine_bwd(XLA_FFI_CallFrame* call_frame); \
  }

// {name, function} of the eleven handlers under `prefix`, as an initializer list.
#define OMNIEP_JAX_HANDLER_TABLE(prefix)                                                          \
  {                                                                                               \
    {#prefix "_prepare", &prefix##_prepare}, {#prefix "_dispatch", &prefix##_dispatch},           \
        {#prefix "_routed_dispatch", &prefix##_routed_dispatch},                                  \
        {#prefix "_dispatch_rows", &prefix##_dispatch_rows}, {#prefix "_combine", &prefix##_combine}, \
        {#prefix "_dispatch_bwd", &prefix##_dispatch_bwd},                                        \
        {#prefix "_em_prepare", &prefix##_em_prepare}, {#prefix "_em_dispatch", &prefix##_em_dispatch}, \
        {#prefix "_em_combine", &prefix##_em_combine},                                            \
        {#prefix "_em_dispatch_bwd", &prefix##_em_dispatch_bwd},                                  \
        {#prefix "_em_combine_bwd", &prefix##_em_combine_bwd},                                    \
  }

OMNIEP_DECLARE_JAX_HANDLERS(omniep_jax)
OMNIEP_DECLARE_JAX_HANDLERS(omniep_nccl_jax)
