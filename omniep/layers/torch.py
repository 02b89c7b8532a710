"""``omniep.layers.torch.MoE``: the MoE layer as a torch ``nn.Module`` (semantics: :mod:`omniep.layers.config`).

One module per rank of an EP process group (``group``; the default group when None — it may be one EP
group of a larger world, EP × DP). The rank holds the router, the optional shared expert and its
``L = E / R`` routed experts; dispatch and combine go through :mod:`omniep.torch`, so the backend is
whatever ``OMNIEP_BACKEND`` (or ``backend=``) picks and nothing here depends on it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import torch as ep
from ..ep_core import env
from ..ep_core.errors import InputError
from .config import MoEConfig, capacities

__all__ = ["MoE", "route", "drop_over_capacity", "swiglu_experts", "grouped_swiglu_rows"]

# Seed streams (see _normal): expert e uses _EXPERT_STREAM + e, so an expert's initial weights do not
# depend on how many ranks share the experts.
_ROUTER_STREAM, _SHARED_STREAM, _EXPERT_STREAM = 0, 1, 2


def _normals(seed: int, stream: int, shapes: tuple, dtype, device) -> list:
    """One N(0, 1/fan_in) tensor per shape (fan_in = shape[0]), drawn in order from one CPU generator
    seeded by (seed, stream)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + stream)
    return [(torch.randn(s, generator=gen) * s[0] ** -0.5).to(device=device, dtype=dtype) for s in shapes]


