// omniep._native_torch, part two: the Autograd kernels of the omniep_native::* ops (the formulas of
// omniep/frontends/torch_ops.py for the C++ kernels: dispatch's adjoint is dispatch_bwd, combine's is
// combine_bwd, a cached dispatch's an unweighted combine) and the Python module that registers
// contexts. Below autograd every op goes through the dispatcher again, so that under torch.compile's
// fake tensors the next kernel is the Python fake one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (the direct entries; libtorch_python)

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torch_ops/direct_entry.h"
#include "torch_ops/native_ops.h"

namespace omniep_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The ops below autograd go through the dispatcher, not straight to the CUDA kernels: under
// torch.compile's fake tensors the next kernel is the Python fake one.
using DispatchSig = DispatchOut(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, int64_t,
                                int64_t, int64_t, int64_t, int64_t, bool);
using CombineSig = Tensor(const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                          const std::optional<Tensor>&, at::TensorList, int64_t, int64_t, int64_t, int64_t, int64_t,
                          bool);
using CachedSig = std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&, at::TensorList, int64_t,
                                             int64_t, int64_t, int64_t, int64_t);

const c10::TypedOperatorHandle<DispatchSig>& dispatch_op() {
  static const auto h = op("omniep_native::dispatch").typed<DispatchSig>();
  return h;
}
const c10::TypedOperatorHandle<CombineSig>& combine_op() {
  static const auto h = op("omniep_native::combine").typed<CombineSig>();
  return h;
}
const c10::TypedOperatorHandle<CachedSig>& cached_dispatch_op() {
  static const auto h = op("omniep_native::cached_dispatch").typed<CachedSig>();
  return h;
}

bool wants_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

struct Config {  // the ops' trailing ints
  int64_t ctx, num_experts, layout, capacity, expert_alignment;
};

void save_config(AutogradContext* ctx, const Config& cfg) {
  ctx->saved_data["cfg"] = std::vector<int64_t>{cfg.ctx, cfg.num_experts, cfg.layout, cfg.capacity, cfg.expert_alignment};
}

Config load_config(AutogradContext* ctx) {
  const auto v = ctx->saved_data["cfg"].toIntVector();
  return Config{v[0], v[1], v[2], v[3], v[4]};
}

