// EpRank: ONE rank of an EP group as every framework binding sees it — the ops of DESIGN §2 over raw
// device pointers and a stream, with the data path (symmetric-buffer regions, own rows moved
// directly, copies in and out, buffer growth) and the op descriptors (omniep/status.h) inside.
//
// The torch ops (csrc/torch) and the XLA FFI handlers (csrc/ffi) only translate their tensor types
// into these calls; IpcRank, NvshmemRank and NcclRank implement them once, in OneRankOps
// (backends/one_rank_ops.h, backends/rank_ops.h). A binding that does not link a rank's module (the
// torch ops library serves all three) reaches it through this interface: plain virtual calls on POD
// arguments. Host-only header, no CUDA headers.
//
// Shapes: T tokens of this rank, K = num_topk, R ranks, E experts, L = E / R, C = the symmetric
// capacity (rows of every rank's receive buffer, rank-major; slots per local expert, expert-major).
// Every op starts with `begin()` (the descriptor, with the group's next sequence number); the calls
// of one op pass the same descriptor. A call never raises for what only the device or the peers can
// see: that lands in the rank's status (`statuses()`), which the binding raises at its host waits.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <stdexcept>

#include "omniep/status.h"
#include "omniep/stream.h"  // cudaStream_t (hipStream_t in a HIP build)

