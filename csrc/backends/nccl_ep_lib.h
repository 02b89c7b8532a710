// nccl_ep_lib: omniep's ops (DESIGN §2) on NVIDIA's NCCL EP library (nccl_ep.h, libnccl_ep.so of the
// nccl-extensions wheel, NCCL EP API version 2). Issue 18 item 2.
//
// Pieces, in the order they are made:
//   Library        libnccl_ep.so opened with dlopen at run time and its entry points looked up with
//                  dlsym, so that building omniep never needs the library and a missing or unusable one
//                  is an error that says why (the file, the loader's message -- e.g. the NCCL symbol an
//                  older libnccl.so.2 lacks --, a missing entry point, the API or NCCL version), not a
//                  link failure. NCCL's own entry points (version, unique id, communicator) are taken
//                  from the libnccl.so.2 that libnccl_ep.so loaded, so both agree on the NCCL.
//   Communicator   an ncclComm_t: borrowed (a torch NCCL process group's) or made here from a unique id.
//   Group          one ncclEpGroup over the communicator, for one algorithm: rank-major ops use HT
//                  (NCCL_EP_ALGO_HIGH_THROUGHPUT, NCCL_EP_LAYOUT_FLAT), expert-major ops LL
//                  (NCCL_EP_ALGO_LOW_LATENCY, NCCL_EP_LAYOUT_EXPERT_MAJOR); with the staging buffers
//                  its ops share (sized at creation by max_tokens and the row bytes).
//   Handle         one ncclEpHandle (ncclEpInitHandle) plus the order of its last dispatch (the
//                  flags / slots / positions of nccl_ep_lib_order.h); omniep's handle refers to one.
// One C++ entry per op, asynchronous on the caller's stream, over raw device pointers:
//   dispatch       ncclEpUpdateHandle (the routing) then ncclEpDispatch of tagged rows, then the
//                  mapping of NCCL EP's slots to the contract order (nccl_ep_lib_order.h);
//   cached_dispatch ncclEpDispatch with the handle's routing (HT: NCCL_EP_BWD_PASS, no weights), same
//                  mapping; rows only, or (expert-major combine_bwd) each copy scaled by its weight;
//   combine        the contract-ordered rows scattered into NCCL EP's slots, ncclEpCombine (HT: sum
//                  over ranks; LL: weighted sum over k, weights applied by NCCL EP), payload copied out;
//   dispatch_bwd   rank-major: ncclEpCombine with NCCL_EP_BWD_PASS (rows and the weights' gradient, each
//                  read back from the rank that owns the expert); expert-major: ncclEpCombine with unit
//                  weights (the gradient of the rows only);
//   combine_bwd    cached_dispatch (above).
// Nothing here has run: libnccl_ep.so needs NCCL >= 2.30.4 and our GPU machines have 2.28.9. What
// is checked without the library: this code compiles against nccl_ep.h (a CUDA build of the CMake
// project makes the module wherever the header is found, CI with nvcc included), the host-side
// argument checks and the order mapping run on CPU (tests/test_nccl_ep_lib_adapter_cpu.py), and opening
// the library reports why it fails.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace omniep::nccl_ep_lib {

// The library cannot be used here (what was tried and why it failed).
struct LoadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// An NCCL EP or CUDA call failed (names the call and the library's message).
struct CallError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Local bad input (DESIGN §9): which argument, what it was, what was expected. Python: ValueError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

enum class Layout : int { kRankMajor = 0, kExpertMajor = 1 };
// Row dtypes the adapter sends through NCCL EP (codes shared with the Python side).
enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };
int dtype_bytes(DType t);

// What fixes a group's buffers; every rank must pass the same (NCCL EP: "Must be the same across all
// ranks" for max_dispatch_tokens_per_rank).
struct GroupShape {
  Layout layout = Layout::kRankMajor;
  int num_experts = 0;
  int num_topk = 0;
  int max_tokens = 0;      // max_dispatch_tokens_per_rank: the most tokens any rank dispatches
  int64_t row_bytes = 0;   // the largest tagged row (nccl_ep_lib_order.h row_bytes), a multiple of 16
};

