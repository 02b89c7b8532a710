"""PyTorch frontend: autograd-aware ``dispatch`` / ``combine`` for one rank of a ``torch.distributed``
EP group (DESIGN §5). The DeepEP-compatible ``Buffer`` (:mod:`.torch_buffer`) is built on them.

The hot path (DESIGN §5): the group's backend is resolved once per (group, backend) — selection,
bootstrap, workspace, ``OMNIEP_BACKEND`` / ``OMNIEP_CHECKS`` read then — and kept; each call is a
dictionary lookup, a few integer checks and ONE ``torch.library`` op (C++ for the native backends),
so ``torch.compile(fullgraph=True)`` traces it and CUDA graphs capture the static-shape ops. What
only the other ranks can see (another op, another hidden size, a bad expert id on a peer) travels
with the op's own data and is raised at the next host wait, :func:`check` or :func:`synchronize`,
and at once with ``OMNIEP_CHECKS=sync`` (DESIGN §9).

The functions are collectives: every rank of the group calls them — and runs their backward passes —
in the same order (a rank whose loss ignores ``out`` still back-propagates through it, e.g. with
``(0 * out).sum()``). Example, inside a process of an initialized group::

    from omniep import torch as ep
    d = ep.dispatch(x, topk_idx, topk_weights, num_experts=64)
    y = experts(d.recv_x, d.recv_topk_idx) * ...        # rank-major: the caller applies weights
    out = ep.combine(y, d.handle)
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Optional

import torch
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from ..backends.torch_group import default_group, pack_ue8m0
from ..ep_core import registry
from ..ep_core.errors import InputError, OmniEPError, UnsupportedError
from ..ep_core.types import Dispatched, DispatchConfig, Layout, frozen_new
from . import torch_ops  # defines the ops

__all__ = ["dispatch", "combine", "cached_dispatch", "check", "synchronize", "destroy", "context", "Dispatched",
           "Handle"]

_LAYOUTS = {"rank_major": Layout.RANK_MAJOR, "expert_major": Layout.EXPERT_MAJOR,
            Layout.RANK_MAJOR: Layout.RANK_MAJOR, Layout.EXPERT_MAJOR: Layout.EXPERT_MAJOR}
_LAYOUT_CODE = {Layout.RANK_MAJOR: 0, Layout.EXPERT_MAJOR: 1}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_CONFIGS: dict = {}  # (num_experts, ranks, layout, capacity, alignment) -> DispatchConfig (frozen, shared)


def without_default_device(fn):
    """An op's public entry: where the only torch function mode on the stack is the default device's
    (``torch.set_default_device``, ``with torch.device(...)``: DeepEP's tests set one), the op runs with it
    off the stack and put back after. Every tensor access in Python (``x.shape``, ``x.dtype``, ...) otherwise
    goes through that mode's Python ``__torch_function__``: ~1 µs each, 2x a Buffer LL op's host time
    (benchmarks/RESULTS.md, 2026-11-27). The op then runs as it does without a default device (every test's
    case): what it makes goes where the op puts it (its inputs' device, or the host for the collective backend's
    metadata), never where the default says. Any other mode (a user's, a tracer's) stays and sees the op as
    before."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if (torch.compiler.is_compiling() or not torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_function_stack() != 1
                or not isinstance(torch._C._get_function_stack_at(0), DeviceContext)):
            return fn(*args, **kwargs)
        mode = torch._C._pop_torch_function_stack()
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    return entry


