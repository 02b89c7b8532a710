"""NumPy golden model of DESIGN §2, for all R ranks at once.

Every backend must reproduce these results bit for bit (dispatch, combine and both backward passes),
except ``g_topk_weights`` of the expert-major combine backward, which is a reduction over ``H`` and is
matched to rounding. Inputs are lists indexed by rank; ranks may hold different numbers of tokens.

Fixed arithmetic, so that results are reproducible on every vendor:
  * dispatch moves bytes unchanged;
  * every sum is accumulated in float32 (float64 for float64 input, used by adjointness checks) starting from +0.0, contributions added one at a time in the
    contract order (ascending rank for rank-major, ascending k for expert-major), each product
    ``w * y`` rounded to float32 before it is added (no fused multiply-add), bias terms added last in
    the order given, and the result rounded once to the output dtype (round to nearest even).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from .capacity import align_up
from .types import DispatchConfig, Layout
from .validation import check_config, check_expert_ids


@dataclasses.dataclass
class RankLayout:
    """prepare() for one rank: what it sends, and (after the count exchange) what it receives."""

    num_tokens_per_rank: np.ndarray    # [R] int32
    num_tokens_per_expert: np.ndarray  # [E] int32: (token, k) pairs per expert
    is_token_in_rank: np.ndarray       # [T, R] bool
    send_pos: np.ndarray               # [T, R] int32, -1 = not sent
    recv_counts: np.ndarray            # [R] int32, tokens from each source rank


@dataclasses.dataclass
class Plan:
    """Where every row goes, for all ranks. The reference's analogue of a Handle."""

    config: DispatchConfig
    topk_idx: list            # per rank [T, K] int64
    owner: list               # per rank [T, K] int64: rank that holds the chosen expert, -1 = none
    layouts: list             # per rank RankLayout
    capacity: list            # per receiving rank: resolved capacity (rows, or slots per expert)
    row_slot: list            # per source rank [T, R] int64: rank-major row at rank r, -1 = none/dropped
    total: list               # per receiving rank: rows (rank-major) or copies (expert-major) before capacity
    copy_slot: Optional[list] = None    # per source rank [T, K] int64: expert-major slot, -1 = none/dropped
    expert_counts: Optional[list] = None  # per receiving rank [L]: copies per local expert before capacity


