// omniep._native_torch: the CUDA and Autograd kernels of the omniep_native::* ops (schemas and fake
// kernels: omniep/frontends/torch_ops.py). One native call per op (DESIGN §5 "The hot path"): the
// kernel checks its arguments, allocates its results, and runs the op through the group's EpRank
// (backends/ep_rank.h) on the current stream — the rank of whichever native module made it (CUDA IPC,
// NVSHMEM, NCCL; HIP IPC on AMD). A context id names a (group, backend) registered from Python once.
//
// Host waits: a rank-major dispatch with capacity=None waits once, for the received row count (the
// mapped counter, rank_ops.cuh); nothing else waits, so the static-shape ops capture into CUDA graphs.
// What the device found (a peer's different op, a bad id on a peer, a capacity overflow) is raised at
// that wait, at omniep.torch.check/synchronize, and after every op with OMNIEP_CHECKS=sync. A raised
// status is kept for Python (`take_raised`), which turns it into the typed exception.
//
// Local bad input raises c10::ValueError naming the argument — after the rank has taken the op's place
// in the group with a rejected descriptor, so its peers stop the op too instead of waiting for it.
//
// Handle tensors of an op (after recv_topk_idx / recv_topk_weights, which the frontend prepends):
//   [0] topk_idx32 [T, K] int32 (device)
//   [1] routing    int32 (device): send_pos [T, R], num_tokens_per_rank [R], num_tokens_per_expert [E],
//                  recv_counts [R], send_offset [R], num_recv / dropped scratch [2]; expert-major
//                  also copy_slot [T, K], recv_expert_count [L], scratch [2], then for the push combine
//                  recv_src [L, C] (each counted slot's source) and push_ok [1]
//   [2] info       int64 [2] (CPU): the dispatch's sequence number (the handle id of later ops'
//                  descriptors) and the symmetric capacity C
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/args.h"
#include "torch_ops/native_ops.h"

namespace omniep_torch {

using at::Tensor;
using omniep::EpRank;
using omniep::OpDesc;
using omniep::Status;

// ---- host stamps ---------------------------------------------------------------------------------------
// Where an op's host time goes (OMNIEP_HOST_STAMPS=1 when the module loads, or set_host_stamps;
// benchmarks/host_split_gpu.py --stamps): each stamp adds the time since the op's previous stamp to its
// step. Off, a stamp is one relaxed load and a predictable branch.

namespace {
std::atomic<bool> g_stamps_on{[] {
  const char* v = std::getenv("OMNIEP_HOST_STAMPS");
  return v != nullptr && *v != '\0' && *v != '0';
}()};
std::mutex g_stamps_mu;
std::vector<HostStep> g_steps;
thread_local std::chrono::steady_clock::time_point t_last_stamp;

void stamp_start() {
  if (g_stamps_on.load(std::memory_order_relaxed)) t_last_stamp = std::chrono::steady_clock::now();
}

void stamp(const char* step) {
  if (!g_stamps_on.load(std::memory_order_relaxed)) return;
  const auto now = std::chrono::steady_clock::now();
  const double us = std::chrono::duration<double, std::micro>(now - t_last_stamp).count();
  {
    std::lock_guard<std::mutex> lock(g_stamps_mu);
    auto it = std::find_if(g_steps.begin(), g_steps.end(), [&](const HostStep& h) { return h.name == step; });
    if (it == g_steps.end()) it = g_steps.insert(g_steps.end(), HostStep{step, 0.0, 0});
    it->total_us += us;
    it->count += 1;
  }
  t_last_stamp = std::chrono::steady_clock::now();  // the bookkeeping above is not the next step's
}
}  // namespace

std::vector<HostStep> host_steps(bool reset) {
  std::lock_guard<std::mutex> lock(g_stamps_mu);
  std::vector<HostStep> out = g_steps;
  if (reset) g_steps.clear();
  return out;
}

void set_host_stamps(bool on) { g_stamps_on.store(on); }

// ---- contexts ----------------------------------------------------------------------------------------

std::atomic<Context*> g_contexts[kMaxContexts];

void set_context(int64_t id, Context* c) {
  TORCH_CHECK(id > 0 && id < kMaxContexts, "omniep: context id out of range: ", id);
  delete g_contexts[id].exchange(c, std::memory_order_acq_rel);
}

Context& context_of(int64_t id) {
  Context* c = (id > 0 && id < kMaxContexts) ? g_contexts[id].load(std::memory_order_acquire) : nullptr;
  TORCH_CHECK(c != nullptr, "omniep: no live native context ", id, ": it was destroyed (omniep.torch.destroy) or "
              "never opened in this process");
  return *c;
}

cudaStream_t stream_of(const Context& c) { return c10::cuda::getCurrentCUDAStream(c.device).stream(); }

// Throws (for Python to turn into the typed error) if `st` reports something.
void raise_status(Context& c, const Status& st, const char* op) {
  if (st.w[omniep::kStCode] == omniep::kStatusOk) return;
  c.raised = st;
  const auto w = [&](int i) { return std::to_string(st.w[i]); };
  throw std::runtime_error(std::string("omniep: ") + op + " on rank " + w(omniep::kStRank) + ": status code " +
                           w(omniep::kStCode) + " (peer " + w(omniep::kStPeer) + ", fields mask " +
                           w(omniep::kStFields) + ", values " + w(omniep::kStMine) + " / " + w(omniep::kStTheirs) +
                           "); omniep.torch raises it as its typed error");
}

// The rank's statuses, raised (sticky first); the pending one is cleared once raised.
void check(Context& c, const char* op) {
  Status fatal, pending;
  c.rank->statuses(&fatal, &pending, /*clear_pending=*/true);
  raise_status(c, fatal, op);
  raise_status(c, pending, op);
}

// After an op: OMNIEP_CHECKS=sync raises what it found at once (never while a graph is captured).
void after_op(Context& c, const char* op) {
  if (!c.sync) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_of(c), &capture) == cudaSuccess && capture != cudaStreamCaptureStatusNone) return;
  check(c, op);
}

