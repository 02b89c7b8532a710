// The C ABI (capi/omniep.h) over omniep::VirtualRankGroup: converts the C argument structs to the
// kernels' argument structs and C++ exceptions to status codes + omniep_last_error().
#include "capi/omniep.h"

#include <cstring>

#include <exception>
#include <stdexcept>
#include <string>

#include "backends/virtual_rank_group.h"

static_assert(OMNIEP_MAX_RANKS == omniep::kMaxRanks, "C ABI and kernels disagree on the rank limit");
static_assert(sizeof(omniep_status_record) == sizeof(omniep::Status), "status record layout");

struct omniep_group {
  omniep::VirtualRankGroup impl;
  omniep_group(int r, uint64_t t) : impl(r, t) {}
};

namespace {

thread_local std::string g_last_error;

template <typename F>
omniep_status guarded(F&& f) {
  try {
    f();
    return OMNIEP_OK;
  } catch (const std::invalid_argument& e) {
    g_last_error = e.what();
    return OMNIEP_ERR_INVALID;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return OMNIEP_ERR_CUDA;
  }
}

template <typename T>
void to_per_rank(omniep::PerRank<T>& dst, const uintptr_t (&src)[OMNIEP_MAX_RANKS]) {
  for (int r = 0; r < OMNIEP_MAX_RANKS; ++r) dst.p[r] = reinterpret_cast<T*>(src[r]);
}

// a.unit / a.unit2 of a dispatch, rank-major (DispatchArgs) or expert-major (EMDispatchArgs): a unit
// must suit every source row (x / x2) and every destination row (recv_x / recv_x2 of all ranks), since
// any rank's rows may land in any other's.
template <typename A, typename C>
void set_copy_units(A& a, const C& c) {
  uintptr_t addrs[2 * OMNIEP_MAX_RANKS];
  for (int r = 0; r < OMNIEP_MAX_RANKS; ++r) { addrs[2 * r] = c.x[r]; addrs[2 * r + 1] = c.recv_x[r]; }
  a.unit = omniep::row_copy_unit(c.row_bytes, addrs, 2 * OMNIEP_MAX_RANKS);
  for (int r = 0; r < OMNIEP_MAX_RANKS; ++r) { addrs[2 * r] = c.x2[r]; addrs[2 * r + 1] = c.recv_x2[r]; }
  a.unit2 = omniep::row_copy_unit(c.row2_bytes, addrs, 2 * OMNIEP_MAX_RANKS);
}

void require_group(const omniep_group* g, const void* args) {
  if (g == nullptr) throw std::invalid_argument("omniep: null group (destroyed?)");
  if (args == nullptr) throw std::invalid_argument("omniep: null argument struct");
}

// The fields the C structs and the kernels' structs share by name, by kind of op (templates: the
// rank-major and expert-major structs of a kind spell them alike).
template <typename A, typename C>
void copy_shape(A& a, const C& c) {
  to_per_rank(a.topk_idx32, c.topk_idx32);
  for (int r = 0; r < OMNIEP_MAX_RANKS; ++r) a.num_tokens[r] = c.num_tokens[r];
  a.num_topk = c.num_topk;
  a.num_experts = c.num_experts;
  a.capacity = c.capacity;
}

template <typename A, typename C>
void copy_layout(A& a, const C& c) {
  copy_shape(a, c);
  to_per_rank(a.num_tokens_per_expert, c.num_tokens_per_expert);
  to_per_rank(a.num_recv, c.num_recv);
  to_per_rank(a.dropped, c.dropped);
}

template <typename A, typename C>
void copy_dispatch(A& a, const C& c) {
  copy_shape(a, c);
  to_per_rank(a.x, c.x);
  to_per_rank(a.x2, c.x2);
  to_per_rank(a.topk_weights, c.topk_weights);
  to_per_rank(a.recv_x, c.recv_x);
  to_per_rank(a.recv_x2, c.recv_x2);
  to_per_rank(a.recv_topk_idx, c.recv_topk_idx);
  to_per_rank(a.recv_topk_weights, c.recv_topk_weights);
  a.row_bytes = c.row_bytes;
  a.row2_bytes = c.row2_bytes;
  set_copy_units(a, c);
}

template <typename A, typename C>
void copy_combine(A& a, const C& c) {
  copy_shape(a, c);
  to_per_rank(a.y, c.y);
  to_per_rank(a.out, c.out);
  to_per_rank(a.bias[0], c.bias0);
  to_per_rank(a.bias[1], c.bias1);
  to_per_rank(a.g_recv_topk_weights, c.g_recv_topk_weights);
  to_per_rank(a.g_topk_weights, c.g_topk_weights);
  a.hidden = c.hidden;
  a.dtype = c.dtype;
  if (c.num_bias < 0 || c.num_bias > 2) throw std::invalid_argument("omniep: num_bias must be 0, 1 or 2");
  a.num_bias = c.num_bias;
  a.bias_dtype[0] = c.bias_dtype[0];
  a.bias_dtype[1] = c.bias_dtype[1];
}

omniep::LayoutArgs convert(const omniep_layout_args& c) {
  omniep::LayoutArgs a = {};
  copy_layout(a, c);
  to_per_rank(a.topk_idx, c.topk_idx);
  to_per_rank(a.send_pos, c.send_pos);
  to_per_rank(a.num_tokens_per_rank, c.num_tokens_per_rank);
  to_per_rank(a.recv_counts, c.recv_counts);
  to_per_rank(a.send_offset, c.send_offset);
  a.index_bytes = c.index_bytes;
  return a;
}

omniep::DispatchArgs convert(const omniep_dispatch_args& c) {
  omniep::DispatchArgs a = {};
  copy_dispatch(a, c);
  to_per_rank(a.send_pos, c.send_pos);
  to_per_rank(a.send_offset, c.send_offset);
  to_per_rank(a.recv_counts, c.recv_counts);
  to_per_rank(a.num_recv_tokens_per_expert, c.num_recv_tokens_per_expert);
  a.expert_alignment = c.expert_alignment;
  a.with_routing = c.with_routing;
  return a;
}

omniep::CombineArgs convert(const omniep_combine_args& c) {
  omniep::CombineArgs a = {};
  copy_combine(a, c);
  to_per_rank(a.send_pos, c.send_pos);
  to_per_rank(a.send_offset, c.send_offset);
  a.with_topk_grad = c.with_topk_grad;
  return a;
}

omniep::EMLayoutArgs convert(const omniep_em_layout_args& c) {
  omniep::EMLayoutArgs a = {};
  copy_layout(a, c);
  to_per_rank(a.copy_slot, c.copy_slot);
  to_per_rank(a.recv_expert_count, c.recv_expert_count);
  to_per_rank(a.num_recv_tokens_per_expert, c.num_recv_tokens_per_expert);
  to_per_rank(a.max_expert_count, c.max_expert_count);
  a.expert_alignment = c.expert_alignment;
  return a;
}

omniep::EMDispatchArgs convert(const omniep_em_dispatch_args& c) {
  omniep::EMDispatchArgs a = {};
  copy_dispatch(a, c);
  to_per_rank(a.copy_slot, c.copy_slot);
  to_per_rank(a.recv_expert_count, c.recv_expert_count);
  a.zero_padding = 1;  // the results are the caller's own tensors: their padding stays zero, as documented
  return a;
}

omniep::EMCombineArgs convert(const omniep_em_combine_args& c) {
  omniep::EMCombineArgs a = {};
  copy_combine(a, c);
  to_per_rank(a.topk_weights, c.topk_weights);
  to_per_rank(a.copy_slot, c.copy_slot);
  return a;
}

omniep::EMCombineBwdArgs convert(const omniep_em_combine_bwd_args& c) {
  omniep::EMCombineBwdArgs a = {};
  copy_shape(a, c);
  to_per_rank(a.g_out, c.g_out);
  to_per_rank(a.y, c.y);
  to_per_rank(a.topk_weights, c.topk_weights);
  to_per_rank(a.copy_slot, c.copy_slot);
  to_per_rank(a.recv_expert_count, c.recv_expert_count);
  to_per_rank(a.g_y, c.g_y);
  to_per_rank(a.g_topk_weights, c.g_topk_weights);
  a.hidden = c.hidden;
  a.dtype = c.dtype;
  a.with_topk_grad = c.with_topk_grad;
  a.zero_padding = c.zero_padding != 0;
  return a;
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

extern "C" {

const char* omniep_last_error(void) { return g_last_error.c_str(); }
const char* omniep_version(void) { return "0.1.0"; }

omniep_status omniep_group_create(int32_t num_ranks, uint64_t timeout_ns, omniep_group** out) {
  return guarded([&] {
    if (out == nullptr) throw std::invalid_argument("omniep: null output pointer");
    *out = new omniep_group(num_ranks, timeout_ns);
  });
}

omniep_status omniep_group_destroy(omniep_group* group) {
  return guarded([&] { delete group; });
}

omniep_status omniep_group_set_timeout(omniep_group* g, uint64_t timeout_ns) {
  return guarded([&] { require_group(g, g); g->impl.set_timeout_ns(timeout_ns); });
}

omniep_status omniep_group_set_blocks_per_rank(omniep_group* g, int32_t blocks) {
  return guarded([&] { require_group(g, g); g->impl.set_blocks_per_rank(blocks); });
}

omniep_status omniep_group_errors(omniep_group* g, omniep_status_record* errors) {
  return guarded([&] {
    require_group(g, errors);
    const auto records = g->impl.read_errors();
    for (size_t r = 0; r < records.size(); ++r) std::memcpy(&errors[r], &records[r], sizeof(omniep_status_record));
  });
}

omniep_status omniep_group_reset(omniep_group* g) {
  return guarded([&] { require_group(g, g); g->impl.reset(); });
}

omniep_status omniep_layout(omniep_group* g, const omniep_layout_args* a, int32_t first, int32_t n, uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.layout(convert(*a), first, n, as_stream(s)); });
}

omniep_status omniep_dispatch(omniep_group* g, const omniep_dispatch_args* a, int32_t first, int32_t n, uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.dispatch(convert(*a), first, n, as_stream(s)); });
}

