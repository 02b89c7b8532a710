// The XLA FFI handlers of the native JAX backends, written once for any rank type G (IpcRank for
// cuda_nvshmem, NcclRank for nccl_ep). Each translates XLA's buffers into the calls of the EpRank
// interface (backends/ep_rank.h) — the same ops, data path and descriptors as the torch ops
// (csrc/torch) — and runs them on XLA's stream with no host synchronisation. It finds its rank
// through the `state` attribute (a JaxGroup<G>, ffi/jax_group.h) and the device ordinal XLA runs it
// on. The data buffer is sized from Python while tracing (the JAX states turn growing inside ops off):
// an op that needs more returns an error instead of writing past it.
//
// dispatch and combine (both layouts) return the op's `status` (omniep/status.h, kStatusWords int32:
// what the op's descriptor exchange and the rank found; zeros when all is well). A dispatch spans two
// handlers (prepare, then dispatch, in program order: the dispatch continues prepare's op), or one
// (routed_dispatch: the layout inside the dispatch kernel, one launch; what the JAX backends use).
//
// A translation unit instantiates the eleven handlers for its rank type and exports them under a name
// prefix with OMNIEP_JAX_HANDLERS(prefix, G): rank-major prefix_prepare, prefix_dispatch, prefix_routed_dispatch,
// prefix_dispatch_rows, prefix_combine, prefix_dispatch_bwd; expert-major prefix_em_prepare,
// prefix_em_dispatch, prefix_em_combine, prefix_em_dispatch_bwd, prefix_em_combine_bwd (operands:
// ffi/jax_handlers.h).
#pragma once

#if defined(__HIPCC__)
#include "omniep/runtime.h"  // the CUDA runtime names below, mapped to their HIP twins (rocm_rocshmem's build)
#else
#include <cuda_runtime.h>  // host C++ of the CUDA build
#endif

#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

#include "backends/ep_rank.h"
#include "ffi/jax_group.h"
#include "kernels/args.h"
#include "xla/ffi/api/ffi.h"

namespace omniep {
namespace jax_ffi {

namespace ffi = xla::ffi;

inline void check_runtime(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("omniep: ") + what + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

using Dims = ffi::AnyBuffer::Dimensions;

inline int64_t rows_of(const ffi::AnyBuffer& b) { return b.dimensions().size() ? b.dimensions()[0] : 0; }
inline int64_t cols_of(const ffi::AnyBuffer& b) { return b.dimensions().size() > 1 ? b.dimensions()[1] : 1; }

// Bytes of one row (all dimensions but the first) of a buffer.
inline int64_t row_bytes_of(const ffi::AnyBuffer& b) {
  const Dims d = b.dimensions();
  int64_t n = static_cast<int64_t>(ffi::ByteWidth(b.element_type()));
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  return n;
}

// The element type as the kernels' DType (combine-like ops; throws for others) and as descriptors
// carry it (any dtype a dispatch moves).
inline int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kFloat32;
    case ffi::DataType::BF16: return kBFloat16;
    case ffi::DataType::F16: return kFloat16;
    default: throw std::invalid_argument("omniep: combine needs float32, bfloat16 or float16 rows");
  }
}
inline int desc_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kDescF32;
    case ffi::DataType::BF16: return kDescBF16;
    case ffi::DataType::F16: return kDescF16;
    case ffi::DataType::F8E4M3FN: return kDescFP8;
    default: return -1;
  }
}

inline void* data(const ffi::AnyBuffer& b) { return b.untyped_data(); }
inline void* data(ffi::Result<ffi::AnyBuffer>& b) { return b->untyped_data(); }
template <typename T>
T* as(const ffi::AnyBuffer& b) { return static_cast<T*>(b.untyped_data()); }
template <typename T>
T* as(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<T*>(b->untyped_data()); }

inline void need_f32(const ffi::AnyBuffer& b, const char* what) {
  if (b.element_type() != ffi::DataType::F32) throw std::invalid_argument(std::string(what) + " must be float32");
}