// An op's descriptor (EpRank::begin). A receive still pending (a send_only op whose hook was not
// called) runs first, on this op's stream: the op reuses its buffers.
template <typename... A>
OpDesc begin_op(Context& c, A... args) {
  if (c.rank->pending_receive() != 0) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
    c.rank->receive(stream_of(c));
  }
  return c.rank->begin(args...);
}

bool receive(int64_t ctx, int64_t seq) {
  Context& c = context_of(ctx);
  if (seq == 0 || c.rank->pending_receive() != static_cast<uint32_t>(seq)) return false;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  c.rank->receive(stream_of(c));
  after_op(c, "receive");
  return true;
}

// ---- argument checks ---------------------------------------------------------------------------------

// Python's spelling of a shape, "(2, 3)" / "(4,)". (String arithmetic, not iostreams: a module built
// against one libstdc++ and loaded beside another crashed formatting numbers into a stream.)
std::string shape_str(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

std::string dtype_str(const Tensor& t) {
  std::string n(c10::toString(t.scalar_type()));
  if (n == "BFloat16") return "bfloat16";
  if (n == "Half") return "float16";
  if (n == "Float") return "float32";
  if (n == "Double") return "float64";
  if (n == "Int") return "int32";
  if (n == "Long") return "int64";
  if (n == "Float8_e4m3fn") return "float8_e4m3fn";
  return n;
}

// Kernel dtype (args.h DType) of a floating tensor, -1 if the kernels do not combine it.
int kernel_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return omniep::kFloat32;
    case at::kBFloat16: return omniep::kBFloat16;
    case at::kHalf: return omniep::kFloat16;
    default: return -1;
  }
}

int desc_dtype(const Tensor& t) {
  const int k = kernel_dtype(t);
  if (k >= 0) return k;
  return t.scalar_type() == at::kFloat8_e4m3fn ? omniep::kDescFP8 : -1;
}

// Collects the first problem with the arguments; the op then rejects its place and throws it.
struct Checker {
  const Context& c;
  std::string error;
  void fail(const std::string& m) {
    if (error.empty()) error = m;
  }
  void on_device(const Tensor& t, const char* name) {
    if (!t.defined()) return;
    if (!t.is_cuda()) {
      fail(std::string(name) + " is on " + t.device().str() + "; the native backends serve CUDA tensors (use "
           "OMNIEP_BACKEND=collective for CPU tensors)");
    } else if (t.get_device() != c.device) {
      fail(std::string(name) + " is on " + t.device().str() + " but this rank of the group runs on cuda:" +
           std::to_string(c.device) + ": call torch.cuda.set_device first");
    }
  }
  void group_shape(int64_t num_experts) {
    if (num_experts <= 0 || num_experts % c.world != 0) {
      fail("num_experts=" + std::to_string(num_experts) + " is not a multiple of the EP group size " +
           std::to_string(c.world) + "; every rank must hold the same number of experts");
    } else if (num_experts / c.world > omniep::kMaxLocalExperts || num_experts > 12 * 1024) {
      fail("num_experts=" + std::to_string(num_experts) + " is more than the native kernels serve (at most " +
           std::to_string(omniep::kMaxLocalExperts) + " per rank and 12288 in all)");
    }
  }
  // x [T, H] (+ fp8 scales [T, H/128] float32); returns H.
  int64_t tokens(const Tensor& x, const std::optional<Tensor>& scales, int64_t T) {
    on_device(x, "x");
    if (x.dim() != 2) {
      fail("x must be 2-D [num_tokens, hidden], got shape " + shape_str(x));
      return 0;
    }
    if (x.size(0) != T) fail("x has " + std::to_string(x.size(0)) + " rows but topk_idx has " + std::to_string(T) + " tokens");
    const bool fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
    if (fp8) {
      if (!scales.has_value()) {
        fail("fp8 x needs x_scales[num_tokens, hidden/128] float32: pass x=(x, x_scales)");
      } else if (x.size(1) % 128 != 0) {
        fail("fp8 x needs hidden to be a multiple of 128, got " + std::to_string(x.size(1)));
      } else if (scales->dim() != 2 || scales->size(0) != T || scales->size(1) != x.size(1) / 128 ||
                 scales->scalar_type() != at::kFloat) {
        fail("x_scales must be float32 of shape (" + std::to_string(T) + ", " + std::to_string(x.size(1) / 128) +
             "), got " + dtype_str(*scales) + " " + shape_str(*scales));
      }
      if (scales.has_value()) on_device(*scales, "x_scales");
    } else if (kernel_dtype(x) < 0) {
      fail("x dtype " + dtype_str(x) + " is not supported; expected one of ('bfloat16', 'float16', 'float32', "
           "'float8_e4m3fn')");
    } else if (scales.has_value()) {
      fail("x_scales is only meaningful for fp8 x, got x of dtype " + dtype_str(x));
    }
    return x.size(1);
  }
  void routing(const Tensor& idx, const Tensor* weights) {
    on_device(idx, "topk_idx");
    if (idx.dim() != 2) {
      fail("topk_idx must be 2-D [num_tokens, num_topk], got shape " + shape_str(idx));
      return;
    }
    if (idx.scalar_type() != at::kInt && idx.scalar_type() != at::kLong) {
      fail("topk_idx must be int32 or int64, got " + dtype_str(idx));
    }
    if (weights != nullptr) {
      on_device(*weights, "topk_weights");
      if (weights->sizes() != idx.sizes()) {
        fail("topk_weights shape " + shape_str(*weights) + " does not match topk_idx shape " + shape_str(idx));
      } else if (weights->scalar_type() != at::kFloat) {
        fail("topk_weights must be float32, got " + dtype_str(*weights));
      }
    }
  }
  void combine_input(const Tensor& y, std::vector<int64_t> rows, const char* layout_shape) {
    on_device(y, "y");
    if (kernel_dtype(y) < 0) {
      fail("combine input y must be one of ('bfloat16', 'float16', 'float32'), got " + dtype_str(y));
      return;
    }
    bool ok = y.dim() == static_cast<int64_t>(rows.size()) + 1;
    for (size_t i = 0; ok && i < rows.size(); ++i) ok = y.size(static_cast<int64_t>(i)) == rows[i];
    if (!ok) {
      std::string want = "(";
      for (int64_t r : rows) want += std::to_string(r) + ", ";
      fail("combine input y has shape " + shape_str(y) + "; expected " + layout_shape + " = " + want +
           "'H') as produced by dispatch with this handle");
    }
  }
  void bias(const std::optional<Tensor>& b, int64_t T, int64_t H) {
    if (!b.has_value()) return;
    on_device(*b, "bias");
    if (b->dim() != 2 || b->size(0) != T || b->size(1) != H) {
      fail("bias must have shape (" + std::to_string(T) + ", " + std::to_string(H) + "), got " + shape_str(*b));
    } else if (kernel_dtype(*b) < 0) {
      fail("bias must be one of ('bfloat16', 'float16', 'float32'), got " + dtype_str(*b));
    }
  }
};

