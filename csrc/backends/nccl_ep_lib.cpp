// nccl_ep_lib: the host side of the adapter (see nccl_ep_lib.h): the library loader, the group and
// handle life cycle, the host-side argument checks, and each op's sequence of NCCL EP calls and order
// kernels (nccl_ep_lib_order.cu). Written against nccl_ep.h (API version 2); the library is reached
// only through the dlsym'd table below, never linked.
#include "backends/nccl_ep_lib.h"

#include <dlfcn.h>
#include <nccl.h>
#include <nccl_ep.h>

#include <sstream>
#include <utility>

#include "backends/nccl_ep_lib_order.h"

static_assert(NCCL_EP_API_VERSION == 2, "nccl_ep_lib is written against NCCL EP API version 2");

namespace omniep::nccl_ep_lib {

namespace {

constexpr int kMinNccl = 23004;  // 2.30.4: the first NCCL libnccl_ep.so (nccl-extensions 0.1.0) runs on

std::string version_string(int code) {
  std::ostringstream s;
  s << code / 10000 << "." << code / 100 % 100 << "." << code % 100;
  return s.str();
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw CallError(std::string("nccl_ep_lib: ") + what + " failed: " + cudaGetErrorString(err));
}

template <typename T>
T* device_alloc(size_t count, const char* what) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, count * sizeof(T) > 0 ? count * sizeof(T) : 16), what);
  return static_cast<T*>(p);
}

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kFloat32: return ncclFloat32;
  }
  return ncclBfloat16;
}

// A tensor descriptor over caller memory: NCCL EP reads `sizes` while a call runs, so it lives here.
struct Tensor {
  ncclEpTensor_t t{};
  size_t sizes[3] = {0, 0, 0};
  Tensor(const void* data, ncclDataType_t dtype, std::initializer_list<int64_t> dims) {
    t.size = static_cast<unsigned int>(sizeof(ncclEpTensor_t));
    t.magic = NCCL_EP_TENSOR_MAGIC;
    t.ndim = static_cast<unsigned int>(dims.size());
    t.datatype = dtype;
    t.data = const_cast<void*>(data);
    unsigned int i = 0;
    for (int64_t d : dims) sizes[i++] = static_cast<size_t>(d);
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ncclEpTensor_t* get() {
    t.sizes = sizes;  // set here, not at construction: the descriptor must point into this object
    return &t;
  }
};

// The versioned structs, zero-filled with size and magic set (what NCCL_EP_*_INIT does in C).
template <typename S>
S versioned() {
  S s{};
  s.size = static_cast<unsigned int>(sizeof(S));
  s.magic = NCCL_EP_MAGIC;
  return s;
}

}  // namespace

int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// ---- the library ----------------------------------------------------------------------------------

struct Library::Table {
  decltype(&ncclEpGetVersion) get_version = nullptr;
  decltype(&ncclEpCreateGroup) create_group = nullptr;
  decltype(&ncclEpGroupDestroy) group_destroy = nullptr;
  decltype(&ncclEpInitHandle) init_handle = nullptr;
  decltype(&ncclEpUpdateHandle) update_handle = nullptr;
  decltype(&ncclEpHandleDestroy) handle_destroy = nullptr;
  decltype(&ncclEpDispatch) dispatch = nullptr;
  decltype(&ncclEpCombine) combine = nullptr;
  // NCCL's, from the libnccl.so.2 libnccl_ep.so loaded.
  decltype(&ncclGetVersion) nccl_get_version = nullptr;
  decltype(&ncclGetErrorString) nccl_error_string = nullptr;
  decltype(&ncclGetUniqueId) nccl_unique_id = nullptr;
  decltype(&ncclCommInitRank) nccl_comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) nccl_comm_destroy = nullptr;
  decltype(&ncclCommCount) nccl_comm_count = nullptr;
  decltype(&ncclCommUserRank) nccl_comm_user_rank = nullptr;

  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess) return;
    std::string msg = nccl_error_string != nullptr ? nccl_error_string(r) : "";
    throw CallError(std::string("nccl_ep_lib: ") + call + " failed (ncclResult_t " + std::to_string(static_cast<int>(r)) +
                    (msg.empty() ? "" : ": " + msg) + ")");
  }
};

