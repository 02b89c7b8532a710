"""JAX frontend (DESIGN §5): ``dispatch`` and ``combine`` for use inside ``shard_map`` over an EP axis.

Both are ``jax.custom_vjp`` functions whose backward passes are the backend's ``dispatch_bwd`` and
``combine_bwd``; they work under ``jit``, ``grad``, ``jax.checkpoint`` and ``scan``. The handle is a
pytree (:class:`~omniep.ep_core.types.Handle`) that flows through the graph: there is no hidden state
per call, and combining with the handle of a dispatch is all a caller needs.

Shapes and dtypes are checked while tracing, before anything runs (:class:`InputError`). What only
the data or the other ranks can show (DESIGN §9) is checked on the device, inside the exchanges the
ops already make, and returned as a **status**: ``Dispatched.status`` and, with
``combine(..., return_status=True)``, the combine's; a ``[STATUS_WORDS]`` int32 array per rank
(:mod:`omniep.ep_core.descriptor`), all zero when every rank ran the same op (E, H, dtype, layout,
capacity, top-k) and every expert id was in ``[-1, E)``. :func:`check` raises what a status reports
(``RankMismatchError``, ``InputError``, ...) once it is on the host; an op whose status is not OK moved
nothing (see :func:`dispatch`). With ``OMNIEP_CHECKS=sync`` (tests, debugging) a host callback raises
inside the jitted program (see :func:`check`). Expert ids are also checked at once when ``topk_idx``
is concrete (never inside ``shard_map``).

Ranks whose programs differ must first get through XLA's compiler: on GPU over several processes,
XLA shares autotuning results between processes per compiled module (``--xla_gpu_shard_autotuning``,
on by default), and a process compiling a program no other process compiles waits for them in
compilation, before any op runs. Where ranks may diverge (tests, debugging), set
``XLA_FLAGS=--xla_gpu_shard_autotuning=false`` so that the ops can report the difference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..backends.collective import jax_layout as lay
from ..backends.collective import jax_status as js
from ..ep_core import descriptor as dsc
from ..ep_core import registry
from ..ep_core import validation as val
from ..ep_core.capacity import check_expert_alignment, resolve_capacity
from ..ep_core.errors import InputError, UnsupportedError
from ..ep_core.types import Dispatched, DispatchConfig, Handle, Layout

__all__ = ["dispatch", "combine", "check", "Dispatched", "Handle", "STATUS_WORDS"]

STATUS_WORDS = dsc.STATUS_WORDS


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
             expert_alignment: int = 1, layout="rank_major", backend: Optional[str] = None,
             zero_padding: bool = False) -> Dispatched:
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

    ``status [STATUS_WORDS] int32`` (per rank): all zero when every rank of the group dispatched with
    the same ``num_experts``, hidden size, dtype, layout, capacity and top-k and no rank's ``topk_idx``
    held an id outside ``[-1, E)``; otherwise the same failure on every rank (RANK_MISMATCH naming the
    first differing rank and field, or BAD_INPUT naming the rank and the id), and the op moved
    nothing. The outputs of a failed op are not to be used: the collective backend returns zeros
    (``recv_x`` 0, ``recv_topk_idx`` -1, counts 0), the native backends leave them unspecified (zeroing
    would cost a pass over them on every call); both return a handle that routes nothing, so a combine
    with it returns the bias (or 0) and reports the same status. Raise it with :func:`check`.

    ``zero_padding=True`` (expert-major): the slots past the counts come back zero instead of unspecified
    (DESIGN §2) — for a dense expert over every slot; one pass over ``recv_x``. It governs the gradient's
    padding too: the handle carries it (``Handle.zero_padding``, static), and the backward of
    :func:`combine` with that handle (a cached dispatch of the output's cotangent) returns the cotangent of
    ``y`` with its slots past the counts zero; without it they are unspecified there (the native kernels
    leave them unwritten, so the backward's time follows the routed copies, not ``L * C * H``).
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
    zero = bool(zero_padding) and layout == Layout.EXPERT_MAJOR
    d = _dispatch_fn(cls, axis_name, config, _sync(), zero)(tuple(x) if fp8_pair else x, topk_idx, topk_weights)
    if zero:
        held = (d.recv_topk_idx >= 0)[..., None]
        masked = tuple(jnp.where(held, t, jnp.zeros((), t.dtype)) for t in d.recv_x) if fp8_pair \
            else jnp.where(held, d.recv_x, jnp.zeros((), d.recv_x.dtype))
        d = dataclasses.replace(d, recv_x=masked)
    return d


def combine(y, handle: Handle, *, bias=None, return_status: bool = False, weighted: bool = True):
    """Bring expert outputs back to the tokens' ranks: ``out[T, H]`` in ``y``'s dtype.

    ``y`` is shaped like the ``recv_x`` of the dispatch that made ``handle``: ``[capacity, H]``
    (rank-major, ``out[t]`` = sum over the ranks that received t, ascending, of their row; the caller
    applies routing weights) or ``[L, capacity, H]`` (expert-major, ``out[t] = Σ_k w[t, k] y[e_k][slot]``
    in k order). Sums are fp32, rounded once. ``bias``: None, one ``[T, H]`` array or a pair, added
    in fp32 after the sum, in the order given.

    ``return_status=True`` returns ``(out, status)``, ``status [STATUS_WORDS] int32`` per rank: the
    status of the dispatch that made ``handle`` when that failed, else a mismatch of this combine
    between ranks (E, H and dtype of ``y``, layout, capacity, top-k), all zero when none. When it is
    not OK, ``out`` is not to be used: when the dispatch failed it is the bias sum (0 without bias);
    when this combine's ranks disagree, it is that on the collective backend and unspecified on the
    native ones. The status has no gradient. (Collective backend: the check rides in the
    combine's own exchange when ``y`` has the hidden size and element width of the dispatch's ``x``,
    bf16 after fp8, otherwise the combine exchanges twice; native backends: in the kernels' first
    barrier.)

    The cotangent of an expert-major ``y`` is zero in the slots past the counts when the dispatch that made
    ``handle`` was called with ``zero_padding=True`` (``handle.zero_padding``), unspecified otherwise.

    ``weighted=False`` (expert-major): ``out[t] = Σ_k y[e_k][slot]`` without the weights — for a caller
    that scaled ``y`` by ``recv_topk_weights`` at the experts, whose gradients come back through
    dispatch exactly (bitwise the same on every backend, unlike the weighted combine's dot product over H).
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
    if not weighted and cfg.layout == Layout.EXPERT_MAJOR:
        # Unit weights where copies are (constants: no gradient reaches the dispatch's weights here): at
        # the sources, and on the held slots for backends whose handle keeps the received weights.
        ones = {"topk_weights": jnp.ones_like(handle.topk_weights)}
        if handle.recv_topk_weights is not None and handle.recv_topk_idx is not None:
            ones["recv_topk_weights"] = (handle.recv_topk_idx >= 0).astype(handle.recv_topk_weights.dtype)
        handle = handle.replace(**ones)
    cls = registry.get_backend_class(handle.backend, "jax")
    bias_dtypes = tuple(val.dtype_name(b) for b in biases)
    out, status = _combine_fn(cls, handle.group, cfg, bias_dtypes, _sync())(y, handle, biases)
    return (out, status) if return_status else out


def check(status) -> None:
    """Raise the first failure a status reports; return None when every word is OK.

    ``status``: a concrete int array of ``STATUS_WORDS`` per rank with any leading shape, e.g. the
    ``[R * STATUS_WORDS]`` or ``[R, STATUS_WORDS]`` that ``shard_map(..., out_specs=P(axis))`` returns
    for ``Dispatched.status`` (or ``status[None]``); over several processes, each checks the ranks it
    holds (every rank reports a failure, so each process raises). The ranks are read in order; the
    error is the one :func:`omniep.ep_core.descriptor.error_from_status` makes: :class:`RankMismatchError` (naming the
    rank, the ranks that differ and the fields), :class:`InputError` (the rank whose ``topk_idx`` held a
    bad expert id, and the id), :class:`PeerTimeoutError`, :class:`CapacityError`.

    Inside ``jit`` a status is not concrete: return it from the jitted function and check it after,
    or set ``OMNIEP_CHECKS=sync``. In that mode every op's status is checked on the host inside the
    program (a ``jax.pure_callback`` every output depends on; for tests and debugging: each op waits
    for the host). On jax 0.10.2 the caller then gets ``jax.errors.JaxRuntimeError`` (a ``RuntimeError``)
    when it first waits for a result of the failed program (``block_until_ready``, ``np.asarray``, ...),
    not at the call (dispatch is asynchronous); its message is ``INTERNAL: CpuCallback error calling
    callback: Traceback ...`` whose last line is the omniep error's class name and message, e.g.
    ``RankMismatchError: rank 1: its dispatch #0 does not match what rank(s) [2, 3] sent: ...`` (the
    rank whose callback failed first). Every rank fails at the same op, so none is left waiting in a
    later exchange. JAX keeps that error and raises it again at the next ``jax.effects_barrier()`` and
    prints it at exit.
    """
    if isinstance(status, jax.Array) and not isinstance(status, jax.core.Tracer) and not status.is_fully_addressable:
        # Over several processes each one holds (and checks) its own ranks' words.
        parts = sorted(status.addressable_shards, key=lambda sh: [i.start or 0 for i in sh.index])
        status = np.concatenate([np.asarray(sh.data).reshape(-1) for sh in parts])
    try:
        words = np.asarray(status)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise InputError("check(status) needs a concrete status: inside jit, return the status from the jitted "
                         "function and check it after the call, or set OMNIEP_CHECKS=sync") from None
    if words.dtype.kind not in "iu" or words.size % STATUS_WORDS:
        raise InputError(f"status must be an int array of {STATUS_WORDS} words per rank (Dispatched.status, "
                         f"combine(..., return_status=True)), got {words.dtype} of shape {words.shape}")
    for row in words.reshape(-1, STATUS_WORDS):
        dsc.raise_for_status(row)


def _sync() -> bool:
    """``OMNIEP_CHECKS=sync``, read when an op is traced (part of the cached functions' keys)."""
    return dsc.checks_mode() == "sync"


def _raise_on_host(status):
    dsc.raise_for_status(np.asarray(status))
    return np.int32(0)


def _checked(tree, status):
    """``tree`` (unchanged) once the host has checked ``status``, raising on a failure.

    The check is a ``pure_callback`` whose result (0) is OR-ed into the bits of every array of
    ``tree``: nothing that uses an output (a later op's exchange above all) can run before the check,
    on any rank, and the check cannot be dropped while an output is used. Not ``io_callback``: its
    effect is refused under ``jax.checkpoint``; not an ``optimization_barrier`` beside the result:
    XLA drops the callback when only the barrier reads it (seen with jax 0.10.2)."""
    try:
        jax.devices("cpu")
    except RuntimeError:
        raise UnsupportedError("OMNIEP_CHECKS=sync checks every op's status in a host callback, which needs "
                               "JAX's CPU platform: add cpu to JAX_PLATFORMS (e.g. JAX_PLATFORMS=cuda,cpu) or "
                               "unset OMNIEP_CHECKS and call omniep.jax.check on the statuses") from None
    zero = jax.pure_callback(_raise_on_host, jax.ShapeDtypeStruct((), jnp.int32), status)

    def after_check(a):
        bits = lay.as_bits(a)
        return lay.from_bits(bits | zero.astype(bits.dtype), a.dtype)

    return jax.tree.map(after_check, tree)


# ---- custom_vjp wrappers, one per static configuration ---------------------------------------------

def _is_zero_ct(ct) -> bool:
    return ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0


def _materialized(tree):
    """``tree`` with its arrays behind an optimization barrier: every backend's op reads and writes
    whole buffers, as a native custom call does, so that XLA cannot fuse the layer's arithmetic into
    one backend's data movement and not another's (a fused reduction may sum in another order). On two
    H100s the Flax layer's g_x / g_router differed by 1 ulp between cuda_nvshmem and collective
    without these barriers and the sort-based layout of jax_layout.token_of_slot, and were bitwise equal
    with both (benchmarks/RESULTS.md, 2026-11-26 18:01; the two changes were not tried apart)."""
    leaves, tree_def = jax.tree.flatten(tree)
    arrays = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array) and not _is_zero_ct(a)]
    kept = jax.lax.optimization_barrier([leaves[i] for i in arrays])
    for i, a in zip(arrays, kept):
        leaves[i] = a
    return jax.tree.unflatten(tree_def, leaves)


