// The EpRank ops of OneRankOps (backends/ep_rank.h, one_rank_ops.h): the data path of every op, written
// once for IpcRank, NvshmemRank and NcclRank, whichever binding calls it (the torch ops, the XLA FFI
// handlers). Included by each class's .cu after backends/one_rank_launch.cuh.
//
// Data path per op (every rank computes the same buffer layout from values the descriptors agree on):
//   * dispatch: peers PUSH rows into my symmetric data buffer, my own rows go straight into the
//     caller's results; then I copy the rest out (results must outlive the next op, which re-uses
//     the buffer);
//   * combine / dispatch_bwd: I copy the rows of y but my own into my data buffer; peers PULL their
//     rows from it, I read mine from y (kernels/copy_rows.cuh: copy_rows_except).
//   Up to fused_copy_bytes the dispatch / combine kernel does that copy itself (one launch per op).
//   * expert-major: the [L, C] slots move as one block each way (C is static).
// Every kernel starts and ends with a barrier over all ranks, so these copies on my stream never race
// a peer's access to my buffer (kernels/sync.cuh). Buffers are regions of [capacity, row bytes] packed
// at 256-byte offsets (`pack_regions`, the rule the JAX backends size their buffers by:
// omniep/native/ipc_rank.py `regions`).
//
// Descriptors: every kernel of an op carries the op's descriptor; `part` counts the op's kernels
// (growth barrier included), so the first exchange is the op's and the later ones follow its verdict.
#pragma once

#include "omniep/runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backends/one_rank_launch.cuh"

namespace omniep {

inline int64_t pack_regions(int64_t capacity, const int64_t* row_bytes, int n, int64_t* offsets) {
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    offsets[i] = total;
    total += (capacity * row_bytes[i] + 255) / 256 * 256;
  }
  return total;
}

// The data buffer's next size when `bytes` do not fit in `current`: at least double, at least 2 MiB,
// in whole 2 MiB granules (a growing sequence of calls re-allocates O(log) times). Python's
// omniep.native.ipc_rank.grown_size follows the same rule for the JAX states.
inline size_t grown_size(size_t bytes, size_t current) {
  size_t n = bytes > 2 * current ? bytes : 2 * current;
  if (n < (size_t{1} << 21)) n = size_t{1} << 21;
  return (n + (size_t{1} << 21) - 1) >> 21 << 21;
}

// Bytes up to which the dispatch and combine kernels do the local copy-out / copy-in themselves (one
// launch fewer per op: host time is what small ops are made of); larger copies get their own launch
// over every SM, faster than the kernels' SM budget. OMNIEP_FUSED_COPY_BYTES (read once; 0: never).
inline int64_t fused_copy_bytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("OMNIEP_FUSED_COPY_BYTES");
    if (v == nullptr || *v == '\0') return int64_t{4} << 20;
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || n < 0) {
      throw std::invalid_argument(std::string("omniep: OMNIEP_FUSED_COPY_BYTES must be an integer >= 0, got '") + v +
                                  "'");
    }
    return static_cast<int64_t>(n);
  }();
  return bytes;
}

template <typename T, typename Rank>
PerRank<T> mine(const Rank& g, const void* p) {
  PerRank<T> out = {};
  out.p[g.rank()] = const_cast<T*>(static_cast<const T*>(p));
  return out;
}

inline void next_part(OpDesc& d) { ++d.w[kDescPart]; }

// The kernel arguments both layouts' combine take from a CombineBase (y and g_recv_topk_weights
// travel through the data region: the caller sets those).
template <typename Args, typename Rank>
void set_combine_args(Args& a, const CombineBase& c, const Rank& g, const OpDesc& d) {
  a.out = mine<void>(g, c.out);
  a.topk_idx32 = mine<const int32_t>(g, c.topk_idx32);
  a.num_tokens[g.rank()] = c.num_tokens;
  a.hidden = c.hidden;
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  a.capacity = c.capacity;
  a.dtype = c.dtype;
  a.num_bias = c.num_bias;
  for (int i = 0; i < c.num_bias && i < 2; ++i) {
    a.bias[i] = mine<const void>(g, c.bias[i]);
    a.bias_dtype[i] = c.bias_dtype[i];
  }
  if (c.with_topk_grad) {
    a.g_topk_weights = mine<float>(g, c.g_topk_weights);
    a.with_topk_grad = 1;
  }
  a.desc[g.rank()] = d;
}