std::shared_ptr<Library> Library::open(const std::string& path) {
  std::shared_ptr<Library> lib(new Library());
  lib->path_ = path;
  lib->fn_ = std::make_unique<Table>();
  dlerror();
  // RTLD_NOW: every undefined symbol is resolved here, so an NCCL that lacks one of libnccl_ep.so's
  // imports (2.28.9 lacks ncclCommQueryProperties, ncclGetPeerDevicePointer, ncclWinGetUserPtr) fails
  // now, with the loader naming it, instead of at the first call.
  lib->dl_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib->dl_ == nullptr) {
    const char* why = dlerror();
    throw LoadError("cannot load " + path + ": " + (why != nullptr ? why : "dlopen failed"));
  }
  std::vector<std::string> missing;
  auto find = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(lib->dl_, name));
    if (slot == nullptr) missing.emplace_back(name);
  };
  Table& t = *lib->fn_;
  find(t.get_version, "ncclEpGetVersion");
  find(t.create_group, "ncclEpCreateGroup");
  find(t.group_destroy, "ncclEpGroupDestroy");
  find(t.init_handle, "ncclEpInitHandle");
  find(t.update_handle, "ncclEpUpdateHandle");
  find(t.handle_destroy, "ncclEpHandleDestroy");
  find(t.dispatch, "ncclEpDispatch");
  find(t.combine, "ncclEpCombine");
  // dlsym on the library's handle searches its dependencies too: these are the libnccl.so.2 it loaded.
  find(t.nccl_get_version, "ncclGetVersion");
  find(t.nccl_error_string, "ncclGetErrorString");
  find(t.nccl_unique_id, "ncclGetUniqueId");
  find(t.nccl_comm_init_rank, "ncclCommInitRank");
  find(t.nccl_comm_destroy, "ncclCommDestroy");
  find(t.nccl_comm_count, "ncclCommCount");
  find(t.nccl_comm_user_rank, "ncclCommUserRank");
  if (!missing.empty()) {
    std::string names;
    for (const auto& n : missing) names += (names.empty() ? "" : ", ") + n;
    throw LoadError(path + " loaded but lacks " + names + " (not an NCCL EP API version 2 library and its NCCL)");
  }
  if (t.get_version(&lib->ep_version_) != ncclSuccess) throw LoadError(path + ": ncclEpGetVersion failed");
  if (t.nccl_get_version(&lib->nccl_version_) != ncclSuccess) throw LoadError(path + ": ncclGetVersion failed");
  if (lib->nccl_version_ < kMinNccl) {
    throw LoadError("NCCL " + version_string(lib->nccl_version_) + " (loaded by " + path +
                    ") is too old: the NCCL EP library needs NCCL >= " + version_string(kMinNccl));
  }
  // The library's major version must be the header's: the structs' ABI is pinned per API version
  // (nccl_ep_lib_abi.cpp), and a new major may move them.
  if (lib->ep_version_ / 10000 != NCCL_EP_MAJOR) {
    throw LoadError(path + " is NCCL EP " + version_string(lib->ep_version_) + "; omniep was built against the " +
                    version_string(NCCL_EP_VERSION_CODE) + " headers (major " + std::to_string(NCCL_EP_MAJOR) + ")");
  }
  return lib;
}

Library::~Library() {
  // Not dlclose'd: the library's CUDA kernels and any NCCL state may outlive the last handle in static
  // destructors; unloading it under them would crash at exit.
}

std::string Library::unique_id() const {
  ncclUniqueId id;
  fn_->check(fn_->nccl_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

// ---- communicator ---------------------------------------------------------------------------------

Communicator::Communicator(std::shared_ptr<Library> lib, uintptr_t borrowed_comm) : lib_(std::move(lib)) {
  if (borrowed_comm == 0) throw ArgumentError("borrowed_comm is null: expected the address of an ncclComm_t");
  comm_ = reinterpret_cast<void*>(borrowed_comm);
  auto c = static_cast<ncclComm_t>(comm_);
  lib_->fn().check(lib_->fn().nccl_comm_user_rank(c, &rank_), "ncclCommUserRank");
  lib_->fn().check(lib_->fn().nccl_comm_count(c, &num_ranks_), "ncclCommCount");
}

Communicator::Communicator(std::shared_ptr<Library> lib, int rank, int num_ranks, const std::string& unique_id)
    : lib_(std::move(lib)), owned_(true), rank_(rank), num_ranks_(num_ranks) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    throw ArgumentError("unique_id has " + std::to_string(unique_id.size()) + " bytes; expected " +
                        std::to_string(sizeof(id.internal)) + " (ncclGetUniqueId)");
  }
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
    throw ArgumentError("rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) + " is not a rank");
  }
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  ncclComm_t c = nullptr;
  lib_->fn().check(lib_->fn().nccl_comm_init_rank(&c, num_ranks, id, rank), "ncclCommInitRank");
  comm_ = c;
}

