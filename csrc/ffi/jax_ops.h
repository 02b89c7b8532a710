// The XLA FFI handlers of the native JAX backends, written once for any rank type G (IpcRank for
// cuda_nvshmem, NcclRank for nccl_ep) with the interface the per-process launchers share
// (backends/one_rank_ops.h, plus each class's rank(), num_ranks(), device(), sym<T>(offset),
// data_ptr(), data_bytes()): layout / dispatch / combine and the em_* ops, memcpy, copy_rows_except.
// They translate XLA buffers into the argument structs of csrc/kernels/args.h and call the same
// launchers as the torch path (omniep/native/ipc_rank.py), data path included:
//   dispatch: peers push rows into my symmetric data buffer, my own rows go straight into XLA's result
//             buffers; I copy the rest out into them (stream order, kernels/copy_rows.cuh);
//   combine / dispatch_bwd: I copy y's rows but my own (and the weight cotangents) into my data
//             buffer; peers pull, I read my own rows from y itself.
// Every kernel starts and ends with a barrier over all ranks, so these copies never race a peer.
// Each handler finds its rank through the `state` attribute (a JaxGroup<G>, ffi/jax_group.h) and the
// device ordinal XLA runs it on, and works on XLA's stream with no host synchronisation. The data
// buffer is sized from Python while tracing; a handler whose shapes need more than it has returns an
// error instead of writing past it.
//
// A translation unit instantiates the ten handlers for its rank type and exports them under a name
// prefix with OMNIEP_JAX_HANDLERS(prefix, G): rank-major prefix_prepare, prefix_dispatch,
// prefix_dispatch_rows, prefix_combine, prefix_dispatch_bwd; expert-major prefix_em_prepare,
// prefix_em_dispatch, prefix_em_combine, prefix_em_dispatch_bwd, prefix_em_combine_bwd (operands:
// ffi/jax_handlers.h).
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

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

// Byte offsets of [capacity, row_bytes[i]] regions packed in the symmetric data buffer (256-byte
// aligned, the same rule as omniep/native/ipc_rank.py `regions` and the JAX backends' `_regions`); returns the total.
inline int64_t pack_regions(int64_t capacity, const int64_t* row_bytes, int n, int64_t* offsets) {
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    offsets[i] = total;
    total += (capacity * row_bytes[i] + 255) / 256 * 256;
  }
  return total;
}

using Dims = ffi::AnyBuffer::Dimensions;

inline int64_t rows_of(const ffi::AnyBuffer& b) { return b.dimensions().size() ? b.dimensions()[0] : 0; }

// Bytes of one row (all dimensions but the first) of a buffer.
inline int64_t row_bytes_of(const ffi::AnyBuffer& b) {
  const Dims d = b.dimensions();
  int64_t n = static_cast<int64_t>(ffi::ByteWidth(b.element_type()));
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  return n;
}

inline int64_t cols_of(const ffi::AnyBuffer& b) { return b.dimensions().size() > 1 ? b.dimensions()[1] : 1; }

inline int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kFloat32;
    case ffi::DataType::BF16: return kBFloat16;
    case ffi::DataType::F16: return kFloat16;
    default: throw std::invalid_argument("omniep: combine needs float32, bfloat16 or float16 rows");
  }
}

template <typename T, typename G>
PerRank<T> mine(const G& g, void* p) {
  PerRank<T> out = {};
  out.p[g.rank()] = static_cast<T*>(p);
  return out;
}

inline void* data(const ffi::AnyBuffer& b) { return b.untyped_data(); }
inline void* data(ffi::Result<ffi::AnyBuffer>& b) { return b->untyped_data(); }

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

inline uintptr_t addr(const ffi::AnyBuffer& b) { return reinterpret_cast<uintptr_t>(b.untyped_data()); }
inline uintptr_t addr(ffi::Result<ffi::AnyBuffer>& b) { return reinterpret_cast<uintptr_t>(b->untyped_data()); }

