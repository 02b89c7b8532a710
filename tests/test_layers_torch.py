"""``omniep.layers.torch.MoE`` against a dense single-device oracle (tests/harness/moe_reference_torch):
forward, aux losses and every gradient, on gloo ranks (EP, and EP × DP inside a larger world), with
hypothesis-chosen shapes and routing (skew, drops at small capacity factors, grouped top-k, sigmoid)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch  # noqa: E402

from omniep.ep_core.errors import InputError  # noqa: E402
from omniep.layers import MoEConfig  # noqa: E402
from omniep.testing.cases import draw  # noqa: E402
from omniep.testing.procs import run_ranks  # noqa: E402
from harness.moe_reference_torch import moe_reference  # noqa: E402
from harness.torch_layer_workers import layer_session  # noqa: E402


def _job(cfg: MoEConfig, tokens: int, world: int, seed: int, skew: float = 0.0) -> tuple:
    """Per-rank jobs for one problem: tokens drawn from ``seed``; ``skew`` > 0 shifts every token
    towards expert 0's router column (the router is the layer's own, so skew enters through x)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((world * tokens, cfg.hidden)).astype(np.float32)
    x += skew  # a shared offset pulls most tokens to the experts whose router column sums highest
    g = rng.standard_normal((world * tokens, cfg.hidden)).astype(np.float32)
    # A load-balancing bias large enough to change the selection (the oracle gets the same values).
    bias = (rng.standard_normal(cfg.num_experts) * 0.5).astype(np.float32) if cfg.expert_bias else None
    return [dict(config=dataclasses.asdict(cfg), x=x[r * tokens:(r + 1) * tokens], g=g[r * tokens:(r + 1) * tokens],
                 seed=seed % 7, expert_bias=bias) for r in range(world)]


def _check(cfg: MoEConfig, jobs_by_rank: list, res: list, ep_size: int) -> list:
    """Compare every EP group's results with the oracle; returns the oracle's dropped copies per rank."""
    dropped = []
    for first in range(0, len(res), ep_size):
        ranks = range(first, first + ep_size)
        params = {"router": torch.from_numpy(res[first]["router"]).requires_grad_(),
                  "w_gate_up": torch.from_numpy(np.concatenate([res[r]["w_gate_up"] for r in ranks])).requires_grad_(),
                  "w_down": torch.from_numpy(np.concatenate([res[r]["w_down"] for r in ranks])).requires_grad_()}
        if cfg.shared_ffn:
            params.update(shared_gate_up=torch.from_numpy(res[first]["shared_gate_up"]).requires_grad_(),
                          shared_down=torch.from_numpy(res[first]["shared_down"]).requires_grad_())
        if cfg.expert_bias:
            params["expert_bias"] = torch.from_numpy(jobs_by_rank[first]["expert_bias"])
        for r in ranks:  # replicated weights are replicas
            for name in ("router", "shared_gate_up", "shared_down"):
                if name in params:
                    np.testing.assert_array_equal(res[r][name], res[first][name], err_msg=f"rank {r} {name} replica")
        xs = [torch.from_numpy(jobs_by_rank[r]["x"]).requires_grad_() for r in ranks]
        outs, auxs, drops = moe_reference(xs, params, cfg)
        loss = sum((o * torch.from_numpy(jobs_by_rank[r]["g"]).double()).sum() + a.double()
                   for r, o, a in zip(ranks, outs, auxs))
        loss.backward()
        for i, r in enumerate(ranks):
            np.testing.assert_allclose(res[r]["out"], outs[i].detach().numpy(), rtol=2e-5, atol=2e-5,
                                       err_msg=f"rank {r} out")
            ref_aux = float(auxs[i].detach())
            assert abs(res[r]["aux"] - ref_aux) <= 1e-5 * max(1.0, abs(ref_aux)), f"rank {r} aux"
            np.testing.assert_allclose(res[r]["g_x"], xs[i].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"rank {r} g_x")
            L = res[r]["w_gate_up"].shape[0]
            mine = slice((r - first) * L, (r - first + 1) * L)
            for name in ("w_gate_up", "w_down"):
                np.testing.assert_allclose(res[r][f"g_{name}"], params[name].grad.numpy()[mine], rtol=1e-4, atol=1e-4,
                                           err_msg=f"rank {r} g_{name}")
        # Replicated weights: the sum over the EP group of the replicas' gradients is the dense gradient.
        for name in ("router", "shared_gate_up", "shared_down"):
            if name in params:
                np.testing.assert_allclose(sum(res[r][f"g_{name}"] for r in ranks), params[name].grad.numpy(),
                                           rtol=1e-4, atol=1e-4, err_msg=f"g_{name}")
        dropped += drops
    return dropped


