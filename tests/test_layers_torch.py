"""``omniep.layers.torch.MoE`` against a dense single-device oracle (tests/harness/moe_reference_torch):
forward, aux losses and every gradient, on gloo ranks (EP, and EP × DP inside a larger world), with
hypothesis-chosen shapes and routing (skew, drops at small capacity factors, grouped top-k, sigmoid)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from omniep.ep_core.errors import InputError  # noqa: E402
from omniep.layers import MoEConfig  # noqa: E402
from harness.strategies import draw  # noqa: E402
from harness.moe_reference_torch import check_results, edge_problems, layer_jobs  # noqa: E402
from harness.torch_layer_workers import run_layers  # noqa: E402


def problem_strategy():
    """A layer config plus tokens per rank, a seed and a skew, for an EP group of 2 (E = 2 or 4 per rank)."""
    @st.composite
    def problem(draw):
        experts = draw(st.sampled_from([4, 8]))
        groups = draw(st.sampled_from([1, 2, 4]))
        topk_groups = draw(st.integers(1, groups))
        top_k = draw(st.integers(1, min(3, topk_groups * experts // groups)))
        cf = draw(st.sampled_from([None, 0.5, 1.0, 1.5]))
        grouped = draw(st.booleans())
        cfg = MoEConfig(hidden=draw(st.sampled_from([4, 8])), ffn=draw(st.sampled_from([2, 6])), num_experts=experts,
                        top_k=top_k, score_func=draw(st.sampled_from(["softmax", "sigmoid"])), num_groups=groups,
                        topk_groups=topk_groups, norm_topk_prob=draw(st.booleans()),
                        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                        aux_loss_coef=draw(st.sampled_from([0.0, 0.01])), z_loss_coef=draw(st.sampled_from([0.0, 1e-3])),
                        capacity_factor=cf, expert_alignment=1 if grouped else draw(st.sampled_from([1, 4])),
                        shared_ffn=draw(st.sampled_from([0, 4])), grouped_gemm=grouped)
        return cfg, draw(st.integers(0, 9)), draw(st.integers(0, 2**16)), draw(st.sampled_from([0.0, 0.0, 3.0]))
    return problem()


def _session(problems: list, world: int, ep_size: int = 0):
    """Every problem as one job per rank, all in one gloo session: ``(jobs per problem, results)``."""
    jobs = [layer_jobs(cfg, tokens, world, seed, skew) for cfg, tokens, seed, skew in problems]
    return jobs, run_layers(jobs, world, ep_size)


@pytest.fixture(scope="module")
def ep2():
    problems = draw(problem_strategy(), settings.default.max_examples) + edge_problems()
    return problems, *_session(problems, 2)


def test_layer_matches_dense_oracle(ep2):
    """Outputs, aux losses and the gradients of x, router, experts and shared expert equal the dense
    oracle's on every drawn and hand-picked problem (2 gloo ranks)."""
    problems, jobs, results = ep2
    dropped = {}
    for i, (cfg, tokens, seed, skew) in enumerate(problems):
        try:
            dropped[i] = sum(check_results(cfg, jobs[i], results[i], 2))
        except AssertionError as exc:
            raise AssertionError(f"problem {i}: {cfg}, tokens={tokens}, seed={seed}, skew={skew}: {exc}") from None
    edges = range(len(problems) - len(edge_problems()), len(problems))
    assert dropped[edges[0]] > 0, "the skewed, small-capacity edge case must drop copies"
    assert any(dropped[i] > 0 for i in range(len(problems)) if problems[i][0].capacity_factor), "drawn drops"
    assert all(dropped[i] == 0 for i in range(len(problems)) if problems[i][0].capacity_factor is None)


@pytest.fixture(scope="module")
def ep_dp():
    """World 4 as 2 EP groups of 2 (EP × DP) and world 1: the first edge problems' configs."""
    problems = edge_problems()[:2]
    return problems, _session(problems, 4, ep_size=2), _session(problems, 1)


def test_ep_group_inside_a_larger_world(ep_dp):
    """Two EP groups of 2 in a world of 4: each group matches the oracle on its own tokens."""
    problems, (jobs, results), _ = ep_dp
    for i, (cfg, *_rest) in enumerate(problems):
        check_results(cfg, jobs[i], results[i], 2)


def test_initial_parameters_do_not_depend_on_the_group_size(ep_dp, ep2):
    """The same seed gives bitwise the same model on 1, 2 (and 2 of 4) ranks."""
    problems, (_, results4), (_, results1) = ep_dp
    edges = edge_problems()
    _, _, results2 = ep2
    n2 = len(results2)
    for i in range(len(problems)):
        one = results1[i][0]
        for res in (results2[n2 - len(edges) + i], results4[i][:2], results4[i][2:]):
            for name in ("w_gate_up", "w_down"):
                np.testing.assert_array_equal(np.concatenate([r[name] for r in res]), one[name], err_msg=name)
            np.testing.assert_array_equal(res[0]["router"], one["router"])


def test_config_errors_name_the_field():
    with pytest.raises(InputError, match="expert_alignment"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, expert_alignment=8, grouped_gemm=True)
    with pytest.raises(InputError, match="grouped_gemm"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, grouped_gemm=1)
    with pytest.raises(InputError, match="top_k"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=5)
    with pytest.raises(InputError, match="num_groups"):
        MoEConfig(hidden=4, ffn=4, num_experts=6, top_k=1, num_groups=4)
    with pytest.raises(InputError, match="score_func"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, score_func="relu")
    with pytest.raises(InputError, match="capacity_factor"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, capacity_factor=0)
    with pytest.raises(InputError, match="hidden"):
        MoEConfig(hidden=0, ffn=4, num_experts=4, top_k=1)
    with pytest.raises(InputError, match="capacity_factor"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, capacity_factor=float("inf"))
    for name in ("routed_scaling_factor", "aux_loss_coef", "z_loss_coef"):
        with pytest.raises(InputError, match=name):
            MoEConfig(hidden=4, ffn=4, num_experts=4, top_k=1, **{name: float("nan")})
