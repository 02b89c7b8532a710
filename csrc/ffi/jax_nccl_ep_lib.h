// The nccl_ep_lib JAX side: the XLA FFI handlers over the adapter (backends/nccl_ep_lib.h), exported
// as omniep_nccl_ep_lib_jax_*, and JaxState, the handles of one JAX EP group they run on.
//
// One process per GPU (jax.distributed). Python (omniep/backends/nccl_ep_lib/jax_backend.py) makes the
// communicator, the NCCL EP groups and one native Handle per traced dispatch -- collectively, while
// tracing, which every process does in the same order -- and adds each Handle to the group's JaxState.
// Every handler takes the attributes `state` (JaxState::address()) and `handle` (the index add()
// returned), runs the adapter's entry point for the op on XLA's stream, with no host synchronisation,
// and returns an FFI InvalidArgument error for bad arguments (ArgumentError) and Internal for the rest.
// The adapter's own checks (check_op) run in every entry point; what the buffers' shapes say is
// checked here first (rows_op_shape).
//
// Operands (int32 unless said; layout attribute 0 rank-major, 1 expert-major; L = E / R local experts):
// dispatch:        x[T, H], topk_idx32[T, K], topk_weights[T, K] f32 -> recv_x (rank-major [C, H];
//                  expert-major [L, C, H]), recv_topk_idx / recv_topk_weights f32 (rank-major [C, K];
//                  expert-major [L, C]), num_recv[], dropped[], num_recv_tokens_per_expert[L],
//                  recv_counts[R] (expert-major: zeros), status[kStatusWords] (zeros: the adapter
//                  exchanges no op descriptor), ticket[] f32 (the handle's dispatch count after this one,
//                  Handle::dispatches() modulo 2^24). Attrs: state, handle, layout, num_experts, expert_alignment.
//                  Handle::dispatch: ncclEpUpdateHandle + ncclEpDispatch + the order mapping.
// cached_dispatch: x[T, H], topk_idx32[T, K], topk_weights[T, K] f32 (expert-major: each copy scaled by
//                  its weight; rank-major: not read) -> recv_x, generation[] f32. Attrs: state, handle,
//                  layout, num_experts.
//                  Handle::cached_dispatch (combine_bwd).
// combine:         y (shaped like recv_x), topk_weights[T, K] f32 (expert-major: applied by NCCL EP's LL
//                  combine; rank-major: not read) -> out[T, H], status (zeros), generation[] f32. Attrs: as
//                  cached_dispatch.
// dispatch_bwd:    g_recv_x (like recv_x), g_recv_topk_weights f32 (rank-major [C, K]; expert-major: not
//                  read), recv_topk_idx (rank-major [C, K]; expert-major: not read), topk_idx32[T, K]
//                  -> g_x[T, H], g_topk_weights[T, K] f32 (expert-major: zeros), generation[] f32. Attrs: as
//                  cached_dispatch.
// generation: the handle's dispatch count when the op ran (as `ticket`). A native handle holds the routing
// of its LAST dispatch; Python compares an op's generation with the ticket of the dispatch that made the
// pytree handle and poisons the op's outputs (NaN) where they differ.
// Host-only header.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "backends/nccl_ep_lib.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* omniep_nccl_ep_lib_jax_dispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* omniep_nccl_ep_lib_jax_cached_dispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* omniep_nccl_ep_lib_jax_combine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* omniep_nccl_ep_lib_jax_dispatch_bwd(XLA_FFI_CallFrame* call_frame);
}

// {name, function} of the four handlers, as an initializer list (python/jax_targets.h).
#define OMNIEP_NCCL_EP_LIB_JAX_HANDLER_TABLE                                              \
  {                                                                                       \
    {"omniep_nccl_ep_lib_jax_dispatch", &omniep_nccl_ep_lib_jax_dispatch},                \
        {"omniep_nccl_ep_lib_jax_cached_dispatch", &omniep_nccl_ep_lib_jax_cached_dispatch}, \
        {"omniep_nccl_ep_lib_jax_combine", &omniep_nccl_ep_lib_jax_combine},              \
        {"omniep_nccl_ep_lib_jax_dispatch_bwd", &omniep_nccl_ep_lib_jax_dispatch_bwd},    \
  }

namespace omniep::nccl_ep_lib {

// The native Handles of one JAX EP group in this process, by index. Constructing it touches no GPU.
class JaxState {
 public:
  explicit JaxState(int device);
  ~JaxState();
  JaxState(const JaxState&) = delete;
  JaxState& operator=(const JaxState&) = delete;

  int64_t address() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(this)); }
  // The state behind an FFI `state` attribute, or nullptr when it is not a JaxState.
  static JaxState* from_address(int64_t address);

  int device() const { return device_; }
  void activate() const;  // cudaSetDevice(device)
  int add(std::shared_ptr<Handle> handle);  // its index, the handlers' `handle` attribute
  // Handle `index`; ArgumentError after destroy() or for an index add() never returned.
  Handle& at(int64_t index) const;
  int size() const { return static_cast<int>(handles_.size()); }
  bool alive() const { return !retired_; }
  // Collective (ncclEpHandleDestroy): synchronise the device, drop every handle; the object stays, so
  // that an executable that still names it gets an FFI error.
  void destroy();

 private:
  uint64_t magic_;
  int device_;
  bool retired_ = false;
  std::vector<std::shared_ptr<Handle>> handles_;
};

// The op an FFI call describes, from its buffers: the routing [T, K] and the rows (recv_x, y or
// g_recv_x: rank-major [C, H], expert-major [L, C, H] with L = num_experts / num_ranks); ArgumentError
// for a shape that fits neither. Host code: the CPU tests call it through the module.
OpShape rows_op_shape(int layout, int num_ranks, int num_experts, int64_t num_tokens, int num_topk,
                      const std::vector<int64_t>& rows, int dtype, int expert_alignment);

}  // namespace omniep::nccl_ep_lib