// Every handler: find the rank of the device XLA runs it on, select that device, turn C++ exceptions
// into FFI errors.
template <typename G, typename F>
ffi::Error guarded(int64_t state, int32_t ordinal, const char* op, F&& body) {
  const JaxGroup<G>* group = JaxGroup<G>::from_handle(state);
  if (group == nullptr) return ffi::Error::InvalidArgument(std::string(op) + ": `state` is not this backend's JAX state");
  if (!group->alive()) return ffi::Error::InvalidArgument(std::string(op) + ": the JAX rank state was used after destroy()");
  try {
    G& g = group->at(ordinal);
    check_runtime(cudaSetDevice(g.device()), "selecting the rank's device");
    body(g);
  } catch (const std::invalid_argument& e) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + e.what());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": " + e.what());
  }
  return ffi::Error::Success();
}

// What combine and dispatch_bwd of both layouts take alike: y (hidden, capacity: its shape), prepare's
// topk_idx32, the bias terms (0-2 remaining operands), out, and for dispatch_bwd the weight cotangents.
inline void set_combine_base(CombineBase& c, const ffi::AnyBuffer& y, int64_t hidden, int64_t capacity,
                             const ffi::AnyBuffer& idx32, const ffi::RemainingArgs* biases,
                             ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer* g_recv_w,
                             ffi::Result<ffi::AnyBuffer>* g_w, int64_t num_experts) {
  c.y = data(y);
  c.hidden = static_cast<int>(hidden);
  c.dtype = dtype_code(y.element_type());
  c.num_tokens = static_cast<int>(rows_of(idx32));
  c.num_topk = static_cast<int>(cols_of(idx32));
  c.num_experts = static_cast<int>(num_experts);
  c.capacity = static_cast<int>(capacity);
  c.topk_idx32 = as<const int32_t>(idx32);
  if (biases) {
    if (biases->size() > 2) throw std::invalid_argument("at most two bias terms");
    c.num_bias = static_cast<int>(biases->size());
    for (size_t i = 0; i < biases->size(); ++i) {
      auto b = biases->get<ffi::AnyBuffer>(i);
      if (!b.has_value()) throw std::invalid_argument("bias operand is not a buffer");
      c.bias[i] = b->untyped_data();
      c.bias_dtype[i] = dtype_code(b->element_type());
    }
  }
  c.out = data(out);
  if (g_recv_w) {
    need_f32(*g_recv_w, "weight cotangents");
    c.with_topk_grad = true;
    c.g_recv_topk_weights = as<const float>(*g_recv_w);
    c.g_topk_weights = as<float>(*g_w);
  }
}

// ---- rank-major -------------------------------------------------------------------------------------

// What prepare of both layouts fills alike: the routing in, its rank-major layout out.
inline PrepareCall prepare_call(const ffi::AnyBuffer& topk_idx, ffi::Result<ffi::AnyBuffer>& idx32,
                                ffi::Result<ffi::AnyBuffer>& send_pos, ffi::Result<ffi::AnyBuffer>& per_rank,
                                ffi::Result<ffi::AnyBuffer>& per_expert, ffi::Result<ffi::AnyBuffer>& recv_counts,
                                ffi::Result<ffi::AnyBuffer>& send_offset, ffi::Result<ffi::AnyBuffer>& num_recv,
                                ffi::Result<ffi::AnyBuffer>& dropped, int64_t num_experts, int64_t capacity,
                                int64_t expert_alignment) {
  const auto t = topk_idx.element_type();
  if (t != ffi::DataType::S32 && t != ffi::DataType::S64) throw std::invalid_argument("topk_idx must be int32 or int64");
  PrepareCall c = {};
  c.topk_idx = data(topk_idx);
  c.index_bytes = t == ffi::DataType::S64 ? 8 : 4;
  c.num_tokens = static_cast<int>(rows_of(topk_idx));
  c.num_topk = static_cast<int>(cols_of(topk_idx));
  c.num_experts = static_cast<int>(num_experts);
  c.capacity = static_cast<int>(capacity);
  c.expert_alignment = static_cast<int>(expert_alignment);
  c.topk_idx32 = as<int32_t>(idx32);
  c.send_pos = as<int32_t>(send_pos);
  c.num_tokens_per_rank = as<int32_t>(per_rank);
  c.num_tokens_per_expert = as<int32_t>(per_expert);
  c.recv_counts = as<int32_t>(recv_counts);
  c.send_offset = as<int32_t>(send_offset);
  c.num_recv = as<int32_t>(num_recv);
  c.dropped = as<int32_t>(dropped);
  return c;
}