Communicator::~Communicator() {
  if (owned_ && comm_ != nullptr) lib_->fn().nccl_comm_destroy(static_cast<ncclComm_t>(comm_));
}

// ---- argument checks ------------------------------------------------------------------------------

GroupShape group_shape_for(const OpShape& op, int max_tokens) {
  GroupShape g;
  g.layout = op.layout;
  g.num_experts = op.num_experts;
  g.num_topk = op.num_topk;
  g.max_tokens = max_tokens;
  g.row_bytes = row_bytes(op.hidden, dtype_bytes(op.dtype), op.num_topk, op.layout == Layout::kExpertMajor);
  return g;
}

OpShape make_op_shape(int layout, int num_ranks, int num_experts, int64_t num_tokens, int64_t hidden, int num_topk,
                      int dtype, int64_t capacity, int expert_alignment) {
  if (layout != 0 && layout != 1) throw ArgumentError("layout=" + std::to_string(layout) + ": expected 0 or 1");
  if (dtype < 0 || dtype > 2) throw ArgumentError("dtype code " + std::to_string(dtype) + ": expected 0, 1 or 2");
  OpShape op;
  op.layout = static_cast<Layout>(layout);
  op.num_ranks = num_ranks;
  op.num_experts = num_experts;
  op.num_tokens = num_tokens;
  op.hidden = hidden;
  op.num_topk = num_topk;
  op.dtype = static_cast<DType>(dtype);
  op.capacity = capacity;
  op.expert_alignment = expert_alignment;
  return op;
}

std::string check_op(const OpShape& op, const GroupShape& group, int num_ranks) {
  std::ostringstream e;
  const bool em = op.layout == Layout::kExpertMajor;
  if (op.layout != group.layout) {
    e << "layout " << (em ? "expert_major" : "rank_major") << " on a group made for the other layout";
  } else if (op.num_ranks != num_ranks) {
    e << "num_ranks=" << op.num_ranks << " but the communicator has " << num_ranks << " ranks";
  } else if (op.num_experts <= 0 || op.num_experts % num_ranks != 0) {
    e << "num_experts=" << op.num_experts << " must be a positive multiple of the " << num_ranks << " ranks";
  } else if (op.num_experts != group.num_experts) {
    e << "num_experts=" << op.num_experts << " but the NCCL EP group was made for " << group.num_experts;
  } else if (op.num_topk <= 0) {
    e << "num_topk=" << op.num_topk << ": NCCL EP needs at least one expert per token";
  } else if (op.num_topk != group.num_topk) {
    e << "num_topk=" << op.num_topk << " but the NCCL EP group was made for " << group.num_topk;
  } else if (op.num_tokens < 0 || op.num_tokens > group.max_tokens) {
    e << "num_tokens=" << op.num_tokens << " is more than max_dispatch_tokens_per_rank=" << group.max_tokens
      << " of the NCCL EP group (raise OMNIEP_NCCL_EP_LIB_MAX_TOKENS on every rank)";
  } else if (op.hidden <= 0) {
    e << "hidden=" << op.hidden << ": expected > 0";
  } else if (op.dtype != DType::kBFloat16 && op.dtype != DType::kFloat16 && op.dtype != DType::kFloat32) {
    e << "dtype code " << static_cast<int>(op.dtype) << ": expected bfloat16, float16 or float32";
  } else if (row_bytes(op.hidden, dtype_bytes(op.dtype), op.num_topk, em) > group.row_bytes) {
    e << "a row of " << op.hidden << " x " << dtype_bytes(op.dtype) << " bytes (+ tag) needs "
      << row_bytes(op.hidden, dtype_bytes(op.dtype), op.num_topk, em) << " bytes; the group was made for "
      << group.row_bytes;
  } else if (op.capacity < 0) {
    e << "capacity=" << op.capacity << ": expected >= 0 (resolve the exact capacity before the native call)";
  } else if (op.capacity > static_cast<int64_t>(num_ranks) * group.max_tokens) {
    e << "capacity=" << op.capacity << " is more than the " << static_cast<int64_t>(num_ranks) * group.max_tokens
      << " rows NCCL EP can deliver (num_ranks x max_dispatch_tokens_per_rank)";
  } else if (op.expert_alignment < 1) {
    e << "expert_alignment=" << op.expert_alignment << ": expected >= 1";
  }
  return e.str();
}