// The shapes of one op, for the host-side checks (DESIGN §9: before any kernel runs).
struct OpShape {
  Layout layout = Layout::kRankMajor;
  int num_ranks = 0;
  int num_experts = 0;
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int num_topk = 0;
  DType dtype = DType::kBFloat16;
  int64_t capacity = 0;     // rows (rank-major) or slots per local expert (expert-major)
  int expert_alignment = 1;
};
// The op shape from the codes the bindings pass (layout 0 rank-major / 1 expert-major, DType code);
// ArgumentError for a code out of range. Shared by the torch binding and the XLA FFI handlers.
OpShape make_op_shape(int layout, int num_ranks, int num_experts, int64_t num_tokens, int64_t hidden, int num_topk,
                      int dtype, int64_t capacity, int expert_alignment);
// "" when `op` fits `group` (a group made for it, or a larger one), else what is wrong and what is
// expected. Pure host code: the CPU tests call it.
std::string check_op(const OpShape& op, const GroupShape& group, int num_ranks);
// The group shape an op needs (its row bytes with the tag; max_tokens as given).
GroupShape group_shape_for(const OpShape& op, int max_tokens);

class Library {
 public:
  // dlopen(path) and dlsym every entry point; LoadError says which step failed and why.
  static std::shared_ptr<Library> open(const std::string& path);
  ~Library();
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  const std::string& path() const { return path_; }
  int ep_version() const { return ep_version_; }      // ncclEpGetVersion (NCCL_EP_VERSION_CODE)
  int nccl_version() const { return nccl_version_; }  // ncclGetVersion of the NCCL it loaded
  std::string unique_id() const;                      // ncclGetUniqueId, as bytes
  struct Table;                                       // the entry points (nccl_ep_lib.cpp)
  const Table& fn() const { return *fn_; }

 private:
  Library() = default;
  std::string path_;
  void* dl_ = nullptr;
  int ep_version_ = 0;
  int nccl_version_ = 0;
  std::unique_ptr<Table> fn_;
};

// An NCCL communicator on the current CUDA device: borrowed (stays its owner's) or made here.
class Communicator {
 public:
  Communicator(std::shared_ptr<Library> lib, uintptr_t borrowed_comm);
  Communicator(std::shared_ptr<Library> lib, int rank, int num_ranks, const std::string& unique_id);  // collective
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  void* comm() const { return comm_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  const std::shared_ptr<Library>& library() const { return lib_; }

 private:
  std::shared_ptr<Library> lib_;
  void* comm_ = nullptr;
  bool owned_ = false;
  int rank_ = 0;
  int num_ranks_ = 0;
};

class Group {
 public:
  // Collective: ncclEpCreateGroup over `comm` on the current CUDA device.
  Group(std::shared_ptr<Communicator> comm, const GroupShape& shape, uint64_t timeout_ns);
  ~Group();  // ncclEpGroupDestroy, staging freed
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const GroupShape& shape() const { return shape_; }
  int rank() const { return comm_->rank(); }
  int num_ranks() const { return comm_->num_ranks(); }
  int num_local_experts() const { return shape_.num_experts / num_ranks(); }
  // Slots per local expert (LL) or receive slots (HT) NCCL EP fills at most: num_ranks * max_tokens.
  int64_t recv_slots() const { return static_cast<int64_t>(num_ranks()) * shape_.max_tokens; }
  void* ep_group() const { return group_; }
  const Library& lib() const { return *comm_->library(); }

  // Staging the ops of this group share (one op at a time per group on one stream).
  struct Staging {
    void* send = nullptr;        // [max_tokens, row_bytes]   tagged rows to dispatch / combine output
    void* recv = nullptr;        // HT [recv_slots, row_bytes]; LL [L, recv_slots, row_bytes]
    float* slot_weights = nullptr;   // HT [recv_slots, K]: dispatch's weights out / BWD combine's in
    int64_t* slot_ids = nullptr;     // HT [recv_slots, K]: dispatch's local ids out (HT flat wants int64)
    float* ones = nullptr;       // [max_tokens, K] 1.0f: LL combine weights for dispatch_bwd
    void* scan_temp = nullptr;   // cub's scratch for the handle's prefix sums
    size_t scan_temp_bytes = 0;
  };
  const Staging& staging() const { return staging_; }