@functools.lru_cache(maxsize=None)
def _dispatch_fn(cls, axis_name, config: DispatchConfig, sync: bool, zero_padding: bool = False):
    backend = cls(axis_name)

    def run(x, topk_idx, topk_weights):
        x, topk_idx, topk_weights = _materialized((x, topk_idx, topk_weights))
        rows = x[0] if isinstance(x, tuple) else x
        desc = js.op_descriptor(dsc.OpKind.DISPATCH, config, hidden=int(rows.shape[1]),
                                dtype=val.dtype_name(rows), num_topk=int(topk_idx.shape[1]))
        (recv_x, recv_idx, recv_w, num_recv, per_expert, dropped), handle = backend.prepare_dispatch(
            x, topk_idx, topk_weights, config, desc)
        if zero_padding:  # static: combine_bwd with this handle zeroes g_y's padding (DESIGN §2)
            handle = handle.replace(zero_padding=True)
        out = Dispatched(recv_x, recv_idx, recv_w, num_recv, per_expert, dropped, handle, handle.status)
        return _materialized(_checked(out, handle.status) if sync else out)

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
        g_x, g_w = _materialized(backend.dispatch_bwd(*_materialized((g.recv_x, g_recv_w)), handle))
        if not _is_zero_ct(g.handle.topk_weights):  # read by expert-major combine
            g_w = g_w + g.handle.topk_weights
        return g_x, None, g_w

    dispatch_vjp.defvjp(fwd, bwd)
    return dispatch_vjp