// ---- group ----------------------------------------------------------------------------------------

Group::Group(std::shared_ptr<Communicator> comm, const GroupShape& shape, uint64_t timeout_ns)
    : comm_(std::move(comm)), shape_(shape) {
  const int R = comm_->num_ranks();
  const int64_t row_align = shape.layout == Layout::kExpertMajor ? kLowLatencyRowAlign : 16;
  if (shape.num_experts <= 0 || shape.num_experts % R != 0 || shape.max_tokens <= 0 || shape.num_topk <= 0 ||
      shape.row_bytes <= 0 || shape.row_bytes % row_align != 0) {
    throw ArgumentError("NCCL EP group shape: num_experts " + std::to_string(shape.num_experts) + ", num_topk " +
                        std::to_string(shape.num_topk) + ", max_tokens " + std::to_string(shape.max_tokens) +
                        ", row_bytes " + std::to_string(shape.row_bytes) +
                        ": expected positive values, experts a multiple of the ranks, row bytes a multiple of " +
                        std::to_string(row_align));
  }
  const bool em = shape.layout == Layout::kExpertMajor;
  auto cfg = versioned<ncclEpGroupConfig_t>();
  cfg.version = NCCL_EP_API_VERSION;
  cfg.algorithm = em ? NCCL_EP_ALGO_LOW_LATENCY : NCCL_EP_ALGO_HIGH_THROUGHPUT;
  cfg.num_experts = static_cast<unsigned int>(shape.num_experts);
  cfg.max_dispatch_tokens_per_rank = static_cast<unsigned int>(shape.max_tokens);
  // HT: a fixed bound (no eager mode, so dispatch is capturable): every token of every rank. LL: AUTO,
  // as the header asks.
  cfg.max_recv_tokens_per_rank = em ? NCCL_EP_AUTO : static_cast<unsigned int>(recv_slots());
  cfg.max_token_bytes = static_cast<unsigned int>(shape.row_bytes);
  cfg.rdma_buffer_size = NCCL_EP_AUTO;
  cfg.num_qp_per_rank = NCCL_EP_AUTO;
  cfg.num_channels = NCCL_EP_AUTO;
  cfg.max_num_sms = NCCL_EP_AUTO;
  cfg.timeout_ns = timeout_ns;
  cfg.overflow_policy = NCCL_EP_OVERFLOW_TRAP;  // cannot overflow: max_recv is every token of every rank
  cfg.num_topk = static_cast<unsigned int>(shape.num_topk);
  ncclEpGroup_t g = nullptr;
  lib().fn().check(lib().fn().create_group(&g, static_cast<ncclComm_t>(comm_->comm()), &cfg), "ncclEpCreateGroup");
  group_ = g;
  const int64_t K = shape.num_topk;
  const int64_t L = num_local_experts();
  const int64_t recv_rows = em ? L * recv_slots() : recv_slots();
  try {
    staging_.send = device_alloc<uint8_t>(static_cast<size_t>(shape.max_tokens) * shape.row_bytes, "staging (send)");
    staging_.recv = device_alloc<uint8_t>(static_cast<size_t>(recv_rows) * shape.row_bytes, "staging (receive)");
    if (!em) {
      staging_.slot_weights = device_alloc<float>(static_cast<size_t>(recv_slots() * K), "staging (weights)");
      staging_.slot_ids = device_alloc<int64_t>(static_cast<size_t>(recv_slots() * K), "staging (ids)");
    }
    staging_.ones = device_alloc<float>(static_cast<size_t>(shape.max_tokens * K), "staging (unit weights)");
    launch_fill(staging_.ones, shape.max_tokens * K, 1.0f, nullptr);
    staging_.scan_temp_bytes = exclusive_scan_temp_bytes(recv_rows + 1);
    staging_.scan_temp = device_alloc<uint8_t>(staging_.scan_temp_bytes, "staging (prefix sum)");
    check_cuda(cudaDeviceSynchronize(), "staging set-up");
  } catch (...) {
    release();
    throw;
  }
}