namespace omniep {

inline constexpr int kExactCapacity = -1;  // PrepareCall::capacity: rank-major, receive exactly what arrives

// prepare: the layout kernel (+ the expert-major layout); or the `route` of a dispatch that runs the
// layout itself (DispatchCall / EMDispatchCall). Outputs are device int32 arrays the caller allocated;
// the expert-major ones are null for rank-major.
struct PrepareCall {
  const void* topk_idx;  // [T, K] int32 or int64 (index_bytes)
  int index_bytes;
  int num_tokens, num_topk, num_experts;
  int capacity;  // rank-major rows / expert-major slots; kExactCapacity (rank-major only): wait for it
  int expert_alignment;
  bool expert_major;
  int32_t* topk_idx32;             // [T, K]
  int32_t* send_pos;               // [T, R]
  int32_t* num_tokens_per_rank;    // [R]
  int32_t* num_tokens_per_expert;  // [E]
  int32_t* recv_counts;            // [R]
  int32_t* send_offset;            // [R]
  int32_t* num_recv;               // [] rank-major rows kept
  int32_t* dropped;                // []
  int32_t* copy_slot;              // [T, K] expert-major: the copy's slot at its receiver, -1 = none / dropped
  int32_t* recv_expert_count;      // [L] expert-major: copies kept per local expert
  int32_t* num_recv_tokens_per_expert;  // [L] expert-major: the same rounded up to expert_alignment
  int32_t* em_num_recv;            // [] expert-major copies kept
  int32_t* em_dropped;             // [] expert-major copies dropped
  int32_t* recv_stats;             // [L] expert-major, optional: += recv_expert_count by the dispatch kernel's
                                   // routing front (DeepEP's cumulative_local_expert_recv_stats)
  int32_t* push_ok;                // [] expert-major, optional: whether the combine of this handle may push
                                   // (EMCombineArgs; written by the dispatch kernel, alike on every rank)
};

struct PrepareResult {
  int rows;      // rows this rank's results hold (exact: what arrives; else the capacity)
  int capacity;  // C of every rank's buffer (exact: the largest receive of any rank)
  bool stopped;  // the op stopped on every rank (exact mode only: a status says why); nothing more to run
  // Exact mode: the rank's status codes when it published (an older pending status is raised by the
  // binding once this op has run everywhere).
  int fatal, pending;
};

// Rank-major dispatch: with topk_weights (the routing moves too) or without (a cached dispatch;
// combine_bwd of the rank-major layout). Results hold `rows` rows (<= capacity); padding rows zero.
struct DispatchCall {
  const void* x;        // [T, row_bytes]
  int64_t row_bytes;
  const void* x2;       // [T, row2_bytes] second payload (fp8 scales) or null
  int64_t row2_bytes;
  int num_tokens, num_topk, num_experts, capacity, rows, expert_alignment;
  bool routing;               // the routing moves too (topk_weights and the recv_topk_* / per-expert outputs)
  const float* topk_weights;  // [T, K]
  const int32_t *topk_idx32, *send_pos, *send_offset, *recv_counts;  // prepare's
  void* recv_x;              // [rows, row_bytes]
  void* recv_x2;             // [rows, row2_bytes]
  int32_t* recv_topk_idx;    // [rows, K] (with topk_weights)
  float* recv_topk_weights;  // [rows, K] (with topk_weights)
  int32_t* num_recv_tokens_per_expert;  // [L] (with topk_weights)
  // Static capacity: the dispatch kernel routes itself (no prepare call before it, one launch): the
  // prepare's arguments; its outputs (topk_idx32, send_pos, send_offset, recv_counts, the counts) are
  // written by the kernel, and the fields above of the same names are ignored.
  const PrepareCall* route = nullptr;
};

// What both layouts' combine (and dispatch_bwd) take: y's rows summed per source token, plus biases.
struct CombineBase {
  const void* y;  // rank-major [rows, hidden]; expert-major [L, C, hidden]; in dtype (args.h DType)
  int hidden, dtype;
  int num_tokens, num_topk, num_experts, capacity;
  const int32_t* topk_idx32;  // [T, K] prepare's
  const void* bias[2];        // [T, hidden] in bias_dtype[i]; first num_bias used
  int bias_dtype[2], num_bias;
  void* out;                         // [T, hidden] in dtype
  bool with_topk_grad;               // dispatch_bwd: read the weight gradients back
  const float* g_recv_topk_weights;  // y's rows x K (rank-major) / [L, C] (expert-major) (with_topk_grad)
  float* g_topk_weights;             // [T, K] (with_topk_grad)
};

// Rank-major combine; with g_recv_topk_weights it is dispatch_bwd (weight gradients read back).
struct CombineCall : CombineBase {
  int rows;  // y's rows (<= capacity)
  const int32_t *send_pos, *send_offset, *recv_counts;  // prepare's
};

// Expert-major dispatch into recv_x[L, C, row_bytes]: slots past recv_expert_count unspecified unless
// zero_padding (their recv_topk_idx -1, weights 0 either way). With `route` (an expert-major
// PrepareCall) the dispatch routes too, in the same kernel: no prepare call before it, and
// topk_idx32 / copy_slot / recv_expert_count here are ignored (route's outputs serve).
struct EMDispatchCall {
  const PrepareCall* route;
  bool cast_round_scale;  // the cast's scales rounded up to powers of two (DeepEP's round_scale)
  const void* cast_src;  // bf16 [T, H] the kernel casts into x / x2 first (writable staging: e4m3 rows, fp32
                         // scales per 128 channels: DeepEP's low-latency cast), or null
  const void* x;
  int64_t row_bytes;
  const void* x2;
  int64_t row2_bytes;
  int num_tokens, num_topk, num_experts, capacity;
  const float* topk_weights;
  const int32_t *topk_idx32, *copy_slot, *recv_expert_count;
  void* recv_x;              // [L, C, row_bytes]
  void* recv_x2;             // [L, C, row2_bytes]
  int32_t* recv_topk_idx;    // [L, C]
  float* recv_topk_weights;  // [L, C]
  int32_t* recv_src;         // [L, C], optional: each counted slot's source (em_src_code), for the push combine
  bool zero_padding;         // zero the padding rows of recv_x / recv_x2 (DESIGN §2)
  bool send_only;            // launch the sends only; EpRank::receive runs the rest (DeepEP's receive hook)
};

// Expert-major combine (weighted) and dispatch_bwd (topk_weights null: weight 1; g_recv_topk_weights).
struct EMCombineCall : CombineBase {
  bool weighted;  // combine: times topk_weights; dispatch_bwd: weight 1
  const float* topk_weights;
  const int32_t* copy_slot;          // prepare's
  const int32_t* recv_expert_count;  // prepare's [L], or null: y's padding slots move too
  bool send_only;                    // copy y in (or push it) and signal only; EpRank::receive sums
  // Optional (both, with recv_expert_count): the dispatch's recv_src and push_ok — the combine then pushes
  // each counted slot's row to its source when *push_ok (one barrier, no copy of y: EMCombineArgs).
  const int32_t* slot_src;
  const int32_t* push_ok;
};

// Expert-major combine_bwd: g_y[l, c] = round(w * g_out[t]) and, with y, g_topk_weights = <g_out, y>.
// A cached dispatch of g_out: g_y's padding slots (past recv_expert_count) unspecified unless zero_padding.
struct EMCombineBwdCall {
  const void* g_out;  // [T, hidden]
  int hidden, dtype;
  int num_tokens, num_topk, num_experts, capacity;
  const float* topk_weights;
  const int32_t *topk_idx32, *copy_slot, *recv_expert_count;
  bool with_topk_grad;    // also the weight gradients (needs y)
  const void* y;          // [L, C, hidden] (with_topk_grad)
  void* g_y;              // [L, C, hidden]
  float* g_topk_weights;  // [T, K] (with_topk_grad)
  bool zero_padding;      // zero g_y's padding rows (the handle's dispatch had zero_padding: DESIGN §2)
};

class EpRank {
 public:
  virtual ~EpRank() = default;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  virtual size_t data_bytes() const = 0;