template <typename G>
ffi::Error Prepare(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> idx32,
                   ffi::Result<ffi::AnyBuffer> send_pos, ffi::Result<ffi::AnyBuffer> per_rank,
                   ffi::Result<ffi::AnyBuffer> per_expert, ffi::Result<ffi::AnyBuffer> recv_counts,
                   ffi::Result<ffi::AnyBuffer> send_offset, ffi::Result<ffi::AnyBuffer> num_recv,
                   ffi::Result<ffi::AnyBuffer> dropped, int64_t state, int64_t num_experts, int64_t capacity,
                   int64_t hidden, int64_t dtype) {
  return guarded<G>(state, ordinal, "omniep prepare (JAX)", [&](G& g) {
    PrepareCall c = prepare_call(topk_idx, idx32, send_pos, per_rank, per_expert, recv_counts, send_offset, num_recv,
                                 dropped, num_experts, capacity, 1);
    // hidden and dtype: of the x the dispatch that continues this op moves (the ranks compare them here)
    g.prepare(c, g.begin(kOpDispatch, c.num_experts, static_cast<int>(hidden), static_cast<int>(dtype), 0, c.capacity,
                         -1, c.num_topk),
              stream);
  });
}

// Shared by dispatch (routing, continues prepare's op), routed_dispatch (`route`: the kernel runs
// prepare's layout itself, the op's only launch) and dispatch_rows (rows only: combine_bwd). idx32,
// send_pos, send_offset and recv_counts: prepare's arrays (with a route, the kernel writes them).
template <typename G>
void run_dispatch(G& g, cudaStream_t stream, OpDesc& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer* x2,
                  const void* idx32, int64_t num_topk, const ffi::AnyBuffer* weights, const void* send_pos,
                  const void* send_offset, const void* recv_counts, ffi::Result<ffi::AnyBuffer>& recv_x,
                  ffi::Result<ffi::AnyBuffer>* recv_x2, ffi::Result<ffi::AnyBuffer>* recv_idx,
                  ffi::Result<ffi::AnyBuffer>* recv_w, ffi::Result<ffi::AnyBuffer>* per_expert, int64_t num_experts,
                  int64_t expert_alignment, const PrepareCall* route = nullptr) {
  const bool routing = weights != nullptr;
  if (routing) need_f32(*weights, "topk_weights");
  DispatchCall c = {};
  c.x = data(x);
  c.row_bytes = row_bytes_of(x);
  c.x2 = x2 ? data(*x2) : nullptr;
  c.row2_bytes = x2 ? row_bytes_of(*x2) : 0;
  c.num_tokens = static_cast<int>(rows_of(x));
  c.num_topk = static_cast<int>(routing ? num_topk : 0);
  c.num_experts = static_cast<int>(num_experts);
  c.capacity = c.rows = static_cast<int>(rows_of(*recv_x));
  c.expert_alignment = static_cast<int>(expert_alignment);
  c.send_pos = static_cast<const int32_t*>(send_pos);
  c.send_offset = static_cast<const int32_t*>(send_offset);
  c.recv_counts = static_cast<const int32_t*>(recv_counts);
  c.route = route;
  c.recv_x = data(recv_x);
  c.recv_x2 = recv_x2 ? data(*recv_x2) : nullptr;
  c.routing = routing;
  if (routing) {
    c.topk_idx32 = static_cast<const int32_t*>(idx32);
    c.topk_weights = as<const float>(*weights);
    c.recv_topk_idx = as<int32_t>(*recv_idx);
    c.recv_topk_weights = as<float>(*recv_w);
    c.num_recv_tokens_per_expert = as<int32_t>(*per_expert);
  }
  if (c.row2_bytes == 0) c.x2 = c.recv_x2 = nullptr;
  g.dispatch(c, d, stream);
}

