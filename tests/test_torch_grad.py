"""Gradients of the torch frontend: adjointness and autograd through a toy MoE layer (2 gloo ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from omniep.ep_core.types import Layout
from omniep.testing.cases import make_case
from omniep.testing.procs import run_ranks
from harness.torch_grad_workers import grad_session

pytest.importorskip("torch")

WORLD = 2
LAYOUTS = (Layout.RANK_MAJOR, Layout.EXPERT_MAJOR)


def adjoint_cases() -> list:
    common = dict(num_ranks=WORLD, num_experts=4, num_topk=2, hidden=8)
    return [
        make_case(1, num_tokens=[5, 3], layout=Layout.RANK_MAJOR, **common),
        make_case(2, num_tokens=[4, 6], layout=Layout.EXPERT_MAJOR, **common),
        make_case(3, num_tokens=[6, 6], layout=Layout.RANK_MAJOR, capacity=12, skew="one_rank", **common),
        make_case(4, num_tokens=[0, 5], layout=Layout.EXPERT_MAJOR, capacity=10, p_none=0.2, **common),
    ]


@pytest.fixture(scope="module")
def results():
    jobs = dict(adjoint=adjoint_cases(), moe=[(layout.value, 7) for layout in LAYOUTS])
    return jobs, run_ranks(grad_session, WORLD, args=(jobs,), timeout=180)


def _summed(results, i: int, dtype: str, key: str):
    parts = [r["adjoint"][i][dtype][key] for r in results]
    if parts[0] is None:
        return None
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-12), ("float32", 2e-6)])
def test_adjointness(results, dtype, rtol):
    """<A u, v> == <u, A^T v> over the whole group, inner products evaluated in float64: backend in
    float64 (tight), autograd frontend in float32 (to float32 rounding of the sums). ``g_topk_weights``
    is float32 by contract, so the weights' adjoint is matched to float32 rounding in both."""
    jobs, res = results
    for i, case in enumerate(jobs["adjoint"]):
        for key in ("dispatch", "combine", "combine_weights"):
            pair = _summed(res, i, dtype, key)
            if pair is None:
                assert key == "combine_weights" and case.layout == Layout.RANK_MAJOR
                continue
            lhs, rhs = pair
            tol = max(rtol, 2e-6) if key == "combine_weights" else rtol
            assert lhs != 0.0, f"case {i} {key}: degenerate (zero) inner product"
            assert abs(lhs - rhs) <= tol * max(abs(lhs), abs(rhs)), f"case {i} {dtype} {key}: {lhs!r} != {rhs!r}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_moe_layer_matches_dense(results, layout):
    """Outputs and gradients (tokens, router, experts) of the expert-parallel layer equal the dense
    layer's on the gathered arrays; router replicas' gradients sum to the dense router gradient."""
    jobs, res = results
    i = [job[0] for job in jobs["moe"]].index(layout.value)
    per_rank = [r["moe"][i] for r in res]
    for r, m in enumerate(per_rank):
        for key in ("out", "g_x", "g_experts"):
            np.testing.assert_allclose(m[key], m[f"dense_{key}"], rtol=1e-5, atol=1e-5, err_msg=f"rank {r} {key}")
        assert np.abs(m["g_experts"]).sum() > 0, "every rank's experts must receive gradient"
    np.testing.assert_allclose(sum(m["g_router"] for m in per_rank), per_rank[0]["dense_g_router"],
                               rtol=1e-5, atol=1e-5, err_msg="router gradient")