// Local bad input: take the op's place with a rejected descriptor (the peers stop it), then raise.
void reject(Context& c, OpDesc& d, const std::string& error) {
  c.rank->reject(d, stream_of(c));
  TORCH_CHECK_VALUE(false, error);
}

// Results and handle tensors on the group's device, straight from the caching allocator
// (at::detail::empty_cuda: no dispatcher round trip per tensor, and a dispatch allocates ten).
Tensor device_empty(at::IntArrayRef shape, at::ScalarType t, const Context& c) {
  return at::detail::empty_cuda(shape, t, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(c.device)),
                                std::nullopt);
}

// An op's small int32 / float32 tensors (handle, counts, routing results) carved from ONE allocation:
// each allocation costs the host ~1.3 µs on the lent H100 hosts (host_split_gpu.py --stamps, 2026-11-26)
// and a dispatch made ten. Parts do not overlap and start on 256-byte boundaries, as allocations do.
class Carved {
 public:
  int add(std::vector<int64_t> shape, at::ScalarType type) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    parts_.push_back(Part{std::move(shape), type, bytes_});
    bytes_ += (n * static_cast<int64_t>(c10::elementSize(type)) + 255) / 256 * 256;
    return static_cast<int>(parts_.size()) - 1;
  }
  // The parts, in the order added, over one fresh allocation.
  std::vector<Tensor> make(const Context& c) const {
    const Tensor base = device_empty({std::max<int64_t>(bytes_, 1)}, at::kByte, c);
    std::vector<Tensor> out;
    out.reserve(parts_.size());
    for (const Part& p : parts_) {
      // (the key set empty_cuda gives a tensor: the constructor adds the autograd keys)
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()),
                                                       c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                       c10::scalarTypeToTypeMeta(p.type));
      impl->set_storage_offset(p.offset / static_cast<int64_t>(c10::elementSize(p.type)));
      impl->set_sizes_contiguous(p.shape);
      out.push_back(Tensor::wrap_tensor_impl(std::move(impl)));
    }
    return out;
  }

 private:
  struct Part {
    std::vector<int64_t> shape;
    at::ScalarType type;
    int64_t offset;  // bytes
  };
  std::vector<Part> parts_;
  int64_t bytes_ = 0;
};

// Where the routing tensor's parts start (int32 offsets), for T tokens, K, R ranks, E experts (and, expert-major,
// C slots per local expert).
struct Routing {
  int64_t send_pos, per_rank, per_expert, recv_counts, send_offset, scratch, copy_slot, recv_expert_count, em_scratch,
      recv_src, push_ok, total;
  Routing(int64_t T, int64_t K, int64_t R, int64_t E, bool expert_major, int64_t C) {
    int64_t at = 0;
    const auto take = [&](int64_t n) {
      const int64_t here = at;
      at += n;
      return here;
    };
    send_pos = take(T * R);
    per_rank = take(R);
    per_expert = take(E);
    recv_counts = take(R);
    send_offset = take(R);
    scratch = take(2);
    copy_slot = expert_major ? take(T * K) : -1;
    recv_expert_count = expert_major ? take(E / R) : -1;
    em_scratch = expert_major ? take(2) : -1;
    recv_src = expert_major ? take(E / R * C) : -1;
    push_ok = expert_major ? take(1) : -1;
    total = at;
  }
};