Group::~Group() { release(); }

void Group::release() {
  for (void* p : {staging_.send, staging_.recv, static_cast<void*>(staging_.slot_weights),
                  static_cast<void*>(staging_.slot_ids), static_cast<void*>(staging_.ones), staging_.scan_temp}) {
    if (p != nullptr) cudaFree(p);
  }
  staging_ = Staging{};
  if (group_ != nullptr) lib().fn().group_destroy(static_cast<ncclEpGroup_t>(group_));
  group_ = nullptr;
}

// ---- handle ---------------------------------------------------------------------------------------

Handle::Handle(std::shared_ptr<Group> group) : group_(std::move(group)) {
  const bool em = group_->shape().layout == Layout::kExpertMajor;
  auto cfg = versioned<ncclEpHandleConfig_t>();
  cfg.dispatch_output_per_expert_alignment = 0;  // HT expert-major only; omniep aligns the counts itself
  ncclEpHandle_t h = nullptr;
  const auto& fn = group_->lib().fn();
  // num_topk for both algorithms: nccl_ep.h says "pass -1 for HT", but the library (nccl-extensions
  // 0.1.0) refuses it there ("HT mode requires num_topk > 0 (pass top_k to ncclEpInitHandle)").
  fn.check(fn.init_handle(&h, static_cast<ncclEpGroup_t>(group_->ep_group()),
                          em ? NCCL_EP_LAYOUT_EXPERT_MAJOR : NCCL_EP_LAYOUT_FLAT, &cfg, group_->shape().num_topk,
                          nullptr),
           "ncclEpInitHandle");
  handle_ = h;
  keys_ = (em ? group_->num_local_experts() : 1) * group_->recv_slots();
  try {
    flags_ = device_alloc<int32_t>(static_cast<size_t>(keys_ + 1), "order flags");  // last: always 0
    slot_of_ = device_alloc<int32_t>(static_cast<size_t>(keys_), "order slots");
    pos_ = device_alloc<int32_t>(static_cast<size_t>(keys_ + 1), "order positions");
    counters_ = device_alloc<int32_t>(static_cast<size_t>(em ? group_->num_local_experts() : 1), "counters");
    bad_tag_ = device_alloc<int32_t>(1, "tag check");
  } catch (...) {
    release();
    throw;
  }
}

Handle::~Handle() { release(); }

void Handle::release() {
  for (void* p : {static_cast<void*>(flags_), static_cast<void*>(slot_of_), static_cast<void*>(pos_),
                  static_cast<void*>(counters_), static_cast<void*>(bad_tag_)}) {
    if (p != nullptr) cudaFree(p);
  }
  flags_ = slot_of_ = pos_ = counters_ = bad_tag_ = nullptr;
  if (handle_ != nullptr) group_->lib().fn().handle_destroy(static_cast<ncclEpHandle_t>(handle_));
  handle_ = nullptr;
}