  // The descriptor of a new op (the group's next sequence number). A receive still pending must
  // run first (receive(), on the op's stream): its op holds the buffers the next one reuses.
  OpDesc& begin(OpKind op, int num_experts, int hidden, int dtype, int layout, int capacity, int handle,
                int num_topk) {
    if (pending_receive_ != 0) throw std::logic_error("omniep: an op began while a receive is pending (a bug)");
    current_ = make_desc(++seq_, op, num_experts, hidden, dtype, layout, capacity, handle, num_topk);
    return current_;
  }

  // An expert-major dispatch or combine called with send_only leaves its second half pending:
  // pending_receive() is its op's sequence number (0: nothing pending) until receive() launches that
  // half on `s` (DeepEP's receive hook; stream-ordered, no host wait).
  uint32_t pending_receive() const { return pending_receive_; }
  virtual void receive(cudaStream_t s) = 0;

  virtual PrepareResult prepare(const PrepareCall& c, OpDesc& d, cudaStream_t s) = 0;
  virtual void dispatch(const DispatchCall& c, OpDesc& d, cudaStream_t s) = 0;
  virtual void combine(const CombineCall& c, OpDesc& d, cudaStream_t s) = 0;
  virtual void em_dispatch(const EMDispatchCall& c, OpDesc& d, cudaStream_t s) = 0;
  virtual void em_combine(const EMCombineCall& c, OpDesc& d, cudaStream_t s) = 0;
  virtual void em_combine_bwd(const EMCombineBwdCall& c, OpDesc& d, cudaStream_t s) = 0;
  // The op's place in the group's sequence when this rank's host refused its arguments: the peers
  // learn it (input status kInputRejected) and stop the op too.
  virtual void reject(OpDesc& d, cudaStream_t s) = 0;
  // A bare barrier over the group (collective, in op order; benchmarks align the ranks with it).
  virtual void barrier(cudaStream_t s) = 0;
  // Synchronises the device; this rank's sticky and pending statuses (code 0 = none). The pending one
  // is cleared when `clear_pending`.
  virtual void statuses(Status* fatal, Status* pending, bool clear_pending) = 0;
  // Stream-ordered, no host wait: the status the last op left (sticky, else pending, which is cleared)
  // into device memory `out` (kStatusWords int32). For static shapes: a capacity overflow reads as OK
  // (the dropped rows are counted in the op's results).
  virtual void take_status(Status* out, cudaStream_t s) = 0;

  // The descriptor of the last op begun (a binding whose op spans two calls, prepare then dispatch,
  // continues it).
  OpDesc& current() { return current_; }

 protected:
  uint32_t seq_ = 0;
  OpDesc current_ = {};
  uint32_t pending_receive_ = 0;
};

}  // namespace omniep