// Device addresses of send_offset[me] and recv_counts[me] (int32 [R] layout outputs): where my own
// rows sit in my receive order and how many.
template <typename G>
std::pair<uintptr_t, uintptr_t> own_segment(const G& g, const ffi::AnyBuffer& send_offset,
                                            const ffi::AnyBuffer& recv_counts) {
  for (const ffi::AnyBuffer* b : {&send_offset, &recv_counts}) {
    if (b->element_type() != ffi::DataType::S32 || rows_of(*b) != g.num_ranks()) {
      throw std::invalid_argument("send_offset / recv_counts must be int32 [R] (prepare's)");
    }
  }
  return {addr(send_offset) + 4 * g.rank(), addr(recv_counts) + 4 * g.rank()};
}

template <typename G>
void need_bytes(const G& g, int64_t total, const char* op) {
  if (static_cast<size_t>(total) > g.data_bytes()) {
    throw std::invalid_argument(std::string("omniep: ") + op + " needs a " + std::to_string(total) +
                                "-byte data buffer but this rank has " + std::to_string(g.data_bytes()) +
                                " (it is reserved while tracing: trace through omniep.jax)");
  }
}

template <typename G>
void copy(const G& g, void* dst, uintptr_t src, int64_t bytes, cudaStream_t s) {
  if (bytes > 0) g.memcpy(reinterpret_cast<uintptr_t>(dst), src, static_cast<size_t>(bytes), s);
}

template <typename G>
void copy_in(const G& g, int64_t offset, const void* src, int64_t bytes, cudaStream_t s) {
  if (bytes > 0) g.memcpy(g.data_ptr() + offset, reinterpret_cast<uintptr_t>(src), static_cast<size_t>(bytes), s);
}

// ---- handlers -------------------------------------------------------------------------------------

// The layout kernel (and count exchange) into XLA's result buffers; shared by both prepares.
template <typename G>
void run_layout(G& g, cudaStream_t stream, const ffi::AnyBuffer& topk_idx, ffi::Result<ffi::AnyBuffer>& idx32,
                ffi::Result<ffi::AnyBuffer>& send_pos, ffi::Result<ffi::AnyBuffer>& per_rank,
                ffi::Result<ffi::AnyBuffer>& per_expert, ffi::Result<ffi::AnyBuffer>& recv_counts,
                ffi::Result<ffi::AnyBuffer>& send_offset, ffi::Result<ffi::AnyBuffer>& num_recv,
                ffi::Result<ffi::AnyBuffer>& dropped, int64_t num_experts, int64_t capacity) {
  const auto t = topk_idx.element_type();
  if (t != ffi::DataType::S32 && t != ffi::DataType::S64) throw std::invalid_argument("topk_idx must be int32 or int64");
  LayoutArgs a = {};
  a.topk_idx = mine<const void>(g, data(topk_idx));
  a.topk_idx32 = mine<int32_t>(g, data(idx32));
  a.send_pos = mine<int32_t>(g, data(send_pos));
  a.num_tokens_per_rank = mine<int32_t>(g, data(per_rank));
  a.num_tokens_per_expert = mine<int32_t>(g, data(per_expert));
  a.recv_counts = mine<int32_t>(g, data(recv_counts));
  a.send_offset = mine<int32_t>(g, data(send_offset));
  a.num_recv = mine<int32_t>(g, data(num_recv));
  a.dropped = mine<int32_t>(g, data(dropped));
  a.num_tokens[g.rank()] = static_cast<int>(rows_of(topk_idx));
  a.num_topk = static_cast<int>(cols_of(topk_idx));
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = static_cast<int>(capacity);
  a.index_bytes = t == ffi::DataType::S64 ? 8 : 4;
  g.layout(a, stream);
}

// Bias terms (0-2 remaining operands) of a combine, rank-major or expert-major.
template <typename G, typename Args>
void set_biases(const G& g, Args& a, const ffi::RemainingArgs& biases) {
  if (biases.size() > 2) throw std::invalid_argument("at most two bias terms");
  a.num_bias = static_cast<int>(biases.size());
  for (size_t i = 0; i < biases.size(); ++i) {
    auto b = biases.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) throw std::invalid_argument("bias operand is not a buffer");
    a.bias[i] = mine<const void>(g, b->untyped_data());
    a.bias_dtype[i] = dtype_code(b->element_type());
  }
}

