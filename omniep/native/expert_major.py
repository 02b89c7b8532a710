"""The expert-major ("low-latency") layout on virtual ranks: the half of :class:`VirtualRanks` that
serves ``layout="expert_major"`` (DESIGN §2). Called through VirtualRanks' own methods, never directly.

Receiver r gets ``recv_x[L, C, H]``: for each local expert, one copy per (source token, k) that chose
it, ordered by (source rank, source token, k); ``C`` = capacity, slots per local expert. Slots past
``C`` are dropped and counted; padding slots are zero (``recv_topk_idx`` -1, weights 0), and so are
``combine_bwd``'s ``g_y`` padding slots unless it is called with ``zero_padding=False`` (then unwritten).
``combine`` applies the routing weights: ``out[t] = sum_k w[t, k] * y[e_k][slot(t, k)]`` in fp32, in
k order, each product rounded to fp32 before the add, bias terms last, rounded once.
Everything equals :mod:`omniep.ep_core.reference` bit for bit, except ``g_topk_weights`` of
``combine_bwd`` (a dot product over H, matched to rounding: DESIGN fixes no order for that sum over H, see tests/harness/bounds.py).

With ``capacity=None`` ("exact") each rank's receive is sliced to its own largest expert count
``cap_r``, as the reference sizes it; buffers are allocated at the largest ``cap_r`` of all ranks (they
are symmetric), and ``[L, cap_r, ...]`` inputs to combine / dispatch_bwd are padded back to it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..ep_core.errors import CapacityError, InputError
from ..ep_core.validation import check_routing, check_tokens
from .virtual_results import VirtualDispatched, dtype_code as _dtype_code, ptrs as _ptrs


def prepare(vr, h, check: bool) -> None:
    """After the rank-major layout kernel of the same prepare: slots, per-expert counts, num_recv."""
    torch = vr._torch
    R, L, K = vr.num_ranks, h.config.num_local_experts, h.topk_idx[0].shape[1]
    i32 = torch.int32
    h.copy_slot = [vr._empty((t, K), i32) for t in h.num_tokens]
    h.recv_expert_count = [vr._empty((L,), i32) for _ in range(R)]
    h.num_recv_tokens_per_expert = [vr._empty((L,), i32) for _ in range(R)]
    h.max_expert_count = [vr._empty((), i32) for _ in range(R)]
    vr._run("em_layout", dict(
        topk_idx32=_ptrs(h.topk_idx), num_tokens_per_expert=_ptrs(h.num_tokens_per_expert),
        copy_slot=_ptrs(h.copy_slot), recv_expert_count=_ptrs(h.recv_expert_count),
        num_recv_tokens_per_expert=_ptrs(h.num_recv_tokens_per_expert), num_recv=_ptrs(h.num_recv),
        dropped=_ptrs(h.dropped), max_expert_count=_ptrs(h.max_expert_count), num_tokens=h.num_tokens,
        num_topk=K, num_experts=h.config.num_experts, capacity=h.capacity,
        expert_alignment=h.config.expert_alignment,
    ), check or h.exact)
    if h.exact:
        h.expert_capacity_host = [int(m) for m in h.max_expert_count]
        h.capacity = max(h.expert_capacity_host, default=0)


def _view(h, r: int, t):
    """Rank r's receive as the reference shapes it: ``[L, cap_r, ...]`` in exact mode."""
    return t[:, : h.expert_capacity_host[r]] if h.exact else t


def _full(vr, h, name: str, ts, trailing: tuple):
    """Per-rank ``[L, C_r, *trailing]`` inputs as ``[L, C, *trailing]`` contiguous buffers (padded with 0
    in exact mode, where C_r may be smaller than the common C)."""
    L, C = h.config.num_local_experts, h.capacity
    out = []
    for r, t in enumerate(ts):
        rows = h.expert_capacity_host[r] if h.exact else C
        want = (L, rows) + tuple(trailing)
        if tuple(t.shape) != want:
            raise InputError(f"{name}[{r}] has shape {tuple(t.shape)}; expected {list(want)} as produced by "
                             f"the expert-major dispatch with this handle")
        if rows != C:
            full = vr._torch.zeros((L, C) + tuple(trailing), dtype=t.dtype, device=vr.device)
            full[:, :rows] = t
            t = full
        out.append(t.contiguous())
    return out


def _weights(vr, h, topk_weights):
    ws = topk_weights if topk_weights is not None else h.topk_weights
    if ws is None:
        raise InputError("expert-major combine needs the routing weights: pass topk_weights= or dispatch "
                         "with this handle first")
    ws = vr._per_rank("topk_weights", ws)
    for r in range(vr.num_ranks):
        check_routing(h.topk_idx[r], ws[r])
    return ws


