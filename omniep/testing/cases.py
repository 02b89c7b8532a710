"""Random routing cases for property tests, the demo and the golden vectors.

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


def case_strategy(*, max_ranks: int = 4, fixed_ranks: Optional[int] = None, equal_tokens: bool = False,
                  max_tokens: int = 12, max_hidden: int = 16, dtypes=("bfloat16", "float16", "float32"),
                  layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR), capacities: bool = True):
    """A hypothesis strategy of :class:`Case`. ``equal_tokens`` for JAX (static T on every rank)."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        R = fixed_ranks or draw(st.integers(1, max_ranks))
        L = draw(st.integers(1, 3))
        E = R * L
        K = draw(st.integers(1, min(4, E)))
        H = draw(st.integers(1, max_hidden))
        if equal_tokens:
            tokens = draw(st.integers(0, max_tokens))
        else:
            tokens = draw(st.lists(st.integers(0, max_tokens), min_size=R, max_size=R))
        skew = draw(st.sampled_from(SKEWS))
        layout = draw(st.sampled_from(layouts))
        capacity = None
        if capacities and draw(st.booleans()):
            capacity = draw(st.integers(0, R * max_tokens))
        return make_case(
            draw(st.integers(0, 2**31 - 1)), num_ranks=R, num_experts=E, num_topk=K, hidden=H,
            num_tokens=tokens, dtype=draw(st.sampled_from(dtypes)),
            index_dtype=draw(st.sampled_from(("int32", "int64"))), skew=skew,
            p_none=draw(st.sampled_from((0.0, 0.2, 0.6))), layout=layout, capacity=capacity,
            expert_alignment=draw(st.sampled_from((1, 1, 4))),
        )

    return strategy()


def draw(strategy, n: int) -> list:
    """``n`` examples of a hypothesis ``strategy`` as a plain list (for sessions that run many cases in
    one process group, where a ``@given`` test per case would restart the processes every time)."""
    from hypothesis import HealthCheck, Phase, given, settings

    drawn = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        drawn.append(case)

    collect()
    return drawn