template <typename G>
ffi::Error Prepare(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> idx32,
                   ffi::Result<ffi::AnyBuffer> send_pos, ffi::Result<ffi::AnyBuffer> per_rank,
                   ffi::Result<ffi::AnyBuffer> per_expert, ffi::Result<ffi::AnyBuffer> recv_counts,
                   ffi::Result<ffi::AnyBuffer> send_offset, ffi::Result<ffi::AnyBuffer> num_recv,
                   ffi::Result<ffi::AnyBuffer> dropped, int64_t state, int64_t num_experts, int64_t capacity) {
  return guarded<G>(state, ordinal, "omniep prepare (JAX)", [&](G& g) {
    run_layout(g, stream, topk_idx, idx32, send_pos, per_rank, per_expert, recv_counts, send_offset, num_recv,
               dropped, num_experts, capacity);
  });
}

// Shared by dispatch (routing) and dispatch_rows (rows only).
template <typename G>
void run_dispatch(G& g, cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer* x2,
                  const ffi::AnyBuffer* idx32, const ffi::AnyBuffer* weights, const ffi::AnyBuffer& send_pos,
                  const ffi::AnyBuffer& send_offset, const ffi::AnyBuffer& recv_counts, const ffi::AnyBuffer& num_recv,
                  ffi::Result<ffi::AnyBuffer>& recv_x,
                  ffi::Result<ffi::AnyBuffer>* recv_x2, ffi::Result<ffi::AnyBuffer>* recv_idx,
                  ffi::Result<ffi::AnyBuffer>* recv_w, ffi::Result<ffi::AnyBuffer>* per_expert, int64_t num_experts,
                  int64_t expert_alignment) {
  const bool routing = idx32 != nullptr;
  const int64_t C = rows_of(*recv_x), K = routing ? cols_of(*idx32) : 0;
  const int64_t row_bytes = row_bytes_of(x), row2_bytes = x2 ? row_bytes_of(*x2) : 0;
  int64_t sizes[4] = {row_bytes, 0, 0, 0}, offsets[4] = {};
  int n = 1;
  const int at_x2 = row2_bytes > 0 ? n++ : -1;
  if (at_x2 >= 0) sizes[at_x2] = row2_bytes;
  const int at_idx = routing ? n : -1;
  if (routing) {
    sizes[n++] = K * 4;
    sizes[n++] = K * 4;
  }
  const int64_t total = pack_regions(C, sizes, n, offsets);
  need_bytes(g, total, "dispatch");

  DispatchArgs a = {};
  a.x = mine<const uint8_t>(g, data(x));
  a.send_pos = mine<const int32_t>(g, data(send_pos));
  a.send_offset = mine<const int32_t>(g, data(send_offset));
  a.num_recv = mine<const int32_t>(g, data(num_recv));
  a.recv_x = g.template sym<uint8_t>(offsets[0]);
  if (at_x2 >= 0) {
    a.x2 = mine<const uint8_t>(g, data(*x2));
    a.recv_x2 = g.template sym<uint8_t>(offsets[at_x2]);
  }
  if (routing) {
    a.topk_idx32 = mine<const int32_t>(g, data(*idx32));
    a.topk_weights = mine<const float>(g, data(*weights));
    a.recv_topk_idx = g.template sym<int32_t>(offsets[at_idx]);
    a.recv_topk_weights = g.template sym<float>(offsets[at_idx + 1]);
    a.num_recv_tokens_per_expert = mine<int32_t>(g, data(*per_expert));
  }
  a.num_tokens[g.rank()] = static_cast<int>(rows_of(x));
  a.row_bytes = row_bytes;
  a.row2_bytes = row2_bytes;
  a.num_topk = static_cast<int>(K);
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = static_cast<int>(C);
  a.expert_alignment = static_cast<int>(expert_alignment);
  a.with_routing = routing ? 1 : 0;
  // My own rows go straight into XLA's results; the copy-out below skips them (kernels/copy_rows.cuh).
  a.own_x = mine<uint8_t>(g, data(recv_x));
  if (at_x2 >= 0) a.own_x2 = mine<uint8_t>(g, data(*recv_x2));
  g.dispatch(a, stream);

  const uintptr_t base = g.data_ptr();
  const auto [skip_begin, skip_count] = own_segment(g, send_offset, recv_counts);
  g.copy_rows_except(addr(recv_x), base + offsets[0], row_bytes, C, skip_begin, skip_count, stream);
  if (at_x2 >= 0) g.copy_rows_except(addr(*recv_x2), base + offsets[at_x2], row2_bytes, C, skip_begin, skip_count, stream);
  if (routing) {
    copy(g, data(*recv_idx), base + offsets[at_idx], C * K * 4, stream);
    copy(g, data(*recv_w), base + offsets[at_idx + 1], C * K * 4, stream);
  }
}