struct HandleView {  // an op's handle, as the kernels need it
  const int32_t* topk_idx32;
  const int32_t* routing;
  int64_t seq, capacity;
  Routing parts;
};

HandleView handle_view(const std::vector<Tensor>& h, const Context& c, int64_t num_experts, bool expert_major) {
  TORCH_CHECK_VALUE(h.size() == 5, "omniep: a native handle has 5 tensors, got ", h.size(),
                    ": pass the handle returned by omniep.torch.dispatch");
  const Tensor& idx32 = h[2];
  const Tensor& routing = h[3];
  const Tensor& info = h[4];
  TORCH_CHECK_VALUE(idx32.dim() == 2 && idx32.scalar_type() == at::kInt && routing.scalar_type() == at::kInt &&
                        info.device().is_cpu() && info.numel() == 2 && info.scalar_type() == at::kLong,
                    "omniep: the handle's tensors are not a native dispatch's: pass the handle omniep.torch.dispatch returned");
  const auto* meta = info.data_ptr<int64_t>();
  HandleView v{idx32.data_ptr<int32_t>(), routing.data_ptr<int32_t>(), meta[0], meta[1],
               Routing(idx32.size(0), idx32.size(1), c.world, num_experts, expert_major, meta[1])};
  TORCH_CHECK_VALUE(routing.numel() == v.parts.total, "omniep: the handle does not match num_experts / layout");
  return v;
}

// ---- dispatch ----------------------------------------------------------------------------------------