 private:
  void release();
  std::shared_ptr<Communicator> comm_;
  GroupShape shape_;
  void* group_ = nullptr;
  Staging staging_;
};

// Outputs of a dispatch (device pointers; int32 unless said). Rank-major: recv_x [capacity, H],
// recv_topk_idx / recv_topk_weights [capacity, K]; expert-major: recv_x [L, capacity, H],
// recv_topk_idx / recv_topk_weights [L, capacity]. num_recv [1], dropped [1],
// num_recv_tokens_per_expert [L] (aligned up), recv_counts [R] (rank-major: rows from each source
// before the capacity cut; may be null for expert-major).
struct DispatchOut {
  void* recv_x = nullptr;
  int32_t* recv_topk_idx = nullptr;
  float* recv_topk_weights = nullptr;
  int32_t* num_recv = nullptr;
  int32_t* dropped = nullptr;
  int32_t* num_recv_tokens_per_expert = nullptr;
  int32_t* recv_counts = nullptr;
};

struct GatherArgs;  // the order kernels' arguments (below)

class Handle {
 public:
  // ncclEpInitHandle (NCCL EP: may be collective when it sizes buffers; every rank makes its handles in
  // the same order) and the order arrays.
  explicit Handle(std::shared_ptr<Group> group);
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  const Group& group() const { return *group_; }

  // dispatch(x [T, H], topk_idx [T, K] int32, topk_weights [T, K] f32): ncclEpUpdateHandle with the
  // routing, ncclEpDispatch, the order mapping; `out` as DispatchOut says.
  void dispatch(const OpShape& op, const void* x, const int32_t* topk_idx, const float* topk_weights,
                const DispatchOut& out, cudaStream_t stream);
  // A dispatch of x [T, H] with this handle's routing: recv_x only (rank-major [capacity, H]).
  // Expert-major: recv_x [L, capacity, H] with each copy of token t for its k-th expert scaled by
  // topk_weights[t, k] (fp32 product, rounded once: the expert-major combine's backward).
  // topk_idx [T, K] int32 (the routing; expert-major tags carry it), topk_weights [T, K] or null (rank-major).
  void cached_dispatch(const OpShape& op, const void* x, const int32_t* topk_idx, const float* topk_weights,
                       void* recv_x, cudaStream_t stream);
  // combine(y) -> out [T, H]. Rank-major y [capacity, H]; expert-major y [L, capacity, H] and
  // topk_weights [T, K] (applied by NCCL EP's LL combine).
  void combine(const OpShape& op, const void* y, const float* topk_weights, void* out, cudaStream_t stream);
  // dispatch_bwd: g_x [T, H] from g_recv_x; rank-major also g_topk_weights [T, K] from
  // g_recv_topk_weights [capacity, K] (non-local entries ignored; recv_topk_idx is the dispatch's).
  void dispatch_bwd(const OpShape& op, const void* g_recv_x, const float* g_recv_topk_weights,
                    const int32_t* recv_topk_idx, void* g_x, float* g_topk_weights, cudaStream_t stream);
  // Slots of the last dispatch whose tag named no token of the group (synchronises `stream`): 0 unless
  // NCCL EP delivered rows the adapter did not send, which the mapping then skipped.
  int bad_tags(cudaStream_t stream) const;
  // Dispatches (not cached ones) this handle has run: which routing it holds. The JAX side compares it
  // with the count its dispatch saw, to find a handle re-dispatched before the ops of an earlier run.
  int64_t dispatches() const { return dispatches_; }

 private:
  void release();
  void map_order(const OpShape& op, cudaStream_t stream);  // flags, slot_of, positions of the last dispatch
  GatherArgs gather_args(const OpShape& op) const;         // the mapping's arguments for `op` (no slot data)
  void run_dispatch(const OpShape& op, const void* x, const int32_t* ids, const float* weights, bool forward,
                    cudaStream_t stream);
  void run_combine(const OpShape& op, const void* rows, const float* rows_weights, const int32_t* recv_topk_idx,
                   const float* topk_weights, void* out, float* out_weights, bool backward, cudaStream_t stream);