def _local_layout(idx: np.ndarray, num_experts: int, num_ranks: int):
    L = num_experts // num_ranks
    owner = np.where(idx >= 0, idx // L, -1)
    in_rank = np.zeros((idx.shape[0], num_ranks), dtype=bool)
    for k in range(idx.shape[1]):
        sel = owner[:, k] >= 0
        in_rank[np.nonzero(sel)[0], owner[sel, k]] = True
    send_pos = np.where(in_rank, np.cumsum(in_rank, axis=0) - 1, -1).astype(np.int32)
    valid = idx[idx >= 0]
    per_expert = np.bincount(valid, minlength=num_experts).astype(np.int32)
    return owner, in_rank, send_pos, per_expert


def make_plan(topk_idx: Sequence[np.ndarray], config: DispatchConfig) -> Plan:
    """prepare() for every rank, then the receive plan of the chosen layout and capacity."""
    check_config(config)
    R, E, L = config.num_ranks, config.num_experts, config.num_local_experts
    if len(topk_idx) != R:
        raise ValueError(f"expected {R} ranks of topk_idx, got {len(topk_idx)}")
    idxs = [np.asarray(i).astype(np.int64) for i in topk_idx]
    for i in idxs:
        check_expert_ids(i, E)
    owners, layouts = [], []
    for idx in idxs:
        owner, in_rank, send_pos, per_expert = _local_layout(idx, E, R)
        owners.append(owner)
        layouts.append(RankLayout(in_rank.sum(0).astype(np.int32), per_expert, in_rank, send_pos, None))
    for r in range(R):
        layouts[r].recv_counts = np.array([layouts[s].num_tokens_per_rank[r] for s in range(R)], np.int32)

    plan = Plan(config, idxs, owners, layouts, [], [np.full((i.shape[0], R), -1, np.int64) for i in idxs], [])
    if config.layout == Layout.RANK_MAJOR:
        for r in range(R):
            rows = [(s, t) for s in range(R) for t in np.nonzero(layouts[s].is_token_in_rank[:, r])[0]]
            cap = len(rows) if config.capacity is None else config.capacity
            for slot, (s, t) in enumerate(rows[:cap]):
                plan.row_slot[s][t, r] = slot
            plan.capacity.append(cap)
            plan.total.append(len(rows))
        return plan

    # Expert-major: one copy per (token, k) choosing a local expert, ordered by (source, token, k).
    # The rank-major receive (uncapped) is kept too: backends may move rows rank-major first.
    for r in range(R):
        rows = [(s, t) for s in range(R) for t in np.nonzero(layouts[s].is_token_in_rank[:, r])[0]]
        for slot, (s, t) in enumerate(rows):
            plan.row_slot[s][t, r] = slot
    plan.copy_slot = [np.full(i.shape, -1, np.int64) for i in idxs]
    plan.expert_counts = []
    for r in range(R):
        copies = [[] for _ in range(L)]
        for s in range(R):
            ts, ks = np.nonzero(owners[s] == r)  # row-major order: (token, k) ascending
            for t, k in zip(ts, ks):
                copies[idxs[s][t, k] - r * L].append((s, t, k))
        counts = [len(c) for c in copies]
        cap = max(counts, default=0) if config.capacity is None else config.capacity
        for per_expert in copies:
            for slot, (s, t, k) in enumerate(per_expert[:cap]):
                plan.copy_slot[s][t, k] = slot
        plan.capacity.append(cap)
        plan.total.append(sum(counts))
        plan.expert_counts.append(np.array(counts, np.int64))
    return plan


@dataclasses.dataclass
class RefDispatched:
    recv_x: np.ndarray
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray
    num_recv: int
    num_recv_tokens_per_expert: np.ndarray
    dropped: int


def dispatch(xs, topk_weights, plan: Plan) -> list[RefDispatched]:
    """Dispatch rows ``xs[r][T_r, ...]`` (any dtype, moved unchanged) with ``topk_weights[r][T_r, K]``."""
    cfg = plan.config
    R, L = cfg.num_ranks, cfg.num_local_experts
    out = []
    for r in range(R):
        cap = plan.capacity[r]
        row_shape = xs[0].shape[1:]
        K = plan.topk_idx[0].shape[1]
        if cfg.layout == Layout.RANK_MAJOR:
            recv_x = np.zeros((cap,) + row_shape, xs[0].dtype)
            recv_idx = np.full((cap, K), -1, np.int32)
            recv_w = np.zeros((cap, K), np.float32)
            for s in range(R):
                ts = np.nonzero(plan.row_slot[s][:, r] >= 0)[0]
                slots = plan.row_slot[s][ts, r]
                recv_x[slots] = xs[s][ts]
                mine = plan.owner[s][ts] == r
                recv_idx[slots] = np.where(mine, plan.topk_idx[s][ts] - r * L, -1)
                recv_w[slots] = np.where(mine, topk_weights[s][ts], 0.0)
            num_recv = int(min(plan.total[r], cap))
            pairs = recv_idx[recv_idx >= 0]
            per_expert = np.bincount(pairs, minlength=L)
        else:
            recv_x = np.zeros((L, cap) + row_shape, xs[0].dtype)
            recv_idx = np.full((L, cap), -1, np.int32)
            recv_w = np.zeros((L, cap), np.float32)
            for s in range(R):
                ts, ks = np.nonzero((plan.copy_slot[s] >= 0) & (plan.owner[s] == r))
                ls = plan.topk_idx[s][ts, ks] - r * L
                cs = plan.copy_slot[s][ts, ks]
                recv_x[ls, cs] = xs[s][ts]
                recv_idx[ls, cs] = ls
                recv_w[ls, cs] = topk_weights[s][ts, ks]
            per_expert = np.minimum(plan.expert_counts[r], cap)
            num_recv = int(per_expert.sum())
        out.append(RefDispatched(
            recv_x, recv_idx, recv_w, num_recv,
            align_up(per_expert, cfg.expert_alignment).astype(np.int32), int(plan.total[r] - num_recv),
        ))
    return out


def _acc_dtype(dtype):
    """float32 for every supported dtype; float64 stays float64 (for exact adjointness checks)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def combine(ys, plan: Plan, *, topk_weights=None, bias=None) -> list[np.ndarray]:
    """Combine ``ys[r]`` (rank-major ``[C_r, H]`` or expert-major ``[L, C_r, H]``) back to every source.

    Expert-major uses ``topk_weights`` (per rank ``[T, K]`` float32); ``bias`` is None or, per rank, a
    tuple of up to two ``[T, H]`` arrays. Output dtype is the dtype of ``ys``.
    """
    cfg = plan.config
    R, L = cfg.num_ranks, cfg.num_local_experts
    dtype = ys[0].dtype
    H = ys[0].shape[-1]
    outs = []
    for s in range(R):
        T = plan.topk_idx[s].shape[0]
        acc_t = _acc_dtype(dtype)
        acc = np.zeros((T, H), acc_t)
        if cfg.layout == Layout.RANK_MAJOR:
            for r in range(R):
                ts = np.nonzero(plan.row_slot[s][:, r] >= 0)[0]
                acc[ts] = acc[ts] + ys[r][plan.row_slot[s][ts, r]].astype(acc_t)
        else:
            w = np.asarray(topk_weights[s], np.float32).astype(acc_t)
            for k in range(plan.topk_idx[s].shape[1]):
                contrib = np.zeros((T, H), acc_t)
                valid = plan.copy_slot[s][:, k] >= 0
                for r in range(R):
                    ts = np.nonzero(valid & (plan.owner[s][:, k] == r))[0]
                    ls = plan.topk_idx[s][ts, k] - r * L
                    y = ys[r][ls, plan.copy_slot[s][ts, k]].astype(acc_t)
                    contrib[ts] = w[ts, k][:, None] * y
                acc[valid] = acc[valid] + contrib[valid]
        for b in (bias[s] if bias is not None else ()):
            acc = acc + np.asarray(b).astype(acc_t)
        outs.append(acc.astype(dtype))
    return outs


def dispatch_bwd(g_recv_x, g_recv_topk_weights, plan: Plan):
    """Adjoint of dispatch: ``g_x`` is the (unweighted) combine of ``g_recv_x``; ``g_topk_weights[t, k]``
    is read back from the slot that carried it (0 when dropped or not routed)."""
    cfg = plan.config
    R, L = cfg.num_ranks, cfg.num_local_experts
    if cfg.layout == Layout.RANK_MAJOR:
        g_x = combine(g_recv_x, plan)
    else:
        ones = [np.ones(i.shape, np.float32) for i in plan.topk_idx]
        g_x = combine(g_recv_x, plan, topk_weights=ones)
    g_w = []
    for s in range(R):
        gw = np.zeros(plan.topk_idx[s].shape, np.float32)
        for t, k in zip(*np.nonzero(plan.owner[s] >= 0)):
            r = plan.owner[s][t, k]
            if cfg.layout == Layout.RANK_MAJOR:
                slot = plan.row_slot[s][t, r]
                if slot >= 0:
                    gw[t, k] = g_recv_topk_weights[r][slot, k]
            else:
                slot = plan.copy_slot[s][t, k]
                if slot >= 0:
                    gw[t, k] = g_recv_topk_weights[r][plan.topk_idx[s][t, k] - r * L, slot]
        g_w.append(gw)
    return g_x, g_w


def combine_bwd(g_out, plan: Plan, *, ys=None, topk_weights=None):
    """Adjoint of combine. Returns ``(g_y, g_topk_weights)``; ``g_topk_weights`` is None for rank-major.

    Rank-major: ``g_y`` is a cached dispatch of ``g_out`` (padding rows 0). Expert-major:
    ``g_y[l, c] = round(w[t, k] * g_out[t])`` and ``g_topk_weights[t, k] = <g_out[t], y[l, c]>``
    (computed in float64 here; backends match it to rounding). ``g_bias`` equals ``g_out``.
    """
    cfg = plan.config
    R, L = cfg.num_ranks, cfg.num_local_experts
    dtype = ys[0].dtype if ys is not None else g_out[0].dtype
    if cfg.layout == Layout.RANK_MAJOR:
        return [d.recv_x.astype(dtype) for d in dispatch(g_out, [np.zeros(i.shape, np.float32) for i in plan.topk_idx], plan)], None
    H = g_out[0].shape[-1]
    g_y = [np.zeros((L, plan.capacity[r], H), dtype) for r in range(R)]
    g_w = []
    for s in range(R):
        gw = np.zeros(plan.topk_idx[s].shape, np.float32)
        for t, k in zip(*np.nonzero(plan.copy_slot[s] >= 0)):
            r, l, c = plan.owner[s][t, k], plan.topk_idx[s][t, k] - plan.owner[s][t, k] * L, plan.copy_slot[s][t, k]
            acc_t = _acc_dtype(dtype)
            g32 = np.asarray(g_out[s][t]).astype(acc_t)
            g_y[r][l, c] = (acc_t(topk_weights[s][t, k]) * g32).astype(dtype)
            gw[t, k] = np.float32(np.dot(g32.astype(np.float64), ys[r][l, c].astype(np.float64)))
        g_w.append(gw)
    return g_y, g_w