template <typename G>
ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x2, ffi::AnyBuffer idx32,
                    ffi::AnyBuffer weights, ffi::AnyBuffer send_pos, ffi::AnyBuffer send_offset,
                    ffi::AnyBuffer recv_counts, ffi::AnyBuffer num_recv, ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x2,
                    ffi::Result<ffi::AnyBuffer> recv_idx, ffi::Result<ffi::AnyBuffer> recv_w,
                    ffi::Result<ffi::AnyBuffer> per_expert, int64_t state, int64_t num_experts,
                    int64_t expert_alignment) {
  return guarded<G>(state, ordinal, "omniep dispatch (JAX)", [&](G& g) {
    if (weights.element_type() != ffi::DataType::F32) throw std::invalid_argument("topk_weights must be float32");
    run_dispatch(g, stream, x, &x2, &idx32, &weights, send_pos, send_offset, recv_counts, num_recv, recv_x, &recv_x2,
                 &recv_idx, &recv_w, &per_expert, num_experts, expert_alignment);
  });
}

template <typename G>
ffi::Error DispatchRows(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer send_pos,
                        ffi::AnyBuffer send_offset, ffi::AnyBuffer recv_counts, ffi::AnyBuffer num_recv,
                        ffi::Result<ffi::AnyBuffer> recv_x, int64_t state,
                        int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep dispatch rows (JAX)", [&](G& g) {
    run_dispatch(g, stream, x, nullptr, nullptr, nullptr, send_pos, send_offset, recv_counts, num_recv, recv_x, nullptr,
                 nullptr, nullptr, nullptr, num_experts, 1);
  });
}

// Shared by combine (biases) and dispatch_bwd (weight cotangents read back).
template <typename G>
void run_combine(G& g, cudaStream_t stream, const ffi::AnyBuffer& y, const ffi::AnyBuffer* g_recv_w,
                 const ffi::AnyBuffer& idx32, const ffi::AnyBuffer& send_pos, const ffi::AnyBuffer& send_offset,
                 const ffi::AnyBuffer& recv_counts, const ffi::RemainingArgs* biases, ffi::Result<ffi::AnyBuffer>& out,
                 ffi::Result<ffi::AnyBuffer>* g_w, int64_t num_experts) {
  const int64_t C = rows_of(y), H = cols_of(y), K = cols_of(idx32);
  const int64_t y_row = row_bytes_of(y);
  int64_t sizes[2] = {y_row, K * 4}, offsets[2] = {};
  const int n = g_recv_w ? 2 : 1;
  need_bytes(g, pack_regions(C, sizes, n, offsets), g_recv_w ? "dispatch_bwd" : "combine");

  CombineArgs a = {};
  a.y = g.template sym<const void>(offsets[0]);
  a.out = mine<void>(g, data(out));
  a.topk_idx32 = mine<const int32_t>(g, data(idx32));
  a.send_pos = mine<const int32_t>(g, data(send_pos));
  a.send_offset = mine<const int32_t>(g, data(send_offset));
  a.num_tokens[g.rank()] = static_cast<int>(rows_of(idx32));
  a.hidden = static_cast<int>(H);
  a.num_topk = static_cast<int>(K);
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = static_cast<int>(C);
  a.dtype = dtype_code(y.element_type());
  if (biases) set_biases(g, a, *biases);
  // My own rows are read from y itself; the copy-in skips them (kernels/copy_rows.cuh).
  a.own_y = mine<const void>(g, data(y));
  const auto [skip_begin, skip_count] = own_segment(g, send_offset, recv_counts);
  g.copy_rows_except(g.data_ptr() + offsets[0], addr(y), y_row, C, skip_begin, skip_count, stream);
  if (g_recv_w) {
    if (g_recv_w->element_type() != ffi::DataType::F32) throw std::invalid_argument("weight cotangents must be float32");
    copy_in(g, offsets[1], data(*g_recv_w), C * K * 4, stream);
    a.g_recv_topk_weights = g.template sym<const float>(offsets[1]);
    a.g_topk_weights = mine<float>(g, data(*g_w));
    a.with_topk_grad = 1;
  }
  g.combine(a, stream);
}

