"""What every PyTorch backend shares: one rank of a ``torch.distributed`` process group, opened once.

A torch backend object is the **context** of one (group, backend) pair: the frontend resolves it at
the group's first call (selection, bootstrap, workspace) and keeps it; every later op finds it by
its integer ``id``, the ``ctx`` argument of the ``torch.library`` ops (so the ops see plain ints and
tensors: CUDA graphs and ``torch.compile`` can take them). Two op families exist:

* ``omniep::*``: backends written in Python (``collective``): the op's kernel calls the context's
  ``op_*`` methods (:class:`PythonOps`);
* ``omniep_native::*``: the native backends: the ops' CUDA and autograd kernels are C++
  (``omniep._native_torch``) and look the context up in the C++ registry under the same ``id``.

Op-level handle: ``(recv_topk_idx, recv_topk_weights, *backend_tensors)``; the first two are the
dispatch's own outputs (rank-major ``[rows, K]``; expert-major ``[L, C]``), the rest is the
backend's business, the first of them always ``topk_idx`` narrowed to int32 ``[T, K]``.
"""

from __future__ import annotations

import itertools
from typing import Optional

from ..ep_core.backend import EPBackend
from ..ep_core.descriptor import checks_mode, timeout_from_env
from ..ep_core.errors import DestroyedError, InputError

_BY_ID: dict = {}  # context id -> live context (every family)
_IDS = itertools.count(1)


def context_of(ctx_id: int):
    """The live context with this id (the ops' ``ctx`` argument)."""
    try:
        return _BY_ID[ctx_id]
    except KeyError:
        raise DestroyedError(f"omniep: no live torch context {ctx_id}: it was destroyed (omniep.torch.destroy, "
                             f"Buffer.destroy) or never opened in this process") from None