template <typename G>
ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x2, ffi::AnyBuffer idx32,
                    ffi::AnyBuffer weights, ffi::AnyBuffer send_pos, ffi::AnyBuffer send_offset,
                    ffi::AnyBuffer recv_counts, ffi::AnyBuffer num_recv, ffi::Result<ffi::AnyBuffer> recv_x,
                    ffi::Result<ffi::AnyBuffer> recv_x2, ffi::Result<ffi::AnyBuffer> recv_idx,
                    ffi::Result<ffi::AnyBuffer> recv_w, ffi::Result<ffi::AnyBuffer> per_expert,
                    ffi::Result<ffi::AnyBuffer> status, int64_t state, int64_t num_experts, int64_t expert_alignment) {
  (void)num_recv;  // the kernel finds the padding from recv_counts
  return guarded<G>(state, ordinal, "omniep dispatch (JAX)", [&](G& g) {
    run_dispatch(g, stream, g.current(), x, &x2, data(idx32), cols_of(idx32), &weights, data(send_pos),
                 data(send_offset), data(recv_counts), recv_x, &recv_x2, &recv_idx, &recv_w, &per_expert, num_experts,
                 expert_alignment);  // prepare's op
    g.take_status(as<Status>(status), stream);
  });
}

// prepare + dispatch as ONE launch (a rank-major dispatch in JAX always has a capacity): the dispatch
// kernel runs the layout itself (kernels/dispatch.cuh, DispatchArgs::route); prepare's results are this
// handler's first eight, dispatch's the rest.
template <typename G>
ffi::Error RoutedDispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x2,
                          ffi::AnyBuffer topk_idx, ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> idx32,
                          ffi::Result<ffi::AnyBuffer> send_pos, ffi::Result<ffi::AnyBuffer> per_rank,
                          ffi::Result<ffi::AnyBuffer> per_expert_all, ffi::Result<ffi::AnyBuffer> recv_counts,
                          ffi::Result<ffi::AnyBuffer> send_offset, ffi::Result<ffi::AnyBuffer> num_recv,
                          ffi::Result<ffi::AnyBuffer> dropped, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> recv_x2, ffi::Result<ffi::AnyBuffer> recv_idx,
                          ffi::Result<ffi::AnyBuffer> recv_w, ffi::Result<ffi::AnyBuffer> per_expert,
                          ffi::Result<ffi::AnyBuffer> status, int64_t state, int64_t num_experts, int64_t capacity,
                          int64_t expert_alignment) {
  return guarded<G>(state, ordinal, "omniep dispatch (JAX)", [&](G& g) {
    PrepareCall p = prepare_call(topk_idx, idx32, send_pos, per_rank, per_expert_all, recv_counts, send_offset,
                                 num_recv, dropped, num_experts, capacity, expert_alignment);
    if (p.capacity < 0) throw std::invalid_argument("a dispatch that routes itself needs a capacity");
    OpDesc& d = g.begin(kOpDispatch, p.num_experts, static_cast<int>(cols_of(x)), desc_dtype(x.element_type()), 0,
                        p.capacity, -1, p.num_topk);
    run_dispatch(g, stream, d, x, &x2, p.topk_idx32, p.num_topk, &weights, p.send_pos, p.send_offset, p.recv_counts,
                 recv_x, &recv_x2, &recv_idx, &recv_w, &per_expert, num_experts, expert_alignment, &p);
    g.take_status(as<Status>(status), stream);
  });
}