namespace {

// dispatch, and dispatch_fp8 (cast_from: the bf16 rows the expert-major kernel casts into x_in /
// x_scales_in, fresh staging tensors, before sending them; round_scale: power-of-two scales).
DispatchOut dispatch_impl(const Tensor& x_in, const std::optional<Tensor>& x_scales_in, const Tensor* cast_from,
                          bool round_scale, const Tensor& topk_idx_in, const Tensor& topk_weights_in, int64_t ctx,
                          int64_t num_experts, int64_t layout, int64_t capacity, int64_t expert_alignment,
                          bool zero_padding) {
  stamp_start();
  Context& c = context_of(ctx);
  const bool em = layout == 1;
  const bool send_only = std::exchange(c.send_only_next, false) && em;
  int32_t* const recv_stats = std::exchange(c.recv_stats_next, nullptr);
  const int64_t T = topk_idx_in.dim() == 2 ? topk_idx_in.size(0) : 0;
  const int64_t K = topk_idx_in.dim() == 2 ? topk_idx_in.size(1) : 0;
  const int64_t R = c.world;
  Checker chk{c, {}};
  chk.routing(topk_idx_in, &topk_weights_in);
  if (cast_from != nullptr) {  // x_in / x_scales_in are the staging made for it: check what the caller gave
    chk.on_device(*cast_from, "x");
    if (cast_from->scalar_type() != at::kBFloat16 || cast_from->dim() != 2 || cast_from->size(1) % 128 != 0) {
      chk.fail("use_fp8 casts x[num_tokens, hidden] bfloat16 with hidden % 128 == 0, got " + dtype_str(*cast_from) +
               " " + shape_str(*cast_from));
    }
    if (!em) chk.fail("use_fp8 (the fp8 cast inside the dispatch) needs layout=\"expert_major\"");
  }
  const int64_t H = chk.tokens(x_in, x_scales_in, T);
  chk.group_shape(num_experts);
  if (expert_alignment < 1) chk.fail("expert_alignment must be an int >= 1, got " + std::to_string(expert_alignment));
  // Expert-major capacity=None: the worst case without duplicate ids, R * T (the descriptor then
  // tells ranks with another T apart).
  const int64_t cap = capacity >= 0 ? capacity : (em ? R * T : -1);
  if (cap > 0x7ffffffe) chk.fail("capacity " + std::to_string(cap) + " is too large");
  OpDesc d = begin_op(c, omniep::kOpDispatch, static_cast<int>(num_experts), static_cast<int>(H),
                      desc_dtype(x_in), static_cast<int>(layout), static_cast<int>(cap), -1, static_cast<int>(K));
  if (!chk.error.empty()) reject(c, d, chk.error);
  stamp("dispatch: checks, descriptor");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const cudaStream_t s = stream_of(c);
  const Tensor x = x_in.contiguous(), topk_idx = topk_idx_in.contiguous(), weights = topk_weights_in.contiguous();
  const std::optional<Tensor> x_scales =
      x_scales_in.has_value() ? std::optional<Tensor>(x_scales_in->contiguous()) : std::nullopt;
  const int64_t E = num_experts, L = E / R;
  stamp("dispatch: device guard, stream, contiguous");

  const Routing parts(T, K, R, E, em, cap);
  const bool fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t S = fp8 ? x_scales->size(1) : 0;
  // The small results: per received row (rank-major [rows, K]) or slot (expert-major [L, rows]).
  // (recv_x_scales is allocated on its own: it need not outlive the handle, and an empty one must not
  // share a Storage a resize could write through.)
  const auto add_results = [&](Carved& k, int64_t n_rows) {
    std::vector<int64_t> per_copy = em ? std::vector<int64_t>{L, n_rows} : std::vector<int64_t>{n_rows};
    if (!em) per_copy.push_back(K);
    k.add(per_copy, at::kInt);    // recv_topk_idx
    k.add(per_copy, at::kFloat);  // recv_topk_weights
  };
  // Rows known before the layout (a capacity): every small tensor in one allocation; exact: two.
  const bool rows_known = cap >= 0;
  Carved small;
  small.add({T, K}, at::kInt);            // idx32
  small.add({parts.total}, at::kInt);     // routing
  small.add({}, at::kInt);                // num_recv
  small.add({}, at::kInt);                // dropped
  small.add({L}, at::kInt);               // num_recv_tokens_per_expert
  if (rows_known) add_results(small, cap);
  std::vector<Tensor> carved = small.make(c);
  Tensor idx32 = carved[0], routing = carved[1], num_recv = carved[2], dropped = carved[3], per_expert = carved[4];
  Tensor info = at::detail::empty_cpu({2}, at::kLong);
  int32_t* r = routing.data_ptr<int32_t>();
  stamp("dispatch: handle / count tensors (one allocation)");

  omniep::PrepareCall p = {};
  p.topk_idx = topk_idx.data_ptr();
  p.index_bytes = static_cast<int>(topk_idx.element_size());
  p.num_tokens = static_cast<int>(T);
  p.num_topk = static_cast<int>(K);
  p.num_experts = static_cast<int>(E);
  p.capacity = static_cast<int>(cap);
  p.expert_alignment = static_cast<int>(expert_alignment);
  p.expert_major = em;
  p.topk_idx32 = idx32.data_ptr<int32_t>();
  p.send_pos = r + parts.send_pos;
  p.num_tokens_per_rank = r + parts.per_rank;
  p.num_tokens_per_expert = r + parts.per_expert;
  p.recv_counts = r + parts.recv_counts;
  p.send_offset = r + parts.send_offset;
  if (em) {
    p.num_recv = r + parts.scratch;
    p.dropped = r + parts.scratch + 1;
    p.copy_slot = r + parts.copy_slot;
    p.recv_expert_count = r + parts.recv_expert_count;
    p.num_recv_tokens_per_expert = per_expert.data_ptr<int32_t>();
    p.em_num_recv = num_recv.data_ptr<int32_t>();
    p.em_dropped = dropped.data_ptr<int32_t>();
    p.recv_stats = recv_stats;
    p.push_ok = r + parts.push_ok;
  } else {
    p.num_recv = num_recv.data_ptr<int32_t>();
    p.dropped = dropped.data_ptr<int32_t>();
  }
  // Expert-major and static rank-major: the dispatch kernel routes itself (one launch, below); exact
  // rank-major: prepare first (its counted wait sizes the results).
  const omniep::PrepareResult prep = rows_known
      ? omniep::PrepareResult{static_cast<int>(cap), static_cast<int>(cap), false, 0, 0}
      : c.rank->prepare(p, d, s);
  stamp("dispatch: prepare (layout launch; the counted wait)");
  if (prep.stopped) {  // the op stopped on every rank: its status says why
    check(c, "dispatch");
    throw std::runtime_error("omniep: dispatch stopped on every rank without a status (a bug in omniep)");
  }
  info.data_ptr<int64_t>()[0] = d.w[omniep::kDescSeq];
  info.data_ptr<int64_t>()[1] = prep.capacity;

  const int64_t rows = prep.rows;
  if (!rows_known) {
    Carved results;
    add_results(results, rows);
    for (Tensor& t : results.make(c)) carved.push_back(std::move(t));
  }
  Tensor recv_idx = carved[5], recv_w = carved[6];
  std::vector<int64_t> x_shape = em ? std::vector<int64_t>{L, rows} : std::vector<int64_t>{rows};
  std::vector<int64_t> s_shape = x_shape;
  x_shape.push_back(H);
  s_shape.push_back(S);
  Tensor recv_x = device_empty(x_shape, x.scalar_type(), c);
  Tensor recv_s = fp8 ? device_empty(s_shape, at::kFloat, c) : device_empty({0}, at::kFloat, c);
  stamp("dispatch: result tensors");
  if (em) {
    omniep::EMDispatchCall e = {};
    e.route = &p;
    e.cast_src = cast_from != nullptr ? cast_from->data_ptr() : nullptr;
    e.cast_round_scale = round_scale;
    e.x = x.data_ptr();
    e.row_bytes = H * x.element_size();
    e.x2 = fp8 ? x_scales->data_ptr() : nullptr;
    e.row2_bytes = S * 4;
    e.num_tokens = static_cast<int>(T);
    e.num_topk = static_cast<int>(K);
    e.num_experts = static_cast<int>(E);
    e.capacity = static_cast<int>(cap);
    e.topk_weights = weights.data_ptr<float>();
    e.recv_x = recv_x.data_ptr();
    e.recv_x2 = fp8 ? recv_s.data_ptr() : nullptr;
    e.recv_topk_idx = recv_idx.data_ptr<int32_t>();
    e.recv_topk_weights = recv_w.data_ptr<float>();
    e.recv_src = r + parts.recv_src;
    e.zero_padding = zero_padding;
    e.send_only = send_only;
    c.rank->em_dispatch(e, d, s);
  } else {
    omniep::DispatchCall q = {};
    q.x = x.data_ptr();
    q.row_bytes = H * x.element_size();
    q.x2 = fp8 ? x_scales->data_ptr() : nullptr;
    q.row2_bytes = S * 4;
    q.num_tokens = static_cast<int>(T);
    q.num_topk = static_cast<int>(K);
    q.num_experts = static_cast<int>(E);
    q.capacity = prep.capacity;
    q.rows = static_cast<int>(rows);
    q.expert_alignment = static_cast<int>(expert_alignment);
    q.routing = true;
    q.topk_weights = weights.data_ptr<float>();
    q.topk_idx32 = p.topk_idx32;
    q.send_pos = p.send_pos;
    q.send_offset = p.send_offset;
    q.recv_counts = p.recv_counts;
    q.recv_x = recv_x.data_ptr();
    q.recv_x2 = fp8 ? recv_s.data_ptr() : nullptr;
    q.recv_topk_idx = recv_idx.data_ptr<int32_t>();
    q.recv_topk_weights = recv_w.data_ptr<float>();
    q.num_recv_tokens_per_expert = per_expert.data_ptr<int32_t>();
    if (rows_known) q.route = &p;
    c.rank->dispatch(q, d, s);
  }
  stamp("dispatch: dispatch launch");
  // The counted wait saw what an earlier op left pending: raise it now that this op ran everywhere.
  if (prep.fatal != omniep::kStatusOk || prep.pending != omniep::kStatusOk) check(c, "dispatch");
  after_op(c, "dispatch");
  stamp("dispatch: after_op");
  return DispatchOut(recv_x, recv_s, recv_idx, recv_w, num_recv, per_expert, dropped,
                     std::vector<Tensor>{idx32, routing, info});
}

}  // namespace

