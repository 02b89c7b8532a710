// Argument structs of the kernels, passed by value (they hold the p2p tables, so a CUDA graph
// replays with the same pointers). Plain C++: the host launchers fill them.
//
// Shapes use T = num_tokens[rank] (may differ per rank), K = num_topk, R = ranks, E = experts,
// L = E / R, C = capacity (rows of every rank's receive buffer). "sym" marks buffers peers access.
#pragma once

#include <stdint.h>

#include "omniep/transport.h"

namespace omniep {

// Element types of floating tensors. Values are part of the C ABI (csrc/capi/omniep.h).
enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing `bytes` and every address in `addrs`:
// DeepEP-shaped rows move as 16-byte vectors and odd shapes (H = 3 in bf16) still work.
inline int row_copy_unit(int64_t bytes, const uintptr_t* addrs, int n) {
  for (int unit = 16; unit > 1; unit /= 2) {
    bool ok = bytes % unit == 0;
    for (int i = 0; ok && i < n; ++i) ok = addrs[i] % unit == 0;
    if (ok) return unit;
  }
  return 1;
}

struct LayoutArgs {
  PerRank<const void> topk_idx;            // [T, K] int32 or int64 (index_bytes), -1 = none
  PerRank<int32_t> topk_idx32;             // out [T, K]: topk_idx narrowed to int32
  PerRank<int32_t> send_pos;               // out [T, R]: position among tokens sent to r, or -1
  PerRank<int32_t> num_tokens_per_rank;    // out [R]
  PerRank<int32_t> num_tokens_per_expert;  // out [E]: (token, k) pairs per expert
  PerRank<int32_t> recv_counts;            // out [R]: tokens each source sends here (before capacity)
  PerRank<int32_t> send_offset;            // out [R]: first row of my tokens in rank r's receive order
  PerRank<int32_t> num_recv;               // out []: min(sum(recv_counts), C)
  PerRank<int32_t> dropped;                // out []: sum(recv_counts) - num_recv
  PerRank<int32_t> count_matrix;           // out [R, R] (optional): tokens s sends to r at [s, r]
  // Optional (exact receive size): pinned host memory the kernel fills after its count exchange, then
  // marks with `ticket` (status.h HostMailbox): the host's one wait of a non-cached dispatch.
  PerRank<HostMailbox> mailbox;
  int32_t ticket;
  int num_tokens[kMaxRanks];
  int num_topk;
  int num_experts;
  int capacity;     // INT32_MAX: exact (nothing is dropped)
  int index_bytes;  // 4 or 8
  OpDesc desc[kMaxRanks];  // entry [rank]: the rank's op descriptor (status.h), exchanged at the first barrier
};

// A static-capacity rank-major dispatch that routes itself (route.on): block 0 of the dispatch kernel
// does the layout kernel's work before the start barrier, which carries the counts (layout.cuh), and
// writes DispatchArgs' topk_idx32, send_pos, send_offset and recv_counts, which the kernel then reads.
struct RMRouteArgs {
  int on;
  int index_bytes;                          // 4 or 8
  PerRank<const void> topk_idx;             // [T, K] int32 or int64, -1 = none
  PerRank<int32_t> num_tokens_per_rank;     // out [R]
  PerRank<int32_t> num_tokens_per_expert;   // out [E]
  PerRank<int32_t> num_recv;                // out []: min(sum(recv_counts), C)
  PerRank<int32_t> dropped;                 // out []
};

struct DispatchArgs {
  RMRouteArgs route;
  PerRank<const uint8_t> x;                 // [T, row_bytes]
  PerRank<const uint8_t> x2;                // [T, row2_bytes]: optional second payload (fp8 scales)
  PerRank<const int32_t> topk_idx32;        // [T, K]
  PerRank<const float> topk_weights;        // [T, K]
  PerRank<const int32_t> send_pos;          // [T, R]
  PerRank<const int32_t> send_offset;       // [R]
  PerRank<const int32_t> recv_counts;       // [R]: rows each source sends here (the padding starts at their sum)
  PerRank<uint8_t> recv_x;                  // sym [C, row_bytes]
  PerRank<uint8_t> recv_x2;                 // sym [C, row2_bytes]
  PerRank<int32_t> recv_topk_idx;           // sym [C, K] (with_routing)
  PerRank<float> recv_topk_weights;         // sym [C, K] (with_routing)
  PerRank<int32_t> num_recv_tokens_per_expert;  // out [L] (with_routing)
  // Optional [C, row_bytes] / [C, row2_bytes]: where a rank's OWN rows (source == receiver) go
  // instead of its recv_x / recv_x2 (the caller's result, so the copy-out skips them:
  // kernels/copy_rows.cuh). Null entry: the symmetric buffer, like every other row.
  PerRank<uint8_t> own_x;
  PerRank<uint8_t> own_x2;
  // Optional [out_rows, K]: the caller's recv_topk_idx / recv_topk_weights, which the kernel fills from
  // its receive buffer after the end barrier (no copies launched after it). Null: left in the buffer.
  PerRank<int32_t> out_topk_idx;
  PerRank<float> out_topk_weights;
  int out_rows;
  // > 0: after the end barrier the kernel itself copies rows [0, copy_rows) of recv_x / recv_x2 to
  // own_x / own_x2, but the rank's own segment (the copy-out, fused: kernels/copy_rows.cuh).
  int copy_rows;
  int num_tokens[kMaxRanks];
  int64_t row_bytes;
  int64_t row2_bytes;  // 0 = no second payload
  int unit;            // copy unit of x / recv_x rows (rows.cuh: row_copy_unit)
  int unit2;
  int num_topk;
  int num_experts;
  int capacity;
  int expert_alignment;
  int with_routing;  // 0: move rows only (combine_bwd, a cached dispatch of g_out)
  OpDesc desc[kMaxRanks];
};

// The scalars of every combine-like op: combine and dispatch_bwd of both layouts (CombineArgs,
// EMCombineArgs in kernels/em_args.h) and the expert-major combine_bwd (EMCombineBwdArgs, no bias).
struct CombineScalars {
  int num_tokens[kMaxRanks];
  int hidden;
  int num_topk;
  int num_experts;
  int capacity;
  int dtype;
  int num_bias;
  int bias_dtype[2];
  int with_topk_grad;
  OpDesc desc[kMaxRanks];
};

struct CombineArgs : CombineScalars {
  PerRank<const void> y;                    // sym [C, H] in `dtype`
  PerRank<void> out;                        // [T, H] in `dtype`
  PerRank<const void> bias[2];              // [T, H] in bias_dtype[i], first num_bias used
  PerRank<const int32_t> topk_idx32;        // [T, K]
  PerRank<const int32_t> send_pos;          // [T, R]
  PerRank<const int32_t> send_offset;       // [R]
  PerRank<const float> g_recv_topk_weights; // sym [C, K] (with_topk_grad: dispatch_bwd)
  PerRank<float> g_topk_weights;            // out [T, K] (with_topk_grad)
  // Optional [C, H]: where a rank reads its OWN rows (it pulls from itself) instead of its y in the
  // symmetric buffer: the caller's y, so the copy-in skips them (kernels/copy_rows.cuh). Null: sym.
  PerRank<const void> own_y;
  PerRank<const int32_t> recv_counts;       // [R] (copy_rows > 0)
  // > 0: before the start barrier the kernel itself copies rows [0, copy_rows) of own_y but the
  // rank's own segment into y (the copy-in, fused: kernels/copy_rows.cuh), in units of copy_unit.
  int copy_rows;
  int copy_unit;
};

}  // namespace omniep