struct DispatchFunction : public torch::autograd::Function<DispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& topk_weights,
                               const std::optional<Tensor>* x_scales, const Tensor* topk_idx, Config cfg,
                               bool zero_padding) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto out = dispatch_op().call(x, *x_scales, *topk_idx, topk_weights, cfg.ctx, cfg.num_experts, cfg.layout,
                                  cfg.capacity, cfg.expert_alignment, zero_padding);
    variable_list flat{std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out),
                       std::get<4>(out), std::get<5>(out), std::get<6>(out)};
    const auto& h = std::get<7>(out);
    flat.insert(flat.end(), h.begin(), h.end());
    ctx->mark_non_differentiable({flat[1], flat[2], flat[4], flat[5], flat[6], h[0], h[1], h[2]});
    ctx->save_for_backward({flat[2], flat[3], h[0], h[1], h[2]});
    ctx->saved_data["x_grad"] = x.is_floating_point() && !x_scales->has_value();
    save_config(ctx, cfg);
    return flat;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Config cfg = load_config(ctx);
    auto handle = ctx->get_saved_variables();
    const Tensor g_recv_x = grads[0].defined() ? grads[0].contiguous() : Tensor();
    Tensor g_recv_w = grads[3].defined() ? grads[3].contiguous() : at::zeros_like(handle[1]);
    auto res = op("omniep_native::dispatch_bwd")
                   .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, at::TensorList, int64_t, int64_t,
                                                     int64_t, int64_t, int64_t)>()
                   .call(g_recv_x, g_recv_w, handle, cfg.ctx, cfg.num_experts, cfg.layout, cfg.capacity,
                         cfg.expert_alignment);
    // (the padding slots' gradient is not read: dispatch_bwd pulls the counted slots only)
    return {ctx->saved_data["x_grad"].toBool() ? std::get<0>(res) : Tensor(), std::get<1>(res), Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

DispatchOut dispatch_autograd(const Tensor& x, const std::optional<Tensor>& x_scales, const Tensor& topk_idx,
                              const Tensor& topk_weights, int64_t ctx, int64_t num_experts, int64_t layout,
                              int64_t capacity, int64_t expert_alignment, bool zero_padding) {
  if (!wants_grad({&x, &topk_weights})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatch_op().call(x, x_scales, topk_idx, topk_weights, ctx, num_experts, layout, capacity, expert_alignment,
                              zero_padding);
  }
  const Config cfg{ctx, num_experts, layout, capacity, expert_alignment};
  auto flat = DispatchFunction::apply(x, topk_weights, &x_scales, &topk_idx, cfg, zero_padding);
  return DispatchOut(flat[0], flat[1], flat[2], flat[3], flat[4], flat[5], flat[6],
                     std::vector<Tensor>(flat.begin() + 7, flat.end()));
}

struct CombineFunction : public torch::autograd::Function<CombineFunction> {
  // Optional tensors travel as std::optional (an undefined Tensor is not a valid autograd input).
  // zero_padding: the handle's dispatch had it; combine_bwd zeroes g_y's padding then (DESIGN §2).
  static variable_list forward(AutogradContext* ctx, const Tensor& y, const std::optional<Tensor>& topk_weights,
                               const std::optional<Tensor>& bias0, const std::optional<Tensor>& bias1,
                               const std::vector<Tensor>* handle, Config cfg, bool zero_padding) {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor out = combine_op().call(y, topk_weights, bias0, bias1, *handle, cfg.ctx, cfg.num_experts, cfg.layout,
                                   cfg.capacity, cfg.expert_alignment, zero_padding);
    variable_list saved(handle->begin(), handle->end());
    const bool em = cfg.layout == 1;
    saved.push_back(em && topk_weights.has_value() ? *topk_weights : Tensor());
    saved.push_back(em ? y : Tensor());
    ctx->save_for_backward(saved);
    ctx->saved_data["bias_dtypes"] = std::vector<int64_t>{
        bias0.has_value() ? static_cast<int64_t>(bias0->scalar_type()) : -1,
        bias1.has_value() ? static_cast<int64_t>(bias1->scalar_type()) : -1};
    ctx->saved_data["zero_padding"] = zero_padding;
    save_config(ctx, cfg);
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Config cfg = load_config(ctx);
    auto saved = ctx->get_saved_variables();
    const Tensor y = saved.back();
    saved.pop_back();
    const Tensor w = saved.back();
    saved.pop_back();
    const Tensor g_out = grads[0].contiguous();
    const auto opt = [](const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; };
    auto res = op("omniep_native::combine_bwd")
                   .typed<std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                     const std::optional<Tensor>&, at::TensorList, int64_t, int64_t,
                                                     int64_t, int64_t, int64_t, bool)>()
                   .call(g_out, opt(w), opt(y), saved, cfg.ctx, cfg.num_experts, cfg.layout, cfg.capacity,
                         cfg.expert_alignment, ctx->saved_data["zero_padding"].toBool());
    const auto dtypes = ctx->saved_data["bias_dtypes"].toIntVector();
    const auto g_bias = [&](int64_t dt) { return dt < 0 ? Tensor() : g_out.to(static_cast<at::ScalarType>(dt)); };
    return {std::get<0>(res), cfg.layout == 1 ? std::get<1>(res) : Tensor(), g_bias(dtypes[0]), g_bias(dtypes[1]),
            Tensor(), Tensor(), Tensor()};
  }
};