@dataclasses.dataclass(frozen=True)
class Handle:
    """What :func:`combine`, :func:`cached_dispatch` and both backward passes need from a dispatch.
    Opaque to callers; keep it alive as long as you use it.

    tensors       the op-level handle: ``(recv_topk_idx, recv_topk_weights, *backend tensors)``
    context       the group's backend (resolved once per (group, backend), see :func:`context`)
    config        :class:`DispatchConfig` of the dispatch (``capacity=None``: exact receive size)
    topk_weights  the routing weights given to dispatch (the expert-major combine applies them)
    zero_padding  the dispatch's ``zero_padding`` (expert-major): the combine's backward then zeroes the
                  padding slots of the gradient of ``y`` too, else leaves them unspecified (DESIGN §2)
    """

    tensors: tuple
    context: Any
    config: DispatchConfig
    topk_weights: Any = None
    zero_padding: bool = False

    @property
    def backend(self) -> str:
        return self.context.name

    def replace(self, **changes) -> "Handle":
        """A copy with ``changes`` (field names of this handle's class). Eagerly without ``dataclasses.replace``,
        whose ``__init__`` per field cost ~3 µs a Buffer LL combine (2-vCPU host); through it while Dynamo traces."""
        if torch.compiler.is_compiling():
            return dataclasses.replace(self, **changes)
        fields = self.__dict__
        for name in changes:
            if name not in fields:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
        return frozen_new(type(self), {**fields, **changes})


# ---- the (group, backend) -> context cache -------------------------------------------------------

_CONTEXTS: dict = {}   # (group as passed, backend as passed, tensors' device type) -> context
_BY_GROUP: dict = {}   # (group, resolved backend name) -> context: one per group and backend


def context(group=None, backend: Optional[str] = None, device: Optional[str] = None):
    """The backend context of ``group`` (None: the default group) for ``backend`` (None:
    ``$OMNIEP_BACKEND``, default ``auto``) and tensors on ``device`` (``"cuda"`` / ``"cpu"``; None: CUDA
    when torch sees a GPU), opened at its first use — collectively: every rank of the group must make
    that first call — and kept until :func:`destroy`. ``auto`` picks the fastest backend that serves
    the device (DESIGN §6)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = _CONTEXTS.get((group, backend, device))
    if ctx is None or not ctx.alive:
        ctx = _open(group, backend, device)
    return ctx


def _open(group, backend, device: str):
    resolved = default_group(group)
    cls = registry.select_backend("torch", backend, device=device)
    ctx = _BY_GROUP.get((resolved, cls.name))
    if ctx is None or not ctx.alive:
        ctx = _BY_GROUP[(resolved, cls.name)] = cls.open(resolved)
        # Backends written in Python: their kernels called straight, not through the dispatcher, in eager
        # use; the native ops: their direct entries where the backend's module has them, else their default
        # overloads (one C++ call either way).
        ctx.eager_ops = (torch_ops.EAGER if ctx.ops is torch.ops.omniep
                         else torch_ops.Overloads(ctx.ops, getattr(ctx, "direct_entries", None)))
    _CONTEXTS[(group, backend, device)] = ctx
    return ctx


def destroy(group=None, backend: Optional[str] = None) -> None:
    """Release the context(s) of ``group`` (every backend if ``backend`` is None). Collective: every rank
    calls it, e.g. before ``torch.distributed.destroy_process_group``. Then raises what the group still
    had to report and had not raised (DESIGN §9: destroy is a host wait)."""
    resolved = default_group(group)
    doomed = {id(c): c for (g, name), c in _BY_GROUP.items() if g is resolved and backend in (None, name)}
    for key in [k for k, c in _CONTEXTS.items() if id(c) in doomed]:
        del _CONTEXTS[key]
    for key in [k for k, c in _BY_GROUP.items() if id(c) in doomed]:
        del _BY_GROUP[key]
    unraised = []
    for ctx in doomed.values():
        try:
            ctx.check(again=False)
        except OmniEPError as exc:
            unraised.append(exc)
        ctx.destroy()
    if unraised:
        raise unraised[0]


def check(group=None, backend: Optional[str] = None, device: Optional[str] = None) -> None:
    """Raise what the group's ops reported and has not been raised yet (a mismatch across ranks, a bad
    expert id on a peer, a capacity overflow, a timeout): :class:`RankMismatchError`, ``InputError``,
    :class:`CapacityError`, :class:`PeerTimeoutError`. A native backend waits for this rank's queued
    GPU work first (the device writes what it found)."""
    context(group, backend, device).check()


def synchronize(group=None, backend: Optional[str] = None, device: Optional[str] = None) -> None:
    """Wait for this rank's queued work on the group, then :func:`check`."""
    context(group, backend, device).synchronize()


