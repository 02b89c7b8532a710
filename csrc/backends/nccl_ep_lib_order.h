// How omniep's nccl_ep_lib adapter learns the order NCCL EP delivers rows in, and maps it to DESIGN §2.
//
// What NVIDIA's header says about the order of dispatch's output (nccl_ep.h and nccl_ep/ep_enums.h of
// nccl-extensions 0.1.0, NCCL EP API version 2):
//   * HT, NCCL_EP_LAYOUT_FLAT: "Tokens arrive as a single contiguous sequence with no rank-major or
//     expert-major structure." Which slot a token lands in is not specified, and dispatch returns no
//     source information (no source rank or token index per slot).
//   * LL, NCCL_EP_LAYOUT_EXPERT_MAJOR: tokens[local_expert, max_dispatch_tokens_per_rank * num_ranks,
//     hidden], the first expert_counters[e] slots of expert e filled. The order inside an expert is not
//     specified either, and again no source information is returned.
//   * combine returns "tokens in the original order" (out[t] is token t of the caller): no mapping is
//     needed on the way back, only the combine input must sit in the slots dispatch filled.
// So the adapter does not assume an order: every row it sends carries a TAG after its payload, and
// the receiver reads the tags of the slots NCCL EP filled and derives the contract order from them.
//
// Row sent through NCCL EP (one per source token; `elt` = bytes of the dtype):
//   [ payload: H * elt bytes | zero pad to 16 | tag: tag_words(K, em) int32 | zero pad to 16 (expert-major:
//     to 1024, the row widths LL's kernels accept; see kLowLatencyRowAlign) ]
// Tag words: [0] source rank, [1] source token index, and for the expert-major layout also
// [2, 2 + K) the token's global expert ids and [2 + K, 2 + 2K) the bits of its K fp32 weights (LL's
// expert-major dispatch returns no weights; the receiver picks the weight of its copy from these).
// NCCL EP moves the row as `dtype` elements without converting them (quantization recipe NONE), so the
// tag's bytes arrive unchanged.
//
// The mapping (the same on the device, nccl_ep_lib_order.cu, and in the host loop the CPU tests run):
//   key(src, t) = src * max_tokens + t   (max_tokens = the group's max_dispatch_tokens_per_rank)
// ascending key == ascending (source rank, source token), the contract order: rank-major rows
// "ordered by (source rank ascending, source token index ascending)"; expert-major copies "ordered by
// (source rank, source token, k) inside each expert" -- with one copy per (token, expert), which
// NCCL EP's expert-major layout guarantees ("at most one match" per (source_token, local_expert)) and
// the adapter enforces by rejecting duplicate expert ids in a row. For every filled slot s the
// receiver sets flag[key] = 1 and slot_of[key] = s (per expert for expert-major); an exclusive prefix
// sum of the flags gives each key's contract position; a position at or past the capacity is a row
// dropped in contract order (the last ones). Host-only callers compile this header with any C++17
// compiler (no CUDA needed); the device code includes it from nvcc.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define OMNIEP_ORDER_HD __host__ __device__ __forceinline__
#else
#define OMNIEP_ORDER_HD inline
#endif

namespace omniep::nccl_ep_lib {

OMNIEP_ORDER_HD int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// int32 words of a row's tag.
OMNIEP_ORDER_HD int tag_words(int num_topk, bool expert_major) { return expert_major ? 2 + 2 * num_topk : 2; }

// LL's kernels take the row width (the tokens' sizes[1], in elements) as a JIT template parameter and
// refuse widths that are not whole warp iterations (nccl_ep/device/ll_ep.cuh of nccl-extensions 0.1.0:
// dispatch `kHidden % (32 * kNumElemsPerRead) == 0`, 512 bytes; combine `kHidden % (kWarpSize *
// kNumRecvUnrolls * kNumElemsPerInt4) == 0`, 1024 bytes, and `kHidden % 128 == 0`), so an expert-major
// row is padded to a multiple of 1024 bytes. HT needs only 16 (its max_token_bytes rule).
constexpr int64_t kLowLatencyRowAlign = 1024;

// Byte offset of the tag in a sent row, and the bytes of the whole row (a multiple of 16; expert-major,
// of kLowLatencyRowAlign).
OMNIEP_ORDER_HD int64_t tag_offset(int64_t hidden, int elt) { return align16(hidden * elt); }
OMNIEP_ORDER_HD int64_t row_bytes(int64_t hidden, int elt, int num_topk, bool expert_major) {
  const int64_t tagged = tag_offset(hidden, elt) + align16(4 * static_cast<int64_t>(tag_words(num_topk, expert_major)));
  return expert_major ? (tagged + kLowLatencyRowAlign - 1) / kLowLatencyRowAlign * kLowLatencyRowAlign : tagged;
}

// The contract order key of a row from `src`, token `t`.
OMNIEP_ORDER_HD int64_t order_key(int32_t src, int32_t t, int64_t max_tokens) { return src * max_tokens + t; }

// Whether a tag read from a filled slot is one this group can have sent (a corrupted or stale slot
// fails here rather than writing out of bounds).
OMNIEP_ORDER_HD bool tag_valid(const int32_t* tag, int num_ranks, int64_t max_tokens) {
  return tag[0] >= 0 && tag[0] < num_ranks && tag[1] >= 0 && tag[1] < max_tokens;
}

// Write the tag of source token t of rank `src` (weights as raw bits).
OMNIEP_ORDER_HD void write_tag(int32_t* tag, int32_t src, int32_t t, const int32_t* ids, const int32_t* weight_bits,
                               int num_topk, bool expert_major) {
  tag[0] = src;
  tag[1] = t;
  if (expert_major) {
    for (int k = 0; k < num_topk; ++k) {
      tag[2 + k] = ids[k];
      tag[2 + num_topk + k] = weight_bits[k];
    }
  }
}

// The k of the copy of a tagged token that went to global expert `expert` (the first k that chose
// it; rows with duplicate ids are rejected before dispatch), or -1.
OMNIEP_ORDER_HD int copy_k(const int32_t* tag, int num_topk, int32_t expert) {
  for (int k = 0; k < num_topk; ++k) {
    if (tag[2 + k] == expert) return k;
  }
  return -1;
}

// Record filled slot `s` whose tag is `tag`: flag its key and remember the slot. `flags` and
// `slot_of` are one expert's arrays (expert-major) or the rank's (rank-major), of num_ranks *
// max_tokens entries, flags zeroed before the first mark. Returns false for an invalid tag.
OMNIEP_ORDER_HD bool mark_slot(const int32_t* tag, int32_t s, int num_ranks, int64_t max_tokens, int32_t* flags,
                               int32_t* slot_of) {
  if (!tag_valid(tag, num_ranks, max_tokens)) return false;
  const int64_t key = order_key(tag[0], tag[1], max_tokens);
  flags[key] = 1;
  slot_of[key] = s;
  return true;
}

}  // namespace omniep::nccl_ep_lib
