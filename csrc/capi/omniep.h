/* omniep C ABI: the native core over raw device pointers and a stream.
 *
 * Every entry point returns OMNIEP_OK or an error code; omniep_last_error() then says what went wrong
 * (thread-local). Pointers are device addresses as integers; `stream` is a cudaStream_t as an
 * integer (0 = the legacy default stream). No call synchronises with the host except
 * omniep_group_errors, omniep_group_reset and omniep_group_destroy.
 *
 * A group is the p2p transport for R ranks whose buffers all live on the current device (virtual
 * ranks). Per-rank pointer arrays are indexed by rank; buffers marked "sym" are accessed by peers.
 * Shapes: T = num_tokens[rank], K = num_topk, R ranks, E experts, L = E / R, C = capacity.
 */
#ifndef OMNIEP_CAPI_H_
#define OMNIEP_CAPI_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OMNIEP_MAX_RANKS 16

typedef enum {
  OMNIEP_OK = 0,
  OMNIEP_ERR_INVALID = 1, /* bad argument; nothing was launched */
  OMNIEP_ERR_CUDA = 2,    /* a CUDA call failed */
} omniep_status;

typedef enum { OMNIEP_FLOAT32 = 0, OMNIEP_BFLOAT16 = 1, OMNIEP_FLOAT16 = 2 } omniep_dtype;

/* Status codes (omniep/ep_core/descriptor.py StatusCode, omniep/status.h). */
typedef enum {
  OMNIEP_STATUS_OK = 0,
  OMNIEP_STATUS_RANK_MISMATCH = 1,
  OMNIEP_STATUS_BAD_INPUT = 2,
  OMNIEP_STATUS_CAPACITY = 3,
  OMNIEP_STATUS_PEER_TIMEOUT = 4,
  OMNIEP_STATUS_LOCAL_TIMEOUT = 5
} omniep_status_code;

/* A rank's sticky device-side status, word for word omniep/status.h `Status` (descriptor.py
 * STATUS_FIELDS): for timeouts `peer` is the rank it waited for (-1: its own blocks) and `fields` the
 * phase (1/2 layout exchange/done, 3/4 dispatch start/done, 5/6 combine start/done, 7 barrier, 8
 * combine remote rows). */
typedef struct {
  int32_t code, rank, peer, peers, fields, field, mine, theirs, op, seq;
} omniep_status_record;

typedef struct {
  uintptr_t topk_idx[OMNIEP_MAX_RANKS];              /* [T, K] int32/int64 */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];            /* out [T, K] int32 */
  uintptr_t send_pos[OMNIEP_MAX_RANKS];              /* out [T, R] int32 */
  uintptr_t num_tokens_per_rank[OMNIEP_MAX_RANKS];   /* out [R] int32 */
  uintptr_t num_tokens_per_expert[OMNIEP_MAX_RANKS]; /* out [E] int32 */
  uintptr_t recv_counts[OMNIEP_MAX_RANKS];           /* out [R] int32 */
  uintptr_t send_offset[OMNIEP_MAX_RANKS];           /* out [R] int32 */
  uintptr_t num_recv[OMNIEP_MAX_RANKS];              /* out [] int32 */
  uintptr_t dropped[OMNIEP_MAX_RANKS];               /* out [] int32 */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int32_t num_topk, num_experts, capacity, index_bytes;
} omniep_layout_args;

typedef struct {
  uintptr_t x[OMNIEP_MAX_RANKS];                 /* [T, row_bytes] */
  uintptr_t x2[OMNIEP_MAX_RANKS];                /* [T, row2_bytes] second payload (fp8 scales) */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];        /* [T, K] from layout */
  uintptr_t topk_weights[OMNIEP_MAX_RANKS];      /* [T, K] float32 */
  uintptr_t send_pos[OMNIEP_MAX_RANKS];          /* [T, R] from layout */
  uintptr_t send_offset[OMNIEP_MAX_RANKS];       /* [R] from layout */
  uintptr_t recv_counts[OMNIEP_MAX_RANKS];       /* [R] from layout */
  uintptr_t recv_x[OMNIEP_MAX_RANKS];            /* sym out [C, row_bytes] */
  uintptr_t recv_x2[OMNIEP_MAX_RANKS];           /* sym out [C, row2_bytes] */
  uintptr_t recv_topk_idx[OMNIEP_MAX_RANKS];     /* sym out [C, K] int32 */
  uintptr_t recv_topk_weights[OMNIEP_MAX_RANKS]; /* sym out [C, K] float32 */
  uintptr_t num_recv_tokens_per_expert[OMNIEP_MAX_RANKS]; /* out [L] int32 */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int64_t row_bytes, row2_bytes; /* row2_bytes = 0: no second payload */
  int32_t num_topk, num_experts, capacity, expert_alignment;
  int32_t with_routing; /* 0: rows only (combine_bwd); recv_topk_* and per-expert counts untouched */
} omniep_dispatch_args;