# ---- the ops -------------------------------------------------------------------------------------

def config_ints(num_experts, capacity, expert_alignment) -> tuple:
    """``num_experts``, ``capacity`` (-1 = None) and ``expert_alignment`` as ints (any integral type)."""
    try:
        experts = operator.index(num_experts)
    except TypeError:
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}") from None
    if experts <= 0 or isinstance(num_experts, bool):
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    if capacity is None:
        cap = -1
    else:
        try:
            cap = operator.index(capacity)
        except TypeError:
            cap = -2
        if cap < 0 or isinstance(capacity, bool):
            raise InputError(f"capacity must be a non-negative int or None, got {capacity!r}")
    try:
        align = operator.index(expert_alignment)
    except TypeError:
        align = 0
    if align < 1 or isinstance(expert_alignment, bool):
        raise InputError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    return experts, cap, align


@without_default_device
def dispatch(x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int, group=None,
             capacity: Optional[int] = None, expert_alignment: int = 1, layout="rank_major",
             backend: Optional[str] = None, use_fp8: bool = False, round_scale: bool = False,
             use_ue8m0: bool = False, zero_padding: bool = False) -> Dispatched:
    """Send every token to the ranks holding the experts it chose (DESIGN §2).

    ``x[T, H]`` bf16/fp16/fp32, or ``(x[T, H] float8_e4m3fn, x_scales[T, H/128] float32)`` (bytes moved
    unchanged); ``topk_idx[T, K]`` int32/int64 global expert ids, ``-1`` = none; ``topk_weights[T, K]``
    float32. ``T`` may differ between ranks. ``group``: a ``ProcessGroup`` (None = default group).

    ``capacity=None``, rank-major: ``recv_x[N, H]`` with exactly the N rows that arrive, ordered by
    (source rank, source token) — the one op that waits on the host (for N). ``capacity=None``,
    expert-major: ``recv_x[L, R * T, H]`` (the worst case without duplicate ids; every rank must have the
    same T, else pass ``capacity``: ranks whose R * T differ raise RankMismatchError naming the capacity). An int gives static buffers of that many rows (slots per expert):
    rank-major padding rows are zero (``recv_topk_idx = -1``, weights 0); expert-major slots past
    ``num_recv_tokens_per_expert`` are unspecified (DESIGN §2). If a rank would receive more, the last
    rows in contract order are dropped and counted, and :class:`CapacityError` is raised at the next
    host wait (at once with ``OMNIEP_CHECKS=sync``).

    Returns :class:`~omniep.ep_core.types.Dispatched`: ``recv_x`` (a tuple ``(recv_x, recv_x_scales)``
    for fp8), ``recv_topk_idx`` int32 local expert ids / -1 (rank-major ``[rows, K]``, expert-major
    ``[L, C]``), ``recv_topk_weights`` float32 (same shape, 0 elsewhere), ``num_recv`` and ``dropped``
    (0-d int32), ``num_recv_tokens_per_expert[L]`` int32 (rounded up to ``expert_alignment``) and the
    ``handle`` for :func:`combine`. Differentiable in ``x`` (float) and ``topk_weights``.

    ``use_fp8=True`` (expert-major, ``x`` bf16 with ``H % 128 == 0``; DeepEP's low-latency cast): the rows
    travel as ``(float8_e4m3fn, scales[H / 128] float32)``, cast per token and 128 channels with
    ``scale = max(amax, 1e-4) / 448`` — on the native backends inside the dispatch kernel — and the result
    is bit for bit that of dispatching the pair :func:`omniep.backends.torch_group.quantize_fp8` gives.
    Not differentiable. ``round_scale=True``: each scale rounded up to a power of two (DeepEP's
    ``round_scale``); ``use_ue8m0=True`` (needs ``round_scale`` and ``H % 512 == 0``): the scales come
    back as DeepEP's UE8M0, ``int32 [L, C, H / 512]`` holding four exponent bytes each (scale ``j`` in byte
    ``j % 4`` of int ``j // 4``; :func:`~omniep.backends.torch_group.pack_ue8m0`).

    ``zero_padding=True`` (expert-major): the slots past the counts come back zero instead of unspecified
    (DESIGN §2) — for a dense expert (``bmm`` over every slot) whose gradients must not see the padding;
    the dispatch writes the zeros itself (the native kernels: the padding rows only, no pass over the
    whole ``recv_x``). It governs the gradient's padding too: the backward of :func:`combine` with this
    handle (a cached dispatch of the output's gradient) returns the gradient of ``y`` with its slots past
    the counts zero; without it they are unspecified there (the native kernels leave them unwritten, so
    the backward's time follows the routed copies, not ``L * C * H``). A grouped GEMM given the counts
    needs neither.
    """
    if type(x) is tuple:
        if len(x) != 2:
            raise InputError(f"x must be a tensor or a pair (x_fp8, x_scales), got a tuple of {len(x)}")
        x, x_scales = x
    else:
        x_scales = None
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
    ctx = _CONTEXTS.get((group, backend, x.device.type))
    if ctx is None or not ctx.alive:
        ctx = context(group, backend, x.device.type)
    lay = _LAYOUTS.get(layout)
    if lay is None:
        lay = Layout.parse(layout)
    if lay not in ctx.layouts:
        raise UnsupportedError(ctx.name, f"layout {lay.value}",
                               registry.serving("torch", lambda c: lay in c.layouts, exclude=ctx.name))
    experts, cap, align = config_ints(num_experts, capacity, expert_alignment)
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_fp8(x, x_scales, lay, use_fp8, round_scale, use_ue8m0)
    zero = bool(zero_padding) and lay == Layout.EXPERT_MAJOR  # (written by the backend's dispatch itself)
    compiling = torch.compiler.is_compiling()
    out, tensors, config = dispatch_op(ctx, x, x_scales, topk_idx, topk_weights, experts, lay, cap, align, zero,
                                       use_fp8, round_scale, compiling)
    handle = frozen_result(Handle, {"tensors": tensors, "context": ctx, "config": config,
                                    "topk_weights": topk_weights, "zero_padding": zero}, compiling)
    recv_x = (out[0], pack_ue8m0(out[1]) if use_ue8m0 else out[1]) if x_scales is not None or use_fp8 else out[0]
    return frozen_result(Dispatched, {"recv_x": recv_x, "recv_topk_idx": out[2], "recv_topk_weights": out[3],
                                      "num_recv": out[4], "num_recv_tokens_per_expert": out[5], "dropped": out[6],
                                      "handle": handle, "status": None}, compiling)