omniep_status omniep_combine(omniep_group* g, const omniep_combine_args* a, int32_t first, int32_t n, uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.combine(convert(*a), first, n, as_stream(s)); });
}

omniep_status omniep_dispatch_bwd(omniep_group* g, const omniep_combine_args* a, int32_t first, int32_t n,
                                  uintptr_t s) {
  return guarded([&] {
    require_group(g, a);
    omniep::CombineArgs args = convert(*a);
    args.with_topk_grad = 1;
    g->impl.combine(args, first, n, as_stream(s));
  });
}

omniep_status omniep_combine_bwd(omniep_group* g, const omniep_dispatch_args* a, int32_t first, int32_t n,
                                 uintptr_t s) {
  return guarded([&] {
    require_group(g, a);
    omniep::DispatchArgs args = convert(*a);
    args.with_routing = 0;
    g->impl.dispatch(args, first, n, as_stream(s));
  });
}

omniep_status omniep_em_layout(omniep_group* g, const omniep_em_layout_args* a, int32_t first, int32_t n,
                               uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.em_layout(convert(*a), first, n, as_stream(s)); });
}

omniep_status omniep_em_dispatch(omniep_group* g, const omniep_em_dispatch_args* a, int32_t first, int32_t n,
                                 uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.em_dispatch(convert(*a), first, n, as_stream(s)); });
}

omniep_status omniep_em_combine(omniep_group* g, const omniep_em_combine_args* a, int32_t first, int32_t n,
                                uintptr_t s) {
  return guarded([&] {
    require_group(g, a);
    omniep::EMCombineArgs args = convert(*a);
    args.with_topk_grad = 0;
    g->impl.em_combine(args, first, n, as_stream(s));
  });
}

omniep_status omniep_em_dispatch_bwd(omniep_group* g, const omniep_em_combine_args* a, int32_t first, int32_t n,
                                     uintptr_t s) {
  return guarded([&] {
    require_group(g, a);
    omniep::EMCombineArgs args = convert(*a);
    args.topk_weights = {};  // null: every weight 1 (the unweighted sum of the copy gradients)
    args.with_topk_grad = 1;
    g->impl.em_combine(args, first, n, as_stream(s));
  });
}

omniep_status omniep_em_combine_bwd(omniep_group* g, const omniep_em_combine_bwd_args* a, int32_t first,
                                    int32_t n, uintptr_t s) {
  return guarded([&] { require_group(g, a); g->impl.em_combine_bwd(convert(*a), first, n, as_stream(s)); });
}

}  // extern "C"
