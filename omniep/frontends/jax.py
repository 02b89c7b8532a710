"""JAX frontend (DESIGN §5): ``dispatch`` and ``combine`` for use inside ``shard_map`` over an EP axis.

Both are ``jax.custom_vjp`` functions whose backward passes are the backend's ``dispatch_bwd`` and
``combine_bwd``; they work under ``jit``, ``grad``, ``jax.checkpoint`` and ``scan``. The handle is a
pytree (:class:`~omniep.ep_core.types.Handle`) that flows through the graph: there is no hidden state
per call, and combining with the handle of a dispatch is all a caller needs.

Shapes and dtypes are checked while tracing, before anything runs (:class:`InputError`). Expert ids
are checked when ``topk_idx`` is concrete; inside ``shard_map`` it never is, and out-of-range ids are
then treated as ``-1`` and counted in ``dropped`` (a traced computation cannot raise).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np

from ..ep_core import registry
from ..ep_core import validation as val
from ..ep_core.capacity import check_expert_alignment, resolve_capacity
from ..ep_core.errors import InputError
from ..ep_core.types import Dispatched, DispatchConfig, Handle, Layout

__all__ = ["dispatch", "combine", "Dispatched", "Handle"]


def _register_pytrees() -> None:
    for cls, meta in ((Handle, Handle.META_FIELDS), (Dispatched, ())):
        try:
            jax.tree_util.register_dataclass(cls, data_fields=list(cls.DATA_FIELDS), meta_fields=list(meta))
        except ValueError:  # already registered (module reloaded)
            pass


_register_pytrees()


def _axis_size(axis_name) -> int:
    try:
        if hasattr(jax.lax, "axis_size"):
            return int(jax.lax.axis_size(axis_name))
        return int(jax.lax.psum(1, axis_name))
    except NameError as exc:
        raise InputError(
            f"axis_name={axis_name!r} is not bound here; call omniep.jax.dispatch inside jax.shard_map "
            f"over a mesh with that axis ({exc})"
        ) from None


def _concrete(array) -> Optional[np.ndarray]:
    """The value of ``array`` if it is known while tracing (not a tracer), else None."""
    try:
        return np.asarray(array)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def dispatch(x, topk_idx, topk_weights, *, num_experts: int, axis_name, capacity: Optional[int] = None,
             expert_alignment: int = 1, layout="rank_major", backend: Optional[str] = None) -> Dispatched:
    """Send each token to the ranks of its experts; call inside ``shard_map`` over ``axis_name``.

    Per rank: ``x[T, H]`` bf16/fp16/fp32, or a tuple ``(x[T, H] float8_e4m3fn, x_scales[T, H/128]
    float32)`` whose bytes are moved unchanged; ``topk_idx[T, K]`` int32/int64 (``-1`` = no expert);
    ``topk_weights[T, K]`` float32. ``T`` is the same on every rank (static shapes).

    Returns :class:`Dispatched`. Rank-major: ``recv_x[capacity, H]`` with rows in (source rank, source
    token) order, ``recv_topk_idx[capacity, K]`` local expert ids / -1, ``recv_topk_weights[capacity, K]``.
    Expert-major: ``recv_x[L, capacity, H]`` ordered by (source rank, source token, k) within each local
    expert, ``recv_topk_idx[L, capacity]``, ``recv_topk_weights[L, capacity]``. ``capacity`` defaults to
    the exact worst case ``R * T``; what does not fit is counted in ``dropped``. For fp8 input
    ``recv_x`` is a tuple ``(recv_x, recv_x_scales)``.
    """
    layout = Layout.parse(layout)
    fp8_pair = isinstance(x, (tuple, list))
    if fp8_pair and len(x) != 2:
        raise InputError(f"x must be an array or a pair (x_fp8, x_scales), got a sequence of {len(x)}")
    x_rows, x_scales = (x[0], x[1]) if fp8_pair else (x, None)
    num_tokens, _ = val.check_routing(topk_idx, topk_weights)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    ids = _concrete(topk_idx)
    if ids is not None:
        val.check_expert_ids(ids, num_experts)
    num_ranks = _axis_size(axis_name)
    val.check_group(num_experts, num_ranks)
    dtype = val.dtype_name(x_rows)
    known = dtype in val.FLOAT_DTYPES or dtype in val.FP8_DTYPES  # others are rejected by check_tokens
    cls = registry.select_backend("jax", backend, layout=layout, dtype=dtype if known else None,
                                  fp8=dtype in val.FP8_DTYPES, num_ranks=num_ranks, device=jax.default_backend())
    val.check_tokens(x_rows, num_tokens, hidden_multiple=cls.capabilities().hidden_multiple, x_scales=x_scales)
    config = DispatchConfig(num_experts, num_ranks, layout,
                            resolve_capacity(capacity, num_ranks, num_tokens, layout, static=True),
                            check_expert_alignment(expert_alignment))
    return _dispatch_fn(cls, axis_name, config)(tuple(x) if fp8_pair else x, topk_idx, topk_weights)


def combine(y, handle: Handle, *, bias=None):
    """Bring expert outputs back to the tokens' ranks: ``out[T, H]`` in ``y``'s dtype.

    ``y`` is shaped like the ``recv_x`` of the dispatch that made ``handle``: ``[capacity, H]``
    (rank-major, ``out[t]`` = sum over the ranks that received t, ascending, of their row; the caller
    applies routing weights) or ``[L, capacity, H]`` (expert-major, ``out[t] = Σ_k w[t, k] y[e_k][slot]``
    in k order). Sums are fp32, rounded once. ``bias``: None, one ``[T, H]`` array or a pair, added
    in fp32 after the sum, in the order given.
    """
    if not isinstance(handle, Handle):
        raise InputError(f"combine needs the Handle returned by dispatch (Dispatched.handle), got {type(handle).__name__}")
    cfg = handle.config
    if cfg.layout == Layout.RANK_MAJOR:
        rows, shape = (cfg.capacity,), "[capacity, H]"
    else:
        rows, shape = (cfg.num_local_experts, cfg.capacity), "[num_local_experts, capacity, H]"
    val.check_combine_input(y, rows, layout_shape=shape)
    biases = val.check_bias(bias, int(handle.topk_idx.shape[0]), int(y.shape[-1]))
    cls = registry.get_backend_class(handle.backend, "jax")
    bias_dtypes = tuple(val.dtype_name(b) for b in biases)
    return _combine_fn(cls, handle.group, cfg, bias_dtypes)(y, handle, biases)


# ---- custom_vjp wrappers, one per static configuration ---------------------------------------------

def _is_zero_ct(ct) -> bool:
    return ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0


@functools.lru_cache(maxsize=None)
def _dispatch_fn(cls, axis_name, config: DispatchConfig):
    backend = cls(axis_name)

    def run(x, topk_idx, topk_weights):
        handle = backend.prepare(topk_idx, config)
        (recv_x, recv_idx, recv_w, num_recv, per_expert, dropped), handle = backend.dispatch(
            x, topk_weights, handle)
        return Dispatched(recv_x, recv_idx, recv_w, num_recv, per_expert, dropped, handle)

    @jax.custom_vjp
    def dispatch_vjp(x, topk_idx, topk_weights):
        return run(x, topk_idx, topk_weights)

    def fwd(x, topk_idx, topk_weights):
        out = run(x, topk_idx, topk_weights)
        return out, out.handle

    def bwd(handle, g):
        g_recv_w = g.recv_topk_weights
        # Rank-major: handle.recv_topk_weights IS recv_topk_weights, so both cotangents add up.
        # Expert-major keeps an internal uncapped copy there; its cotangent is not propagated.
        if config.layout == Layout.RANK_MAJOR and not _is_zero_ct(g.handle.recv_topk_weights):
            g_recv_w = g_recv_w + g.handle.recv_topk_weights
        g_x, g_w = backend.dispatch_bwd(g.recv_x, g_recv_w, handle)
        if not _is_zero_ct(g.handle.topk_weights):  # read by expert-major combine
            g_w = g_w + g.handle.topk_weights
        return g_x, None, g_w

    dispatch_vjp.defvjp(fwd, bwd)
    return dispatch_vjp


@functools.lru_cache(maxsize=None)
def _combine_fn(cls, group, config: DispatchConfig, bias_dtypes: tuple):
    backend = cls(group)
    expert_major = config.layout == Layout.EXPERT_MAJOR

    @jax.custom_vjp
    def combine_vjp(y, handle, biases):
        return backend.combine(y, handle, biases)

    def fwd(y, handle, biases):
        # Expert-major needs y for the weights' gradient <g_out[t], y[l, c]>.
        return backend.combine(y, handle, biases), (handle, y if expert_major else None)

    def bwd(res, g_out):
        handle, y = res
        g_y, g_w = backend.combine_bwd(g_out, handle, y)
        if not expert_major:
            g_y = g_y.astype(g_out.dtype)
        no_data = {name: None for name in Handle.DATA_FIELDS}
        g_handle = handle.replace(**{**no_data, "topk_weights": g_w})
        return g_y, g_handle, tuple(g_out.astype(dt) for dt in bias_dtypes)

    combine_vjp.defvjp(fwd, bwd)
    return combine_vjp