void Handle::run_dispatch(const OpShape& op, const void* x, const int32_t* ids, const float* weights, bool forward,
                          cudaStream_t stream) {
  const Group& g = *group_;
  const bool em = op.layout == Layout::kExpertMajor;
  const int elt = dtype_bytes(op.dtype);
  const int64_t row = g.shape().row_bytes;  // every row of the group has the group's stride
  const int64_t width = row / elt;          // the row as `dtype` elements (row is a multiple of 16 or 1024)
  const int64_t K = op.num_topk;
  launch_stage_rows(x, op.num_tokens, op.hidden * elt, row, tag_offset(op.hidden, elt), ids, weights, op.num_topk,
                    em, g.rank(), g.staging().send, stream);
  const ncclDataType_t dt = nccl_dtype(op.dtype);
  Tensor tokens(g.staging().send, dt, {op.num_tokens, width});
  Tensor in_weights(weights, ncclFloat32, {op.num_tokens, K});
  auto inputs = versioned<ncclEpDispatchInputs_t>();
  inputs.tokens = tokens.get();
  auto outputs = versioned<ncclEpDispatchOutputs_t>();
  auto cfg = versioned<ncclEpDispatchConfig_t>();
  cfg.quant_recipe = NCCL_EP_DISP_QUANT_NONE;  // rows (and their tags) moved as they are
  const auto& fn = g.lib().fn();
  if (em) {
    // LL expert-major: tokens [L, R * max_tokens, width]; the counts per expert in layout_info.
    Tensor out_tokens(g.staging().recv, dt, {g.num_local_experts(), g.recv_slots(), width});
    Tensor counts(counters_, ncclInt32, {g.num_local_experts()});
    outputs.tokens = out_tokens.get();
    auto info = versioned<ncclEpLayoutInfo_t>();
    info.expert_counters = counts.get();
    fn.check(fn.dispatch(static_cast<ncclEpHandle_t>(handle_), &inputs, &outputs, &info, &cfg, stream), "ncclEpDispatch (LL)");
    return;
  }
  // HT flat: tokens [recv_slots, width]; forward also the weights and local ids per slot.
  Tensor out_tokens(g.staging().recv, dt, {g.recv_slots(), width});
  Tensor out_weights(g.staging().slot_weights, ncclFloat32, {g.recv_slots(), K});
  // ncclEpDispatch (HT flat) asserts recv_topk_idx->datatype == ncclInt64 (libnccl_ep.so of
  // nccl-extensions 0.1.0; the header does not say): an int32 tensor would abort the process.
  Tensor out_ids(g.staging().slot_ids, ncclInt64, {g.recv_slots(), K});
  outputs.tokens = out_tokens.get();
  if (forward) {
    inputs.topk_weights = in_weights.get();
    outputs.topk_weights = out_weights.get();
    outputs.topk_idx = out_ids.get();
  }
  cfg.pass_direction = forward ? NCCL_EP_FWD_PASS : NCCL_EP_BWD_PASS;
  fn.check(fn.dispatch(static_cast<ncclEpHandle_t>(handle_), &inputs, &outputs, nullptr, &cfg, stream), "ncclEpDispatch (HT)");
}

void Handle::map_order(const OpShape& op, cudaStream_t stream) {
  const Group& g = *group_;
  const bool em = op.layout == Layout::kExpertMajor;
  check_cuda(cudaMemsetAsync(flags_, 0, static_cast<size_t>(keys_ + 1) * sizeof(int32_t), stream), "clearing the order flags");
  check_cuda(cudaMemsetAsync(bad_tag_, 0, sizeof(int32_t), stream), "clearing the tag check");
  launch_mark(g.staging().recv, g.shape().row_bytes, tag_offset(op.hidden, dtype_bytes(op.dtype)), counters_,
              em ? g.num_local_experts() : 1, g.recv_slots(), g.num_ranks(), g.shape().max_tokens, flags_, slot_of_,
              bad_tag_, stream);
  launch_exclusive_scan(flags_, pos_, keys_ + 1, g.staging().scan_temp, g.staging().scan_temp_bytes, stream);
}

GatherArgs Handle::gather_args(const OpShape& op) const {
  const Group& g = *group_;
  GatherArgs a{};
  a.recv = g.staging().recv;
  a.row_bytes = g.shape().row_bytes;
  a.payload_bytes = op.hidden * dtype_bytes(op.dtype);
  a.tag_offset = tag_offset(op.hidden, dtype_bytes(op.dtype));
  a.num_topk = op.num_topk;
  a.num_ranks = g.num_ranks();
  a.num_local_experts = g.num_local_experts();
  a.rank = g.rank();
  a.dtype = static_cast<int>(op.dtype);
  a.max_tokens = g.shape().max_tokens;
  a.capacity = op.capacity;
  a.slots_per_group = g.recv_slots();
  a.expert_alignment = op.expert_alignment;
  a.flags = flags_;
  a.slot_of = slot_of_;
  a.pos = pos_;
  return a;
}