template <typename G>
ffi::Error Combine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer idx32, ffi::AnyBuffer send_pos,
                   ffi::AnyBuffer send_offset, ffi::AnyBuffer recv_counts, ffi::RemainingArgs biases, ffi::Result<ffi::AnyBuffer> out,
                   int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep combine (JAX)", [&](G& g) {
    run_combine(g, stream, y, nullptr, idx32, send_pos, send_offset, recv_counts, &biases, out, nullptr, num_experts);
  });
}

template <typename G>
ffi::Error DispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_recv_x, ffi::AnyBuffer g_recv_w, ffi::AnyBuffer idx32,
                       ffi::AnyBuffer send_pos, ffi::AnyBuffer send_offset, ffi::AnyBuffer recv_counts,
                       ffi::Result<ffi::AnyBuffer> g_x,
                       ffi::Result<ffi::AnyBuffer> g_w, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep dispatch bwd (JAX)", [&](G& g) {
    run_combine(g, stream, g_recv_x, &g_recv_w, idx32, send_pos, send_offset, recv_counts, nullptr, g_x, &g_w,
                num_experts);
  });
}

// ---- expert-major ("low-latency") handlers: kernels/em_*.cuh, recv_x[L, C, H] ----
// The data buffer holds [L * C] slots per region (C = the static capacity of the results), copied
// out / in whole (contiguous): the same regions on every rank, as sized by the JAX backend.

template <typename G>
ffi::Error EmPrepare(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> idx32,
                     ffi::Result<ffi::AnyBuffer> send_pos, ffi::Result<ffi::AnyBuffer> per_rank,
                     ffi::Result<ffi::AnyBuffer> per_expert, ffi::Result<ffi::AnyBuffer> recv_counts,
                     ffi::Result<ffi::AnyBuffer> send_offset, ffi::Result<ffi::AnyBuffer> rm_num_recv,
                     ffi::Result<ffi::AnyBuffer> rm_dropped, ffi::Result<ffi::AnyBuffer> copy_slot,
                     ffi::Result<ffi::AnyBuffer> recv_expert_count, ffi::Result<ffi::AnyBuffer> per_expert_aligned,
                     ffi::Result<ffi::AnyBuffer> num_recv, ffi::Result<ffi::AnyBuffer> dropped,
                     ffi::Result<ffi::AnyBuffer> max_expert_count, int64_t state, int64_t num_experts,
                     int64_t capacity, int64_t expert_alignment) {
  return guarded<G>(state, ordinal, "omniep expert-major prepare (JAX)", [&](G& g) {
    // The rank-major view keeps every row (capacity unbounded); the expert-major capacity is below.
    run_layout(g, stream, topk_idx, idx32, send_pos, per_rank, per_expert, recv_counts, send_offset, rm_num_recv,
               rm_dropped, num_experts, 0x7fffffff);
    EMLayoutArgs e = {};
    e.topk_idx32 = mine<const int32_t>(g, data(idx32));
    e.num_tokens_per_expert = mine<const int32_t>(g, data(per_expert));
    e.copy_slot = mine<int32_t>(g, data(copy_slot));
    e.recv_expert_count = mine<int32_t>(g, data(recv_expert_count));
    e.num_recv_tokens_per_expert = mine<int32_t>(g, data(per_expert_aligned));
    e.num_recv = mine<int32_t>(g, data(num_recv));
    e.dropped = mine<int32_t>(g, data(dropped));
    e.max_expert_count = mine<int32_t>(g, data(max_expert_count));
    e.num_tokens[g.rank()] = static_cast<int>(rows_of(topk_idx));
    e.num_topk = static_cast<int>(cols_of(topk_idx));
    e.num_experts = static_cast<int>(num_experts);
    e.capacity = static_cast<int>(capacity);
    e.expert_alignment = static_cast<int>(expert_alignment);
    g.em_layout(e, stream);
  });
}