  std::shared_ptr<Group> group_;
  void* handle_ = nullptr;
  int64_t keys_ = 0;            // order entries: recv_slots (HT) or L * recv_slots (LL)
  int32_t* flags_ = nullptr;    // [keys_ + 1], the last always 0 (so that the scan's last entry is the total)
  int32_t* slot_of_ = nullptr;  // [keys_]
  int32_t* pos_ = nullptr;      // [keys_ + 1]: exclusive prefix sum of flags, total last
  int32_t* counters_ = nullptr; // HT: [0] recv_total_counter; LL: [L] expert_counters
  int32_t* bad_tag_ = nullptr;  // [1]: slots whose tag was out of range (0 when all were good)
  int64_t num_tokens_ = 0;      // T of the routing (UpdateHandle)
  int64_t dispatches_ = 0;      // dispatch() calls so far
};

// Kernels (nccl_ep_lib_order.cu). Rows are bytes; `row_bytes` the stride of a tagged row.
void launch_stage_rows(const void* x, int64_t num_tokens, int64_t payload_bytes, int64_t row_bytes, int64_t tag_offset,
                       const int32_t* ids, const float* weights, int num_topk, bool expert_major, int rank,
                       void* staged, cudaStream_t stream);
void launch_mark(const void* recv, int64_t row_bytes, int64_t tag_offset, const int32_t* counts, int groups,
                 int64_t slots_per_group, int num_ranks, int64_t max_tokens, int32_t* flags, int32_t* slot_of,
                 int32_t* bad_tag, cudaStream_t stream);
void launch_exclusive_scan(const int32_t* flags, int32_t* pos, int64_t n, void* temp, size_t temp_bytes,
                           cudaStream_t stream);
size_t exclusive_scan_temp_bytes(int64_t n);
struct GatherArgs {
  const void* recv;            // NCCL EP's receive rows
  int64_t row_bytes, payload_bytes, tag_offset;
  const int64_t* slot_ids;     // HT: NCCL EP's recv topk_idx per slot (local ids, int64), or null
  const float* slot_weights;   // HT: NCCL EP's recv topk_weights per slot, or null
  const float* scale_weights;  // LL cached dispatch: scale each copy by its tag weight (combine_bwd), or null
  int num_topk, num_ranks, num_local_experts, rank, dtype;
  int64_t max_tokens, capacity, slots_per_group;
  int expert_alignment;
  const int32_t* flags;
  const int32_t* slot_of;
  const int32_t* pos;          // [groups * keys_per_group + 1]
};
void launch_gather(const GatherArgs& a, bool expert_major, const DispatchOut& out, cudaStream_t stream);
// For every key of the last dispatch: slot slot_of[key] of `dst` gets row pos[key] of `rows` (zeros
// when that row was dropped); rank-major also the weights of the slot's local entries.
struct ScatterArgs {
  const void* rows;                  // contract order: [capacity, H] or [L, capacity, H]
  const float* rows_weights;         // rank-major dispatch_bwd: [capacity, K], or null
  const int32_t* recv_topk_idx;      // with rows_weights: which entries are local (>= 0)
  int64_t payload_bytes, row_bytes, capacity, slots_per_group, keys_per_group;
  int groups, num_topk;
  const int32_t* flags;
  const int32_t* slot_of;
  const int32_t* pos;
  void* dst;                         // NCCL EP's combine input, shaped like its dispatch output
  float* dst_weights;                // HT BWD combine's input weights [recv_slots, K], or null
};
void launch_scatter(const ScatterArgs& a, cudaStream_t stream);
// out [T, payload] <- staged [T, row_bytes] (the payload bytes of each row).
void launch_unstage_rows(const void* staged, int64_t num_tokens, int64_t row_bytes, int64_t payload_bytes, void* out,
                         cudaStream_t stream);
void launch_fill(float* dst, int64_t n, float value, cudaStream_t stream);

}  // namespace omniep::nccl_ep_lib
