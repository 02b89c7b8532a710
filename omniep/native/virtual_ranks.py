"""R virtual ranks on ONE GPU over the native p2p transport, driven from per-rank torch tensors.

Every rank's buffers live on the same device and each op launches all ranks' kernels at once (one
cooperative launch whose second grid dimension is the rank), so the multi-rank kernel logic —
count exchange, push dispatch, pull combine, barriers, timeouts — runs and is tested on one GPU.
Results equal :mod:`omniep.ep_core.reference` bit for bit (DESIGN §2), in the rank-major layout and,
with ``prepare(..., layout="expert_major")``, the expert-major one (:mod:`omniep.native.expert_major`:
``recv_x[L, C, H]``; combine applies the routing weights; combine_bwd also returns g_topk_weights).

Example::

    with VirtualRanks(num_ranks=4) as vr:
        handle = vr.prepare(topk_idx, num_experts=16, capacity=64)  # lists of per-rank tensors
        outs = vr.dispatch(xs, topk_weights, handle)                # list of VirtualDispatched
        ys = vr.combine([o.recv_x for o in outs], handle)

Calls are asynchronous on torch's current stream except ``prepare`` with ``capacity=None`` (it
must read the received counts to size the buffers) and ``check=True`` (the default), which
synchronises and raises :class:`~omniep.ep_core.errors.PeerTimeoutError` naming the rank if a wait
on a peer timed out. After such an error call :meth:`VirtualRanks.reset`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..ep_core.capacity import check_expert_alignment
from ..ep_core.errors import CapacityError, DestroyedError, InputError
from ..ep_core.types import DispatchConfig, Layout
from ..ep_core.validation import check_bias, check_config, check_expert_ids, check_routing, check_tokens
from . import expert_major as em
from . import load
from .virtual_results import VirtualDispatched, dtype_code as _dtype_code, ptrs as _ptrs

INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class VirtualHandle:
    """What dispatch, combine and both backward passes need, for all R ranks (lists by rank).

    ``capacity``: rows of every rank's receive buffer. ``exact``: capacity was None, so returned
    receive tensors are sliced to each rank's ``num_recv`` rows. ``send_offset[r]``: first row of
    this rank's tokens in rank r's receive order (the exclusive sum over lower source ranks).
    Expert-major: ``capacity`` is slots per local expert, ``exact`` slices each rank's receive to its
    fullest expert, and ``num_recv`` / ``dropped`` count copies.
    """

    config: DispatchConfig
    capacity: int
    exact: bool
    num_tokens: list
    topk_idx: list               # [T, K] int32
    send_pos: list               # [T, R] int32, -1 = not sent
    num_tokens_per_rank: list    # [R] int32
    num_tokens_per_expert: list  # [E] int32
    recv_counts: list            # [R] int32
    send_offset: list            # [R] int32
    num_recv: list               # [] int32
    dropped: list                # [] int32
    num_recv_host: Optional[list] = None  # exact mode only
    # Expert-major only (omniep.native.expert_major); num_recv / dropped then count copies.
    copy_slot: Optional[list] = None         # [T, K] int32: slot of copy (t, k) at its receiver, -1 = none/dropped
    recv_expert_count: Optional[list] = None  # [L] int32: kept copies per local expert
    num_recv_tokens_per_expert: Optional[list] = None  # [L] int32: kept, aligned up
    max_expert_count: Optional[list] = None  # [] int32: uncapped copies of the fullest local expert
    expert_capacity_host: Optional[list] = None  # exact mode: each rank's slots per expert
    topk_weights: Optional[list] = None      # [T, K] float32, recorded by dispatch for combine

    @property
    def is_token_in_rank(self):
        return [p >= 0 for p in self.send_pos]

    @property
    def expert_major(self) -> bool:
        return self.config.layout == Layout.EXPERT_MAJOR


class VirtualRanks:
    """The p2p transport's state for R virtual ranks on the current CUDA device.

    ``timeout_s`` bounds every device-side wait on a peer; ``blocks_per_rank`` (0 = automatic, at
    most 24) sets the SMs each rank's dispatch/combine uses. Release with :meth:`destroy` or ``with``.
    """

    def __init__(self, num_ranks: int, *, timeout_s: float = 10.0, blocks_per_rank: int = 0):
        import torch

        self._native = load()
        self._torch = torch
        self.num_ranks = int(num_ranks)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        self._group = self._native.Group(self.num_ranks, int(self.timeout_s * 1e9))
        if blocks_per_rank:
            self._group.set_blocks_per_rank(int(blocks_per_rank))
        # Ranks each op launches: (first, count). Tests narrow it to provoke a peer timeout.
        self.launched = (0, self.num_ranks)

    # ---- life cycle ----
    def destroy(self) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def _g(self):
        if self._group is None:
            raise DestroyedError("VirtualRanks was used after destroy()")
        return self._group

    def check(self) -> None:
        """Synchronise and raise what the first rank in error recorded (PeerTimeoutError, ...)."""
        self._g().check_errors()

    def errors(self) -> list:
        """Per rank its sticky status (``descriptor.STATUS_FIELDS``: code, rank, peer, ...; synchronises)."""
        return self._g().errors()

    def reset(self) -> None:
        """Clear every rank's device state (after an error: signal counters no longer agree)."""
        self._g().reset()

    def _stream(self) -> int:
        return int(self._torch.cuda.current_stream().cuda_stream)

    def _run(self, op: str, args: dict, check: bool) -> None:
        first, count = self.launched
        getattr(self._g(), op)(args, first, count, self._stream())
        if check:
            self.check()

    def _empty(self, shape, dtype):
        return self._torch.empty(shape, dtype=dtype, device=self.device)

    def _per_rank(self, name: str, tensors: Sequence) -> list:
        if len(tensors) != self.num_ranks:
            raise InputError(f"{name}: expected one tensor per rank ({self.num_ranks}), got {len(tensors)}")
        for r, t in enumerate(tensors):
            if t.device != self.device:
                raise InputError(f"{name}[{r}] is on {t.device}; every rank's tensors must be on {self.device}")
        return [t.contiguous() for t in tensors]

    # ---- prepare ----
    def prepare(self, topk_idx: Sequence, num_experts: int, *, capacity: Optional[int] = None,
                expert_alignment: int = 1, layout="rank_major", check: bool = True) -> VirtualHandle:
        """Layout + count exchange for every rank. ``capacity=None``: exact receive sizes (syncs).

        ``capacity`` is rows (rank-major) or slots per local expert (expert-major)."""
        torch = self._torch
        R = self.num_ranks
        config = DispatchConfig(num_experts, R, Layout.parse(layout), capacity,
                                check_expert_alignment(expert_alignment))
        check_config(config)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise InputError(f"capacity must be a non-negative int or None, got {capacity!r}")
        idx = self._per_rank("topk_idx", topk_idx)
        shapes = [check_routing(i) for i in idx]
        K = shapes[0][1]
        if any(k != K for _, k in shapes) or len({i.dtype for i in idx}) != 1:
            raise InputError("every rank's topk_idx must have the same num_topk and dtype")
        if not torch.cuda.is_current_stream_capturing():  # value checks read the ids on the host
            for i in idx:
                check_expert_ids(i.cpu().numpy(), num_experts)
        T = [t for t, _ in shapes]
        i32 = torch.int32
        h = VirtualHandle(
            config=config, capacity=INT32_MAX if capacity is None else capacity, exact=capacity is None,
            num_tokens=T, topk_idx=[self._empty((t, K), i32) for t in T],
            send_pos=[self._empty((t, R), i32) for t in T],
            num_tokens_per_rank=[self._empty((R,), i32) for _ in T],
            num_tokens_per_expert=[self._empty((num_experts,), i32) for _ in T],
            recv_counts=[self._empty((R,), i32) for _ in T], send_offset=[self._empty((R,), i32) for _ in T],
            num_recv=[self._empty((), i32) for _ in T], dropped=[self._empty((), i32) for _ in T],
        )
        self._run("layout", dict(
            topk_idx=_ptrs(idx), topk_idx32=_ptrs(h.topk_idx), send_pos=_ptrs(h.send_pos),
            num_tokens_per_rank=_ptrs(h.num_tokens_per_rank),
            num_tokens_per_expert=_ptrs(h.num_tokens_per_expert), recv_counts=_ptrs(h.recv_counts),
            send_offset=_ptrs(h.send_offset), num_recv=_ptrs(h.num_recv), dropped=_ptrs(h.dropped),
            num_tokens=T, num_topk=K, num_experts=num_experts,
            capacity=INT32_MAX if h.expert_major else h.capacity,  # expert-major: em_layout counts copies
            index_bytes=idx[0].element_size(),
        ), check or (h.exact and not h.expert_major))
        if h.expert_major:
            em.prepare(self, h, check)
        elif h.exact:  # every rank's buffer holds the largest receive; returned views are sliced
            h.num_recv_host = [int(n) for n in h.num_recv]
            h.capacity = max(h.num_recv_host, default=0)
        return h

    # ---- dispatch / combine ----
    def _dispatch_args(self, xs, handle: VirtualHandle, recv, row_bytes: int, routing: bool) -> dict:
        return dict(
            x=_ptrs(xs), send_pos=_ptrs(handle.send_pos), send_offset=_ptrs(handle.send_offset),
            recv_counts=_ptrs(handle.recv_counts), topk_idx32=_ptrs(handle.topk_idx), recv_x=_ptrs(recv),
            num_tokens=handle.num_tokens, row_bytes=row_bytes, num_topk=handle.topk_idx[0].shape[1],
            num_experts=handle.config.num_experts, capacity=handle.capacity,
            expert_alignment=handle.config.expert_alignment, with_routing=int(routing),
        )

    def _rows(self, handle: VirtualHandle, r: int, t):
        return t[: handle.num_recv_host[r]] if handle.exact else t

    def dispatch(self, x: Sequence, topk_weights: Sequence, handle: VirtualHandle, *,
                 x_scales: Optional[Sequence] = None, check: bool = True, raise_on_overflow: bool = False):
        """Dispatch of ``x[r][T_r, H]`` (bf16/fp16/fp32, or fp8-e4m3 with ``x_scales``) in the handle's layout."""
        if handle.expert_major:
            return em.dispatch(self, x, topk_weights, handle, x_scales=x_scales, check=check,
                               raise_on_overflow=raise_on_overflow)
        torch = self._torch
        xs = self._per_rank("x", x)
        ws = self._per_rank("topk_weights", topk_weights)
        scales = self._per_rank("x_scales", x_scales) if x_scales is not None else [None] * self.num_ranks
        K = handle.topk_idx[0].shape[1]
        for r in range(self.num_ranks):
            check_routing(handle.topk_idx[r], ws[r])
            check_tokens(xs[r], handle.num_tokens[r], x_scales=scales[r])
        H = xs[0].shape[1]
        if any(t.shape[1] != H or t.dtype != xs[0].dtype for t in xs):
            raise InputError("every rank's x must have the same hidden size and dtype")
        C, L, R = handle.capacity, handle.config.num_local_experts, self.num_ranks
        recv_x = [self._empty((C, H), xs[0].dtype) for _ in range(R)]
        recv_idx = [self._empty((C, K), torch.int32) for _ in range(R)]
        recv_w = [self._empty((C, K), torch.float32) for _ in range(R)]
        per_expert = [self._empty((L,), torch.int32) for _ in range(R)]
        args = self._dispatch_args(xs, handle, recv_x, H * xs[0].element_size(), routing=True)
        args.update(topk_weights=_ptrs(ws), recv_topk_idx=_ptrs(recv_idx), recv_topk_weights=_ptrs(recv_w),
                    num_recv_tokens_per_expert=_ptrs(per_expert))
        recv_scales = [None] * R
        if x_scales is not None:
            S = scales[0].shape[1]
            recv_scales = [self._empty((C, S), torch.float32) for _ in range(R)]
            args.update(x2=_ptrs(scales), recv_x2=_ptrs(recv_scales), row2_bytes=S * 4)
        self._run("dispatch", args, check)
        if raise_on_overflow:
            for r in range(R):
                if int(handle.dropped[r]):
                    raise CapacityError(int(handle.num_recv[r]) + int(handle.dropped[r]), C, rank=r)
        return [VirtualDispatched(
            self._rows(handle, r, recv_x[r]), self._rows(handle, r, recv_idx[r]), self._rows(handle, r, recv_w[r]),
            handle.num_recv[r], per_expert[r], handle.dropped[r],
            None if recv_scales[r] is None else self._rows(handle, r, recv_scales[r]),
        ) for r in range(R)]

    def _combine_args(self, ys, handle: VirtualHandle, outs) -> dict:
        return dict(
            y=_ptrs(ys), out=_ptrs(outs), topk_idx32=_ptrs(handle.topk_idx), send_pos=_ptrs(handle.send_pos),
            send_offset=_ptrs(handle.send_offset), num_tokens=handle.num_tokens, hidden=ys[0].shape[1],
            num_topk=handle.topk_idx[0].shape[1], num_experts=handle.config.num_experts,
            capacity=handle.capacity, dtype=_dtype_code(ys[0].dtype),
        )

    def _check_recv_rows(self, name: str, ts, handle: VirtualHandle) -> None:
        for r, t in enumerate(ts):
            rows = handle.num_recv_host[r] if handle.exact else handle.capacity
            if t.dim() != 2 or t.shape[0] != rows:
                raise InputError(f"{name}[{r}] has shape {tuple(t.shape)}; expected [{rows}, H] as produced by "
                                 f"dispatch with this handle")

    def _bias_args(self, bias, handle: VirtualHandle, H: int) -> dict:
        """Kernel arguments of up to two ``[T, H]`` bias terms per rank (None: no bias)."""
        if bias is None:
            return {}
        biases = [check_bias(bias[r], handle.num_tokens[r], H) for r in range(self.num_ranks)]
        n = len(biases[0])
        if any(len(b) != n for b in biases):
            raise InputError("every rank must pass the same number of bias terms")
        biases = [tuple(b.to(self.device).contiguous() for b in bs) for bs in biases]
        args = {"num_bias": n}
        for i in range(n):
            args[f"bias{i}"] = _ptrs([bs[i] for bs in biases])
            args[f"bias_dtype{i}"] = _dtype_code(biases[0][i].dtype)
            if any(bs[i].dtype != biases[0][i].dtype for bs in biases):
                raise InputError("bias dtypes must agree across ranks")
        return args

    def combine(self, y: Sequence, handle: VirtualHandle, *, bias=None, topk_weights=None,
                check: bool = True) -> list:
        """``out[r][T_r, H]``, fp32 (+ up to two bias terms), rounded once. Rank-major: sum over ranks in
        ascending order. Expert-major: sum over k of ``topk_weights`` (default: those dispatch saw) times
        the copies, in k order."""
        if handle.expert_major:
            return em.combine(self, y, handle, topk_weights=topk_weights, bias=bias, check=check)
        ys = self._per_rank("y", y)
        self._check_recv_rows("y", ys, handle)
        _dtype_code(ys[0].dtype)
        H = ys[0].shape[1]
        outs = [self._empty((t, H), ys[0].dtype) for t in handle.num_tokens]
        args = self._combine_args(ys, handle, outs)
        args.update(self._bias_args(bias, handle, H))
        self._run("combine", args, check)
        return outs

    def dispatch_bwd(self, g_recv_x: Sequence, g_recv_topk_weights: Sequence, handle: VirtualHandle, *,
                     check: bool = True):
        """``(g_x, g_topk_weights)``: g_x is the (unweighted) combine of g_recv_x; g_topk_weights read back
        from the slot that carried each (t, k)."""
        if handle.expert_major:
            return em.dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle, check=check)
        torch = self._torch
        gs = self._per_rank("g_recv_x", g_recv_x)
        gws = self._per_rank("g_recv_topk_weights", g_recv_topk_weights)
        self._check_recv_rows("g_recv_x", gs, handle)
        K = handle.topk_idx[0].shape[1]
        g_x = [self._empty((t, gs[0].shape[1]), gs[0].dtype) for t in handle.num_tokens]
        g_w = [self._empty((t, K), torch.float32) for t in handle.num_tokens]
        gws = [w.float().contiguous() for w in gws]  # kept alive until the launch is queued
        args = self._combine_args(gs, handle, g_x)
        args.update(g_recv_topk_weights=_ptrs(gws), g_topk_weights=_ptrs(g_w))
        self._run("dispatch_bwd", args, check)
        return g_x, g_w

    def combine_bwd(self, g_out: Sequence, handle: VirtualHandle, *, y: Optional[Sequence] = None,
                    topk_weights=None, check: bool = True, zero_padding: bool = True):
        """Rank-major: ``g_y``, a cached dispatch of g_out (padding rows 0).

        Expert-major: ``(g_y, g_topk_weights)`` with ``g_y[l, c] = round(w[t, k] * g_out[t])`` and
        ``g_topk_weights[t, k] = <g_out[t], y[l, c]>`` in fp32 (None unless ``y``, the combine input, is
        given); ``topk_weights`` default to those dispatch saw. ``zero_padding`` (expert-major): g_y's
        slots past the counts come back zero (the default: this class's dispatch zeroes them in recv_x
        too) or, with False, unwritten — unspecified, as the frontends leave them unless their dispatch was
        called with ``zero_padding=True`` (DESIGN §2: combine_bwd is a cached dispatch of g_out)."""
        if handle.expert_major:
            return em.combine_bwd(self, g_out, handle, y=y, topk_weights=topk_weights, check=check,
                                  zero_padding=zero_padding)
        gs = self._per_rank("g_out", g_out)
        for r in range(self.num_ranks):
            check_tokens(gs[r], handle.num_tokens[r])
        H = gs[0].shape[1]
        g_y = [self._empty((handle.capacity, H), gs[0].dtype) for _ in range(self.num_ranks)]
        args = self._dispatch_args(gs, handle, g_y, H * gs[0].element_size(), routing=False)
        self._run("combine_bwd", args, check)
        return [self._rows(handle, r, g_y[r]) for r in range(self.num_ranks)]