DispatchOut dispatch_cuda(const Tensor& x, const std::optional<Tensor>& x_scales, const Tensor& topk_idx,
                          const Tensor& topk_weights, int64_t ctx, int64_t num_experts, int64_t layout,
                          int64_t capacity, int64_t expert_alignment, bool zero_padding) {
  return dispatch_impl(x, x_scales, nullptr, false, topk_idx, topk_weights, ctx, num_experts, layout, capacity,
                       expert_alignment, zero_padding);
}

DispatchOut dispatch_fp8_cuda(const Tensor& x_in, const Tensor& topk_idx, const Tensor& topk_weights, bool round_scale,
                              int64_t ctx, int64_t num_experts, int64_t layout, int64_t capacity,
                              int64_t expert_alignment, bool zero_padding) {
  Context& c = context_of(ctx);
  // Staging for the cast (shaped from x as far as x has a shape: dispatch_impl checks x itself).
  const bool two_d = x_in.dim() == 2;
  const int64_t T = two_d ? x_in.size(0) : 0, H = two_d ? x_in.size(1) : 0;
  const Tensor x = x_in.contiguous();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const Tensor x8 = device_empty({T, H}, at::kFloat8_e4m3fn, c);
  const Tensor scales = device_empty({T, H / 128}, at::kFloat, c);
  return dispatch_impl(x8, scales, &x, round_scale, topk_idx, topk_weights, ctx, num_experts, layout, capacity,
                       expert_alignment, zero_padding);
}

// Rank-major rows only with a handle: a cached dispatch (op kCachedDispatch) or combine_bwd.
std::tuple<Tensor, Tensor> dispatch_rows(Context& c, const Tensor& x_in, const std::optional<Tensor>& x_scales_in,
                                         const std::vector<Tensor>& handle, int64_t num_experts, omniep::OpKind op,
                                         const char* what) {
  Checker chk{c, {}};
  const int64_t T = handle.size() == 5 ? handle[2].size(0) : 0;
  const int64_t H = chk.tokens(x_in, x_scales_in, T);
  HandleView h = handle_view(handle, c, num_experts, false);
  const int64_t rows = handle[0].size(0);
  OpDesc d = begin_op(c, op, static_cast<int>(num_experts), static_cast<int>(H), desc_dtype(x_in), 0,
                      static_cast<int>(h.capacity), static_cast<int>(h.seq), 0);
  if (!chk.error.empty()) reject(c, d, chk.error);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const Tensor x = x_in.contiguous();
  const bool fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  const std::optional<Tensor> x_scales = fp8 ? std::optional<Tensor>(x_scales_in->contiguous()) : std::nullopt;
  const int64_t S = fp8 ? x_scales->size(1) : 0;
  Tensor recv_x = device_empty({rows, H}, x.scalar_type(), c);
  Tensor recv_s = fp8 ? device_empty({rows, S}, at::kFloat, c) : device_empty({0}, at::kFloat, c);
  omniep::DispatchCall q = {};
  q.x = x.data_ptr();
  q.row_bytes = H * x.element_size();
  q.x2 = fp8 ? x_scales->data_ptr() : nullptr;
  q.row2_bytes = S * 4;
  q.num_tokens = static_cast<int>(T);
  q.num_topk = static_cast<int>(handle[2].size(1));
  q.num_experts = static_cast<int>(num_experts);
  q.capacity = static_cast<int>(h.capacity);
  q.rows = static_cast<int>(rows);
  q.expert_alignment = 1;
  q.send_pos = h.routing + h.parts.send_pos;
  q.send_offset = h.routing + h.parts.send_offset;
  q.recv_counts = h.routing + h.parts.recv_counts;
  q.recv_x = recv_x.data_ptr();
  q.recv_x2 = fp8 ? recv_s.data_ptr() : nullptr;
  c.rank->dispatch(q, d, stream_of(c));
  after_op(c, what);
  return {recv_x, recv_s};
}

std::tuple<Tensor, Tensor> cached_dispatch_cuda(const Tensor& x, const std::optional<Tensor>& x_scales,
                                                at::TensorList handle, int64_t ctx, int64_t num_experts, int64_t layout,
                                                int64_t, int64_t) {
  Context& c = context_of(ctx);
  TORCH_CHECK_VALUE(layout == 0, "cached dispatch serves rank-major handles; dispatch again for the expert-major layout");
  return dispatch_rows(c, x, x_scales, handle.vec(), num_experts, omniep::kOpCachedDispatch, "cached dispatch");
}

