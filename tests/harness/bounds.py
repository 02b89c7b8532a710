"""The one tolerance of the tests: ``g_topk_weights`` of the expert-major combine backward.

That gradient is a dot product over H; the reference sums it in float64, a kernel in fp32, so the two
may differ by rounding. DESIGN §2 fixes the order of combine's sums (over ranks, over k), not of this
sum over H, which each backend reduces its own way: this repository's one exception to bitwise,
stated here (DESIGN does not grant it). Everything else is compared bit for bit.
"""

from __future__ import annotations

import numpy as np


def assert_dots_close(got, want, g_out, ys, plan, r_src: int, what: str) -> None:
    """``got``: rank ``r_src``'s ``g_topk_weights [T, K]`` (numpy or torch); ``want`` the reference's.
    The bound is that of recursive fp32 summation of rounded products, ``(H + 2) u sum|g y| + u |want|``
    (doubled), with ``g_out`` / ``ys`` every rank's combine_bwd inputs and ``plan`` the reference's.
    Unrouted and dropped copies must give exactly 0."""
    if not isinstance(got, np.ndarray):
        from omniep.testing.torch_bits import to_numpy

        got = to_numpy(got)
    L = plan.config.num_local_experts
    H = g_out[r_src].shape[1]
    bound = np.zeros_like(want, dtype=np.float64)
    for t, k in zip(*np.nonzero(plan.copy_slot[r_src] >= 0)):
        r = plan.owner[r_src][t, k]
        y = ys[r][plan.topk_idx[r_src][t, k] - r * L, plan.copy_slot[r_src][t, k]].astype(np.float64)
        bound[t, k] = np.abs(g_out[r_src][t].astype(np.float64) * y).sum()
    u = 2.0 ** -24
    tol = 2 * ((H + 2) * u * bound + u * np.abs(want)) + 1e-30
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.nonzero(np.abs(got.astype(np.float64) - want) > tol)
    assert bad[0].size == 0, f"{what}: {bad[0].size} dots off, first {got[bad][0]} vs {want[bad][0]}"
    assert np.all(got[plan.copy_slot[r_src] < 0] == 0), f"{what}: unrouted / dropped copies must give 0"
