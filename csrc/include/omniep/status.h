// Op descriptors and status words (DESIGN §9): the C++ mirror of omniep/ep_core/descriptor.py, whose
// docstring is the contract. Every number here must equal the Python one (tests/test_descriptor.py
// compares them through the native modules' constants).
//
// A kernel's FIRST barrier of an op carries the rank's descriptor to every peer (kernels/sync.cuh
// `rank_barrier` with a descriptor); the receiver compares and, on a difference or a peer's rejected
// input, records a status and the op moves nothing on ANY rank (every rank sees every descriptor).
// Host-only-safe header (no device code).
#pragma once

#include <stdint.h>

namespace omniep {

inline constexpr int kDescWords = 12;
// Descriptor fields (descriptor.DESC_FIELDS); the first kDescCompared must agree on every rank.
enum DescField : int32_t {
  kDescSeq = 0,
  kDescOp = 1,
  kDescExperts = 2,
  kDescHidden = 3,
  kDescDtype = 4,
  kDescLayout = 5,
  kDescCapacity = 6,
  kDescHandle = 7,
  kDescTopk = 8,
  kDescInputStatus = 9,
  kDescInputDetail = 10,
  kDescPart = 11,  // 0: the op's first kernel; > 0: a later kernel of the same op (not compared)
};
inline constexpr int kDescCompared = 9;

// descriptor.OpKind
enum OpKind : int32_t {
  kOpDispatch = 1,
  kOpCachedDispatch = 2,
  kOpCombine = 3,
  kOpDispatchBwd = 4,
  kOpCombineBwd = 5,
  kOpBarrier = 6,
};

// descriptor.INPUT_*: a rank's verdict on its own input.
enum InputStatus : int32_t {
  kInputOk = 0,
  kInputBadExpertId = 1,  // detail: the id
  kInputRejected = 2,     // the host rejected the rank's arguments before its kernels (detail 0)
};

// descriptor.DTYPE_CODES (the kernels' DType of args.h for the first three).
enum DescDtype : int32_t { kDescF32 = 0, kDescBF16 = 1, kDescF16 = 2, kDescFP8 = 3, kDescF64 = 4 };

struct OpDesc {
  int32_t w[kDescWords];
};

inline constexpr int kStatusWords = 10;
// descriptor.STATUS_FIELDS
enum StatusField : int32_t {
  kStCode = 0,
  kStRank = 1,
  kStPeer = 2,
  kStPeers = 3,
  kStFields = 4,  // mismatch: mask of differing fields; timeouts: the phase
  kStField = 5,   // mismatch: the first differing field; BAD_INPUT: the input status
  kStMine = 6,
  kStTheirs = 7,
  kStOp = 8,
  kStSeq = 9,
};

// descriptor.StatusCode
enum StatusCode : int32_t {
  kStatusOk = 0,
  kStatusRankMismatch = 1,  // sticky: the group is failed
  kStatusBadInput = 2,
  kStatusCapacity = 3,
  kStatusPeerTimeout = 4,   // sticky
  kStatusLocalTimeout = 5,  // sticky
};

struct Status {
  int32_t w[kStatusWords];
};

inline bool status_sticky(int32_t code) {
  return code == kStatusRankMismatch || code == kStatusPeerTimeout || code == kStatusLocalTimeout;
}

// Host -> device: the descriptor of an op (the caller fills seq; input status and detail start at 0).
inline OpDesc make_desc(uint32_t seq, OpKind op, int num_experts, int hidden, int dtype, int layout, int capacity,
                        int handle, int num_topk) {
  OpDesc d = {};
  d.w[kDescSeq] = static_cast<int32_t>(seq & 0x7fffffffu);
  d.w[kDescOp] = op;
  d.w[kDescExperts] = num_experts;
  d.w[kDescHidden] = hidden;
  d.w[kDescDtype] = dtype;
  d.w[kDescLayout] = layout;
  d.w[kDescCapacity] = capacity;
  d.w[kDescHandle] = handle;
  d.w[kDescTopk] = num_topk;
  return d;
}

// The host's copy of what the layout kernel learnt after its count exchange, in pinned host-mapped
// memory: a non-cached rank-major dispatch of exact size waits on `ticket` (its one host wait) and
// then sizes its outputs from it. Written by the kernel with system-scope stores, `ticket` last.
struct HostMailbox {
  int32_t rows;        // rows this rank receives (before capacity)
  int32_t max_rows;    // the largest `rows` of any rank: the symmetric receive buffer's row count
  int32_t stopped;     // the op stopped at its exchange (on every rank); a status says why
  int32_t fatal;       // the rank's sticky status code (0 = none)
  int32_t pending;     // its non-sticky status code (0 = none)
  volatile int32_t ticket;  // the ticket of the op that wrote the rest
};

}  // namespace omniep