template <typename G>
ffi::Error DispatchRows(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer send_pos,
                        ffi::AnyBuffer send_offset, ffi::AnyBuffer recv_counts, ffi::AnyBuffer num_recv,
                        ffi::Result<ffi::AnyBuffer> recv_x, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep dispatch rows (JAX)", [&](G& g) {
    OpDesc& d = g.begin(kOpCombineBwd, static_cast<int>(num_experts), static_cast<int>(cols_of(x)),
                        desc_dtype(x.element_type()), 0, static_cast<int>(rows_of(*recv_x)), -1, 0);
    (void)num_recv;  // the kernel finds the padding from recv_counts
    run_dispatch(g, stream, d, x, nullptr, nullptr, 0, nullptr, data(send_pos), data(send_offset), data(recv_counts),
                 recv_x, nullptr, nullptr, nullptr, nullptr, num_experts, 1);
  });
}

// Shared by combine (biases) and dispatch_bwd (weight cotangents read back).
template <typename G>
void run_combine(G& g, cudaStream_t stream, OpKind op, const ffi::AnyBuffer& y, const ffi::AnyBuffer* g_recv_w,
                 const ffi::AnyBuffer& idx32, const ffi::AnyBuffer& send_pos, const ffi::AnyBuffer& send_offset,
                 const ffi::AnyBuffer& recv_counts, const ffi::RemainingArgs* biases, ffi::Result<ffi::AnyBuffer>& out,
                 ffi::Result<ffi::AnyBuffer>* g_w, int64_t num_experts) {
  CombineCall c = {};
  set_combine_base(c, y, cols_of(y), rows_of(y), idx32, biases, out, g_recv_w, g_w, num_experts);
  c.rows = c.capacity;
  c.send_pos = as<const int32_t>(send_pos);
  c.send_offset = as<const int32_t>(send_offset);
  c.recv_counts = as<const int32_t>(recv_counts);
  g.combine(c, g.begin(op, c.num_experts, c.hidden, c.dtype, 0, c.capacity, -1, c.num_topk), stream);
}

template <typename G>
ffi::Error Combine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer idx32, ffi::AnyBuffer send_pos,
                   ffi::AnyBuffer send_offset, ffi::AnyBuffer recv_counts, ffi::RemainingArgs biases,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> status, int64_t state,
                   int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep combine (JAX)", [&](G& g) {
    run_combine(g, stream, kOpCombine, y, nullptr, idx32, send_pos, send_offset, recv_counts, &biases, out, nullptr,
                num_experts);
    g.take_status(as<Status>(status), stream);
  });
}

template <typename G>
ffi::Error DispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_recv_x, ffi::AnyBuffer g_recv_w,
                       ffi::AnyBuffer idx32, ffi::AnyBuffer send_pos, ffi::AnyBuffer send_offset,
                       ffi::AnyBuffer recv_counts, ffi::Result<ffi::AnyBuffer> g_x, ffi::Result<ffi::AnyBuffer> g_w,
                       int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep dispatch bwd (JAX)", [&](G& g) {
    run_combine(g, stream, kOpDispatchBwd, g_recv_x, &g_recv_w, idx32, send_pos, send_offset, recv_counts, nullptr,
                g_x, &g_w, num_experts);
  });
}

// ---- expert-major ("low-latency"): recv_x[L, C, H], C static -----------------------------------------