// ---- combine and the backward passes -----------------------------------------------------------------

// Rank-major combine (g_recv_w undefined) or dispatch_bwd; expert-major likewise.
std::tuple<Tensor, Tensor> combine_impl(Context& c, omniep::OpKind op, const Tensor& y_in, const Tensor* weights_in,
                                        const std::optional<Tensor>& b0, const std::optional<Tensor>& b1,
                                        const Tensor* g_recv_w_in, const std::vector<Tensor>& handle,
                                        int64_t num_experts, int64_t layout, const char* what) {
  stamp_start();
  const bool em = layout == 1;
  const bool send_only = std::exchange(c.send_only_next, false) && em;
  Checker chk{c, {}};
  HandleView h = handle_view(handle, c, num_experts, em);
  const int64_t T = handle[2].size(0), K = handle[2].size(1), L = num_experts / c.world;
  const std::vector<int64_t> rows = em ? std::vector<int64_t>{L, handle[0].size(1)} : std::vector<int64_t>{handle[0].size(0)};
  chk.combine_input(y_in, rows, em ? "[num_local_experts, capacity, H]" : "[rows, H]");
  const int64_t H = y_in.dim() >= 1 ? y_in.size(-1) : 0;
  chk.bias(b0, T, H);
  chk.bias(b1, T, H);
  if (g_recv_w_in != nullptr) {
    const std::vector<int64_t> want = em ? rows : std::vector<int64_t>{rows[0], K};
    if (g_recv_w_in->sizes() != at::IntArrayRef(want) || g_recv_w_in->scalar_type() != at::kFloat) {
      chk.fail("g_recv_topk_weights must be float32 shaped like recv_topk_weights, got " + dtype_str(*g_recv_w_in) +
               " " + shape_str(*g_recv_w_in));
    }
  }
  OpDesc d = begin_op(c, op, static_cast<int>(num_experts), static_cast<int>(H), desc_dtype(y_in),
                      static_cast<int>(layout), static_cast<int>(h.capacity), static_cast<int>(h.seq),
                      static_cast<int>(K));
  if (!chk.error.empty()) reject(c, d, chk.error);
  stamp("combine: handle, checks, descriptor");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const Tensor y = y_in.contiguous();
  Tensor bias[2];
  int num_bias = 0;
  for (const auto* b : {&b0, &b1}) {
    if (b->has_value()) bias[num_bias++] = (*b)->contiguous();
  }
  Tensor out = device_empty({T, H}, y.scalar_type(), c);
  const bool grad = g_recv_w_in != nullptr;
  const Tensor g_recv_w = grad ? g_recv_w_in->contiguous() : Tensor();
  Tensor g_w = grad ? device_empty({T, K}, at::kFloat, c) : Tensor();  // (a combine returns `out` only)
  const cudaStream_t s = stream_of(c);
  stamp("combine: device guard, contiguous, result tensor");
  // What both layouts take alike (omniep::CombineBase).
  const auto fill = [&](omniep::CombineBase& b) {
    b.y = y.data_ptr();
    b.hidden = static_cast<int>(H);
    b.dtype = kernel_dtype(y);
    b.num_tokens = static_cast<int>(T);
    b.num_topk = static_cast<int>(K);
    b.num_experts = static_cast<int>(num_experts);
    b.capacity = static_cast<int>(h.capacity);
    b.topk_idx32 = h.topk_idx32;
    b.num_bias = num_bias;
    for (int i = 0; i < num_bias; ++i) {
      b.bias[i] = bias[i].data_ptr();
      b.bias_dtype[i] = kernel_dtype(bias[i]);
    }
    b.out = out.data_ptr();
    b.with_topk_grad = grad;
    if (grad) {
      b.g_recv_topk_weights = g_recv_w.data_ptr<float>();
      b.g_topk_weights = g_w.data_ptr<float>();
    }
  };
  if (em) {
    omniep::EMCombineCall e = {};
    fill(e);
    const Tensor w = weights_in != nullptr ? weights_in->contiguous() : Tensor();
    e.weighted = weights_in != nullptr;
    e.topk_weights = weights_in != nullptr ? w.data_ptr<float>() : nullptr;
    e.copy_slot = h.routing + h.parts.copy_slot;
    e.recv_expert_count = h.routing + h.parts.recv_expert_count;
    e.slot_src = h.routing + h.parts.recv_src;
    e.push_ok = h.routing + h.parts.push_ok;
    e.send_only = send_only;
    c.rank->em_combine(e, d, s);
  } else {
    omniep::CombineCall q = {};
    fill(q);
    q.rows = static_cast<int>(rows[0]);
    q.send_pos = h.routing + h.parts.send_pos;
    q.send_offset = h.routing + h.parts.send_offset;
    q.recv_counts = h.routing + h.parts.recv_counts;
    c.rank->combine(q, d, s);
  }
  stamp("combine: combine launch");
  after_op(c, what);
  stamp("combine: after_op");
  return {out, g_w};
}