def problem_strategy():
    """A layer config plus tokens per rank, a seed and a skew, for an EP group of 2 (E = 2 or 4 per rank)."""
    @st.composite
    def problem(draw):
        experts = draw(st.sampled_from([4, 8]))
        groups = draw(st.sampled_from([1, 2, 4]))
        topk_groups = draw(st.integers(1, groups))
        top_k = draw(st.integers(1, min(3, topk_groups * experts // groups)))
        cf = draw(st.sampled_from([None, 0.5, 1.0, 1.5]))
        cfg = MoEConfig(hidden=draw(st.sampled_from([4, 8])), ffn=draw(st.sampled_from([2, 6])), num_experts=experts,
                        top_k=top_k, score_func=draw(st.sampled_from(["softmax", "sigmoid"])), num_groups=groups,
                        topk_groups=topk_groups, norm_topk_prob=draw(st.booleans()),
                        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                        aux_loss_coef=draw(st.sampled_from([0.0, 0.01])), z_loss_coef=draw(st.sampled_from([0.0, 1e-3])),
                        capacity_factor=cf, expert_alignment=draw(st.sampled_from([1, 4])),
                        shared_ffn=draw(st.sampled_from([0, 4])))
        return cfg, draw(st.integers(0, 9)), draw(st.integers(0, 2**16)), draw(st.sampled_from([0.0, 0.0, 3.0]))
    return problem()


def edge_problems() -> list:
    """Hand-picked: heavy skew with a small capacity factor (drops certain), DeepSeek-V3-like sigmoid grouped
    routing with scaling and a shared expert, exact capacity with alignment, one token per rank."""
    base = dict(hidden=8, ffn=4, num_experts=8, top_k=2)
    return [
        (MoEConfig(**base, capacity_factor=0.25, aux_loss_coef=0.01), 8, 11, 4.0),
        (MoEConfig(**base, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                   shared_ffn=6, capacity_factor=1.0, z_loss_coef=1e-3), 7, 12, 0.0),
        (MoEConfig(**base, expert_alignment=8), 5, 13, 1.0),
        (MoEConfig(**base, capacity_factor=0.5), 1, 14, 0.0),
        (MoEConfig(**base, expert_bias=True, score_func="sigmoid", capacity_factor=2.0), 6, 15, 0.0),
    ]


def _session(problems: list, world: int, ep_size: int = 0):
    """Every problem as one job per rank, all in one gloo session: ``(jobs per problem, results)``."""
    jobs = [_job(cfg, tokens, world, seed, skew) for cfg, tokens, seed, skew in problems]
    res = run_ranks(_rank_jobs, world, args=(jobs, ep_size), timeout=240)
    return jobs, [[res[r][i] for r in range(world)] for i in range(len(problems))]


def _rank_jobs(rank, world, port, jobs, ep_size):
    return layer_session(rank, world, port, [j[rank] for j in jobs], ep_size)


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
            dropped[i] = sum(_check(cfg, jobs[i], results[i], 2))
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
        _check(cfg, jobs[i], results[i], 2)


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