template <typename G>
ffi::Error EmPrepare(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> idx32,
                     ffi::Result<ffi::AnyBuffer> send_pos, ffi::Result<ffi::AnyBuffer> per_rank,
                     ffi::Result<ffi::AnyBuffer> per_expert, ffi::Result<ffi::AnyBuffer> recv_counts,
                     ffi::Result<ffi::AnyBuffer> send_offset, ffi::Result<ffi::AnyBuffer> rm_num_recv,
                     ffi::Result<ffi::AnyBuffer> rm_dropped, ffi::Result<ffi::AnyBuffer> copy_slot,
                     ffi::Result<ffi::AnyBuffer> recv_expert_count, ffi::Result<ffi::AnyBuffer> per_expert_aligned,
                     ffi::Result<ffi::AnyBuffer> num_recv, ffi::Result<ffi::AnyBuffer> dropped,
                     ffi::Result<ffi::AnyBuffer> max_expert_count, int64_t state, int64_t num_experts,
                     int64_t capacity, int64_t expert_alignment, int64_t hidden, int64_t dtype) {
  return guarded<G>(state, ordinal, "omniep expert-major prepare (JAX)", [&](G& g) {
    (void)max_expert_count;  // the exact-capacity output of old layouts: C is static now
    PrepareCall c = prepare_call(topk_idx, idx32, send_pos, per_rank, per_expert, recv_counts, send_offset,
                                 rm_num_recv, rm_dropped, num_experts, capacity, expert_alignment);
    c.expert_major = true;
    c.copy_slot = as<int32_t>(copy_slot);
    c.recv_expert_count = as<int32_t>(recv_expert_count);
    c.num_recv_tokens_per_expert = as<int32_t>(per_expert_aligned);
    c.em_num_recv = as<int32_t>(num_recv);
    c.em_dropped = as<int32_t>(dropped);
    g.prepare(c, g.begin(kOpDispatch, c.num_experts, static_cast<int>(hidden), static_cast<int>(dtype), 1, c.capacity,
                         -1, c.num_topk),
              stream);
  });
}

template <typename G>
ffi::Error EmDispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x2, ffi::AnyBuffer idx32,
                      ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot, ffi::AnyBuffer recv_expert_count,
                      ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x2,
                      ffi::Result<ffi::AnyBuffer> recv_idx, ffi::Result<ffi::AnyBuffer> recv_w,
                      ffi::Result<ffi::AnyBuffer> status, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major dispatch (JAX)", [&](G& g) {
    need_f32(weights, "topk_weights");
    const Dims dims = recv_x->dimensions();
    if (dims.size() < 2) throw std::invalid_argument("recv_x must be [L, C, ...]");
    EMDispatchCall c = {};
    c.x = data(x);
    c.row_bytes = row_bytes_of(x);
    c.row2_bytes = row_bytes_of(x2);
    c.x2 = c.row2_bytes > 0 ? data(x2) : nullptr;
    c.num_tokens = static_cast<int>(rows_of(x));
    c.num_topk = static_cast<int>(cols_of(idx32));
    c.num_experts = static_cast<int>(num_experts);
    c.capacity = static_cast<int>(dims[1]);
    c.topk_weights = as<const float>(weights);
    c.topk_idx32 = as<const int32_t>(idx32);
    c.copy_slot = as<const int32_t>(copy_slot);
    c.recv_expert_count = as<const int32_t>(recv_expert_count);
    c.recv_x = data(recv_x);
    c.recv_x2 = c.row2_bytes > 0 ? data(recv_x2) : nullptr;
    c.recv_topk_idx = as<int32_t>(recv_idx);
    c.recv_topk_weights = as<float>(recv_w);
    c.zero_padding = false;  // DESIGN §2: slots past the counts are unspecified
    g.em_dispatch(c, g.current(), stream);  // continues prepare's op
    g.take_status(as<Status>(status), stream);
  });
}

