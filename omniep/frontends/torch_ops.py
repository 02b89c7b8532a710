"""``torch.library`` ops of the PyTorch frontend: one schema per op, two families.

* ``omniep::{dispatch, cached_dispatch, combine, dispatch_bwd, combine_bwd}``: backends written in
  Python (``collective``); each op's kernel calls the context's ``op_*`` method
  (:class:`omniep.backends.torch_group.PythonOps`); autograd formulas are registered here.
* ``omniep_native::{...}``: the native backends; same schemas, defined here, with CUDA and Autograd
  kernels registered in C++ by ``omniep._native_torch`` (one native call per op: argument checks,
  workspace, launches; DESIGN §5 "The hot path").

Both families share the fake (meta) kernels below, so ``torch.compile`` and ``torch.library.opcheck``
see one contract: data-dependent row counts (``capacity = -1``: exact) are unbacked sizes from
``get_ctx().new_dynamic_size()``. Every op takes the group's context id ``ctx`` and the dispatch
config ``num_experts, layout (0 rank-major, 1 expert-major), capacity (-1 = exact), expert_alignment``;
``dispatch`` and ``dispatch_fp8`` also ``zero_padding`` (expert-major: the slots past the counts come
back zero, written by the backend's dispatch itself — DESIGN §2; rank-major: ignored), and so do
``combine`` and ``combine_bwd``: the ``zero_padding`` of the dispatch that made the handle (the frontend
passes the handle's), which ``combine`` only hands to its backward, and with which the expert-major
``combine_bwd`` — a cached dispatch of ``g_out`` — zeroes ``g_y``'s padding slots; without it they are
unspecified (the native kernel leaves them unwritten: its cost follows the routed copies, not ``L·C·H``).
"""

from __future__ import annotations

import torch

from ..backends.torch_group import context_of

CONFIG = "int ctx, int num_experts, int layout, int capacity, int expert_alignment"
SCHEMAS = {
    # -> recv_x, recv_x_scales (empty unless fp8), recv_topk_idx, recv_topk_weights, num_recv [],
    #    num_recv_tokens_per_expert [L], dropped [], handle tensors (the backend's)
    "dispatch": f"(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor topk_weights, {CONFIG}, "
                f"bool zero_padding=False) -> "
                f"(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])",
    # dispatch of DeepEP's fp8 cast of x (bf16 [T, H]): the outputs of dispatch((x_fp8, scales), ...);
    # round_scale: power-of-two scales
    "dispatch_fp8": f"(Tensor x, Tensor topk_idx, Tensor topk_weights, bool round_scale, {CONFIG}, "
                    f"bool zero_padding=False) -> "
                    f"(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])",
    "cached_dispatch": f"(Tensor x, Tensor? x_scales, Tensor[] handle, {CONFIG}) -> (Tensor, Tensor)",
    # zero_padding: the handle's dispatch had it (expert-major: combine_bwd then zeroes g_y's padding)
    "combine": f"(Tensor y, Tensor? topk_weights, Tensor? bias0, Tensor? bias1, Tensor[] handle, {CONFIG}, "
               f"bool zero_padding=False) -> Tensor",
    "dispatch_bwd": f"(Tensor g_recv_x, Tensor g_recv_topk_weights, Tensor[] handle, {CONFIG}) -> (Tensor, Tensor)",
    "combine_bwd": f"(Tensor g_out, Tensor? topk_weights, Tensor? y, Tensor[] handle, {CONFIG}, "
                   f"bool zero_padding=False) -> (Tensor, Tensor)",
}
RANK_MAJOR, EXPERT_MAJOR = 0, 1
# Positions in an op-level handle: the dispatch's recv_topk_idx / recv_topk_weights, then the backend's
# tensors, the first of which is always topk_idx narrowed to int32 [T, K].
RECV_IDX, RECV_W, TOPK_IDX = 0, 1, 2

_native_lib = torch.library.Library("omniep_native", "DEF")
for _name, _schema in SCHEMAS.items():
    _native_lib.define(_name + _schema)


# ---- fake kernels, shared by both families --------------------------------------------------------

def _fake_dispatch(x, x_scales, topk_idx, topk_weights, ctx, num_experts, layout, capacity, expert_alignment,
                   zero_padding=False):
    be = context_of(ctx)
    T, K = topk_idx.shape
    H, L = x.shape[1], num_experts // be.world
    if capacity >= 0:
        rows = capacity
    elif layout == RANK_MAJOR:
        rows = torch.library.get_ctx().new_dynamic_size()  # exact: the rows that arrive
    else:
        rows = be.world * T  # expert-major default: the worst case without duplicate ids
    lead = (rows,) if layout == RANK_MAJOR else (L, rows)
    per_copy = lead + ((K,) if layout == RANK_MAJOR else ())
    i32, f32 = torch.int32, torch.float32
    scales = x.new_empty(lead + (x_scales.shape[1],), dtype=f32) if x_scales is not None else x.new_empty((0,), dtype=f32)
    return (x.new_empty(lead + (H,)), scales, x.new_empty(per_copy, dtype=i32), x.new_empty(per_copy, dtype=f32),
            x.new_empty((), dtype=i32), x.new_empty((L,), dtype=i32), x.new_empty((), dtype=i32),
            be.fake_handle(topk_idx, num_experts, layout, rows))