template <typename G>
ffi::Error EmDispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x2, ffi::AnyBuffer idx32,
                      ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot, ffi::AnyBuffer recv_expert_count,
                      ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x2,
                      ffi::Result<ffi::AnyBuffer> recv_idx, ffi::Result<ffi::AnyBuffer> recv_w, int64_t state,
                      int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major dispatch (JAX)", [&](G& g) {
    if (weights.element_type() != ffi::DataType::F32) throw std::invalid_argument("topk_weights must be float32");
    const Dims d = recv_x->dimensions();
    if (d.size() < 2) throw std::invalid_argument("recv_x must be [L, C, ...]");
    const int64_t L = d[0], C = d[1], K = cols_of(idx32);
    const int64_t row_bytes = row_bytes_of(x), row2_bytes = row_bytes_of(x2);
    int64_t sizes[4] = {row_bytes, row2_bytes > 0 ? row2_bytes : 4, 4, 4}, offsets[4] = {};
    need_bytes(g, pack_regions(L * C, sizes, 4, offsets), "expert-major dispatch");
    EMDispatchArgs a = {};
    a.x = mine<const uint8_t>(g, data(x));
    a.topk_idx32 = mine<const int32_t>(g, data(idx32));
    a.topk_weights = mine<const float>(g, data(weights));
    a.copy_slot = mine<const int32_t>(g, data(copy_slot));
    a.recv_expert_count = mine<const int32_t>(g, data(recv_expert_count));
    a.recv_x = g.template sym<uint8_t>(offsets[0]);
    if (row2_bytes > 0) {
      a.x2 = mine<const uint8_t>(g, data(x2));
      a.recv_x2 = g.template sym<uint8_t>(offsets[1]);
    }
    a.recv_topk_idx = g.template sym<int32_t>(offsets[2]);
    a.recv_topk_weights = g.template sym<float>(offsets[3]);
    a.num_tokens[g.rank()] = static_cast<int>(rows_of(x));
    a.row_bytes = row_bytes;
    a.row2_bytes = row2_bytes;
    a.num_topk = static_cast<int>(K);
    a.num_experts = static_cast<int>(num_experts);
    a.capacity = static_cast<int>(C);
    g.em_dispatch(a, stream);
    const uintptr_t base = g.data_ptr();
    copy(g, data(recv_x), base + offsets[0], L * C * row_bytes, stream);
    if (row2_bytes > 0) copy(g, data(recv_x2), base + offsets[1], L * C * row2_bytes, stream);
    copy(g, data(recv_idx), base + offsets[2], L * C * 4, stream);
    copy(g, data(recv_w), base + offsets[3], L * C * 4, stream);
  });
}

