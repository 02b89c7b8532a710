// XLA FFI handlers of the cuda_nvshmem JAX backend (one rank per process, CUDA IPC peers).
// Every handler takes the attribute `state` (the address of a JaxRank, see jax_rank.h) and runs on
// XLA's stream, with no host synchronisation. Registered from Python (jax.ffi.register_ffi_target,
// platform "CUDA") under the names omniep/backends/cuda_nvshmem/jax_backend.py uses.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// topk_idx[T, K] s32/s64 -> topk_idx32[T, K], send_pos[T, R], num_tokens_per_rank[R],
// num_tokens_per_expert[E], recv_counts[R], send_offset[R], num_recv[], dropped[] (all s32).
// Attrs: state, num_experts, capacity.
XLA_FFI_Error* omniep_jax_prepare(XLA_FFI_CallFrame* call_frame);
// x[T, H], x2[T, H2] (f32 scales; H2 = 0 for none), topk_idx32, topk_weights[T, K] f32, send_pos,
// send_offset, num_recv -> recv_x[C, H], recv_x2[C, H2], recv_topk_idx[C, K], recv_topk_weights[C, K],
// num_recv_tokens_per_expert[L]. Attrs: state, num_experts, expert_alignment.
XLA_FFI_Error* omniep_jax_dispatch(XLA_FFI_CallFrame* call_frame);
// Rows only (combine_bwd: a cached dispatch of g_out): x[T, H], send_pos, send_offset, num_recv
// -> recv_x[C, H] (padding rows 0). Attrs: state, num_experts.
XLA_FFI_Error* omniep_jax_dispatch_rows(XLA_FFI_CallFrame* call_frame);
// y[C, H], topk_idx32, send_pos, send_offset, biases... ([T, H] each, 0-2) -> out[T, H].
// Attrs: state, num_experts.
XLA_FFI_Error* omniep_jax_combine(XLA_FFI_CallFrame* call_frame);
// g_recv_x[C, H], g_recv_topk_weights[C, K] f32, topk_idx32, send_pos, send_offset
// -> g_x[T, H], g_topk_weights[T, K] f32. Attrs: state, num_experts.
XLA_FFI_Error* omniep_jax_dispatch_bwd(XLA_FFI_CallFrame* call_frame);
}