class MoE(nn.Module):
    """Router → expert-major dispatch → SwiGLU experts (batched GEMMs) → weighted combine (+ shared expert).

    ``forward(x[..., H]) -> (out[..., H] in x's dtype, aux_loss fp32 scalar)``. Parameters:
    ``router[H, E]``, ``w_gate_up[L, H, 2F]`` and ``w_down[L, F, H]`` (this rank's experts ``rank·L ..
    rank·L + L - 1``), ``shared_gate_up[H, 2S]`` / ``shared_down[S, H]`` when ``config.shared_ffn``, and
    the buffer ``expert_bias[E]`` when ``config.expert_bias``. Router and shared weights are replicated
    over the EP group (average their gradients over it, as for any data-parallel weight); expert weights
    are this rank's alone. Every rank of the group must call forward with the same number of tokens.
    ``dtype``: the parameters' dtype (experts compute in ``x``'s dtype, the router in fp32).
    """

    def __init__(self, config: MoEConfig, *, group=None, dtype: torch.dtype = torch.float32, device=None,
                 seed: int = 0, backend: Optional[str] = None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise InputError(f"config must be an omniep.layers.MoEConfig, got {type(config).__name__}")
        self.config, self.group, self.backend = config, group, backend
        self.num_ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if config.num_experts % self.num_ranks:
            raise InputError(f"config.num_experts={config.num_experts} must be a multiple of the EP group size "
                             f"{self.num_ranks}")
        E, H, Fw, S = config.num_experts, config.hidden, config.ffn, config.shared_ffn
        L = E // self.num_ranks
        self.num_local_experts = L
        kw = dict(dtype=dtype, device=device)
        (router,) = _normals(seed, _ROUTER_STREAM, ((H, E),), **kw)
        self.router = nn.Parameter(router)
        experts = [_normals(seed, _EXPERT_STREAM + self.rank * L + l, ((H, 2 * Fw), (Fw, H)), **kw) for l in range(L)]
        self.w_gate_up = nn.Parameter(torch.stack([w[0] for w in experts]))
        self.w_down = nn.Parameter(torch.stack([w[1] for w in experts]))
        if S:
            gate_up, down = _normals(seed, _SHARED_STREAM, ((H, 2 * S), (S, H)), **kw)
            self.shared_gate_up, self.shared_down = nn.Parameter(gate_up), nn.Parameter(down)
        else:
            self.shared_gate_up = self.shared_down = None
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device)
                             if config.expert_bias else None)

    def forward(self, x: torch.Tensor):
        cfg = self.config
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != cfg.hidden:
            raise InputError(f"x must be a tensor [..., hidden={cfg.hidden}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        tokens = x.reshape(-1, cfg.hidden)
        topk_idx, topk_weights, aux_loss = route(tokens, self.router, cfg, self.expert_bias)
        c_send, slots = capacities(cfg, self.num_ranks, tokens.shape[0])
        if c_send is not None and c_send < tokens.shape[0]:
            topk_idx, topk_weights = drop_over_capacity(topk_idx, topk_weights, c_send, cfg.num_experts)
        if cfg.grouped_gemm:  # steps 6'-8': exactly the rows that arrive, the routed copies' grouped GEMMs
            d = ep.dispatch(tokens, topk_idx, topk_weights, num_experts=cfg.num_experts, group=self.group,
                            backend=self.backend)
            rows = grouped_swiglu_rows(d.recv_x, d.recv_topk_idx, d.recv_topk_weights, self.w_gate_up, self.w_down)
            out = ep.combine(rows, d.handle)
        else:
            d = ep.dispatch(tokens, topk_idx, topk_weights, num_experts=cfg.num_experts, group=self.group,
                            capacity=slots, expert_alignment=cfg.expert_alignment, layout="expert_major",
                            backend=self.backend, zero_padding=True)
            y = swiglu_experts(d.recv_x, self.w_gate_up, self.w_down)
            # Weighted here, by the weight that travelled with each copy (its gradient returns through
            # dispatch exactly: bitwise the same on every backend); padding slots zero, so that no gradient
            # reaches the expert weights through them.
            y = _elementwise(_weigh_held, y)(y, d.recv_topk_weights, d.recv_topk_idx)
            out = ep.combine(y, d.handle, weighted=False)
        if self.shared_gate_up is not None:
            out = out + _swiglu(tokens, self.shared_gate_up.to(tokens.dtype), self.shared_down.to(tokens.dtype))
        return out.view(x.shape), aux_loss

    def extra_repr(self) -> str:
        return f"{self.config}, ranks={self.num_ranks}, rank={self.rank}, local_experts={self.num_local_experts}"


def route(x: torch.Tensor, router: torch.Tensor, config: MoEConfig, expert_bias: Optional[torch.Tensor] = None):
    """Steps 1–4 of :mod:`omniep.layers.config`: ``(topk_idx[T, K] int64, topk_weights[T, K] fp32,
    aux_loss fp32 scalar)`` for ``x[T, H]``."""
    cfg = config
    logits = x.float() @ router.float()
    scores = torch.softmax(logits, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
    sel = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    if cfg.num_groups > 1:
        T = sel.shape[0]
        grouped = sel.view(T, cfg.num_groups, cfg.num_experts // cfg.num_groups)
        group_score = grouped.topk(cfg.group_top, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_groups, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1), float("-inf"))
    topk_idx = sel.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    aux = logits.new_zeros(())
    T = x.shape[0]
    if T and cfg.aux_loss_coef:
        f = torch.bincount(topk_idx.flatten(), minlength=cfg.num_experts).float() / (T * cfg.top_k)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        aux = aux + cfg.aux_loss_coef * cfg.num_experts * (f * p).sum()
    if T and cfg.z_loss_coef:
        aux = aux + cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
    return topk_idx, weights, aux


def drop_over_capacity(topk_idx: torch.Tensor, topk_weights: torch.Tensor, c_send: int, num_experts: int):
    """Step 5: keep the first ``c_send`` copies per expert in ``(t, k)`` row-major order; the others get
    id ``-1`` and weight ``0``. Ids must be in ``[0, E)``."""
    flat = topk_idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    position = torch.empty_like(flat)
    position[order] = rank_sorted
    kept = (position < c_send).view_as(topk_idx)
    return (torch.where(kept, topk_idx, torch.full((), -1, dtype=topk_idx.dtype, device=topk_idx.device)),
            torch.where(kept, topk_weights, torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device)))


def swiglu_experts(recv_x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Step 7 over the expert-major buffer ``recv_x[L, C, H]``: ``[L, C, H]`` in ``recv_x``'s dtype.

    Every expert has the same C slots, so the grouped GEMM is a batched one (``torch.bmm``): one for
    gate and up together, one for down."""
    dt = recv_x.dtype
    return _swiglu(recv_x, w_gate_up.to(dt), w_down.to(dt))


def grouped_swiglu_rows(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                        w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Steps 7'-8' over rank-major rows: ``recv_x[N, H]``, ``recv_topk_idx[N, K]`` local ids (-1: none),
    ``recv_topk_weights[N, K]`` fp32, ``w_gate_up[L, H, 2F]``, ``w_down[L, F, H]`` → ``[N, H]`` in
    ``recv_x``'s dtype: each row's copies through their experts by grouped GEMMs, weighted, summed in k
    order. Waits on the host once (the number of copies)."""
    N, K = recv_topk_idx.shape
    L, dt, dev = w_gate_up.shape[0], recv_x.dtype, recv_x.device
    key = torch.where(recv_topk_idx >= 0, recv_topk_idx.long(), L).reshape(-1)  # L: no copy, sorted last
    order = torch.argsort(key, stable=True)  # copies by (expert, row, k)
    counts = torch.bincount(key, minlength=L + 1)[:L]
    M = int(counts.sum())
    order = order[:M]
    slot = torch.full((N * K,), -1, dtype=torch.long, device=dev)  # (row, k) -> its copy's position, or -1
    slot[order] = torch.arange(M, device=dev)
    slot, rows = slot.view(N, K), order // K
    xs = _ToCopies.apply(recv_x, rows, slot)
    h = _grouped_mm(xs, w_gate_up.to(dt), counts)
    ys = _grouped_mm(_elementwise(_silu_mul, h)(h), w_down.to(dt), counts)
    # fp32 product rounded once (type promotion), as step 7
    scaled = (ys * recv_topk_weights.reshape(-1)[order].unsqueeze(-1)).to(dt)
    return _ToRows.apply(scaled, rows, slot).to(dt)


def _gather_sum(src: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``out[n] = Σ_k src[slot[n, k]]`` over ``slot[n, k] >= 0``, k ascending, fp32 from +0.0 (the sum
    of a row's copies, and the gradient of gathering rows into copies: no scatter, so deterministic)."""
    acc = src.new_zeros((slot.shape[0], src.shape[1]), dtype=torch.float32)
    for k in range(slot.shape[1]):
        at = slot[:, k]
        acc = acc + torch.where((at >= 0).unsqueeze(-1), src[at.clamp(min=0)].float(),
                                torch.zeros((), dtype=torch.float32, device=src.device))
    return acc


class _ToCopies(torch.autograd.Function):
    """``x[N, H]`` → its copies ``x[rows]`` (``[M, H]``); the backward sums each row's copies' gradients
    in k order (``slot``), rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x, rows, slot):
        ctx.save_for_backward(slot)
        ctx.dtype = x.dtype
        return x[rows]

    @staticmethod
    def backward(ctx, g):
        (slot,) = ctx.saved_tensors
        return _gather_sum(g, slot).to(ctx.dtype), None, None


class _ToRows(torch.autograd.Function):
    """Copies ``y[M, H]`` → per row the fp32 sum of its copies in k order (``[N, H]``); the backward
    gathers each copy's row gradient, in y's dtype."""

    @staticmethod
    def forward(ctx, y, rows, slot):
        ctx.save_for_backward(rows)
        ctx.dtype = y.dtype
        return _gather_sum(y, slot)

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        return g[rows].to(ctx.dtype), None, None


_GROUPED_MM: dict = {}  # (device type, dtype, inner, outer) -> whether torch._grouped_mm serves it


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``a[M, I]`` in consecutive groups of ``counts[g]`` rows times ``b[G, I, O]`` → ``[M, O]``:
    ``torch._grouped_mm`` where it serves the device, dtype and shape (found out once per kind), else one
    GEMM per group."""
    kind = (a.device.type, a.dtype, a.shape[1], b.shape[2])
    if a.shape[0] and _GROUPED_MM.get(kind, True) and hasattr(torch, "_grouped_mm"):
        try:
            out = torch._grouped_mm(a, b, offs=torch.cumsum(counts, 0, dtype=torch.int32))
            _GROUPED_MM[kind] = True
            return out
        except (RuntimeError, NotImplementedError):
            if kind in _GROUPED_MM:
                raise
            _GROUPED_MM[kind] = False
    parts, at = [], 0
    for g, n in enumerate(counts.tolist()):  # every group, empty ones too: each b[g] gets a gradient
        parts.append(a[at:at + n] @ b[g])
        at += n
    return torch.cat(parts)


def _swiglu(x, w_gate_up, w_down):
    """``x[..., H] @ w_gate_up[(L,) H, 2F]`` → SwiGLU → ``@ w_down[(L,) F, H]``: a batched GEMM over the
    experts' ``[L, C, H]`` buffer, a plain one for the shared expert's ``[T, H]``."""
    h = x @ w_gate_up
    return _elementwise(_silu_mul, h)(h) @ w_down


def _silu_mul(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _weigh_held(y, recv_topk_weights, recv_topk_idx):
    """``y[L, C, H]`` times its copy's fp32 weight, rounded to y's dtype; slots that hold no copy 0."""
    weighted = (y * recv_topk_weights.unsqueeze(-1)).to(y.dtype)  # fp32 product (type promotion)
    return torch.where((recv_topk_idx >= 0).unsqueeze(-1), weighted, torch.zeros((), dtype=y.dtype, device=y.device))


_COMPILED: dict = {}


def _elementwise(fn, like: torch.Tensor):
    """``fn`` itself on CPU; on a GPU, ``fn`` compiled by ``torch.compile`` (TorchInductor fuses its
    elementwise passes over the ``[L, C, H]`` buffers, forward and backward, into one kernel each; the
    same formula, so every backend of a device type runs the same kernels and stays bitwise equal).
    ``OMNIEP_LAYER_COMPILE=0`` keeps the eager kernels everywhere."""
    if like.device.type == "cpu" or not env.get("OMNIEP_LAYER_COMPILE"):
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fn]