Tensor combine_cuda(const Tensor& y, const std::optional<Tensor>& topk_weights, const std::optional<Tensor>& bias0,
                    const std::optional<Tensor>& bias1, at::TensorList handle, int64_t ctx, int64_t num_experts,
                    int64_t layout, int64_t, int64_t, bool) {
  Context& c = context_of(ctx);
  TORCH_CHECK_VALUE(layout == 0 || topk_weights.has_value(), "expert-major combine needs the routing weights");
  const Tensor* w = (layout == 1 && topk_weights.has_value()) ? &*topk_weights : nullptr;
  return std::get<0>(combine_impl(c, omniep::kOpCombine, y, w, bias0, bias1, nullptr, handle.vec(), num_experts, layout,
                                  "combine"));
}

std::tuple<Tensor, Tensor> dispatch_bwd_cuda(const Tensor& g_recv_x, const Tensor& g_recv_topk_weights,
                                             at::TensorList handle, int64_t ctx, int64_t num_experts, int64_t layout,
                                             int64_t, int64_t) {
  Context& c = context_of(ctx);
  return combine_impl(c, omniep::kOpDispatchBwd, g_recv_x, nullptr, std::nullopt, std::nullopt, &g_recv_topk_weights,
                      handle.vec(), num_experts, layout, "dispatch_bwd");
}

std::tuple<Tensor, Tensor> combine_bwd_cuda(const Tensor& g_out_in, const std::optional<Tensor>& topk_weights,
                                            const std::optional<Tensor>& y_in, at::TensorList handle_list, int64_t ctx,
                                            int64_t num_experts, int64_t layout, int64_t, int64_t, bool zero_padding) {
  Context& c = context_of(ctx);
  const std::vector<Tensor> handle = handle_list.vec();
  if (layout == 0) {  // a cached dispatch of g_out
    auto out = dispatch_rows(c, g_out_in, std::nullopt, handle, num_experts, omniep::kOpCombineBwd, "combine_bwd");
    return {std::get<0>(out), device_empty({0}, at::kFloat, c)};
  }
  Checker chk{c, {}};
  HandleView h = handle_view(handle, c, num_experts, true);
  const int64_t T = handle[2].size(0), K = handle[2].size(1), L = num_experts / c.world, C = handle[0].size(1);
  chk.on_device(g_out_in, "g_out");
  if (g_out_in.dim() != 2 || g_out_in.size(0) != T || kernel_dtype(g_out_in) < 0) {
    chk.fail("g_out must be [T, H] bfloat16 / float16 / float32, got " + dtype_str(g_out_in) + " " + shape_str(g_out_in));
  }
  const int64_t H = g_out_in.dim() == 2 ? g_out_in.size(1) : 0;
  if (!topk_weights.has_value()) chk.fail("expert-major combine_bwd needs the routing weights");
  if (y_in.has_value()) {
    chk.combine_input(*y_in, {L, C}, "[num_local_experts, capacity, H]");
    if (y_in->scalar_type() != g_out_in.scalar_type()) chk.fail("y and g_out must have the same dtype");
  }
  OpDesc d = begin_op(c, omniep::kOpCombineBwd, static_cast<int>(num_experts), static_cast<int>(H),
                      desc_dtype(g_out_in), 1, static_cast<int>(h.capacity), static_cast<int>(h.seq),
                      static_cast<int>(K));
  if (!chk.error.empty()) reject(c, d, chk.error);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  const Tensor g_out = g_out_in.contiguous();
  const Tensor w = topk_weights->contiguous();
  const Tensor y = y_in.has_value() ? y_in->contiguous() : Tensor();
  // Padding slots: zeroed by the kernel with zero_padding, else left as the allocator gives them (DESIGN §2).
  Tensor g_y = device_empty({L, C, H}, g_out.scalar_type(), c);
  Tensor g_w = y_in.has_value() ? device_empty({T, K}, at::kFloat, c) : device_empty({0}, at::kFloat, c);
  omniep::EMCombineBwdCall e = {};
  e.g_out = g_out.data_ptr();
  e.hidden = static_cast<int>(H);
  e.dtype = kernel_dtype(g_out);
  e.num_tokens = static_cast<int>(T);
  e.num_topk = static_cast<int>(K);
  e.num_experts = static_cast<int>(num_experts);
  e.capacity = static_cast<int>(h.capacity);
  e.topk_weights = w.data_ptr<float>();
  e.topk_idx32 = h.topk_idx32;
  e.copy_slot = h.routing + h.parts.copy_slot;
  e.recv_expert_count = h.routing + h.parts.recv_expert_count;
  e.with_topk_grad = y_in.has_value();
  e.y = y_in.has_value() ? y.data_ptr() : nullptr;
  e.g_y = g_y.data_ptr();
  e.g_topk_weights = y_in.has_value() ? g_w.data_ptr<float>() : nullptr;
  e.zero_padding = zero_padding;
  c.rank->em_combine_bwd(e, d, stream_of(c));
  after_op(c, "combine_bwd");
  return {g_y, g_w};
}

}  // namespace omniep_torch

// The schemas are defined in Python (omniep/frontends/torch_ops.py), once for both op families.
TORCH_LIBRARY_IMPL(omniep_native, CUDA, m) {
  m.impl("dispatch", &omniep_torch::dispatch_cuda);
  m.impl("dispatch_fp8", &omniep_torch::dispatch_fp8_cuda);
  m.impl("cached_dispatch", &omniep_torch::cached_dispatch_cuda);
  m.impl("combine", &omniep_torch::combine_cuda);
  m.impl("dispatch_bwd", &omniep_torch::dispatch_bwd_cuda);
  m.impl("combine_bwd", &omniep_torch::combine_bwd_cuda);
}
