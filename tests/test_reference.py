"""The NumPy reference against first principles: order, conservation, adjointness, golden files."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from omniep.ep_core import DispatchConfig, Layout
from omniep.ep_core import reference as ref
from omniep.ep_core.errors import InputError
from omniep.testing.cases import make_case
from harness.strategies import case_strategy
from harness.golden import (GOLDEN_CASES, assert_bitwise_equal, golden_files, load,
                                   reference_results, static_capacity)


def _tagged(case):
    """x[r][t] = (r, t, 0...) in float64 so that each received row names where it came from."""
    return [np.stack([np.full(len(i), r, np.float64), np.arange(len(i), dtype=np.float64)], 1)
            for r, i in enumerate(case.topk_idx)]


@given(case_strategy(layouts=(Layout.RANK_MAJOR,)))
def test_rank_major_order_and_routing(case):
    plan = ref.make_plan(case.topk_idx, case.config())
    out = ref.dispatch(_tagged(case), case.topk_weights, plan)
    L = case.num_experts // case.num_ranks
    for r, d in enumerate(out):
        expected_rows = [(s, t) for s in range(case.num_ranks) for t in range(len(case.topk_idx[s]))
                         if np.any((case.topk_idx[s][t] >= 0) & (case.topk_idx[s][t] // L == r))]
        cap = len(expected_rows) if case.capacity is None else case.capacity
        kept = expected_rows[:cap]
        assert d.num_recv == len(kept) and d.dropped == len(expected_rows) - len(kept)
        assert [tuple(map(int, row)) for row in d.recv_x[: d.num_recv]] == kept
        assert not d.recv_x[d.num_recv:].any() and (d.recv_topk_idx[d.num_recv:] == -1).all()
        for i, (s, t) in enumerate(kept):
            idx = case.topk_idx[s][t]
            mine = (idx >= 0) & (idx // L == r)
            np.testing.assert_array_equal(d.recv_topk_idx[i], np.where(mine, idx - r * L, -1))
            np.testing.assert_array_equal(d.recv_topk_weights[i], np.where(mine, case.topk_weights[s][t], 0))
        pairs = np.bincount(d.recv_topk_idx[d.recv_topk_idx >= 0], minlength=L)
        a = case.expert_alignment
        np.testing.assert_array_equal(d.num_recv_tokens_per_expert, (pairs + a - 1) // a * a)


@given(case_strategy(layouts=(Layout.EXPERT_MAJOR,)))
def test_expert_major_order_and_counts(case):
    plan = ref.make_plan(case.topk_idx, case.config())
    out = ref.dispatch(_tagged(case), case.topk_weights, plan)
    L = case.num_experts // case.num_ranks
    for r, d in enumerate(out):
        total = dropped = 0
        for l in range(L):
            copies = [(s, t, k) for s in range(case.num_ranks) for t in range(len(case.topk_idx[s]))
                      for k in range(case.num_topk) if case.topk_idx[s][t, k] == r * L + l]
            n = (d.recv_topk_idx[l] >= 0).sum()
            assert [(int(a), int(b)) for a, b in d.recv_x[l, :n]] == [(s, t) for s, t, _ in copies[:n]]
            np.testing.assert_array_equal(d.recv_topk_weights[l, :n],
                                          [case.topk_weights[s][t, k] for s, t, k in copies[:n]])
            assert n == min(len(copies), d.recv_x.shape[1])
            total, dropped = total + n, dropped + len(copies) - n
        assert (d.num_recv, d.dropped) == (total, dropped)


@given(case_strategy(layouts=(Layout.EXPERT_MAJOR,)))
def test_expert_major_copies_of_one_source_take_consecutive_slots(case):
    """What the native expert-major kernels rely on to skip a rank's own copies (kernels/em_slots.cuh,
    em_find_own_slots: one slot range per local expert): the kept copies that source s sends to expert e
    fill [first, first + n) with first = the copies of e from the lower sources (duplicate ids in one
    token's row included), and copies past the capacity are dropped."""
    plan = ref.make_plan(case.topk_idx, case.config())
    R, E = case.num_ranks, case.num_experts
    L = E // R
    for e in range(E):
        C = plan.capacity[e // L]
        first = 0
        for s in range(R):
            chosen = case.topk_idx[s] == e
            slots = plan.copy_slot[s][chosen]  # (t, k) ascending
            expected = np.arange(first, first + chosen.sum())
            np.testing.assert_array_equal(slots, np.where(expected < C, expected, -1))
            first += int(chosen.sum())


@given(case_strategy(dtypes=("float32",)))
def test_combine_of_dispatch_counts_each_delivery(case):
    """With y = recv_x, rank-major combine gives x times the number of ranks that kept the token;
    expert-major gives sum_k w_k * x (small integers, so every fp32 operation is exact)."""
    xs = [np.round(x * 4).astype(np.float32) for x in case.x]
    ws = [np.round(w * 8).astype(np.float32) / 8 for w in case.topk_weights]
    plan = ref.make_plan(case.topk_idx, case.config())
    out = ref.combine([d.recv_x for d in ref.dispatch(xs, ws, plan)], plan, topk_weights=ws)
    for s, (x, o) in enumerate(zip(xs, out)):
        if case.layout == Layout.RANK_MAJOR:
            factor = (plan.row_slot[s] >= 0).sum(1)
        else:
            factor = np.where(plan.copy_slot[s] >= 0, ws[s], 0).sum(1)
        np.testing.assert_array_equal(o, x * factor[:, None].astype(np.float32))


def _dot(a, b):
    return sum(float(np.vdot(np.asarray(x, np.float64), np.asarray(y, np.float64))) for x, y in zip(a, b))


@given(case_strategy(dtypes=("float32",)), st.integers(0, 2**31 - 1))
def test_adjointness_float64(case, seed):
    rng = np.random.default_rng(seed)
    xs = [x.astype(np.float64) for x in case.x]
    plan = ref.make_plan(case.topk_idx, case.config())
    disp = ref.dispatch(xs, case.topk_weights, plan)
    g_rx = [rng.standard_normal(d.recv_x.shape) for d in disp]
    g_rw = [rng.standard_normal(d.recv_topk_weights.shape).astype(np.float32) for d in disp]
    g_x, g_w = ref.dispatch_bwd(g_rx, g_rw, plan)
    lhs = _dot([d.recv_x for d in disp], g_rx) + _dot([d.recv_topk_weights for d in disp], g_rw)
    rhs = _dot(xs, g_x) + _dot(case.topk_weights, g_w)
    assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-9)

    ys = [rng.standard_normal(d.recv_x.shape) for d in disp]
    g_out = [rng.standard_normal(x.shape) for x in xs]
    out = ref.combine(ys, plan, topk_weights=case.topk_weights)
    g_y, g_w2 = ref.combine_bwd(g_out, plan, ys=ys, topk_weights=case.topk_weights)
    assert _dot(out, g_out) == pytest.approx(_dot(ys, g_y), rel=1e-9, abs=1e-9)
    if case.layout == Layout.EXPERT_MAJOR:
        # combine is linear in the weights too: <combine(y; w), g> == <w, g_w>
        assert _dot(out, g_out) == pytest.approx(_dot(case.topk_weights, g_w2), rel=1e-5, abs=1e-5)


def test_bias_added_last_in_fp32_and_rounded_once():
    case = make_case(3, num_ranks=2, num_experts=2, num_topk=1, hidden=4, num_tokens=3, dtype="bfloat16",
                     p_none=0.0)
    plan = ref.make_plan(case.topk_idx, case.config())
    ys = [d.recv_x for d in ref.dispatch(case.x, case.topk_weights, plan)]
    b1 = [np.full(x.shape, 2.0**-9, x.dtype) for x in case.x]
    out = ref.combine(ys, plan, bias=[(b, b) for b in b1])
    for x, o in zip(case.x, out):
        expected = ((x.astype(np.float32) + np.float32(2.0**-9)) + np.float32(2.0**-9)).astype(x.dtype)
        assert_bitwise_equal(o, expected, "bias")


def test_expert_ids_out_of_range_are_rejected():
    idx = [np.array([[0, 4]]), np.array([[1, -1]])]
    with pytest.raises(InputError, match="expert id 4"):
        ref.make_plan(idx, DispatchConfig(4, 2))
    with pytest.raises(InputError, match="expert id -2"):
        ref.make_plan([np.array([[-2]]), np.array([[0]])], DispatchConfig(4, 2))
    with pytest.raises(InputError, match="not a multiple"):
        ref.make_plan(idx, DispatchConfig(3, 2))


def test_golden_files_cover_every_case_and_match_the_reference():
    names = {p.stem for p in golden_files()}
    assert names == {name for name, _ in GOLDEN_CASES}
    for path in golden_files():
        g = load(path)
        got = reference_results(g.case, g.inputs)
        for key, per_rank in g.expected.items():
            for r, (a, e) in enumerate(zip(got[key], per_rank)):
                assert_bitwise_equal(a, e, f"{g.name}:{key}[{r}]")
        assert static_capacity(g.case) > 0
