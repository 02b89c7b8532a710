"""PyTorch frontend: autograd-aware ``dispatch`` / ``combine`` for one rank of a ``torch.distributed``
EP group (DESIGN §5), and the DeepEP-compatible :class:`Buffer`.

Both functions are eager and run the custom ops of :mod:`omniep.frontends.torch_ops`, so
``torch.autograd`` differentiates through them (dispatch's adjoint is a combine, combine's a cached
dispatch) and ``torch.compile`` traces them. They are collectives: every rank of the group must call them — and
run their backward passes — in the same order, with the same ``requires_grad`` pattern (a rank whose
loss ignores ``out`` still has to back-propagate through it, e.g. with ``(0 * out).sum()``).
Example, inside a process of an initialized group::

    from omniep import torch as ep
    d = ep.dispatch(x, topk_idx, topk_weights, num_experts=64)
    y = experts(d.recv_x, d.recv_topk_idx) * ...        # rank-major: the caller applies weights
    out = ep.combine(y, d.handle)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ep_core import registry
from ..ep_core.capacity import check_expert_alignment, resolve_capacity
from ..ep_core.errors import InputError
from ..ep_core.types import Dispatched, Handle, Layout
from ..ep_core.validation import FLOAT_DTYPES, FP8_DTYPES, dtype_name
from . import torch_ops as ops
from .torch_buffer import Buffer  # noqa: F401  (re-exported)

__all__ = ["dispatch", "combine", "cached_dispatch", "Buffer", "Dispatched", "Handle"]


def _group_name(group) -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                         "before omniep.torch.dispatch/combine")
    return (group if group is not None else dist.group.WORLD).group_name


def _select(backend: Optional[str], layout: Layout, x) -> type:
    """The backend for this request: a named one must serve it (or raise why not); ``auto`` takes the
    first available backend that serves the layout, dtype and device (see ``registry.select_backend``)."""
    name = dtype_name(x)
    known = name in FLOAT_DTYPES or name in FP8_DTYPES  # other dtypes are rejected by validation, by name
    return registry.select_backend("torch", backend, layout=layout, dtype=name if known else None,
                                   fp8=name in FP8_DTYPES, device=x.device.type)


def dispatch(x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int, group=None,
             capacity: Optional[int] = None, expert_alignment: int = 1, layout="rank_major",
             backend: Optional[str] = None) -> Dispatched:
    """Send every token to the ranks holding the experts it chose (DESIGN §2).

    ``x[T, H]`` bf16/fp16/fp32, or ``(x[T, H] float8_e4m3fn, x_scales[T, H/128] float32)`` (bytes moved
    unchanged); ``topk_idx[T, K]`` int32/int64 global expert ids, ``-1`` = none; ``topk_weights[T, K]``
    float32. ``T`` may differ between ranks. ``group``: a ``ProcessGroup`` (None = default group).

    ``capacity=None`` gives the exact receive size: rank-major ``recv_x[N, H]`` with N the rows that
    arrive, ordered by (source rank, source token); expert-major ``recv_x[L, C, H]`` with C the largest
    per-expert count on this rank. An int gives static buffers of that many rows (slots per expert),
    zero padded (``recv_topk_idx = -1``, weights 0); if any rank would receive more, ``CapacityError``
    (naming the rank, the rows needed and the capacity) is raised on every rank before data moves.

    Returns :class:`~omniep.ep_core.types.Dispatched`: ``recv_x`` (a tuple ``(recv_x, recv_x_scales)``
    for fp8), ``recv_topk_idx`` int32 local expert ids / -1 (rank-major ``[rows, K]``, expert-major
    ``[L, C]``), ``recv_topk_weights`` float32 (same shape, 0 elsewhere), ``num_recv`` and ``dropped``
    (0-d int32), ``num_recv_tokens_per_expert[L]`` int32 (rounded up to ``expert_alignment``) and the
    ``handle`` for :func:`combine`. Differentiable in ``x`` (float) and ``topk_weights``.
    """
    x, x_scales = x if isinstance(x, tuple) else (x, None)
    layout = Layout.parse(layout)
    capacity = resolve_capacity(capacity, 1, 0, layout, static=False)
    check_expert_alignment(expert_alignment)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    cls = _select(backend, layout, x)
    group_name = _group_name(group)
    meta = (group_name, cls.name, num_experts, layout.value, -1 if capacity is None else capacity, expert_alignment)
    out = torch.ops.omniep.dispatch(x, x_scales, topk_idx, topk_weights, *meta)
    handle = ops.handle_from_tensors(ops.dispatch_handle_tensors(out, layout.value), meta, topk_weights)
    recv_x = (out[0], out[1]) if x_scales is not None else out[0]
    return Dispatched(recv_x=recv_x, recv_topk_idx=out[2], recv_topk_weights=out[3], num_recv=out[4],
                      num_recv_tokens_per_expert=out[5], dropped=out[6], handle=handle)


def _meta(handle) -> tuple:
    if not isinstance(handle, Handle) or getattr(handle, "all_counts", None) is None:
        raise InputError(f"handle must be the handle returned by omniep.torch.dispatch, got {type(handle).__name__}")
    cfg = handle.config
    return (handle.group_name, handle.backend, cfg.num_experts, cfg.layout.value,
            -1 if cfg.capacity is None else cfg.capacity, cfg.expert_alignment)


def combine(y: torch.Tensor, handle: Handle, *, bias=None) -> torch.Tensor:
    """Send expert outputs back to the tokens' ranks and sum them: ``out[T, H]`` in ``y``'s dtype.

    Rank-major ``y[rows, H]`` (rows as ``recv_x``; padding rows ignored): ``out[t]`` is the sum over
    the ranks that received t, ascending rank order — weights are the caller's business (DeepEP).
    Expert-major ``y[L, C, H]``: ``out[t] = sum_k topk_weights[t, k] * y[copy (t, k)]`` in k order, the
    weights being the ``topk_weights`` given to dispatch (gradients flow to them). ``bias``: None, one
    ``[T, H]`` tensor or a tuple of two, added after the sum. Every sum is in fp32 from +0.0, in that
    order, rounded once. Differentiable in ``y``, ``bias`` and (expert-major) ``topk_weights``.
    """
    meta = _meta(handle)
    biases = () if bias is None else (tuple(bias) if isinstance(bias, (tuple, list)) else (bias,))
    if len(biases) > 2:
        raise InputError(f"bias takes at most two [T, H] tensors, got {len(biases)}")
    biases = biases + (None,) * (2 - len(biases))
    weights = handle.topk_weights if handle.config.layout == Layout.EXPERT_MAJOR else None
    return torch.ops.omniep.combine(y, weights, biases[0], biases[1], ops.handle_tensors(handle), *meta)


def cached_dispatch(x, handle: Handle):
    """Dispatch ``x[T, H]`` (or ``(x, x_scales)`` for fp8) again with the routing of a rank-major
    ``handle``: no layout work, only rows move. Returns ``recv_x`` (a tuple for fp8) shaped like the
    first dispatch's. Differentiable in ``x`` (its adjoint is a combine)."""
    meta = _meta(handle)
    if handle.config.layout != Layout.RANK_MAJOR:
        raise InputError("cached dispatch serves rank-major handles; dispatch again for the expert-major layout")
    x, x_scales = x if isinstance(x, tuple) else (x, None)
    recv_x, recv_scales = torch.ops.omniep.cached_dispatch(x, x_scales, ops.handle_tensors(handle), *meta)
    return (recv_x, recv_scales) if x_scales is not None else recv_x