void Handle::dispatch(const OpShape& op, const void* x, const int32_t* topk_idx, const float* topk_weights,
                      const DispatchOut& out, cudaStream_t stream) {
  const Group& g = *group_;
  const std::string why = check_op(op, g.shape(), g.num_ranks());
  if (!why.empty()) throw ArgumentError(why);
  const bool em = op.layout == Layout::kExpertMajor;
  const auto& fn = g.lib().fn();
  // The routing: NCCL EP's per-step collective. HT also reports the received total here (the count of
  // filled slots the order mapping reads); LL takes no layout info at this point.
  Tensor idx(topk_idx, ncclInt32, {op.num_tokens, op.num_topk});
  if (em) {
    fn.check(fn.update_handle(static_cast<ncclEpHandle_t>(handle_), idx.get(), nullptr, stream), "ncclEpUpdateHandle (LL)");
  } else {
    Tensor total(counters_, ncclInt32, {1});
    auto info = versioned<ncclEpLayoutInfo_t>();
    info.recv_total_counter = total.get();
    info.recv_topk_idx_kind = NCCL_EP_EXPERT_ID_LOCAL;  // pinned: AUTO "may shift in a future release"
    fn.check(fn.update_handle(static_cast<ncclEpHandle_t>(handle_), idx.get(), &info, stream), "ncclEpUpdateHandle (HT)");
  }
  num_tokens_ = op.num_tokens;
  ++dispatches_;
  run_dispatch(op, x, topk_idx, topk_weights, /*forward=*/true, stream);
  map_order(op, stream);
  GatherArgs a = gather_args(op);
  a.slot_ids = em ? nullptr : g.staging().slot_ids;
  a.slot_weights = em ? nullptr : g.staging().slot_weights;
  launch_gather(a, em, out, stream);
}

void Handle::cached_dispatch(const OpShape& op, const void* x, const int32_t* topk_idx, const float* topk_weights,
                             void* recv_x, cudaStream_t stream) {
  const Group& g = *group_;
  const std::string why = check_op(op, g.shape(), g.num_ranks());
  if (!why.empty()) throw ArgumentError(why);
  if (op.num_tokens != num_tokens_) {
    throw ArgumentError("x has " + std::to_string(op.num_tokens) + " rows; the handle routes " +
                        std::to_string(num_tokens_) + " tokens");
  }
  const bool em = op.layout == Layout::kExpertMajor;
  // LL dispatches again with the handle's routing (its expert-major dispatch takes no weights); the tag
  // carries the weights each copy is scaled by. HT: the backward pass direction, "reuses cached routing".
  if (em && (topk_idx == nullptr || topk_weights == nullptr)) {
    throw ArgumentError("the expert-major cached dispatch needs topk_idx and topk_weights [T, K] (the tags carry them)");
  }
  run_dispatch(op, x, topk_idx, topk_weights, /*forward=*/false, stream);
  map_order(op, stream);
  GatherArgs a = gather_args(op);
  a.scale_weights = em ? topk_weights : nullptr;
  DispatchOut out;
  out.recv_x = recv_x;
  launch_gather(a, em, out, stream);
}