// Shared by combine (weighted, biases) and dispatch_bwd (weights 1, the weight cotangents read back).
template <typename G>
void run_em_combine(G& g, cudaStream_t stream, const ffi::AnyBuffer& y, const ffi::AnyBuffer* weights,
                    const ffi::AnyBuffer* g_recv_w, const ffi::AnyBuffer& idx32, const ffi::AnyBuffer& copy_slot,
                    const ffi::RemainingArgs* biases, ffi::Result<ffi::AnyBuffer>& out,
                    ffi::Result<ffi::AnyBuffer>* g_w, int64_t num_experts) {
  const Dims d = y.dimensions();
  if (d.size() != 3) throw std::invalid_argument("y must be [L, C, H]");
  const int64_t L = d[0], C = d[1], H = d[2], K = cols_of(idx32);
  int64_t sizes[2] = {H * static_cast<int64_t>(ffi::ByteWidth(y.element_type())), 4}, offsets[2] = {};
  need_bytes(g, pack_regions(L * C, sizes, g_recv_w ? 2 : 1, offsets), "expert-major combine");
  EMCombineArgs a = {};
  a.y = g.template sym<const void>(offsets[0]);
  a.out = mine<void>(g, data(out));
  a.topk_idx32 = mine<const int32_t>(g, data(idx32));
  if (weights) {
    if (weights->element_type() != ffi::DataType::F32) throw std::invalid_argument("topk_weights must be float32");
    a.topk_weights = mine<const float>(g, data(*weights));
  }
  a.copy_slot = mine<const int32_t>(g, data(copy_slot));
  a.num_tokens[g.rank()] = static_cast<int>(rows_of(idx32));
  a.hidden = static_cast<int>(H);
  a.num_topk = static_cast<int>(K);
  a.num_experts = static_cast<int>(num_experts);
  a.capacity = static_cast<int>(C);
  a.dtype = dtype_code(y.element_type());
  if (biases) set_biases(g, a, *biases);
  copy_in(g, offsets[0], data(y), L * C * sizes[0], stream);
  if (g_recv_w) {
    if (g_recv_w->element_type() != ffi::DataType::F32) throw std::invalid_argument("weight cotangents must be float32");
    copy_in(g, offsets[1], data(*g_recv_w), L * C * 4, stream);
    a.g_recv_topk_weights = g.template sym<const float>(offsets[1]);
    a.g_topk_weights = mine<float>(g, data(*g_w));
    a.with_topk_grad = 1;
  }
  g.em_combine(a, stream);
}

template <typename G>
ffi::Error EmCombine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer idx32,
                     ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot, ffi::RemainingArgs biases,
                     ffi::Result<ffi::AnyBuffer> out, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major combine (JAX)", [&](G& g) {
    run_em_combine(g, stream, y, &weights, nullptr, idx32, copy_slot, &biases, out, nullptr, num_experts);
  });
}

template <typename G>
ffi::Error EmDispatchBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_recv_x, ffi::AnyBuffer g_recv_w,
                         ffi::AnyBuffer idx32, ffi::AnyBuffer copy_slot, ffi::Result<ffi::AnyBuffer> g_x,
                         ffi::Result<ffi::AnyBuffer> g_w, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major dispatch bwd (JAX)", [&](G& g) {
    run_em_combine(g, stream, g_recv_x, nullptr, &g_recv_w, idx32, copy_slot, nullptr, g_x, &g_w, num_experts);
  });
}