// Shared by combine (weighted, biases) and dispatch_bwd (weights 1, the weight cotangents read back).
template <typename G>
void run_em_combine(G& g, cudaStream_t stream, OpKind op, const ffi::AnyBuffer& y, const ffi::AnyBuffer* weights,
                    const ffi::AnyBuffer* g_recv_w, const ffi::AnyBuffer& idx32, const ffi::AnyBuffer& copy_slot,
                    const ffi::RemainingArgs* biases, ffi::Result<ffi::AnyBuffer>& out,
                    ffi::Result<ffi::AnyBuffer>* g_w, int64_t num_experts) {
  const Dims dims = y.dimensions();
  if (dims.size() != 3) throw std::invalid_argument("y must be [L, C, H]");
  EMCombineCall c = {};
  set_combine_base(c, y, dims[2], dims[1], idx32, biases, out, g_recv_w, g_w, num_experts);
  if (weights) {
    need_f32(*weights, "topk_weights");
    c.weighted = true;
    c.topk_weights = as<const float>(*weights);
  }
  c.copy_slot = as<const int32_t>(copy_slot);
  g.em_combine(c, g.begin(op, c.num_experts, c.hidden, c.dtype, 1, c.capacity, -1, c.num_topk), stream);
}

template <typename G>
ffi::Error EmCombine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer idx32,
                     ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot, ffi::RemainingArgs biases,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> status, int64_t state,
                     int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major combine (JAX)", [&](G& g) {
    run_em_combine(g, stream, kOpCombine, y, &weights, nullptr, idx32, copy_slot, &biases, out, nullptr, num_experts);
    g.take_status(as<Status>(status), stream);
  });
}

template <typename G>
ffi::Error EmDispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_recv_x, ffi::AnyBuffer g_recv_w,
                         ffi::AnyBuffer idx32, ffi::AnyBuffer copy_slot, ffi::Result<ffi::AnyBuffer> g_x,
                         ffi::Result<ffi::AnyBuffer> g_w, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major dispatch bwd (JAX)", [&](G& g) {
    run_em_combine(g, stream, kOpDispatchBwd, g_recv_x, nullptr, &g_recv_w, idx32, copy_slot, nullptr, g_x, &g_w,
                   num_experts);
  });
}

// combine_bwd: g_y[l, c] = round(w[t, k] * g_out[t]) and g_w[t, k] = <g_out[t], y[copy]>; g_y's padding
// slots zeroed when the attribute zero_padding is nonzero (the handle's dispatch had it), else unwritten.
template <typename G>
ffi::Error EmCombineBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_out, ffi::AnyBuffer y,
                        ffi::AnyBuffer idx32, ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot,
                        ffi::AnyBuffer recv_expert_count, ffi::Result<ffi::AnyBuffer> g_y,
                        ffi::Result<ffi::AnyBuffer> g_w, int64_t state, int64_t num_experts, int64_t zero_padding) {
  return guarded<G>(state, ordinal, "omniep expert-major combine bwd (JAX)", [&](G& g) {
    need_f32(weights, "topk_weights");
    if (y.element_type() != g_out.element_type()) throw std::invalid_argument("y and g_out must have one dtype");
    const Dims dims = g_y->dimensions();
    if (dims.size() != 3) throw std::invalid_argument("g_y must be [L, C, H]");
    EMCombineBwdCall c = {};
    c.g_out = data(g_out);
    c.hidden = static_cast<int>(dims[2]);
    c.dtype = dtype_code(g_out.element_type());
    c.num_tokens = static_cast<int>(rows_of(g_out));
    c.num_topk = static_cast<int>(cols_of(idx32));
    c.num_experts = static_cast<int>(num_experts);
    c.capacity = static_cast<int>(dims[1]);
    c.topk_weights = as<const float>(weights);
    c.topk_idx32 = as<const int32_t>(idx32);
    c.copy_slot = as<const int32_t>(copy_slot);
    c.recv_expert_count = as<const int32_t>(recv_expert_count);
    c.with_topk_grad = true;
    c.y = data(y);
    c.g_y = data(g_y);
    c.g_topk_weights = as<float>(g_w);
    c.zero_padding = zero_padding != 0;
    g.em_combine_bwd(c, g.begin(kOpCombineBwd, c.num_experts, c.hidden, c.dtype, 1, c.capacity, -1, c.num_topk),
                     stream);
  });
}