typedef struct {
  uintptr_t y[OMNIEP_MAX_RANKS];                   /* sym [C, H] */
  uintptr_t out[OMNIEP_MAX_RANKS];                 /* out [T, H] */
  uintptr_t bias0[OMNIEP_MAX_RANKS];               /* [T, H] (num_bias >= 1) */
  uintptr_t bias1[OMNIEP_MAX_RANKS];               /* [T, H] (num_bias == 2) */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];          /* [T, K] from layout */
  uintptr_t send_pos[OMNIEP_MAX_RANKS];            /* [T, R] from layout */
  uintptr_t send_offset[OMNIEP_MAX_RANKS];         /* [R] from layout */
  uintptr_t g_recv_topk_weights[OMNIEP_MAX_RANKS]; /* sym [C, K] float32 (with_topk_grad) */
  uintptr_t g_topk_weights[OMNIEP_MAX_RANKS];      /* out [T, K] float32 (with_topk_grad) */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int32_t hidden, num_topk, num_experts, capacity;
  int32_t dtype; /* omniep_dtype of y and out */
  int32_t num_bias;
  int32_t bias_dtype[2];
  int32_t with_topk_grad; /* 1: dispatch_bwd (also read back g_topk_weights) */
} omniep_combine_args;

/* ---- expert-major ("low-latency") layout: recv_x[L, C, H], one copy per (token, local expert) ----
 * copy_slot[T, K] (from omniep_em_layout) is each copy's slot inside its expert at the receiver, or -1
 * (unrouted / dropped); C = capacity slots per local expert, the same on every rank. */
typedef struct {
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];                 /* [T, K] from omniep_layout */
  uintptr_t num_tokens_per_expert[OMNIEP_MAX_RANKS];      /* [E] from omniep_layout */
  uintptr_t copy_slot[OMNIEP_MAX_RANKS];                  /* out [T, K] int32 */
  uintptr_t recv_expert_count[OMNIEP_MAX_RANKS];          /* out [L] int32: kept copies per local expert */
  uintptr_t num_recv_tokens_per_expert[OMNIEP_MAX_RANKS]; /* out [L] int32: kept, aligned up */
  uintptr_t num_recv[OMNIEP_MAX_RANKS];                   /* out [] int32: kept copies */
  uintptr_t dropped[OMNIEP_MAX_RANKS];                    /* out [] int32 */
  uintptr_t max_expert_count[OMNIEP_MAX_RANKS];           /* out [] int32: uncapped max over local experts */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int32_t num_topk, num_experts, capacity, expert_alignment;
} omniep_em_layout_args;

typedef struct {
  uintptr_t x[OMNIEP_MAX_RANKS];                 /* [T, row_bytes] */
  uintptr_t x2[OMNIEP_MAX_RANKS];                /* [T, row2_bytes] second payload (fp8 scales) */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];        /* [T, K] */
  uintptr_t topk_weights[OMNIEP_MAX_RANKS];      /* [T, K] float32 */
  uintptr_t copy_slot[OMNIEP_MAX_RANKS];         /* [T, K] from omniep_em_layout */
  uintptr_t recv_expert_count[OMNIEP_MAX_RANKS]; /* [L] from omniep_em_layout */
  uintptr_t recv_x[OMNIEP_MAX_RANKS];            /* sym out [L, C, row_bytes] */
  uintptr_t recv_x2[OMNIEP_MAX_RANKS];           /* sym out [L, C, row2_bytes] */
  uintptr_t recv_topk_idx[OMNIEP_MAX_RANKS];     /* sym out [L, C] int32 */
  uintptr_t recv_topk_weights[OMNIEP_MAX_RANKS]; /* sym out [L, C] float32 */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int64_t row_bytes, row2_bytes;
  int32_t num_topk, num_experts, capacity;
} omniep_em_dispatch_args;

typedef struct {
  uintptr_t y[OMNIEP_MAX_RANKS];                   /* sym [L, C, H] */
  uintptr_t out[OMNIEP_MAX_RANKS];                 /* out [T, H] */
  uintptr_t bias0[OMNIEP_MAX_RANKS];               /* [T, H] (num_bias >= 1) */
  uintptr_t bias1[OMNIEP_MAX_RANKS];               /* [T, H] (num_bias == 2) */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];          /* [T, K] */
  uintptr_t topk_weights[OMNIEP_MAX_RANKS];        /* [T, K] float32 (ignored by omniep_em_dispatch_bwd) */
  uintptr_t copy_slot[OMNIEP_MAX_RANKS];           /* [T, K] */
  uintptr_t g_recv_topk_weights[OMNIEP_MAX_RANKS]; /* sym [L, C] float32 (dispatch_bwd) */
  uintptr_t g_topk_weights[OMNIEP_MAX_RANKS];      /* out [T, K] float32 (dispatch_bwd) */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int32_t hidden, num_topk, num_experts, capacity;
  int32_t dtype;
  int32_t num_bias;
  int32_t bias_dtype[2];
} omniep_em_combine_args;

