"""Checks of :class:`omniep.native.virtual_ranks.VirtualRanks` (R ranks on one GPU) against the reference.

One round of every op and the golden vectors, for either layout (the case's): rank-major in
tests/gpu/test_native_virtual_ranks.py, expert-major in tests/gpu/test_native_expert_major.py. Bit for
bit against :mod:`omniep.ep_core.reference`, except expert-major combine_bwd's g_topk_weights (a dot
product over H), which is held to a rounding bound (:mod:`harness.bounds`).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from omniep.ep_core import reference as ref
from omniep.ep_core.types import DispatchConfig, Layout
from harness import golden
from harness.bounds import assert_dots_close
from omniep.testing.torch_bits import assert_bits_equal, randn
from omniep.testing.torch_bits import to_torch as _to_torch

to_torch = partial(_to_torch, device="cuda")


def run_and_compare(vr, case, capacity=None, *, seed=0, num_bias=1):
    """Run ``case`` once through ``vr`` (R = ``case.num_ranks``) in ``case.layout`` and compare everything.

    prepare's per-rank layout (send positions and per-expert counts; rank-major also per-rank and
    receive counts, expert-major every copy's slot), dispatch (all outputs), combine with ``num_bias``
    biases, dispatch_bwd and combine_bwd. Returns the handle.
    """
    R, E = case.num_ranks, case.num_experts
    em = case.layout == Layout.EXPERT_MAJOR
    # None stays None in both layouts: VirtualRanks' exact mode (each rank's largest receive, as the
    # reference sizes it), not the frontends' expert-major default R * T that case.config() resolves.
    capacity = case.capacity if capacity is None else capacity
    plan = ref.make_plan(case.topk_idx, DispatchConfig(E, R, case.layout, capacity, case.expert_alignment))
    want = ref.dispatch(case.x, case.topk_weights, plan)
    handle = vr.prepare([to_torch(i) for i in case.topk_idx], E, capacity=capacity,
                        expert_alignment=case.expert_alignment, layout=case.layout.value)
    for r in range(R):
        lay = plan.layouts[r]
        assert_bits_equal(handle.send_pos[r], lay.send_pos, f"rank {r} send_pos")
        assert_bits_equal(handle.num_tokens_per_expert[r], lay.num_tokens_per_expert, f"rank {r} per expert sent")
        if em:
            assert_bits_equal(handle.copy_slot[r], plan.copy_slot[r].astype(np.int32), f"rank {r} copy_slot")
        else:
            assert_bits_equal(handle.num_tokens_per_rank[r], lay.num_tokens_per_rank, f"rank {r} num_tokens_per_rank")
            assert_bits_equal(handle.recv_counts[r], lay.recv_counts, f"rank {r} recv_counts")
    got = vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle)
    for r in range(R):
        d, g = want[r], got[r]
        assert_bits_equal(g.recv_x, d.recv_x, f"rank {r} recv_x")
        assert_bits_equal(g.recv_topk_idx, d.recv_topk_idx, f"rank {r} recv_topk_idx")
        assert_bits_equal(g.recv_topk_weights, d.recv_topk_weights, f"rank {r} recv_topk_weights")
        assert int(g.num_recv) == d.num_recv, f"rank {r} num_recv"
        assert int(g.dropped) == d.dropped, f"rank {r} dropped"
        assert_bits_equal(g.num_recv_tokens_per_expert, d.num_recv_tokens_per_expert, f"rank {r} per expert")

    rng = np.random.default_rng(seed + 7)
    ys = [randn(rng, d.recv_x.shape, case.dtype) for d in want]
    biases = [tuple(randn(rng, x.shape, case.dtype) for _ in range(num_bias)) for x in case.x]
    # The reference ignores topk_weights for rank-major; expert-major's combine applies them.
    want_out = ref.combine(ys, plan, topk_weights=case.topk_weights, bias=biases if num_bias else None)
    got_out = vr.combine([to_torch(y) for y in ys], handle,
                         bias=[tuple(to_torch(b) for b in bs) for bs in biases] if num_bias else None)
    for r in range(R):
        assert_bits_equal(got_out[r], want_out[r], f"rank {r} combine out")

    g_recv_x = [randn(rng, d.recv_x.shape, case.dtype) for d in want]
    g_recv_w = [rng.standard_normal(d.recv_topk_weights.shape).astype(np.float32) for d in want]
    want_gx, want_gw = ref.dispatch_bwd(g_recv_x, g_recv_w, plan)
    got_gx, got_gw = vr.dispatch_bwd([to_torch(g) for g in g_recv_x], [to_torch(g) for g in g_recv_w], handle)
    g_out = [randn(rng, x.shape, case.dtype) for x in case.x]
    want_gy, want_gtw = ref.combine_bwd(g_out, plan, ys=ys, topk_weights=case.topk_weights)
    if em:
        got_gy, got_gtw = vr.combine_bwd([to_torch(g) for g in g_out], handle, y=[to_torch(y) for y in ys])
    else:
        got_gy = vr.combine_bwd([to_torch(g) for g in g_out], handle)
    for r in range(R):
        assert_bits_equal(got_gx[r], want_gx[r], f"rank {r} dispatch_bwd g_x")
        assert_bits_equal(got_gw[r], want_gw[r], f"rank {r} dispatch_bwd g_topk_weights")
        assert_bits_equal(got_gy[r], want_gy[r], f"rank {r} combine_bwd g_y")
        if em:
            assert_dots_close(got_gtw[r], want_gtw[r], g_out, ys, plan, r, f"rank {r} combine_bwd g_topk_weights")
    return handle


def check_golden_vector(vr, g: golden.Golden) -> None:
    """The loaded golden vector ``g`` through every op on ``vr`` (``g.case.num_ranks`` ranks) in its own
    layout, bit for bit against its expected outputs."""
    case, inp, exp = g.case, g.inputs, g.expected
    R = case.num_ranks
    handle = vr.prepare([to_torch(i) for i in case.topk_idx], case.num_experts, capacity=golden.static_capacity(case),
                        expert_alignment=case.expert_alignment, layout=case.layout.value)
    got = vr.dispatch([to_torch(x) for x in case.x], [to_torch(w) for w in case.topk_weights], handle)
    out = vr.combine([to_torch(y) for y in inp["y"]], handle, bias=[(to_torch(b),) for b in inp["bias"]])
    g_x, g_w = vr.dispatch_bwd([to_torch(a) for a in inp["g_recv_x"]], [to_torch(a) for a in inp["g_recv_w"]], handle)
    if case.layout == Layout.EXPERT_MAJOR:
        g_y, _ = vr.combine_bwd([to_torch(a) for a in inp["g_out"]], handle, y=[to_torch(y) for y in inp["y"]])
    else:
        g_y = vr.combine_bwd([to_torch(a) for a in inp["g_out"]], handle)
    for r in range(R):
        assert_bits_equal(got[r].recv_x, exp["recv_x"][r], f"{g.name} rank {r} recv_x")
        assert_bits_equal(got[r].recv_topk_idx, exp["recv_topk_idx"][r], f"{g.name} rank {r} recv_topk_idx")
        assert_bits_equal(got[r].recv_topk_weights, exp["recv_topk_weights"][r], f"{g.name} rank {r} weights")
        assert int(got[r].num_recv) == int(exp["num_recv"][r])
        assert int(got[r].dropped) == int(exp["dropped"][r])
        assert_bits_equal(got[r].num_recv_tokens_per_expert, exp["num_recv_tokens_per_expert"][r].astype(np.int32),
                          f"{g.name} rank {r} per expert")
        assert_bits_equal(out[r], exp["out"][r], f"{g.name} rank {r} combine out")
        assert_bits_equal(g_x[r], exp["g_x"][r], f"{g.name} rank {r} g_x")
        assert_bits_equal(g_w[r], exp["g_w"][r], f"{g.name} rank {r} g_w")
        assert_bits_equal(g_y[r], exp["g_y"][r], f"{g.name} rank {r} g_y")