def _fake_dispatch_fp8(x, topk_idx, topk_weights, round_scale, *config_and_zero_padding):
    T, H = x.shape
    return _fake_dispatch(x.new_empty((T, H), dtype=torch.float8_e4m3fn), x.new_empty((T, H // 128), dtype=torch.float32),
                          topk_idx, topk_weights, *config_and_zero_padding)


def _fake_cached_dispatch(x, x_scales, handle, *config):
    rows = handle[RECV_IDX].shape[0]
    scales = x.new_empty((rows, x_scales.shape[1]), dtype=torch.float32) if x_scales is not None \
        else x.new_empty((0,), dtype=torch.float32)
    return x.new_empty((rows, x.shape[1])), scales


def _fake_combine(y, topk_weights, bias0, bias1, handle, *config):
    return y.new_empty((handle[TOPK_IDX].shape[0], y.shape[-1]))


def _fake_dispatch_bwd(g_recv_x, g_recv_topk_weights, handle, *config):
    T, K = handle[TOPK_IDX].shape
    return g_recv_x.new_empty((T, g_recv_x.shape[-1])), g_recv_x.new_empty((T, K), dtype=torch.float32)


def _fake_combine_bwd(g_out, topk_weights, y, handle, ctx, num_experts, layout, capacity, expert_alignment,
                      zero_padding=False):
    T, K = handle[TOPK_IDX].shape
    H = g_out.shape[-1]
    if layout == RANK_MAJOR:
        return g_out.new_empty((handle[RECV_IDX].shape[0], H)), g_out.new_empty((0,), dtype=torch.float32)
    g_w = g_out.new_empty((T, K) if y is not None else (0,), dtype=torch.float32)
    return g_out.new_empty(tuple(handle[RECV_IDX].shape) + (H,), dtype=y.dtype if y is not None else g_out.dtype), g_w


FAKES = {"dispatch": _fake_dispatch, "dispatch_fp8": _fake_dispatch_fp8, "cached_dispatch": _fake_cached_dispatch,
         "combine": _fake_combine, "dispatch_bwd": _fake_dispatch_bwd, "combine_bwd": _fake_combine_bwd}
for _name, _fake in FAKES.items():
    torch.library.register_fake(f"omniep_native::{_name}", _fake, lib=_native_lib)


# ---- omniep::* — backends written in Python --------------------------------------------------------
# Defined with ``torch.library.Library`` (a kernel for every device, the shared fakes) and an autograd
# kernel of our own: ``torch.library.custom_op`` / ``register_autograd`` wrap each call in generic
# argument handling (pytree flattening, default filling) that costs ~110 µs per op with a
# grad-requiring input on our CPU hosts, an ``autograd.Function`` ~20 µs (benchmarks/RESULTS.md).

_lib = torch.library.Library("omniep", "DEF")


def _python_kernel(name: str):
    """``omniep::<name>``'s kernel on every device: the context's ``op_<name>`` method, given the op's
    arguments but ``ctx``, every one of them (the dispatcher leaves out trailing arguments that have
    their default value: filled here from the schema)."""
    method = "op_" + name
    params = getattr(torch.ops.omniep, name).default._schema.arguments
    at = [p.name for p in params].index("ctx")
    defaults = tuple(p.default_value for p in params)

    def kernel(*args):
        if len(args) < len(defaults):
            args += defaults[len(args):]
        return getattr(context_of(args[at]), method)(*args[:at], *args[at + 1:])
    return kernel


for _name in SCHEMAS:
    _lib.define(_name + SCHEMAS[_name])
_KERNELS = {name: _python_kernel(name) for name in SCHEMAS}  # registered below, and called by EAGER
for _name in SCHEMAS:
    _lib.impl(_name, _KERNELS[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"omniep::{_name}", FAKES[_name], lib=_lib)


def _autograd(name: str, setup, backward):
    """Give ``omniep::<name>`` its autograd kernel and its eager entry point (``EAGER``): two
    ``autograd.Function``s with the same ``setup(ctx, inputs, output)`` (saves what ``backward`` needs)
    and ``backward(ctx, *grads)`` (a gradient per input; None for the ``Tensor[]`` handle, whose
    tensors autograd does not track). The kernel's forward is the op below autograd, so fake tensors
    and functionalization (torch.compile, make_fx, opcheck) get their turn; the eager one calls the
    Python kernel itself, sparing the dispatcher's two boxed Python calls per op, and only through its
    Function when a tensor argument needs a gradient."""
    op = getattr(torch.ops.omniep, name).default

    def below(*inputs):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*inputs)

    def function(call, role: str):
        def forward(ctx, *inputs):
            output = call(*inputs)
            setup(ctx, inputs, output)
            return output
        return type(f"_{name}_{role}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    _lib.impl(name, function(below, "autograd").apply, "Autograd")
    plain = _profiled(name, _KERNELS[name])
    tracked = function(plain, "eager").apply

    def eager(*inputs):
        # Where no tensor argument needs a gradient (or grad mode is off) autograd records nothing, and its
        # Function costs ~18 µs a call on our CPU hosts (benchmarks/RESULTS.md, twenty-fourth session): the
        # kernel alone then, with the same outputs.
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return tracked(*inputs)
        return plain(*inputs)
    setattr(EAGER, name, staticmethod(eager))


def _profiled(name: str, kernel):
    """``kernel`` named ``omniep::<name>`` in a running profiler's trace, as the dispatcher names the op
    (one cheap check when no profiler runs)."""
    label = f"omniep::{name}"

    def call(*args):
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(label):
                return kernel(*args)
        return kernel(*args)
    return call


class Overloads:
    """What the frontend calls eagerly on the native backends, per op: the ``direct`` module's ``eager_<op>``
    where it has one (the same C++ Autograd kernel, entered without the dispatcher's boxed call from Python:
    ``csrc/torch_ops/native_autograd.cpp``), else the op's ``.default`` overload (a call through the packet
    resolves the overload each time: ~3 µs more on the lent H100 hosts, ``host_split_gpu.py``'s
    ``torch.ops dispatch`` rows). Same arguments, results and autograd either way."""

    def __init__(self, namespace, direct=None):
        for name in SCHEMAS:
            entry = getattr(direct, f"eager_{name}", None)
            setattr(self, name, entry if entry is not None else getattr(namespace, name).default)


class EAGER:
    """The ``omniep::*`` ops as plain calls for eager use on real tensors (the torch frontend's fast
    path; the ops themselves serve tracing): same schemas' arguments and results, same autograd."""

    dispatch_fp8 = staticmethod(_profiled("dispatch_fp8", _KERNELS["dispatch_fp8"]))  # no gradient (fp8 rows)
    dispatch_bwd = staticmethod(_profiled("dispatch_bwd", _KERNELS["dispatch_bwd"]))
    combine_bwd = staticmethod(_profiled("combine_bwd", _KERNELS["combine_bwd"]))


# Autograd: dispatch's adjoint is dispatch_bwd (a combine that reads back the weight gradients),
# combine's is combine_bwd (a cached dispatch; expert-major also gives the weights' gradient), a cached
# dispatch's is an unweighted combine. The C++ kernels of omniep_native implement the same formulas.
# dispatch_fp8 has none (fp8 rows carry no gradient: DeepEP's decode path), nor have the two backward ops.


def _dispatch_setup(ctx, inputs, output):
    ctx.config = tuple(inputs[4:9])  # (not zero_padding: the padding's gradient is never read)
    ctx.x_is_float = inputs[0].is_floating_point() and inputs[1] is None
    ctx.mark_non_differentiable(output[1], output[2], output[4], output[5], output[6])
    ctx.save_for_backward(output[2], output[3], *output[7])


def _dispatch_backward(ctx, g_recv_x, _g_scales, _g_idx, g_recv_w, _n, _pe, _d, _g_handle):
    g_x, g_w = torch.ops.omniep.dispatch_bwd(g_recv_x.contiguous(), g_recv_w.contiguous(), list(ctx.saved_tensors),
                                             *ctx.config)
    return (g_x if ctx.x_is_float else None, None, None, g_w) + (None,) * 6


_autograd("dispatch", _dispatch_setup, _dispatch_backward)


def _combine_setup(ctx, inputs, output):
    y, topk_weights, bias0, bias1, handle = inputs[:5]
    ctx.config = tuple(inputs[5:])  # the config and, when given, zero_padding: combine_bwd takes both
    ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (bias0, bias1))
    ctx.expert_major = ctx.config[2] == EXPERT_MAJOR
    ctx.n_handle = len(handle)
    keep = (topk_weights, y) if ctx.expert_major else (None, None)
    ctx.save_for_backward(*handle, *keep)


def _combine_backward(ctx, g_out):
    saved = ctx.saved_tensors
    handle, topk_weights, y = list(saved[:ctx.n_handle]), saved[ctx.n_handle], saved[ctx.n_handle + 1]
    g_y, g_w = torch.ops.omniep.combine_bwd(g_out.contiguous(), topk_weights, y, handle, *ctx.config)
    g_bias = tuple(None if dt is None else g_out.to(dt) for dt in ctx.bias_dtypes)
    return (g_y, g_w if ctx.expert_major else None, *g_bias, None) + (None,) * len(ctx.config)


_autograd("combine", _combine_setup, _combine_backward)


def _cached_setup(ctx, inputs, output):
    ctx.config = tuple(inputs[3:])
    ctx.x_is_float = inputs[0].is_floating_point() and inputs[1] is None
    ctx.mark_non_differentiable(output[1])
    ctx.n_handle = len(inputs[2])
    ctx.save_for_backward(*inputs[2])


def _cached_backward(ctx, g_recv_x, _g_scales):
    g_x = torch.ops.omniep.combine(g_recv_x.contiguous(), None, None, None, list(ctx.saved_tensors), *ctx.config)
    return (g_x if ctx.x_is_float else None, None, None) + (None,) * 5


_autograd("cached_dispatch", _cached_setup, _cached_backward)