class TorchGroupBackend(EPBackend):
    """An :class:`EPBackend` for one rank of ``group`` (a ``ProcessGroup``; ``None`` = the default group).

    Sets ``group``, ``rank``, ``world``, ``id`` (registered for the ops), ``checks`` (``OMNIEP_CHECKS``:
    ``"sync"`` raises every op's status at once) and ``timeout_s`` (``OMNIEP_TIMEOUT_S``), all read here,
    once. Raises :class:`InputError` if ``torch.distributed`` has not been initialised.
    """

    framework = "torch"
    ops_namespace = "omniep"  # omniep_native for the C++ ops
    # Whether an expert-major dispatch / combine can launch its sends only and leave the rest to a
    # receive hook (send_only_next / receive: the native backends). Elsewhere an op's data has
    # arrived when its call returns.
    recv_hooks = False
    # Whether the next expert-major dispatch can add its kept copies per local expert to a caller's int32
    # tensor inside its kernel (recv_stats_next: the native backends); elsewhere the Buffer adds them itself.
    recv_stats_in_kernel = False

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise InputError("torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group(...) before using omniep")
        super().__init__(group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.checks = checks_mode()
        self.timeout_s = timeout_from_env()
        self.ops = getattr(torch.ops, self.ops_namespace)
        self.eager_ops = self.ops  # the frontend gives backends written in Python a direct entry point
        self.layouts = self.capabilities().layouts  # what the frontend checks per call
        self.id = next(_IDS)
        _BY_ID[self.id] = self

    @classmethod
    def open(cls, group=None) -> "TorchGroupBackend":
        """The context of ``group`` for this backend (collective over the group where the backend
        needs a bootstrap). The frontend calls it once per (group, backend)."""
        return cls(group)

    def num_ranks(self) -> int:
        return self.world

    @property
    def alive(self) -> bool:
        return self.id in _BY_ID

    def destroy(self) -> None:
        """Release the context; later ops on it raise :class:`DestroyedError`. Collective for backends
        with native buffers (every rank calls it)."""
        _BY_ID.pop(self.id, None)

    def set_checks(self, mode: str) -> None:
        """``"sync"`` or ``"default"`` for this context from now on (``OMNIEP_CHECKS`` chose it at open)."""
        if mode not in ("sync", "default"):
            raise InputError(f"checks mode must be 'sync' or 'default', got {mode!r}")
        self.checks = mode

    def translate(self, exc: BaseException) -> BaseException:
        """The typed error an exception of this context's ops stands for (the frontend raises it)."""
        return exc

    def check(self, again: bool = True) -> None:
        """Raise what an earlier op of this group reported and has not been raised yet (DESIGN §9).
        A failed group (a sticky status: mismatch, timeout) raises at every check, unless ``again`` is
        False and it was raised before (destroy)."""

    def synchronize(self) -> None:
        """Wait for this rank's queued ops, then :meth:`check`."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.check()

    def source_counts(self, tensors, num_experts: int):
        """Rows a rank-major dispatch's handle (``tensors``: the frontend handle's, recv_topk_idx first)
        receives from each source rank, before any capacity drop: an int32 tensor ``[R]`` (no
        communication; on the device for the native backends)."""
        raise NotImplementedError

    # ---- what the shared fake kernels need from a backend (torch.compile, opcheck) ----
    def fake_handle(self, topk_idx, num_experts: int, layout: int, rows) -> list:
        """Fake tensors shaped like this backend's handle tensors (after recv_topk_idx / weights), for a
        dispatch of ``topk_idx [T, K]`` with ``rows`` receive rows (rank-major) or slots per expert."""
        raise NotImplementedError


def with_zero_padding(out: tuple) -> tuple:
    """An expert-major dispatch's outputs (the schema's) with ``recv_x`` and, for fp8 rows, its scales zero
    in the slots past the counts (``recv_topk_idx`` -1): ``zero_padding`` for backends written in Python."""
    import torch

    held = (out[2] >= 0).unsqueeze(-1)

    def zeroed(t):
        return torch.where(held, t, torch.zeros((), dtype=t.dtype, device=t.device))
    return (zeroed(out[0]), zeroed(out[1]) if out[1].dim() == 3 else out[1]) + tuple(out[2:])


class PythonOps:
    """The ``op_*`` methods a backend written in Python implements; the ``omniep::*`` ops call them.

    Arguments after the tensors are the op's config: ``num_experts``, ``layout`` (0 rank-major, 1
    expert-major), ``capacity`` (-1 = exact) and ``expert_alignment``, then for dispatch, combine and
    combine_bwd ``zero_padding`` (combine and combine_bwd: the handle's dispatch's); ``handle`` is the
    op-level handle list (see the module docstring). Returns as the op schemas in :mod:`omniep.frontends.torch_ops`.
    """

    def op_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts: int, layout: int, capacity: int,
                    expert_alignment: int, zero_padding: bool = False) -> tuple:
        raise NotImplementedError

    def op_dispatch_fp8(self, x, topk_idx, topk_weights, round_scale: bool, num_experts: int, layout: int,
                        capacity: int, expert_alignment: int, zero_padding: bool = False) -> tuple:
        """op_dispatch of :func:`quantize_fp8` of ``x`` (the native kernels cast while they send)."""
        x8, scales = quantize_fp8(x, round_scale=round_scale)
        return self.op_dispatch(x8, scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                                zero_padding)

    def op_cached_dispatch(self, x, x_scales, handle: list, num_experts: int, layout: int, capacity: int,
                           expert_alignment: int) -> tuple:
        raise NotImplementedError

    def op_combine(self, y, topk_weights, bias0, bias1, handle: list, num_experts: int, layout: int, capacity: int,
                   expert_alignment: int, zero_padding: bool = False):
        raise NotImplementedError

    def op_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: list, num_experts: int, layout: int,
                        capacity: int, expert_alignment: int) -> tuple:
        raise NotImplementedError

    def op_combine_bwd(self, g_out, topk_weights, y, handle: list, num_experts: int, layout: int, capacity: int,
                       expert_alignment: int, zero_padding: bool = False) -> tuple:
        """``zero_padding`` (that of the handle's dispatch): the expert-major ``g_y``'s slots past the counts
        must come back zero; without it they are unspecified (zeros serve too)."""
        raise NotImplementedError


def destroy_contexts(cls) -> None:
    """Destroy every live context of backend class ``cls`` in this process (collective: every rank calls
    it, e.g. before ``destroy_process_group``)."""
    for ctx in [c for c in _BY_ID.values() if isinstance(c, cls)]:
        ctx.destroy()


def default_group(group: Optional[object]):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise InputError("torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                         "before omniep.torch.dispatch/combine")
    return group if group is not None else dist.group.WORLD


def quantize_fp8(x, block: int = 128, round_scale: bool = False) -> tuple:
    """DeepEP's low-latency fp8 cast: per token and ``block`` channels, ``scale = max(amax, 1e-4) / 448``
    (``round_scale``: rounded up to the next power of two, DeepEP's ``round_scale``; a NaN stays NaN),
    ``x_fp8 = float8_e4m3fn(x / scale)``. Returns ``(x_fp8 [T, H], scales [T, H / block] float32)``. The
    native expert-major dispatch casts in its kernel to the same bits (``dispatch(..., use_fp8=True)``)."""
    import torch

    T, H = x.shape
    if H % block:
        raise InputError(f"use_fp8 needs hidden % {block} == 0, got {H}")
    xf = x.to(torch.float32).reshape(T, H // block, block)
    # Divide by a tensor: on CUDA torch turns division by a Python scalar into multiplication by its
    # reciprocal, which rounds differently from the division the contract (and NumPy) does.
    scales = xf.abs().amax(dim=-1).clamp(min=1e-4) / torch.full((), 448.0, device=x.device)
    if round_scale:  # exponent + 1 unless the mantissa is zero: the scales are positive, so no sign bit
        bits = scales.view(torch.int32)
        up = ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scales = torch.where(scales.isnan(), scales, ((((bits >> 23) & 0xFF) + up) << 23).view(torch.float32))
    x8 = (xf / scales.unsqueeze(-1)).reshape(T, H).to(torch.float8_e4m3fn)
    return x8, scales.contiguous()


def pack_ue8m0(scales):
    """Power-of-two fp32 scales ``[..., S]`` (``S % 4 == 0``) as DeepEP's UE8M0 ``int32 [..., S / 4]``: each
    scale's exponent byte (``bits >> 23``), four to an int32, the first scale in the lowest byte."""
    import torch

    return ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.int32)
