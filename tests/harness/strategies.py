"""Hypothesis strategies of routing cases (:mod:`omniep.testing.cases`), and ``draw`` for suites that need
their cases as a plain list."""

from __future__ import annotations

from typing import Optional

from omniep.ep_core.types import Layout
from omniep.testing.cases import SKEWS, make_case


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