// ---- bindings -----------------------------------------------------------------------------------------

// Every handler's binding: XLA's stream and device ordinal, `Args` buffer operands (then the remaining
// ones: combine's bias terms), `Rets` buffer results, and the int64 attributes named, in the order of
// the handler's parameters. XLA's Binding can only be chained on temporaries (its copy is deleted and
// its move private), hence one expression, taken by reference, each step a new prvalue; counts >= 1.
template <int N, typename B>
auto buffer_args(B&& b) {
  if constexpr (N == 1) return std::move(b).template Arg<ffi::AnyBuffer>();
  else return buffer_args<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}
template <int N, typename B>
auto buffer_rets(B&& b) {
  if constexpr (N == 1) return std::move(b).template Ret<ffi::AnyBuffer>();
  else return buffer_rets<N - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
}
template <typename B, typename... More>
auto int_attrs(B&& b, const char* name, More... more) {
  if constexpr (sizeof...(More) == 0) return std::move(b).template Attr<int64_t>(name);
  else return int_attrs(std::move(b).template Attr<int64_t>(name), more...);
}
template <int Args, int Rets, bool Remaining = false, typename... Names>
auto bind(Names... attrs) {
  if constexpr (Remaining) {
    return int_attrs(buffer_rets<Rets>(buffer_args<Args>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                             .Ctx<ffi::DeviceOrdinal>())
                                           .RemainingArgs()),
                     attrs...);
  } else {
    return int_attrs(buffer_rets<Rets>(buffer_args<Args>(
                         ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>())),
                     attrs...);
  }
}

}  // namespace jax_ffi
}  // namespace omniep

// Defines the eleven exported handler symbols `prefix_*` over rank type G (see the file comment).
#define OMNIEP_JAX_HANDLER(prefix, name, Impl, G, ...) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_##name, omniep::jax_ffi::Impl<G>, (omniep::jax_ffi::__VA_ARGS__))
#define OMNIEP_JAX_HANDLERS(prefix, G)                                                                         \
  OMNIEP_JAX_HANDLER(prefix, prepare, Prepare, G, bind<1, 8>("state", "num_experts", "capacity", "hidden", "dtype")); \
  OMNIEP_JAX_HANDLER(prefix, dispatch, Dispatch, G, bind<8, 6>("state", "num_experts", "expert_alignment"));   \
  OMNIEP_JAX_HANDLER(prefix, routed_dispatch, RoutedDispatch, G,                                              \
                     bind<4, 14>("state", "num_experts", "capacity", "expert_alignment"));                    \
  OMNIEP_JAX_HANDLER(prefix, dispatch_rows, DispatchRows, G, bind<5, 1>("state", "num_experts"));              \
  OMNIEP_JAX_HANDLER(prefix, combine, Combine, G, bind<5, 2, true>("state", "num_experts"));                   \
  OMNIEP_JAX_HANDLER(prefix, dispatch_bwd, DispatchBwd, G, bind<6, 2>("state", "num_experts"));                \
  OMNIEP_JAX_HANDLER(prefix, em_prepare, EmPrepare, G,                                                        \
                     bind<1, 14>("state", "num_experts", "capacity", "expert_alignment", "hidden", "dtype"));  \
  OMNIEP_JAX_HANDLER(prefix, em_dispatch, EmDispatch, G, bind<6, 5>("state", "num_experts"));                  \
  OMNIEP_JAX_HANDLER(prefix, em_combine, EmCombine, G, bind<4, 2, true>("state", "num_experts"));              \
  OMNIEP_JAX_HANDLER(prefix, em_dispatch_bwd, EmDispatchBwd, G, bind<4, 2>("state", "num_experts"));           \
  OMNIEP_JAX_HANDLER(prefix, em_combine_bwd, EmCombineBwd, G, bind<6, 2>("state", "num_experts", "zero_padding"))