template <typename Rank>
OneRankOps<Rank>::~OneRankOps() {
  if (mailbox_ != nullptr) (void)cudaFreeHost(mailbox_);
}

template <typename Rank>
HostMailbox* OneRankOps<Rank>::mailbox() {
  if (mailbox_ == nullptr) {
    void* p = nullptr;
    check_cuda(cudaHostAlloc(&p, sizeof(HostMailbox), cudaHostAllocMapped), "allocating the host mailbox");
    mailbox_ = static_cast<HostMailbox*>(p);
    mailbox_->ticket = 0;
    ticket_ = 0;
  }
  return mailbox_;
}

template <typename Rank>
bool OneRankOps<Rank>::stopped(const OpDesc& d) const {
  Status fatal;
  int32_t abort_seq = 0;
  self().on_device([&] {
    check_cuda(cudaMemcpy(&fatal, &self().my_workspace()->fatal, sizeof(Status), cudaMemcpyDeviceToHost),
               "reading the status");
    check_cuda(cudaMemcpy(&abort_seq, &self().my_workspace()->abort_seq, sizeof(int32_t), cudaMemcpyDeviceToHost),
               "reading the status");
  });
  return fatal.w[kStCode] != kStatusOk || abort_seq == d.w[kDescSeq] + 1;
}