// combine_bwd: g_y[l, c] = round(w[t, k] * g_out[t]) (padding 0) and g_w[t, k] = <g_out[t], y[copy]>.
template <typename G>
ffi::Error EmCombineBwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer g_out, ffi::AnyBuffer y,
                        ffi::AnyBuffer idx32, ffi::AnyBuffer weights, ffi::AnyBuffer copy_slot,
                        ffi::AnyBuffer recv_expert_count, ffi::Result<ffi::AnyBuffer> g_y,
                        ffi::Result<ffi::AnyBuffer> g_w, int64_t state, int64_t num_experts) {
  return guarded<G>(state, ordinal, "omniep expert-major combine bwd (JAX)", [&](G& g) {
    if (weights.element_type() != ffi::DataType::F32) throw std::invalid_argument("topk_weights must be float32");
    if (y.element_type() != g_out.element_type()) throw std::invalid_argument("y and g_out must have one dtype");
    const Dims d = g_y->dimensions();
    if (d.size() != 3) throw std::invalid_argument("g_y must be [L, C, H]");
    const int64_t L = d[0], C = d[1], H = d[2];
    const int64_t row_bytes = H * static_cast<int64_t>(ffi::ByteWidth(g_out.element_type()));
    int64_t sizes[2] = {row_bytes, row_bytes}, offsets[2] = {};
    need_bytes(g, pack_regions(L * C, sizes, 2, offsets), "expert-major combine_bwd");
    EMCombineBwdArgs a = {};
    a.g_out = mine<const void>(g, data(g_out));
    a.y = g.template sym<const void>(offsets[1]);
    a.topk_idx32 = mine<const int32_t>(g, data(idx32));
    a.topk_weights = mine<const float>(g, data(weights));
    a.copy_slot = mine<const int32_t>(g, data(copy_slot));
    a.recv_expert_count = mine<const int32_t>(g, data(recv_expert_count));
    a.g_y = g.template sym<void>(offsets[0]);
    a.g_topk_weights = mine<float>(g, data(g_w));
    a.num_tokens[g.rank()] = static_cast<int>(rows_of(g_out));
    a.hidden = static_cast<int>(H);
    a.num_topk = static_cast<int>(cols_of(idx32));
    a.num_experts = static_cast<int>(num_experts);
    a.capacity = static_cast<int>(C);
    a.dtype = dtype_code(g_out.element_type());
    a.with_topk_grad = 1;
    copy_in(g, offsets[1], data(y), L * C * row_bytes, stream);
    g.em_combine_bwd(a, stream);
    copy(g, data(g_y), g.data_ptr() + offsets[0], L * C * row_bytes, stream);
  });
}

}  // namespace jax_ffi
}  // namespace omniep

// Defines the ten exported handler symbols `prefix_*` over rank type G (see the file comment).
#define OMNIEP_JAX_HANDLERS(prefix, G)                                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_prepare, omniep::jax_ffi::Prepare<G>,                              \
                                xla::ffi::Ffi::Bind()                                                       \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                          \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                         \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                 \
                                    .Attr<int64_t>("num_experts")                                           \
                                    .Attr<int64_t>("capacity"));                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_dispatch, omniep::jax_ffi::Dispatch<G>,                            \
                                xla::ffi::Ffi::Bind()                                                       \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                          \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                         \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                 \
                                    .Attr<int64_t>("num_experts")                                           \
                                    .Attr<int64_t>("expert_alignment"));                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_dispatch_rows, omniep::jax_ffi::DispatchRows<G>,                   \
                                xla::ffi::Ffi::Bind()                                                       \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                          \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                         \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                 \
                                    .Attr<int64_t>("num_experts"));                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_combine, omniep::jax_ffi::Combine<G>,                              \
                                xla::ffi::Ffi::Bind()                                                       \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                          \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                         \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .RemainingArgs()                                                        \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                 \
                                    .Attr<int64_t>("num_experts"));                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_dispatch_bwd, omniep::jax_ffi::DispatchBwd<G>,                     \
                                xla::ffi::Ffi::Bind()                                                       \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                          \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                         \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                 \
                                    .Attr<int64_t>("num_experts"));                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_em_prepare, omniep::jax_ffi::EmPrepare<G>,                           \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                            \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                           \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                   \
                                    .Attr<int64_t>("num_experts")                                             \
                                    .Attr<int64_t>("capacity")                                                \
                                    .Attr<int64_t>("expert_alignment"));                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_em_dispatch, omniep::jax_ffi::EmDispatch<G>,                         \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                            \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                           \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                   \
                                    .Attr<int64_t>("num_experts"));                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_em_combine, omniep::jax_ffi::EmCombine<G>,                           \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                            \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                           \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .RemainingArgs()                                                          \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                   \
                                    .Attr<int64_t>("num_experts"));                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_em_dispatch_bwd, omniep::jax_ffi::EmDispatchBwd<G>,                  \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                            \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                           \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                   \
                                    .Attr<int64_t>("num_experts"));                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##_em_combine_bwd, omniep::jax_ffi::EmCombineBwd<G>,                    \
                                xla::ffi::Ffi::Bind()                                                         \
                                    .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                            \
                                    .Ctx<xla::ffi::DeviceOrdinal>()                                           \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Arg<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Ret<xla::ffi::AnyBuffer>()                                             \
                                    .Attr<int64_t>("state")                                                   \
                                    .Attr<int64_t>("num_experts"))