@functools.lru_cache(maxsize=None)
def _combine_fn(cls, group, config: DispatchConfig, bias_dtypes: tuple, sync: bool):
    backend = cls(group)
    expert_major = config.layout == Layout.EXPERT_MAJOR

    def run(y, handle, biases):
        # (biases behind a barrier of their own: one made early need not wait for y, nor y for it)
        out, status = backend.combine(*_materialized((y, handle)), _materialized(biases))
        return _materialized(_checked((out, status), status) if sync else (out, status))

    @jax.custom_vjp
    def combine_vjp(y, handle, biases):
        return run(y, handle, biases)

    def fwd(y, handle, biases):
        out, status = run(y, handle, biases)
        # The backward pass moves data only if this combine did: its handle carries this status.
        # Expert-major needs y for the weights' gradient <g_out[t], y[l, c]>.
        return (out, status), (handle.replace(status=status), y if expert_major else None)

    def bwd(res, g):
        g_out, _ = g  # the status has no gradient
        handle, y = res
        g_y, g_w = _materialized(backend.combine_bwd(*_materialized((g_out, handle, y))))
        if not expert_major:
            g_y = g_y.astype(g_out.dtype)
        no_data = {name: None for name in Handle.DATA_FIELDS}
        g_handle = handle.replace(**{**no_data, "topk_weights": g_w})
        return g_y, g_handle, tuple(g_out.astype(dt) for dt in bias_dtypes)

    combine_vjp.defvjp(fwd, bwd)
    return combine_vjp