def check_fp8(x: torch.Tensor, x_scales, lay: Layout, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
    """The fp8 cast's arguments of a dispatch (:func:`dispatch`'s ``use_fp8``, ``round_scale``, ``use_ue8m0``)."""
    if use_fp8:
        if x_scales is not None:
            raise InputError("use_fp8 casts a bf16 x itself: pass x alone, not a pair (x, x_scales)")
        if lay != Layout.EXPERT_MAJOR:
            raise InputError(f"use_fp8 (the cast inside the dispatch) needs layout='expert_major', got {lay.value!r}")
        if x.dtype != torch.bfloat16:
            raise InputError(f"use_fp8 casts a bfloat16 x, got {str(x.dtype).replace('torch.', '')}")
        if x.requires_grad:
            raise InputError("use_fp8: fp8 rows carry no gradient, but x requires grad (pass x.detach())")
        if use_ue8m0 and not round_scale:
            raise InputError("use_ue8m0 packs power-of-two scales: it needs round_scale=True")
        if use_ue8m0 and (x.dim() != 2 or x.shape[1] % 512):
            raise InputError(f"use_ue8m0 packs four scales per int32: hidden must be a multiple of 512, got "
                             f"x of shape {tuple(x.shape)}")
    elif round_scale or use_ue8m0:
        raise InputError("round_scale / use_ue8m0 shape the scales of the fp8 cast: they need use_fp8=True")


def dispatch_op(ctx, x, x_scales, topk_idx, topk_weights, experts: int, lay: Layout, cap: int, align: int,
                zero: bool, use_fp8: bool, round_scale: bool, compiling: bool):
    """The dispatch op on arguments already checked (by :func:`dispatch`, or by the Buffer's low-latency
    dispatch for its own): ``(out, tensors, config)`` — the op's outputs in its schema's order (recv_x,
    recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv, num_recv_tokens_per_expert, dropped, the
    backend's handle tensors), the handle's tensors, and its shared :class:`DispatchConfig`. ``cap`` -1: none.
    ``compiling``: ``torch.compiler.is_compiling()``, asked once by the caller."""
    ops = _ops(ctx, x, compiling)
    code = _LAYOUT_CODE[lay]
    try:
        if use_fp8:
            out = ops.dispatch_fp8(x, topk_idx, topk_weights, bool(round_scale), ctx.id, experts, code, cap, align,
                                   zero)
        else:
            out = ops.dispatch(x, x_scales, topk_idx, topk_weights, ctx.id, experts, code, cap, align, zero)
    except (RuntimeError, ValueError) as exc:  # the native ops raise c10 errors: the typed one here
        raise ctx.translate(exc) from None
    key = (experts, ctx.world, lay, cap, align)
    config = _CONFIGS.get(key)
    if config is None:
        config = _CONFIGS[key] = DispatchConfig(experts, ctx.world, lay, None if cap < 0 else cap, align)
    # recv_topk_weights may be differentiable: the handle keeps it out of the autograd graph.
    recv_w = out[3].detach() if out[3].requires_grad else out[3]
    return out, (out[2], recv_w, *out[7]), config


def _ops(ctx, x, compiling: bool):
    """The ops to call: the ``torch.ops`` namespace while anything traces (torch.compile — ``compiling``, which
    Dynamo folds, so that it traces nothing after —, a dispatch mode such as make_fx's or FakeTensorMode, a tensor
    subclass): it sees the schemas and fake kernels; otherwise the context's eager entry points
    (:data:`torch_ops.EAGER` for backends written in Python)."""
    if compiling:
        return ctx.ops
    if type(x) in _PLAIN and _dispatch_mode() is None:
        return ctx.eager_ops
    return ctx.ops


def frozen_result(cls, fields: dict, compiling: bool):
    """A frozen result object: eagerly without the dataclass ``__init__`` (ep_core.types.frozen_new);
    through it while Dynamo traces (``compiling``: it does not trace ``__dict__`` updates)."""
    if compiling:
        return cls(**fields)
    return frozen_new(cls, fields)


def config_of(handle) -> tuple:
    """The op arguments a handle stands for: ``(context id, num_experts, layout code, capacity or -1,
    expert_alignment)``; refuses anything but a :class:`Handle`."""
    if not isinstance(handle, Handle):
        raise InputError(f"handle must be the handle returned by omniep.torch.dispatch, got {type(handle).__name__}")
    cfg, ctx = handle.config, handle.context
    return (ctx.id, cfg.num_experts, _LAYOUT_CODE[cfg.layout], -1 if cfg.capacity is None else cfg.capacity,
            cfg.expert_alignment)


@without_default_device
def combine(y: torch.Tensor, handle: Handle, *, bias=None, weighted: bool = True) -> torch.Tensor:
    """Send expert outputs back to the tokens' ranks and sum them: ``out[T, H]`` in ``y``'s dtype.

    Rank-major ``y[rows, H]`` (rows as ``recv_x``; padding rows ignored): ``out[t]`` is the sum over
    the ranks that received t, ascending rank order — weights are the caller's business (DeepEP).
    Expert-major ``y[L, C, H]``: ``out[t] = sum_k topk_weights[t, k] * y[copy (t, k)]`` in k order, the
    weights being the ``topk_weights`` given to dispatch (gradients flow to them). ``bias``: None, one
    ``[T, H]`` tensor or a tuple of two, added after the sum. Every sum is in fp32 from +0.0, in that
    order, rounded once. Differentiable in ``y``, ``bias`` and (expert-major) ``topk_weights``.

    The gradient of an expert-major ``y`` is zero in the slots past the counts when the dispatch was
    called with ``zero_padding=True``, unspecified otherwise (DESIGN §2: the backward is a cached
    dispatch of the output's gradient).

    ``weighted=False`` (expert-major): sum the copies without weights, ``out[t] = sum_k y[copy (t, k)]``
    — for a caller that scaled ``y`` by ``recv_topk_weights`` at the experts (Megatron's practice): the
    weights' gradients then come back through dispatch, read back exactly, so they are bitwise the same
    on every backend (the weighted combine's weight gradient is a dot product over H whose rounding is
    each backend's own, DESIGN §2).
    """
    config = config_of(handle)
    if bias is None:
        b0 = b1 = None
    elif isinstance(bias, (tuple, list)):
        if len(bias) > 2:
            raise InputError(f"bias takes at most two [T, H] tensors, got {len(bias)}")
        b0, b1 = (tuple(bias) + (None, None))[:2]
    else:
        b0, b1 = bias, None
    weights, tensors = None, handle.tensors
    if handle.config.layout == Layout.EXPERT_MAJOR:
        if weighted:
            weights = handle.topk_weights
        else:  # unit weights at the sources and on the held slots (the backward scales by the latter)
            weights = torch.ones_like(handle.topk_weights)
            tensors = (tensors[0], (tensors[0] >= 0).to(torch.float32), *tensors[2:])
    return combine_op(handle, config, y, weights, tensors, b0, b1)


def combine_op(handle: Handle, config: tuple, y: torch.Tensor, weights, tensors: tuple, b0=None, b1=None):
    """The combine op on arguments already checked (by :func:`combine`, or by the Buffer's low-latency combine
    for its own): ``handle``'s context and padding rule, ``config`` its :func:`config_of` tuple, ``weights``
    (expert-major) and the handle ``tensors`` to use (the handle's own, or :func:`combine`'s unit-weight
    ones), the bias terms."""
    ctx = handle.context
    try:
        return _ops(ctx, y, torch.compiler.is_compiling()).combine(y, weights, b0, b1, list(tensors), *config,
                                                                   handle.zero_padding)
    except (RuntimeError, ValueError) as exc:
        raise ctx.translate(exc) from None


@without_default_device
def cached_dispatch(x, handle: Handle):
    """Dispatch ``x[T, H]`` (or ``(x, x_scales)`` for fp8) again with the routing of a rank-major
    ``handle``: no layout work, no host wait, only rows move. Returns ``recv_x`` (a tuple for fp8)
    shaped like the first dispatch's. Differentiable in ``x`` (its adjoint is a combine)."""
    config = config_of(handle)
    if handle.config.layout != Layout.RANK_MAJOR:
        raise InputError("cached dispatch serves rank-major handles; dispatch again for the expert-major layout")
    if type(x) is tuple:
        x, x_scales = x
    else:
        x_scales = None
    ctx = handle.context
    try:
        ops = _ops(ctx, x, torch.compiler.is_compiling())
        recv_x, recv_scales = ops.cached_dispatch(x, x_scales, list(handle.tensors), *config)
    except (RuntimeError, ValueError) as exc:
        raise ctx.translate(exc) from None
    return (recv_x, recv_scales) if x_scales is not None else recv_x