typedef struct {
  uintptr_t g_out[OMNIEP_MAX_RANKS];             /* [T, H] */
  uintptr_t y[OMNIEP_MAX_RANKS];                 /* sym [L, C, H] (with_topk_grad) */
  uintptr_t topk_idx32[OMNIEP_MAX_RANKS];        /* [T, K] */
  uintptr_t topk_weights[OMNIEP_MAX_RANKS];      /* [T, K] float32 */
  uintptr_t copy_slot[OMNIEP_MAX_RANKS];         /* [T, K] */
  uintptr_t recv_expert_count[OMNIEP_MAX_RANKS]; /* [L] */
  uintptr_t g_y[OMNIEP_MAX_RANKS];               /* sym out [L, C, H], padding zeroed with zero_padding */
  uintptr_t g_topk_weights[OMNIEP_MAX_RANKS];    /* out [T, K] float32 (with_topk_grad) */
  int32_t num_tokens[OMNIEP_MAX_RANKS];
  int32_t hidden, num_topk, num_experts, capacity;
  int32_t dtype;
  int32_t with_topk_grad; /* 1: also g_topk_weights[t, k] = <g_out[t], y[l, c]> (fp32) */
  int32_t zero_padding;   /* 1: g_y's padding slots (past recv_expert_count) zeroed; 0: left unwritten */
} omniep_em_combine_bwd_args;

typedef struct omniep_group omniep_group;

const char* omniep_last_error(void);
const char* omniep_version(void);

/* R virtual ranks on the current device; waits on a peer give up after timeout_ns. */
omniep_status omniep_group_create(int32_t num_ranks, uint64_t timeout_ns, omniep_group** out);
omniep_status omniep_group_destroy(omniep_group* group);
omniep_status omniep_group_set_timeout(omniep_group* group, uint64_t timeout_ns);
omniep_status omniep_group_set_blocks_per_rank(omniep_group* group, int32_t blocks);
/* Fills errors[0..R) (synchronises the device). */
omniep_status omniep_group_errors(omniep_group* group, omniep_status_record* errors);
omniep_status omniep_group_reset(omniep_group* group);

/* Each op launches ranks [first_rank, first_rank + num_launched) on `stream`. */
omniep_status omniep_layout(omniep_group* g, const omniep_layout_args* a, int32_t first_rank,
                            int32_t num_launched, uintptr_t stream);
omniep_status omniep_dispatch(omniep_group* g, const omniep_dispatch_args* a, int32_t first_rank,
                              int32_t num_launched, uintptr_t stream);
omniep_status omniep_combine(omniep_group* g, const omniep_combine_args* a, int32_t first_rank,
                             int32_t num_launched, uintptr_t stream);
/* Backward passes (DESIGN §2): dispatch_bwd is a combine with with_topk_grad = 1 (g_x = combine of
 * g_recv_x, g_topk_weights read back); combine_bwd is a cached dispatch of g_out, rows only. */
omniep_status omniep_dispatch_bwd(omniep_group* g, const omniep_combine_args* a, int32_t first_rank,
                                  int32_t num_launched, uintptr_t stream);
omniep_status omniep_combine_bwd(omniep_group* g, const omniep_dispatch_args* a, int32_t first_rank,
                                 int32_t num_launched, uintptr_t stream);

/* Expert-major ops. omniep_em_layout runs after omniep_layout on the same stream (it reads that call's
 * topk_idx32 and num_tokens_per_expert). dispatch_bwd: g_x = unweighted combine of g_recv_x, and
 * g_topk_weights read back from the carrying slot. combine_bwd: g_y[l, c] = round(w * g_out[t]), the
 * padding slots zeroed only with zero_padding (a cached dispatch: DESIGN §2). */
omniep_status omniep_em_layout(omniep_group* g, const omniep_em_layout_args* a, int32_t first_rank,
                               int32_t num_launched, uintptr_t stream);
omniep_status omniep_em_dispatch(omniep_group* g, const omniep_em_dispatch_args* a, int32_t first_rank,
                                 int32_t num_launched, uintptr_t stream);
omniep_status omniep_em_combine(omniep_group* g, const omniep_em_combine_args* a, int32_t first_rank,
                                int32_t num_launched, uintptr_t stream);
omniep_status omniep_em_dispatch_bwd(omniep_group* g, const omniep_em_combine_args* a, int32_t first_rank,
                                     int32_t num_launched, uintptr_t stream);
omniep_status omniep_em_combine_bwd(omniep_group* g, const omniep_em_combine_bwd_args* a, int32_t first_rank,
                                    int32_t num_launched, uintptr_t stream);

#ifdef __cplusplus
}
#endif

#endif /* OMNIEP_CAPI_H_ */
