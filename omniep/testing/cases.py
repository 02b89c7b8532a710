"""Random routing cases for the demo, the soak, the golden vectors and the property tests (whose hypothesis
strategies are tests/harness/strategies.py).

A case is everything every rank passes to dispatch: ``x``, ``topk_idx``, ``topk_weights`` per rank.
Rows choose distinct experts (as a router's top-k does); ``-1`` marks "no expert".
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..ep_core.types import DispatchConfig, Layout

SKEWS = ("uniform", "one_expert", "one_rank", "empty_rank")


def np_dtype(name: str):
    """numpy dtype for a dtype name, bfloat16/float8 through ml_dtypes."""
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return getattr(ml_dtypes, name)
    return np.dtype(name)


@dataclasses.dataclass
class Case:
    num_ranks: int
    num_experts: int
    hidden: int
    dtype: str
    index_dtype: str
    x: list            # per rank [T_r, H] numpy in `dtype`
    topk_idx: list     # per rank [T_r, K] numpy int32/int64
    topk_weights: list  # per rank [T_r, K] float32
    layout: Layout = Layout.RANK_MAJOR
    capacity: Optional[int] = None
    expert_alignment: int = 1

    @property
    def num_topk(self) -> int:
        return self.topk_idx[0].shape[1]

    def config(self, capacity: Optional[int] = None) -> DispatchConfig:
        """The dispatch config of the case (``capacity``: another capacity). An expert-major case without
        a capacity gets the frontends' default, ``R * T`` (:func:`make_case` gives every expert-major
        case with uneven T an explicit capacity: that default needs the same T on every rank)."""
        cap = self.capacity if capacity is None else capacity
        if cap is None and self.layout == Layout.EXPERT_MAJOR and len({x.shape[0] for x in self.x}) == 1:
            cap = self.num_ranks * self.x[0].shape[0]
        return DispatchConfig(self.num_experts, self.num_ranks, self.layout, cap, self.expert_alignment)


def make_routing(rng: np.random.Generator, num_tokens: int, num_topk: int, num_experts: int,
                 num_ranks: int, *, skew: str = "uniform", p_none: float = 0.1,
                 rank_of_skew: int = 0) -> np.ndarray:
    """``topk_idx[T, K]`` int64 with distinct experts per row and ``-1`` holes."""
    L = num_experts // num_ranks
    idx = np.full((num_tokens, num_topk), -1, np.int64)
    for t in range(num_tokens):
        if skew == "one_expert":
            idx[t, 0] = rank_of_skew * L
            continue
        pool = np.arange(rank_of_skew * L, (rank_of_skew + 1) * L) if skew == "one_rank" else np.arange(num_experts)
        chosen = rng.permutation(pool)[:num_topk]
        idx[t, : len(chosen)] = chosen
    if p_none > 0 and skew == "uniform":
        idx[rng.random(idx.shape) < p_none] = -1
    return idx


def make_case(seed: int, *, num_ranks: int, num_experts: int, num_topk: int, hidden: int,
              num_tokens, dtype: str = "float32", index_dtype: str = "int32",
              skew: str = "uniform", p_none: float = 0.1, layout=Layout.RANK_MAJOR,
              capacity: Optional[int] = None, expert_alignment: int = 1) -> Case:
    """``num_tokens`` is an int (same on every rank) or a per-rank list. ``skew='empty_rank'`` gives the
    last rank no routed tokens (all ``-1``). An expert-major case with uneven T and no capacity gets
    ``R * max(T)`` (the frontends' default ``R * T`` needs the same T on every rank)."""
    rng = np.random.default_rng(seed)
    tokens = list(num_tokens) if isinstance(num_tokens, (list, tuple)) else [num_tokens] * num_ranks
    xs, idxs, ws = [], [], []
    for r, T in enumerate(tokens):
        routing_skew = "uniform" if skew == "empty_rank" else skew
        idx = make_routing(rng, T, num_topk, num_experts, num_ranks, skew=routing_skew, p_none=p_none,
                           rank_of_skew=(seed % num_ranks))
        if skew == "empty_rank" and r == num_ranks - 1:
            idx[:] = -1
        xs.append(rng.standard_normal((T, hidden)).astype(np.float32).astype(np_dtype(dtype)))
        idxs.append(idx.astype(index_dtype))
        ws.append(rng.random((T, num_topk)).astype(np.float32))
    if capacity is None and Layout(layout) == Layout.EXPERT_MAJOR and len(set(tokens)) > 1:
        capacity = num_ranks * max(tokens)  # the default R * T needs the same T everywhere
    return Case(num_ranks, num_experts, hidden, dtype, index_dtype, xs, idxs, ws, Layout(layout), capacity,
                expert_alignment)