def dispatch(vr, x: Sequence, topk_weights: Sequence, h, *, x_scales: Optional[Sequence], check: bool,
             raise_on_overflow: bool):

    torch = vr._torch
    R, L, C = vr.num_ranks, h.config.num_local_experts, h.capacity
    xs = vr._per_rank("x", x)
    ws = vr._per_rank("topk_weights", topk_weights)
    scales = vr._per_rank("x_scales", x_scales) if x_scales is not None else [None] * R
    for r in range(R):
        check_routing(h.topk_idx[r], ws[r])
        check_tokens(xs[r], h.num_tokens[r], x_scales=scales[r])
    H = xs[0].shape[1]
    if any(t.shape[1] != H or t.dtype != xs[0].dtype for t in xs):
        raise InputError("every rank's x must have the same hidden size and dtype")
    recv_x = [vr._empty((L, C, H), xs[0].dtype) for _ in range(R)]
    recv_idx = [vr._empty((L, C), torch.int32) for _ in range(R)]
    recv_w = [vr._empty((L, C), torch.float32) for _ in range(R)]
    args = dict(
        x=_ptrs(xs), topk_idx32=_ptrs(h.topk_idx), topk_weights=_ptrs(ws), copy_slot=_ptrs(h.copy_slot),
        recv_expert_count=_ptrs(h.recv_expert_count), recv_x=_ptrs(recv_x), recv_topk_idx=_ptrs(recv_idx),
        recv_topk_weights=_ptrs(recv_w), num_tokens=h.num_tokens, row_bytes=H * xs[0].element_size(),
        num_topk=h.topk_idx[0].shape[1], num_experts=h.config.num_experts, capacity=C,
    )
    recv_scales = [None] * R
    if x_scales is not None:
        S = scales[0].shape[1]
        recv_scales = [vr._empty((L, C, S), torch.float32) for _ in range(R)]
        args.update(x2=_ptrs(scales), recv_x2=_ptrs(recv_scales), row2_bytes=S * 4)
    vr._run("em_dispatch", args, check)
    h.topk_weights = ws  # expert-major combine applies them
    if raise_on_overflow:
        for r in range(R):
            if int(h.dropped[r]):
                raise CapacityError(int(h.max_expert_count[r]), C, rank=r, what="copies for one local expert")
    return [VirtualDispatched(
        _view(h, r, recv_x[r]), _view(h, r, recv_idx[r]), _view(h, r, recv_w[r]), h.num_recv[r],
        h.num_recv_tokens_per_expert[r], h.dropped[r],
        None if recv_scales[r] is None else _view(h, r, recv_scales[r]),
    ) for r in range(R)]


def _combine_args(vr, h, ys, outs) -> dict:

    return dict(
        y=_ptrs(ys), out=_ptrs(outs), topk_idx32=_ptrs(h.topk_idx), copy_slot=_ptrs(h.copy_slot),
        num_tokens=h.num_tokens, hidden=ys[0].shape[-1], num_topk=h.topk_idx[0].shape[1],
        num_experts=h.config.num_experts, capacity=h.capacity, dtype=_dtype_code(ys[0].dtype),
    )


def _check_same(name: str, ts) -> None:
    if any(t.dtype != ts[0].dtype or t.shape[-1] != ts[0].shape[-1] for t in ts):
        raise InputError(f"every rank's {name} must have the same hidden size and dtype")


def combine(vr, y: Sequence, h, *, topk_weights, bias, check: bool) -> list:
    ys = vr._per_rank("y", y)
    _check_same("y", ys)
    H = ys[0].shape[-1]
    ys = _full(vr, h, "y", ys, (H,))
    ws = _weights(vr, h, topk_weights)
    outs = [vr._empty((t, H), ys[0].dtype) for t in h.num_tokens]
    args = _combine_args(vr, h, ys, outs)
    args.update(topk_weights=_ptrs(ws), **vr._bias_args(bias, h, H))
    vr._run("em_combine", args, check)
    return outs


def dispatch_bwd(vr, g_recv_x: Sequence, g_recv_topk_weights: Sequence, h, *, check: bool):
    torch = vr._torch
    gs = vr._per_rank("g_recv_x", g_recv_x)
    _check_same("g_recv_x", gs)
    H = gs[0].shape[-1]
    gs = _full(vr, h, "g_recv_x", gs, (H,))
    gws = _full(vr, h, "g_recv_topk_weights", [w.float() for w in vr._per_rank("g_recv_topk_weights",
                                                                                  g_recv_topk_weights)], ())
    K = h.topk_idx[0].shape[1]
    g_x = [vr._empty((t, H), gs[0].dtype) for t in h.num_tokens]
    g_w = [vr._empty((t, K), torch.float32) for t in h.num_tokens]
    args = _combine_args(vr, h, gs, g_x)
    args.update(g_recv_topk_weights=_ptrs(gws), g_topk_weights=_ptrs(g_w))
    vr._run("em_dispatch_bwd", args, check)
    return g_x, g_w


def combine_bwd(vr, g_out: Sequence, h, *, y: Optional[Sequence], topk_weights, check: bool,
                zero_padding: bool = True):

    torch = vr._torch
    R, L, C, K = vr.num_ranks, h.config.num_local_experts, h.capacity, h.topk_idx[0].shape[1]
    gs = vr._per_rank("g_out", g_out)
    for r in range(R):
        check_tokens(gs[r], h.num_tokens[r])
    _check_same("g_out", gs)
    H = gs[0].shape[1]
    ws = _weights(vr, h, topk_weights)
    ys = None
    if y is not None:
        ys = _full(vr, h, "y", vr._per_rank("y", y), (H,))
        if any(t.dtype != gs[0].dtype for t in ys):
            raise InputError("y and g_out must have the same dtype")
    g_y = [vr._empty((L, C, H), gs[0].dtype) for _ in range(R)]
    g_w = [vr._empty((t, K), torch.float32) for t in h.num_tokens] if ys is not None else None
    vr._run("em_combine_bwd", dict(
        g_out=_ptrs(gs), y=_ptrs(ys) if ys is not None else [0] * R, topk_idx32=_ptrs(h.topk_idx),
        topk_weights=_ptrs(ws), copy_slot=_ptrs(h.copy_slot), recv_expert_count=_ptrs(h.recv_expert_count),
        g_y=_ptrs(g_y), g_topk_weights=_ptrs(g_w) if g_w is not None else [0] * R, num_tokens=h.num_tokens,
        hidden=H, num_topk=K, num_experts=h.config.num_experts, capacity=C, dtype=_dtype_code(gs[0].dtype),
        with_topk_grad=int(ys is not None), zero_padding=int(bool(zero_padding)),
    ), check)
    return [_view(h, r, g_y[r]) for r in range(R)], g_w
