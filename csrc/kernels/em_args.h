// Argument structs of the expert-major ("low-latency") kernels, passed by value like args.h's.
//
// Layout (DESIGN §2): receiver r holds recv_x[L, C, H]: for each local expert l, one copy per
// (source token, k) that chose global expert r*L + l, ordered by (source rank, source token, k);
// C = capacity (slots per local expert, the same on every rank so the buffers are symmetric).
// A copy's slot c = (copies of that expert from lower source ranks) + (earlier copies of it from
// the same source in (t, k) order); copies with c >= C are dropped and counted.
//
// The source keeps copy_slot[T, K]: c, or -1 when (t, k) is unrouted or dropped. It comes from
// em_layout_kernel (prepare, the JAX and virtual-rank bindings) or from the routing front of the
// dispatch kernel itself (EMRouteArgs: the torch ops' one-launch dispatch) — the same steps
// (em_layout.cuh), the same slots. Every later pass (combine, both backward passes) finds a copy
// through it, so only those scan the routing in order.
#pragma once

#include <stdint.h>

#include "kernels/args.h"
#include "omniep/transport.h"

namespace omniep {

// Runs after layout_kernel (kernels/layout.cuh) on the same stream: reads its topk_idx32 and
// num_tokens_per_expert.
struct EMLayoutArgs {
  PerRank<const int32_t> topk_idx32;             // [T, K] from layout_kernel
  PerRank<const int32_t> num_tokens_per_expert;  // [E] from layout_kernel
  PerRank<int32_t> copy_slot;                    // out [T, K]: slot at the receiver, -1 = none/dropped
  PerRank<int32_t> recv_expert_count;            // out [L]: kept copies per local expert, min(n_l, C)
  PerRank<int32_t> num_recv_tokens_per_expert;   // out [L]: kept copies rounded up to expert_alignment
  PerRank<int32_t> num_recv;                     // out []: kept copies (sum of recv_expert_count)
  PerRank<int32_t> dropped;                      // out []: copies lost to capacity
  PerRank<int32_t> max_expert_count;             // out [] (optional): max_l n_l (the exact capacity of this rank)
  PerRank<int32_t> expert_count_matrix;          // out [R, E], optional (null: not written): copies
                                                 // every source sends to every expert (the exchange)
  int num_tokens[kMaxRanks];
  int num_topk;
  int num_experts;
  int capacity;
  int expert_alignment;
  OpDesc desc[kMaxRanks];  // a later kernel of the layout kernel's op (part 1)
};

// The routing front of the one-kernel dispatch (EMDispatchArgs::route): prepare's expert-major work
// done by the dispatch kernel itself (kernels/em_dispatch.cuh), no layout kernel before it.
struct EMRouteArgs {
  int on;                                         // 0: prepare ran before (copy_slot etc. are inputs)
  int index_bytes;                                // 4 or 8
  int expert_alignment;
  PerRank<const void> topk_idx;                   // [T, K] int32 or int64, -1 = none
  // The front also writes EMDispatchArgs' topk_idx32 (the ids narrowed, -1 for none), copy_slot and
  // recv_expert_count, which the rest of the kernel then reads.
  PerRank<int32_t> num_recv_tokens_per_expert;    // out [L]: rounded up to expert_alignment
  PerRank<int32_t> num_recv;                      // out []
  PerRank<int32_t> dropped;                       // out []
  PerRank<int32_t> recv_stats;                    // in/out [L] (optional): += recv_expert_count (DeepEP's
                                                  // cumulative_local_expert_recv_stats, no launch of its own)
  PerRank<int32_t> push_ok;                       // out [] (optional): 1 when every rank's T <= em_push_tokens(C,
                                                  // R), so the push combine's buffers hold every copy (em_combine.cuh)
};

// A copy's source as the push combine needs it: its (t, k) pair i = t * K + k at source rank s.
constexpr int32_t em_src_code(int64_t i, int s, int R) { return static_cast<int32_t>(i * R + s); }
// Tokens per rank the push combine's receive buffer holds ([2][that * K] rows at every rank: the same size on
// every rank, from the capacity the descriptors agree on): C / R rounded up — the tokens of every rank when
// capacity=None (C = R * T) and DeepEP's num_max_dispatch_tokens_per_rank through the Buffer (C = R * M).
constexpr int em_push_tokens(int capacity, int R) { return (capacity + R - 1) / R; }

// An expert-major op in one kernel, or split in two launches of it (the same kernel, one profiler row):
// the sends, up to the signals of the barrier that says "my rows have arrived / my y is complete",
// and later the receive, from the waits of that barrier on.
enum EMPhase : int { kEMWhole = 0, kEMSend = 1, kEMReceive = 2 };

struct EMDispatchArgs {
  EMRouteArgs route;                         // route.on: the kernel routes first, writing topk_idx32,
                                             // copy_slot and recv_expert_count below
  PerRank<const uint8_t> x;                  // [T, row_bytes]
  PerRank<const uint8_t> x2;                 // [T, row2_bytes]: optional second payload (fp8 scales)
  // Optional bf16 [T, H]: the kernel first casts it into x (e4m3 [T, H], row_bytes = H) and x2
  // (fp32 scales [T, H / 128]) as DeepEP's low-latency dispatch does (rows.cuh grid_cast_fp8), before
  // its first barrier, and sends those.
  PerRank<const uint8_t> cast_src;
  int cast_round_scale;                      // 1: the cast's scales are rounded up to powers of two
  PerRank<const int32_t> topk_idx32;         // [T, K]
  PerRank<const float> topk_weights;         // [T, K]
  PerRank<const int32_t> copy_slot;          // [T, K] from em_layout
  PerRank<const int32_t> recv_expert_count;  // [L] from em_layout: slots [count, C) are padding
  PerRank<uint8_t> recv_x;                   // sym [L, C, row_bytes]
  PerRank<uint8_t> recv_x2;                  // sym [L, C, row2_bytes]
  PerRank<int32_t> recv_topk_idx;            // sym [L, C]: l on kept slots (kEMSlotInResult on the rank's
                                             // own copies when out_x is given: their rows and routing
                                             // are in the results, not here); with out_src, em_src_code
  PerRank<float> recv_topk_weights;          // sym [L, C]: the copy's weight
  // Optional: the caller's results, which the kernel fills from its receive buffers after its end
  // barrier — only the counted slots' rows (no copy launched after it, nothing that grows with C * H):
  // out_x [L, C, row_bytes], out_x2 [L, C, row2_bytes], out_topk_idx / out_topk_weights [L, C]
  // (-1 / 0 on padding slots). Null out_x: the results ARE the symmetric buffers (virtual ranks).
  PerRank<uint8_t> out_x;
  PerRank<uint8_t> out_x2;
  PerRank<int32_t> out_topk_idx;
  PerRank<float> out_topk_weights;
  // Optional, with out_x: [L, C] each counted slot's source, em_src_code (what the push combine needs: its
  // recv_topk_idx entries then carry the code, not l, and the results copy writes l from the slot).
  PerRank<int32_t> out_src;
  int zero_padding;    // 1: padding rows of the result are zeroed too (DESIGN §2 zero_padding); 0: left as they are
  int phase;           // kEMWhole, or one half of a dispatch split at its end barrier (DeepEP's receive hook)
  int num_tokens[kMaxRanks];
  int64_t row_bytes;
  int64_t row2_bytes;  // 0 = no second payload
  int unit;            // copy unit of x / recv_x rows (args.h: row_copy_unit)
  int unit2;
  int num_topk;
  int num_experts;
  int capacity;
  OpDesc desc[kMaxRanks];
};

// combine (weighted) and dispatch_bwd (topk_weights all null: weight 1, with_topk_grad = 1).
struct EMCombineArgs : CombineScalars {
  PerRank<const void> y;                      // sym [L, C, H] in `dtype`
  int phase;                                  // EMPhase: split at the start barrier (send: y in, signals)
  // Optional: the caller's y [L, C, H] (and g_recv_topk_weights [L, C]), copied into the symmetric
  // buffers by the kernel before its start barrier — the counted slots only when recv_expert_count is
  // given, else every slot; skipped when it already is the symmetric buffer (zero-copy). A whole op
  // (kEMWhole) copies only the slots its peers pull and reads the rank's own copies from own_y, so the
  // symmetric y holds no own copies afterwards.
  PerRank<const void> own_y;
  PerRank<const float> own_g_recv_topk_weights;
  PerRank<const int32_t> recv_expert_count;   // [L] (optional)
  int copy_unit;                              // copy unit of own_y / y rows
  PerRank<void> out;                          // [T, H] in `dtype`
  PerRank<const void> bias[2];                // [T, H] in bias_dtype[i], first num_bias used
  PerRank<const int32_t> topk_idx32;          // [T, K]
  PerRank<const float> topk_weights;          // [T, K]; a null entry means every weight is 1
  PerRank<const int32_t> copy_slot;           // [T, K]
  PerRank<const float> g_recv_topk_weights;   // sym [L, C] (with_topk_grad)
  PerRank<float> g_topk_weights;              // out [T, K] (with_topk_grad)
  // The push combine (all four given, and *push_ok set by the dispatch): every rank writes the rows of its
  // counted slots into their sources' receive buffers, back[p][t * K + k] (p: the barrier's parity), then ONE
  // barrier, then every source sums its own buffer — no copy of y, no second barrier. Else the pull above.
  PerRank<const int32_t> slot_src;            // [L, C]: the dispatch's out_src
  PerRank<const int32_t> push_ok;             // []: the dispatch's route.push_ok
  PerRank<uint8_t> back;                      // sym: two halves of back_half bytes (parity p at p * back_half),
  int64_t back_half;                          // each [back_rows, H] in `dtype`, then (with_topk_grad) back_rows
  int64_t back_g_at;                          // floats at byte back_g_at of the half
  int64_t back_rows;                          // em_push_tokens(C, R) * K
};

// combine_bwd: g_y[l, c] = round(w[t, k] * g_out[t]) pushed to the copy's slot, and (with_topk_grad)
// g_topk_weights[t, k] = <g_out[t], y[l, c]> in fp32. A cached dispatch of g_out (DESIGN §2): g_y's padding
// slots [recv_expert_count[l], C) are zeroed only with zero_padding (the dispatch that made the handle was
// asked for zero_padding=True), else left unwritten, so the op's cost follows the routed copies, not L * C * H.
struct EMCombineBwdArgs : CombineScalars {  // num_bias / bias_dtype unused
  PerRank<const void> g_out;                  // [T, H] in `dtype`
  PerRank<const void> y;                      // sym [L, C, H] in `dtype` (with_topk_grad)
  PerRank<const int32_t> topk_idx32;          // [T, K]
  PerRank<const float> topk_weights;          // [T, K]
  PerRank<const int32_t> copy_slot;           // [T, K]
  PerRank<const int32_t> recv_expert_count;   // [L]
  PerRank<void> g_y;                          // sym out [L, C, H] in `dtype`, padding zeroed with zero_padding
  PerRank<float> g_topk_weights;              // out [T, K] (with_topk_grad)
  // Optional: the caller's y [L, C, H] (with_topk_grad), copied into the symmetric `y` above for the
  // counted slots (the peers' only, with out_g_y), and g_y result [L, C, H]. With out_g_y the kernel fills
  // the result itself: its own copies' rows pushed there directly (their y read from own_y), the padding
  // zeroed there (with zero_padding), the peers' rows copied out of the symmetric g_y after the end
  // barrier. Nothing copies a whole [L, C, H] buffer.
  PerRank<const void> own_y;
  PerRank<void> out_g_y;
  int zero_padding;  // 1: the result's padding slots are zeroed (out_g_y, else the symmetric g_y); 0: left as they are
};

}  // namespace omniep