void Handle::run_combine(const OpShape& op, const void* rows, const float* rows_weights, const int32_t* recv_topk_idx,
                         const float* topk_weights, void* out, float* out_weights, bool backward, cudaStream_t stream) {
  const Group& g = *group_;
  const std::string why = check_op(op, g.shape(), g.num_ranks());
  if (!why.empty()) throw ArgumentError(why);
  if (op.num_tokens != num_tokens_) {
    throw ArgumentError("the combine returns " + std::to_string(op.num_tokens) + " tokens; the handle routes " +
                        std::to_string(num_tokens_));
  }
  const bool em = op.layout == Layout::kExpertMajor;
  const int elt = dtype_bytes(op.dtype);
  const int64_t row = g.shape().row_bytes;
  const int64_t width = row / elt;
  const int64_t K = op.num_topk;
  // NCCL EP's combine input has the shape of its dispatch output: the rows go back into the slots the
  // last dispatch filled (tag columns zero; a dropped row's slot all zero, so it adds nothing).
  ScatterArgs s{};
  s.rows = rows;
  s.rows_weights = em ? nullptr : rows_weights;
  s.recv_topk_idx = recv_topk_idx;
  s.payload_bytes = op.hidden * elt;
  s.row_bytes = row;
  s.capacity = op.capacity;
  s.slots_per_group = g.recv_slots();
  s.keys_per_group = g.recv_slots();
  s.groups = em ? g.num_local_experts() : 1;
  s.num_topk = op.num_topk;
  s.flags = flags_;
  s.slot_of = slot_of_;
  s.pos = pos_;
  s.dst = g.staging().recv;
  s.dst_weights = (!em && rows_weights != nullptr) ? g.staging().slot_weights : nullptr;
  launch_scatter(s, stream);
  const ncclDataType_t dt = nccl_dtype(op.dtype);
  Tensor in_ll(g.staging().recv, dt, {g.num_local_experts(), g.recv_slots(), width});
  Tensor in_ht(g.staging().recv, dt, {g.recv_slots(), width});
  Tensor in_weights(g.staging().slot_weights, ncclFloat32, {g.recv_slots(), K});
  Tensor out_tokens(g.staging().send, dt, {op.num_tokens, width});
  Tensor out_w(em ? static_cast<const void*>(topk_weights) : static_cast<const void*>(out_weights), ncclFloat32,
               {op.num_tokens, K});
  auto inputs = versioned<ncclEpCombineInputs_t>();
  inputs.tokens = em ? in_ll.get() : in_ht.get();
  auto outputs = versioned<ncclEpCombineOutputs_t>();
  outputs.tokens = out_tokens.get();
  auto cfg = versioned<ncclEpCombineConfig_t>();
  cfg.quant_recipe = NCCL_EP_COMB_QUANT_NONE;
  if (em) {
    outputs.topk_weights = out_w.get();  // LL expert-major: the weights NCCL EP applies on receive
  } else if (backward) {
    inputs.topk_weights = in_weights.get();
    outputs.topk_weights = out_w.get();  // HT backward: the weights' gradient, read back per (t, k)
    cfg.pass_direction = NCCL_EP_BWD_PASS;
  }
  const auto& fn = g.lib().fn();
  fn.check(fn.combine(static_cast<ncclEpHandle_t>(handle_), &inputs, &outputs, &cfg, stream),
           em ? "ncclEpCombine (LL)" : "ncclEpCombine (HT)");
  launch_unstage_rows(g.staging().send, op.num_tokens, row, op.hidden * elt, out, stream);
}

void Handle::combine(const OpShape& op, const void* y, const float* topk_weights, void* out, cudaStream_t stream) {
  if (op.layout == Layout::kExpertMajor && topk_weights == nullptr) {
    throw ArgumentError("the expert-major combine needs topk_weights [T, K]");
  }
  run_combine(op, y, nullptr, nullptr, topk_weights, out, nullptr, /*backward=*/false, stream);
}

void Handle::dispatch_bwd(const OpShape& op, const void* g_recv_x, const float* g_recv_topk_weights,
                          const int32_t* recv_topk_idx, void* g_x, float* g_topk_weights, cudaStream_t stream) {
  if (op.layout == Layout::kExpertMajor) {
    // The unweighted sum of the copies' gradients: LL combine with unit weights.
    run_combine(op, g_recv_x, nullptr, nullptr, group_->staging().ones, g_x, nullptr, /*backward=*/false, stream);
    return;
  }
  if (g_recv_topk_weights == nullptr || recv_topk_idx == nullptr || g_topk_weights == nullptr) {
    throw ArgumentError("the rank-major dispatch_bwd needs g_recv_topk_weights, recv_topk_idx and g_topk_weights");
  }
  run_combine(op, g_recv_x, g_recv_topk_weights, recv_topk_idx, nullptr, g_x, g_topk_weights, /*backward=*/true,
              stream);
}

int Handle::bad_tags(cudaStream_t stream) const {
  int32_t n = 0;
  check_cuda(cudaMemcpyAsync(&n, bad_tag_, sizeof(n), cudaMemcpyDeviceToHost, stream), "reading the tag check");
  check_cuda(cudaStreamSynchronize(stream), "reading the tag check");
  return n;
}

}  // namespace omniep::nccl_ep_lib