Tensor combine_autograd(const Tensor& y, const std::optional<Tensor>& topk_weights, const std::optional<Tensor>& bias0,
                        const std::optional<Tensor>& bias1, at::TensorList handle, int64_t ctx, int64_t num_experts,
                        int64_t layout, int64_t capacity, int64_t expert_alignment, bool zero_padding) {
  const auto ptr = [](const std::optional<Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  if (!wants_grad({&y, ptr(topk_weights), ptr(bias0), ptr(bias1)})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return combine_op().call(y, topk_weights, bias0, bias1, handle, ctx, num_experts, layout, capacity,
                             expert_alignment, zero_padding);
  }
  const std::vector<Tensor> h = handle.vec();
  return CombineFunction::apply(y, topk_weights, bias0, bias1, &h,
                                Config{ctx, num_experts, layout, capacity, expert_alignment}, zero_padding)[0];
}

struct CachedDispatchFunction : public torch::autograd::Function<CachedDispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>* x_scales,
                               const std::vector<Tensor>* handle, Config cfg) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto out = cached_dispatch_op().call(x, *x_scales, *handle, cfg.ctx, cfg.num_experts, cfg.layout, cfg.capacity,
                                         cfg.expert_alignment);
    ctx->mark_non_differentiable({std::get<1>(out)});
    ctx->save_for_backward(variable_list(handle->begin(), handle->end()));
    save_config(ctx, cfg);
    return {std::get<0>(out), std::get<1>(out)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Config cfg = load_config(ctx);
    const auto handle = ctx->get_saved_variables();
    Tensor g_x = combine_op().call(grads[0].contiguous(), std::nullopt, std::nullopt, std::nullopt, handle, cfg.ctx,
                                   cfg.num_experts, cfg.layout, cfg.capacity, cfg.expert_alignment, false);
    return {g_x, Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> cached_dispatch_autograd(const Tensor& x, const std::optional<Tensor>& x_scales,
                                                    at::TensorList handle, int64_t ctx, int64_t num_experts,
                                                    int64_t layout, int64_t capacity, int64_t expert_alignment) {
  if (!wants_grad({&x}) || x_scales.has_value()) {
    at::AutoDispatchBelowADInplaceOrView below;
    return cached_dispatch_op().call(x, x_scales, handle, ctx, num_experts, layout, capacity, expert_alignment);
  }
  const std::vector<Tensor> h = handle.vec();
  auto out = CachedDispatchFunction::apply(x, &x_scales, &h, Config{ctx, num_experts, layout, capacity, expert_alignment});
  return {out[0], out[1]};
}

using DispatchFp8Sig = DispatchOut(const Tensor&, const Tensor&, const Tensor&, bool, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, bool);

// dispatch_fp8 has no Autograd kernel (fp8 rows carry no gradient): its direct entry calls below autograd.
DispatchOut dispatch_fp8_direct(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, bool round_scale,
                                int64_t ctx, int64_t num_experts, int64_t layout, int64_t capacity,
                                int64_t expert_alignment, bool zero_padding) {
  static const auto h = op("omniep_native::dispatch_fp8").typed<DispatchFp8Sig>();
  at::AutoDispatchBelowADInplaceOrView below;
  return h.call(x, topk_idx, topk_weights, round_scale, ctx, num_experts, layout, capacity, expert_alignment,
                zero_padding);
}

}  // namespace omniep_torch

TORCH_LIBRARY_IMPL(omniep_native, Autograd, m) {
  m.impl("dispatch", &omniep_torch::dispatch_autograd);
  m.impl("cached_dispatch", &omniep_torch::cached_dispatch_autograd);
  m.impl("combine", &omniep_torch::combine_autograd);
}

PYBIND11_MODULE(_native_torch, m) {
  namespace py = pybind11;
  m.doc() = "omniep native torch ops: the CUDA and Autograd kernels of omniep_native::* over a group's EpRank";
  m.def("register_context", [](int64_t id, uintptr_t ep_rank, int world, int device, bool sync) {
        omniep_torch::set_context(
            id, new omniep_torch::Context{reinterpret_cast<omniep::EpRank*>(ep_rank), world, device, sync, {}});
      }, py::arg("id"), py::arg("ep_rank"), py::arg("world"), py::arg("device"), py::arg("sync"),
      "Make context `id` run its ops on the EpRank at address `ep_rank` (kept alive by the caller).");
  m.def("unregister_context", [](int64_t id) { omniep_torch::set_context(id, nullptr); }, "Forget context `id` (its ops fail from now on). Call before the EpRank goes away.");
  m.def("set_sync", [](int64_t id, bool sync) { omniep_torch::context_of(id).sync = sync; },
        "OMNIEP_CHECKS=sync (True) or default for context `id` from now on.");
  m.def("send_only_next", [](int64_t id, bool on) { omniep_torch::context_of(id).send_only_next = on; },
        "Whether the next expert-major dispatch / combine of context `id` launches its sends only (then "
        "`receive` runs the rest); the next dispatch or combine clears it.");
  m.def("recv_stats_next", [](int64_t id, uintptr_t stats) {
        omniep_torch::context_of(id).recv_stats_next = reinterpret_cast<int32_t*>(stats);
      }, py::arg("id"), py::arg("stats"),
      "The address of an int32 [L] tensor on the context's device (0: none) to which the next expert-major "
      "dispatch of context `id` adds its kept copies per local expert, inside its kernel (DeepEP's "
      "cumulative_local_expert_recv_stats); the next dispatch clears it.");
  m.def("pending_receive", [](int64_t id) { return omniep_torch::context_of(id).rank->pending_receive(); },
        "The sequence number of context `id`'s send_only op whose second half has not run (0: none).");
  m.def("receive", &omniep_torch::receive, py::arg("id"), py::arg("seq"),
        "Run the second half of context `id`'s send_only op `seq` on the current stream (DeepEP's receive "
        "hook); False when it is not pending (it ran already).");
  m.def("host_steps", [](bool reset) {
        std::vector<std::tuple<std::string, double, int64_t>> out;
        for (const auto& h : omniep_torch::host_steps(reset)) out.emplace_back(h.name, h.total_us, h.count);
        return out;
      }, py::arg("reset") = false,
      "[(step, total µs, count)] of the ops' host stamps (OMNIEP_HOST_STAMPS=1 when the module loaded, or "
      "set_host_stamps(True); empty otherwise); reset clears them.");
  m.def("set_host_stamps", &omniep_torch::set_host_stamps, py::arg("on"),
        "Record the ops' host stamps from now on (True) or stop (False).");
  // The direct entries: what the frontend calls eagerly on plain tensors outside any tracing (its `_ops`): the
  // Autograd kernels above (and dispatch_fp8 below autograd), entered without the dispatcher's boxed call from
  // Python — every argument parsed against the schema into an IValue, the kernel's unboxing, the results boxed
  // back: ~6 µs per op on the lent H100 hosts (benchmarks/RESULTS.md, twenty-first session, host split). The
  // same C++ below them; profilers still see the ops (the calls below autograd go through the dispatcher).
  // Arguments in the schemas' order (omniep/frontends/torch_ops.py); the GIL is released while the op runs, as
  // the dispatcher's call from Python does.
  using omniep_torch::Direct;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("eager_dispatch", &Direct<&omniep_torch::dispatch_autograd>::call, nogil,
        "omniep_native::dispatch, entered directly.");
  m.def("eager_dispatch_fp8", &Direct<&omniep_torch::dispatch_fp8_direct>::call, nogil,
        "omniep_native::dispatch_fp8, entered directly.");
  m.def("eager_cached_dispatch", &Direct<&omniep_torch::cached_dispatch_autograd>::call, nogil,
        "omniep_native::cached_dispatch, entered directly.");
  m.def("eager_combine", &Direct<&omniep_torch::combine_autograd>::call, nogil,
        "omniep_native::combine, entered directly.");
  m.def("take_raised", [](int64_t id) -> py::object {
        auto& c = omniep_torch::context_of(id);
        if (c.raised.w[omniep::kStCode] == omniep::kStatusOk) return py::none();
        std::vector<int> out(c.raised.w, c.raised.w + omniep::kStatusWords);
        c.raised = {};
        return py::cast(out);
      }, "The status behind the last exception an op of context `id` threw (None: none), cleared.");
}
