// The nccl_ep_lib XLA FFI handlers (omniep_nccl_ep_lib_jax_*) and JaxState (ffi/jax_nccl_ep_lib.h):
// each handler translates XLA's buffers into one entry point of the adapter's Handle -- the same ones
// the torch binding (python/module_nccl_ep_lib.cpp) calls -- on XLA's stream.
#include "ffi/jax_nccl_ep_lib.h"

#include <cuda_runtime.h>

#include <exception>
#include <string>
#include <utility>

#include "ffi/jax_ops.h"  // bind, data, as, rows_of, cols_of, check_runtime
#include "xla/ffi/api/ffi.h"

namespace omniep::nccl_ep_lib {

namespace {
constexpr uint64_t kJaxStateMagic = 0x6e63636c65706a78ULL;  // "ncclepjx"
}

JaxState::JaxState(int device) : magic_(kJaxStateMagic), device_(device) {}

JaxState::~JaxState() { magic_ = 0; }

JaxState* JaxState::from_address(int64_t address) {
  auto* p = reinterpret_cast<JaxState*>(static_cast<uintptr_t>(address));
  return (p != nullptr && p->magic_ == kJaxStateMagic) ? p : nullptr;
}

void JaxState::activate() const {
  jax_ffi::check_runtime(cudaSetDevice(device_), "selecting the nccl_ep_lib rank's device");
}

int JaxState::add(std::shared_ptr<Handle> handle) {
  if (retired_) throw ArgumentError("the nccl_ep_lib JAX state was used after destroy()");
  handles_.push_back(std::move(handle));
  return size() - 1;
}

Handle& JaxState::at(int64_t index) const {
  if (retired_) throw ArgumentError("the nccl_ep_lib JAX state was used after destroy()");
  if (index < 0 || index >= size()) {
    throw ArgumentError("handle " + std::to_string(index) + " is not one of the " + std::to_string(size()) +
                        " native handles of this JAX state");
  }
  return *handles_[static_cast<size_t>(index)];
}

void JaxState::destroy() {
  if (retired_) return;
  retired_ = true;
  if (handles_.empty()) return;
  activate();
  jax_ffi::check_runtime(cudaDeviceSynchronize(), "synchronising before the handles are destroyed");
  handles_.clear();
}

OpShape rows_op_shape(int layout, int num_ranks, int num_experts, int64_t num_tokens, int num_topk,
                      const std::vector<int64_t>& rows, int dtype, int expert_alignment) {
  const bool em = layout == 1;
  if (num_ranks <= 0 || num_experts % num_ranks != 0) {
    throw ArgumentError("num_experts=" + std::to_string(num_experts) + " must be a multiple of the " +
                        std::to_string(num_ranks) + " ranks");
  }
  const size_t want = em ? 3 : 2;
  if (rows.size() != want) {
    throw ArgumentError(std::string("the rows must be ") + (em ? "[L, C, H] (expert-major)" : "[C, H] (rank-major)") +
                        ", got " + std::to_string(rows.size()) + " dimensions");
  }
  if (em && rows[0] != num_experts / num_ranks) {
    throw ArgumentError("the rows have " + std::to_string(rows[0]) + " local experts; expected num_experts / "
                        "num_ranks = " + std::to_string(num_experts / num_ranks));
  }
  return make_op_shape(layout, num_ranks, num_experts, num_tokens, rows.back(), num_topk, dtype, rows[want - 2],
                       expert_alignment);
}

}  // namespace omniep::nccl_ep_lib

namespace omniep::nccl_ep_lib::jax_ffi_handlers {

namespace ffi = xla::ffi;
using omniep::jax_ffi::as;
using omniep::jax_ffi::cols_of;
using omniep::jax_ffi::data;
using omniep::jax_ffi::rows_of;

// The adapter's DType code of a row buffer; fp8 and the rest are refused.
int dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return static_cast<int>(DType::kBFloat16);
    case ffi::DataType::F16: return static_cast<int>(DType::kFloat16);
    case ffi::DataType::F32: return static_cast<int>(DType::kFloat32);
    default: throw ArgumentError("nccl_ep_lib moves bfloat16, float16 or float32 rows (fp8 and others are refused)");
  }
}

void need(const ffi::AnyBuffer& b, ffi::DataType t, const char* what) {
  if (b.element_type() != t) {
    throw ArgumentError(std::string(what) + (t == ffi::DataType::S32 ? " must be int32" : " must be float32"));
  }
}