template <typename Rank>
bool OneRankOps<Rank>::ensure_data(size_t bytes, OpDesc& d, cudaStream_t s, int64_t regions_end) {
  regions_high_ = std::max(regions_high_, regions_end >= 0 ? regions_end : static_cast<int64_t>(bytes));
  if (bytes <= self().data_bytes()) return true;
  if (!grow_in_ops_) {
    throw std::invalid_argument("omniep: this op needs a " + std::to_string(bytes) + "-byte data buffer but rank " +
                                std::to_string(self().rank()) + " has " + std::to_string(self().data_bytes()) +
                                " (it is reserved while tracing: trace through omniep.jax)");
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(s, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) {
    throw std::invalid_argument("omniep: the native buffer must grow to " + std::to_string(bytes) +
                                " bytes during CUDA graph capture; run the same op once eagerly before capturing");
  }
  // The op's first exchange: ranks that disagree on the op (and so on the size) stop here, together.
  BarrierArgs a = {};
  a.exchange = 1;
  a.desc[self().rank()] = d;
  launch_barrier(a, s);
  next_part(d);
  self().on_device([&] { check_cuda(cudaStreamSynchronize(s), "synchronising before growing the data buffer"); });
  if (stopped(d)) return false;
  self().grow_data(grown_size(bytes, self().data_bytes()), s);
  return true;
}

// A dispatch that routes itself and stopped at the data buffer's growth barrier (then its first exchange,
// before its kernel ran): a handle that routes nothing, as the layout kernels leave one
// (layout.cuh layout_route_nothing, em_layout.cuh), on the op's stream.
inline void route_nothing(const PrepareCall& p, int num_ranks, cudaStream_t s) {
  const auto fill = [s](void* dst, int byte, int64_t words) {
    if (dst != nullptr && words > 0) {
      check_cuda(cudaMemsetAsync(dst, byte, static_cast<size_t>(words) * sizeof(int32_t), s), "routing nothing");
    }
  };
  const int64_t T = p.num_tokens, K = p.num_topk, R = num_ranks, L = p.num_experts / num_ranks;
  fill(p.topk_idx32, 0xff, T * K);  // -1
  fill(p.send_pos, 0xff, T * R);
  fill(p.num_tokens_per_rank, 0, R);
  fill(p.num_tokens_per_expert, 0, p.num_experts);
  fill(p.recv_counts, 0, R);
  fill(p.send_offset, 0, R);
  fill(p.num_recv, 0, 1);
  fill(p.dropped, 0, 1);
  if (p.expert_major) {
    fill(p.copy_slot, 0xff, T * K);
    fill(p.recv_expert_count, 0, L);
    fill(p.num_recv_tokens_per_expert, 0, L);
    fill(p.em_num_recv, 0, 1);
    fill(p.em_dropped, 0, 1);
  }
}

// ---- ops ----

template <typename Rank>
PrepareResult OneRankOps<Rank>::prepare(const PrepareCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  const bool exact = c.capacity == kExactCapacity;
  if (exact && c.expert_major) throw std::invalid_argument("omniep: expert-major prepare needs a capacity");
  if (c.capacity < 0 && !exact) throw std::invalid_argument("omniep: capacity must be >= 0");
  if (c.index_bytes != 4 && c.index_bytes != 8) throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
  LayoutArgs a = {};
  a.topk_idx = mine<const void>(g, c.topk_idx);
  a.topk_idx32 = mine<int32_t>(g, c.topk_idx32);
  a.send_pos = mine<int32_t>(g, c.send_pos);
  a.num_tokens_per_rank = mine<int32_t>(g, c.num_tokens_per_rank);
  a.num_tokens_per_expert = mine<int32_t>(g, c.num_tokens_per_expert);
  a.recv_counts = mine<int32_t>(g, c.recv_counts);
  a.send_offset = mine<int32_t>(g, c.send_offset);
  a.num_recv = mine<int32_t>(g, c.num_recv);
  a.dropped = mine<int32_t>(g, c.dropped);
  a.num_tokens[g.rank()] = c.num_tokens;
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  // The rank-major view of an expert-major prepare keeps every row; its capacity is em_layout's.
  a.capacity = exact || c.expert_major ? 0x7fffffff : c.capacity;
  a.index_bytes = c.index_bytes;
  a.desc[g.rank()] = d;
  HostMailbox* box = nullptr;
  if (exact) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(s, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      throw std::invalid_argument("omniep: a rank-major dispatch with capacity=None waits on the host for the "
                                  "received row count and cannot be captured in a CUDA graph: pass a capacity");
    }
    box = mailbox();
    a.mailbox = mine<HostMailbox>(g, box);
    a.ticket = ++ticket_;
  }
  launch_layout(a, s);
  next_part(d);
  if (c.expert_major) {
    EMLayoutArgs e = {};
    e.topk_idx32 = mine<const int32_t>(g, c.topk_idx32);
    e.num_tokens_per_expert = mine<const int32_t>(g, c.num_tokens_per_expert);
    e.copy_slot = mine<int32_t>(g, c.copy_slot);
    e.recv_expert_count = mine<int32_t>(g, c.recv_expert_count);
    e.num_recv_tokens_per_expert = mine<int32_t>(g, c.num_recv_tokens_per_expert);
    e.num_recv = mine<int32_t>(g, c.em_num_recv);
    e.dropped = mine<int32_t>(g, c.em_dropped);
    e.num_tokens[g.rank()] = c.num_tokens;
    e.num_topk = c.num_topk;
    e.num_experts = c.num_experts;
    e.capacity = c.capacity;
    e.expert_alignment = c.expert_alignment;
    e.desc[g.rank()] = d;
    launch_em_layout(e, s);
    next_part(d);
  }
  if (!exact) return PrepareResult{c.capacity, c.capacity, false, 0, 0};
  // The one host wait of a non-cached dispatch (DeepEP's mapped counter): the layout kernel publishes
  // this rank's receive size, then the ticket. The device's own waits end within three timeouts (a
  // local one waits two more for a peer's: sync.cuh), so a silent ticket means the GPU never got to
  // the kernel.
  const auto start = std::chrono::steady_clock::now();
  const auto limit = std::chrono::nanoseconds(4 * g.timeout_ns()) + std::chrono::seconds(10);
  for (uint64_t spins = 1; box->ticket != a.ticket; ++spins) {
    if ((spins & 1023) == 0 && std::chrono::steady_clock::now() - start > limit) {
      throw std::runtime_error("omniep: rank " + std::to_string(g.rank()) + " timed out after " +
                               std::to_string(std::chrono::duration_cast<std::chrono::seconds>(limit).count()) +
                               " s waiting on the host for its received row count (the GPU never ran the prepare "
                               "kernel: is an earlier kernel on this stream stuck?)");
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before the ticket
  return PrepareResult{box->stopped ? 0 : box->rows, box->stopped ? 0 : box->max_rows, box->stopped != 0, box->fatal,
                       box->pending};
}

template <typename Rank>
void OneRankOps<Rank>::dispatch(const DispatchCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  // (Flags, not null pointers: an empty tensor's data pointer is null too.)
  const bool routing = c.routing;
  const int64_t C = c.capacity, K = c.num_topk;
  if (c.rows < 0 || c.rows > C) throw std::invalid_argument("omniep: dispatch rows must be in [0, capacity]");
  int64_t sizes[4] = {c.row_bytes, 0, 0, 0}, offsets[4] = {};
  int n = 1;
  const int at_x2 = c.row2_bytes > 0 ? n++ : -1;
  if (at_x2 >= 0) sizes[at_x2] = c.row2_bytes;
  const int at_idx = routing ? n : -1;
  if (routing) {
    sizes[n++] = K * 4;
    sizes[n++] = K * 4;
  }
  if (!ensure_data(static_cast<size_t>(pack_regions(C, sizes, n, offsets)), d, s)) {
    if (c.route != nullptr) self().on_device([&] { route_nothing(*c.route, self().num_ranks(), s); });
    return;
  }

  DispatchArgs a = {};
  a.x = mine<const uint8_t>(g, c.x);
  const int32_t *topk_idx32 = c.topk_idx32, *send_pos = c.send_pos, *send_offset = c.send_offset,
                *recv_counts = c.recv_counts;
  if (const PrepareCall* p = c.route) {  // the kernel routes first: prepare's rank-major outputs
    // (the index type and the routing's presence: checked where the launch is, launch_common.cuh)
    if (p->expert_major || p->capacity != c.capacity || c.capacity < 0) {
      throw std::invalid_argument("omniep: the route is not this static-capacity dispatch's");
    }
    a.route.on = 1;
    a.route.index_bytes = p->index_bytes;
    a.route.topk_idx = mine<const void>(g, p->topk_idx);
    a.route.num_tokens_per_rank = mine<int32_t>(g, p->num_tokens_per_rank);
    a.route.num_tokens_per_expert = mine<int32_t>(g, p->num_tokens_per_expert);
    a.route.num_recv = mine<int32_t>(g, p->num_recv);
    a.route.dropped = mine<int32_t>(g, p->dropped);
    topk_idx32 = p->topk_idx32;
    send_pos = p->send_pos;
    send_offset = p->send_offset;
    recv_counts = p->recv_counts;
  }
  a.send_pos = mine<const int32_t>(g, send_pos);
  a.send_offset = mine<const int32_t>(g, send_offset);
  a.recv_counts = mine<const int32_t>(g, recv_counts);
  a.recv_x = g.template sym<uint8_t>(offsets[0]);
  if (at_x2 >= 0) {
    a.x2 = mine<const uint8_t>(g, c.x2);
    a.recv_x2 = g.template sym<uint8_t>(offsets[at_x2]);
    a.own_x2 = mine<uint8_t>(g, c.recv_x2);
  }
  if (routing) {
    a.topk_idx32 = mine<const int32_t>(g, topk_idx32);
    a.topk_weights = mine<const float>(g, c.topk_weights);
    a.recv_topk_idx = g.template sym<int32_t>(offsets[at_idx]);
    a.recv_topk_weights = g.template sym<float>(offsets[at_idx + 1]);
    a.num_recv_tokens_per_expert = mine<int32_t>(g, c.num_recv_tokens_per_expert);
  }
  a.num_tokens[g.rank()] = c.num_tokens;
  a.row_bytes = c.row_bytes;
  a.row2_bytes = c.row2_bytes;
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  a.capacity = c.capacity;
  a.expert_alignment = c.expert_alignment;
  a.with_routing = routing ? 1 : 0;
  a.own_x = mine<uint8_t>(g, c.recv_x);  // my own rows straight into the result; the copy-out skips them
  if (routing) {  // the kernel copies the routing out itself (two copies fewer to launch)
    a.out_topk_idx = mine<int32_t>(g, c.recv_topk_idx);
    a.out_topk_weights = mine<float>(g, c.recv_topk_weights);
    a.out_rows = c.rows;
  }
  const bool fused = c.rows > 0 && c.rows * (c.row_bytes + c.row2_bytes) <= fused_copy_bytes();
  a.copy_rows = fused ? c.rows : 0;
  a.desc[g.rank()] = d;
  launch_dispatch(a, s);
  next_part(d);
  if (fused) return;

  const uintptr_t base = g.data_ptr();
  const uintptr_t skip_begin = reinterpret_cast<uintptr_t>(send_offset + g.rank());
  const uintptr_t skip_count = reinterpret_cast<uintptr_t>(recv_counts + g.rank());
  const auto out = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  copy_rows_except(out(c.recv_x), base + offsets[0], c.row_bytes, c.rows, skip_begin, skip_count, s);
  if (at_x2 >= 0) copy_rows_except(out(c.recv_x2), base + offsets[at_x2], c.row2_bytes, c.rows, skip_begin, skip_count, s);
}

template <typename Rank>
void OneRankOps<Rank>::combine(const CombineCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  const int64_t C = c.capacity, K = c.num_topk;
  if (c.rows < 0 || c.rows > C) throw std::invalid_argument("omniep: combine rows must be in [0, capacity]");
  const int64_t y_row = static_cast<int64_t>(c.hidden) * dtype_size(c.dtype);
  const bool grad = c.with_topk_grad;
  int64_t sizes[2] = {y_row, K * 4}, offsets[2] = {};
  if (!ensure_data(static_cast<size_t>(pack_regions(C, sizes, grad ? 2 : 1, offsets)), d, s)) return;

  CombineArgs a = {};
  set_combine_args(a, c, g, d);
  a.y = g.template sym<const void>(offsets[0]);
  a.send_pos = mine<const int32_t>(g, c.send_pos);
  a.send_offset = mine<const int32_t>(g, c.send_offset);
  a.own_y = mine<const void>(g, c.y);  // my own rows are read from y itself; the copy-in skips them
  const uintptr_t base = g.data_ptr();
  if (c.rows > 0 && c.rows * y_row <= fused_copy_bytes()) {  // the kernel copies in itself
    a.recv_counts = mine<const int32_t>(g, c.recv_counts);
    a.copy_rows = static_cast<int>(c.rows);
    const uintptr_t ends[2] = {base + offsets[0], reinterpret_cast<uintptr_t>(c.y)};
    a.copy_unit = row_copy_unit(y_row, ends, 2);
  } else {
    copy_rows_except(base + offsets[0], reinterpret_cast<uintptr_t>(c.y), y_row, c.rows,
                     reinterpret_cast<uintptr_t>(c.send_offset + g.rank()),
                     reinterpret_cast<uintptr_t>(c.recv_counts + g.rank()), s);
  }
  if (grad) {
    if (c.rows > 0) memcpy(base + offsets[1], reinterpret_cast<uintptr_t>(c.g_recv_topk_weights),
                           static_cast<size_t>(c.rows * K * 4), s);
    a.g_recv_topk_weights = g.template sym<const float>(offsets[1]);
  }
  launch_combine(a, s);
  next_part(d);
}

template <typename Rank>
void OneRankOps<Rank>::em_dispatch(const EMDispatchCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  const int64_t L = c.num_experts / g.num_ranks(), C = c.capacity;
  int64_t sizes[4] = {c.row_bytes, c.row2_bytes > 0 ? c.row2_bytes : 4, 4, 4}, offsets[4] = {};
  if (!ensure_data(static_cast<size_t>(pack_regions(L * C, sizes, 4, offsets)), d, s)) {
    if (c.route != nullptr) self().on_device([&] { route_nothing(*c.route, g.num_ranks(), s); });
    return;
  }
  EMDispatchArgs a = {};
  a.x = mine<const uint8_t>(g, c.x);
  a.cast_src = mine<const uint8_t>(g, c.cast_src);
  a.cast_round_scale = c.cast_round_scale ? 1 : 0;
  if (c.cast_src != nullptr && (c.row2_bytes * kFp8Block != c.row_bytes * 4 || c.row_bytes % kFp8Block != 0)) {
    throw std::invalid_argument("omniep: the fp8 cast needs fp8 rows of H % 128 == 0 bytes and H / 128 scales");
  }
  a.topk_weights = mine<const float>(g, c.topk_weights);
  if (const PrepareCall* p = c.route) {  // the kernel routes first: prepare's expert-major outputs
    if (p->index_bytes != 4 && p->index_bytes != 8) throw std::invalid_argument("omniep: topk_idx must be int32 or int64");
    if (p->capacity != c.capacity || !p->expert_major) throw std::invalid_argument("omniep: the route is not this dispatch's");
    a.route.on = 1;
    a.route.index_bytes = p->index_bytes;
    a.route.expert_alignment = p->expert_alignment;
    a.route.topk_idx = mine<const void>(g, p->topk_idx);
    a.route.num_recv_tokens_per_expert = mine<int32_t>(g, p->num_recv_tokens_per_expert);
    a.route.num_recv = mine<int32_t>(g, p->em_num_recv);
    a.route.dropped = mine<int32_t>(g, p->em_dropped);
    a.route.recv_stats = mine<int32_t>(g, p->recv_stats);
    a.route.push_ok = mine<int32_t>(g, p->push_ok);
  }
  // With the route these are the front's outputs (prepare's arrays), else prepare's results.
  a.topk_idx32 = mine<const int32_t>(g, c.route ? c.route->topk_idx32 : c.topk_idx32);
  a.copy_slot = mine<const int32_t>(g, c.route ? c.route->copy_slot : c.copy_slot);
  a.recv_expert_count = mine<const int32_t>(g, c.route ? c.route->recv_expert_count : c.recv_expert_count);
  a.recv_x = g.template sym<uint8_t>(offsets[0]);
  if (c.row2_bytes > 0) {
    a.x2 = mine<const uint8_t>(g, c.x2);
    a.recv_x2 = g.template sym<uint8_t>(offsets[1]);
  }
  a.recv_topk_idx = g.template sym<int32_t>(offsets[2]);
  a.recv_topk_weights = g.template sym<float>(offsets[3]);
  // The kernel fills the results itself: the counted slots only (no copy of the whole buffer).
  a.out_x = mine<uint8_t>(g, c.recv_x);
  if (c.row2_bytes > 0) a.out_x2 = mine<uint8_t>(g, c.recv_x2);
  a.out_topk_idx = mine<int32_t>(g, c.recv_topk_idx);
  a.out_topk_weights = mine<float>(g, c.recv_topk_weights);
  a.out_src = mine<int32_t>(g, c.recv_src);
  a.zero_padding = c.zero_padding ? 1 : 0;
  a.num_tokens[g.rank()] = c.num_tokens;
  a.row_bytes = c.row_bytes;
  a.row2_bytes = c.row2_bytes;
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  a.capacity = c.capacity;
  a.desc[g.rank()] = d;
  a.phase = c.send_only ? kEMSend : kEMWhole;
  launch_em_dispatch(a, s);
  if (c.send_only) keep_receive(a, d);
  next_part(d);
}

template <typename Rank>
template <typename Args>
void OneRankOps<Rank>::keep_receive(Args a, const OpDesc& d) {
  a.phase = kEMReceive;
  pending_ = a;
  pending_receive_ = static_cast<uint32_t>(d.w[kDescSeq]);
}

template <typename Rank>
void OneRankOps<Rank>::receive(cudaStream_t s) {
  if (pending_receive_ == 0) return;
  pending_receive_ = 0;
  if (const auto* a = std::get_if<EMDispatchArgs>(&pending_)) launch_em_dispatch(*a, s);
  if (const auto* a = std::get_if<EMCombineArgs>(&pending_)) launch_em_combine(*a, s);
  pending_ = std::monostate{};
}

template <typename Rank>
void OneRankOps<Rank>::em_combine(const EMCombineCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  const int64_t L = c.num_experts / g.num_ranks(), C = c.capacity;
  const bool grad = c.with_topk_grad;
  const int64_t row = static_cast<int64_t>(c.hidden) * dtype_size(c.dtype);
  int64_t sizes[2] = {row, 4}, offsets[2] = {};
  int64_t bytes = pack_regions(L * C, sizes, grad ? 2 : 1, offsets);
  // The push's receive buffers [2][back_rows] (rows, then their weights' gradients): where a peer may write
  // BEFORE this op's barrier, so nowhere a peer's previous op may still read after its last barrier (a peer is
  // at most that far behind): past every region any op used so far (the previous op's, whichever it was: a
  // replayed CUDA graph's first op follows whatever ran before it) — the last push buffers while that holds
  // (the other parity is this op's), else new ones past them.
  // Each parity's half holds back_rows rows, then (grad) their floats; the halves keep the allocated stride, the
  // same for every op that reuses them.
  const bool push = c.slot_src != nullptr && c.push_ok != nullptr && c.recv_expert_count != nullptr;
  const int64_t back_rows = push ? static_cast<int64_t>(em_push_tokens(c.capacity, g.num_ranks())) * c.num_topk : 0;
  int64_t back_offsets[2] = {};
  const int64_t back_half = pack_regions(back_rows, sizes, grad ? 2 : 1, back_offsets);
  const int64_t own_end = bytes;
  if (push) {
    const int64_t high = std::max(regions_high_, own_end);
    if (back_at_ < high || back_half_ < back_half) {
      back_at_ = (high + 255) / 256 * 256;
      back_half_ = back_half;
    }
    bytes = back_at_ + 2 * back_half_;
  }
  if (!ensure_data(static_cast<size_t>(bytes), d, s, own_end)) return;
  EMCombineArgs a = {};
  set_combine_args(a, c, g, d);
  a.y = g.template sym<const void>(offsets[0]);
  // weight 1 for dispatch_bwd: the kernel's null weights
  if (c.weighted) a.topk_weights = mine<const float>(g, c.topk_weights);
  a.copy_slot = mine<const int32_t>(g, c.copy_slot);
  // The kernel copies y (the counted slots, when the counts are given) into the buffer itself.
  a.own_y = mine<const void>(g, c.y);
  a.recv_expert_count = mine<const int32_t>(g, c.recv_expert_count);
  // (the rows of y it copies in or pushes, and, pushing, those of the push buffers)
  const uintptr_t ends[3] = {g.data_ptr() + offsets[0], reinterpret_cast<uintptr_t>(c.y), g.data_ptr() + back_at_};
  a.copy_unit = row_copy_unit(sizes[0], ends, push ? 3 : 2);
  if (grad) {
    a.own_g_recv_topk_weights = mine<const float>(g, c.g_recv_topk_weights);
    a.g_recv_topk_weights = g.template sym<const float>(offsets[1]);
  }
  if (push) {
    a.slot_src = mine<const int32_t>(g, c.slot_src);
    a.push_ok = mine<const int32_t>(g, c.push_ok);
    a.back = g.template sym<uint8_t>(back_at_);
    a.back_half = back_half_;
    a.back_g_at = back_offsets[1];
    a.back_rows = back_rows;
  }
  a.phase = c.send_only ? kEMSend : kEMWhole;
  launch_em_combine(a, s);
  if (c.send_only) keep_receive(a, d);
  next_part(d);
}

template <typename Rank>
void OneRankOps<Rank>::em_combine_bwd(const EMCombineBwdCall& c, OpDesc& d, cudaStream_t s) {
  Rank& g = self();
  const int64_t L = c.num_experts / g.num_ranks(), C = c.capacity;
  const int64_t row = static_cast<int64_t>(c.hidden) * dtype_size(c.dtype);
  const bool grad = c.with_topk_grad;
  int64_t sizes[2] = {row, row}, offsets[2] = {};
  if (!ensure_data(static_cast<size_t>(pack_regions(L * C, sizes, grad ? 2 : 1, offsets)), d, s)) return;
  EMCombineBwdArgs a = {};
  a.g_out = mine<const void>(g, c.g_out);
  a.topk_idx32 = mine<const int32_t>(g, c.topk_idx32);
  a.topk_weights = mine<const float>(g, c.topk_weights);
  a.copy_slot = mine<const int32_t>(g, c.copy_slot);
  a.recv_expert_count = mine<const int32_t>(g, c.recv_expert_count);
  a.g_y = g.template sym<void>(offsets[0]);
  a.num_tokens[g.rank()] = c.num_tokens;
  a.hidden = c.hidden;
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  a.capacity = c.capacity;
  a.dtype = c.dtype;
  a.desc[g.rank()] = d;
  // The kernel fills the caller's g_y itself and copies into the symmetric y only the slots the peers
  // read (EMCombineBwdArgs): no copy of a whole [L, C, H] buffer.
  a.out_g_y = mine<void>(g, c.g_y);
  a.zero_padding = c.zero_padding ? 1 : 0;
  if (grad) {
    a.own_y = mine<const void>(g, c.y);
    a.y = g.template sym<const void>(offsets[1]);
    a.g_topk_weights = mine<float>(g, c.g_topk_weights);
    a.with_topk_grad = 1;
  }
  launch_em_combine_bwd(a, s);
  next_part(d);
}

template <typename Rank>
void OneRankOps<Rank>::reject(OpDesc& d, cudaStream_t s) {
  BarrierArgs a = {};
  a.exchange = 1;
  d.w[kDescInputStatus] = kInputRejected;
  a.desc[self().rank()] = d;
  launch_barrier(a, s);
  next_part(d);
}

template <typename Rank>
void OneRankOps<Rank>::barrier(cudaStream_t s) {
  BarrierArgs a = {};
  launch_barrier(a, s);
}

template <typename Rank>
void OneRankOps<Rank>::statuses(Status* fatal, Status* pending, bool clear_pending) {
  self().on_device([&] {
    check_cuda(cudaDeviceSynchronize(), "synchronising before reading the status");
    RankWorkspace* ws = self().my_workspace();
    check_cuda(cudaMemcpy(fatal, &ws->fatal, sizeof(Status), cudaMemcpyDeviceToHost), "reading the status");
    check_cuda(cudaMemcpy(pending, &ws->pending, sizeof(Status), cudaMemcpyDeviceToHost), "reading the status");
    if (clear_pending && pending->w[kStCode] != kStatusOk) {
      check_cuda(cudaMemset(&ws->pending, 0, sizeof(Status)), "clearing the pending status");
      check_cuda(cudaDeviceSynchronize(), "clearing the pending status");
    }
  });
}

template <typename Rank>
void OneRankOps<Rank>::take_status(Status* out, cudaStream_t s) {
  self().on_device([&] {
    take_status_kernel<><<<1, 1, 0, s>>>(self().my_workspace(), out);
    check_cuda(cudaGetLastError(), "reading the op's status");
  });
}

}  // namespace omniep