std::vector<int64_t> dims_of(const ffi::AnyBuffer& b) {
  const auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

// The op of a call: the routing idx32 [T, K] (int32), the rows' buffer and dtype.
OpShape op_of(const Handle& h, int64_t layout, int64_t num_experts, const ffi::AnyBuffer& idx32,
              const std::vector<int64_t>& rows, ffi::DataType dtype, int64_t expert_alignment) {
  need(idx32, ffi::DataType::S32, "topk_idx");
  return rows_op_shape(static_cast<int>(layout), h.group().num_ranks(), static_cast<int>(num_experts),
                       rows_of(idx32), static_cast<int>(cols_of(idx32)), rows, dtype_of(dtype),
                       static_cast<int>(expert_alignment));
}

// x / g_out / out [T, H] against the op.
void need_tokens(const ffi::AnyBuffer& b, const OpShape& op, const char* what) {
  const auto d = b.dimensions();
  if (d.size() != 2 || d[0] != op.num_tokens || d[1] != op.hidden) {
    throw ArgumentError(std::string(what) + " must be [T, H] = [" + std::to_string(op.num_tokens) + ", " +
                        std::to_string(op.hidden) + "]");
  }
}

void zero(void* p, size_t bytes, cudaStream_t stream, const char* what) {
  if (bytes) omniep::jax_ffi::check_runtime(cudaMemsetAsync(p, 0, bytes, stream), what);
}

// The handle's dispatch count (modulo 2^24, exact in float32) into a [] f32 output: the dispatch's
// `ticket`, the other ops' `generation` (ffi/jax_nccl_ep_lib.h).
void write_generation(const Handle& h, ffi::Result<ffi::AnyBuffer>& out, cudaStream_t stream) {
  if (out->element_type() != ffi::DataType::F32 || out->element_count() != 1) {
    throw ArgumentError("the generation output must be a float32 scalar");
  }
  launch_fill(as<float>(out), 1, static_cast<float>(h.dispatches() % (int64_t{1} << 24)), stream);
}

// Every handler: the state and handle its attributes name, its device selected, errors as FFI errors.
template <typename F>
ffi::Error guarded(int64_t state, int64_t handle, const char* op, F&& body) {
  JaxState* s = JaxState::from_address(state);
  if (s == nullptr) return ffi::Error::InvalidArgument(std::string(op) + ": `state` is not an nccl_ep_lib JAX state");
  try {
    Handle& h = s->at(handle);
    s->activate();
    body(h);
  } catch (const std::invalid_argument& e) {  // ArgumentError
    return ffi::Error::InvalidArgument(std::string(op) + ": " + e.what());
  } catch (const std::exception& e) {  // LoadError, CallError, CUDA
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Dispatch(cudaStream_t stream, int32_t, ffi::AnyBuffer x, ffi::AnyBuffer idx32, ffi::AnyBuffer weights,
                    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_idx,
                    ffi::Result<ffi::AnyBuffer> recv_w, ffi::Result<ffi::AnyBuffer> num_recv,
                    ffi::Result<ffi::AnyBuffer> dropped, ffi::Result<ffi::AnyBuffer> per_expert,
                    ffi::Result<ffi::AnyBuffer> recv_counts, ffi::Result<ffi::AnyBuffer> status,
                    ffi::Result<ffi::AnyBuffer> ticket, int64_t state, int64_t handle, int64_t layout,
                    int64_t num_experts, int64_t expert_alignment) {
  return guarded(state, handle, "nccl_ep_lib dispatch (JAX)", [&](Handle& h) {
    const OpShape op = op_of(h, layout, num_experts, idx32, dims_of(*recv_x), x.element_type(), expert_alignment);
    need_tokens(x, op, "x");
    need(weights, ffi::DataType::F32, "topk_weights");
    const bool em = op.layout == Layout::kExpertMajor;
    DispatchOut out;
    out.recv_x = data(recv_x);
    out.recv_topk_idx = as<int32_t>(recv_idx);
    out.recv_topk_weights = as<float>(recv_w);
    out.num_recv = as<int32_t>(num_recv);
    out.dropped = as<int32_t>(dropped);
    out.num_recv_tokens_per_expert = as<int32_t>(per_expert);
    out.recv_counts = em ? nullptr : as<int32_t>(recv_counts);
    if (em) zero(data(recv_counts), recv_counts->size_bytes(), stream, "clearing recv_counts");
    h.dispatch(op, data(x), as<const int32_t>(idx32), as<const float>(weights), out, stream);
    zero(data(status), status->size_bytes(), stream, "clearing the status");
    write_generation(h, ticket, stream);
  });
}

ffi::Error CachedDispatch(cudaStream_t stream, int32_t, ffi::AnyBuffer x, ffi::AnyBuffer idx32,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> generation, int64_t state, int64_t handle, int64_t layout,
                          int64_t num_experts) {
  return guarded(state, handle, "nccl_ep_lib cached dispatch (JAX)", [&](Handle& h) {
    const OpShape op = op_of(h, layout, num_experts, idx32, dims_of(*recv_x), x.element_type(), 1);
    need_tokens(x, op, "g_out");
    need(weights, ffi::DataType::F32, "topk_weights");
    const bool em = op.layout == Layout::kExpertMajor;
    h.cached_dispatch(op, data(x), as<const int32_t>(idx32), em ? as<const float>(weights) : nullptr, data(recv_x),
                      stream);
    write_generation(h, generation, stream);
  });
}

ffi::Error Combine(cudaStream_t stream, int32_t, ffi::AnyBuffer y, ffi::AnyBuffer idx32, ffi::AnyBuffer weights,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> status,
                   ffi::Result<ffi::AnyBuffer> generation, int64_t state, int64_t handle, int64_t layout,
                   int64_t num_experts) {
  return guarded(state, handle, "nccl_ep_lib combine (JAX)", [&](Handle& h) {
    const OpShape op = op_of(h, layout, num_experts, idx32, dims_of(y), y.element_type(), 1);
    need_tokens(*out, op, "out");
    need(weights, ffi::DataType::F32, "topk_weights");
    const bool em = op.layout == Layout::kExpertMajor;
    h.combine(op, data(y), em ? as<const float>(weights) : nullptr, data(out), stream);
    zero(data(status), status->size_bytes(), stream, "clearing the status");
    write_generation(h, generation, stream);
  });
}

ffi::Error DispatchBwd(cudaStream_t stream, int32_t, ffi::AnyBuffer g_recv_x, ffi::AnyBuffer g_recv_w,
                       ffi::AnyBuffer recv_idx, ffi::AnyBuffer idx32, ffi::Result<ffi::AnyBuffer> g_x,
                       ffi::Result<ffi::AnyBuffer> g_w, ffi::Result<ffi::AnyBuffer> generation, int64_t state,
                       int64_t handle, int64_t layout, int64_t num_experts) {
  return guarded(state, handle, "nccl_ep_lib dispatch bwd (JAX)", [&](Handle& h) {
    const OpShape op = op_of(h, layout, num_experts, idx32, dims_of(g_recv_x), g_recv_x.element_type(), 1);
    need_tokens(*g_x, op, "g_x");
    if (op.layout == Layout::kExpertMajor) {
      zero(data(g_w), g_w->size_bytes(), stream, "clearing g_topk_weights");
      h.dispatch_bwd(op, data(g_recv_x), nullptr, nullptr, data(g_x), nullptr, stream);
      write_generation(h, generation, stream);
      return;
    }
    need(g_recv_w, ffi::DataType::F32, "g_recv_topk_weights");
    need(recv_idx, ffi::DataType::S32, "recv_topk_idx");
    h.dispatch_bwd(op, data(g_recv_x), as<const float>(g_recv_w), as<const int32_t>(recv_idx), data(g_x),
                   as<float>(g_w), stream);
    write_generation(h, generation, stream);
  });
}

}  // namespace omniep::nccl_ep_lib::jax_ffi_handlers

#define OMNIEP_NCCL_EP_LIB_HANDLER(name, Impl, ...) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, omniep::nccl_ep_lib::jax_ffi_handlers::Impl, (omniep::jax_ffi::__VA_ARGS__))

OMNIEP_NCCL_EP_LIB_HANDLER(omniep_nccl_ep_lib_jax_dispatch, Dispatch,
                           bind<3, 9>("state", "handle", "layout", "num_experts", "expert_alignment"));
OMNIEP_NCCL_EP_LIB_HANDLER(omniep_nccl_ep_lib_jax_cached_dispatch, CachedDispatch,
                           bind<3, 2>("state", "handle", "layout", "num_experts"));
OMNIEP_NCCL_EP_LIB_HANDLER(omniep_nccl_ep_lib_jax_combine, Combine,
                           bind<3, 3>("state", "handle", "layout", "num_experts"));
OMNIEP_NCCL_EP_LIB_HANDLER(omniep_nccl_ep_lib_jax_dispatch_bwd, DispatchBwd,
                           bind<4, 3>("state", "handle", "layout", "num_experts"));
