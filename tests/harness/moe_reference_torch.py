"""The dense single-device oracle of the torch MoE layer (``omniep.layers.torch``): every token through
its kept experts, no communication, written from :mod:`omniep.layers.config`'s text — it calls nothing
of the layer's code. The routing is computed in float32 as the layer does (so the same experts are
chosen); the experts, the weighted sum and the shared expert in float64 (a more exact oracle)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from omniep.layers.config import MoEConfig


def _select(sel: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Top-k ids per row of ``sel[T, E]`` (grouped top-k per DeepSeek-V3), by sorting, row by row."""
    T, E = sel.shape
    size = E // cfg.num_groups
    ids = []
    for t in range(T):
        row = sel[t].clone()
        if cfg.num_groups > 1:
            group_scores = [torch.sort(row[g * size:(g + 1) * size], descending=True).values[:cfg.group_top].sum()
                            for g in range(cfg.num_groups)]
            best = torch.argsort(torch.stack(group_scores), descending=True, stable=True)[:cfg.topk_groups]
            allowed = torch.zeros(E, dtype=torch.bool)
            for g in best.tolist():
                allowed[g * size:(g + 1) * size] = True
            row = torch.where(allowed, row, torch.tensor(float("-inf")))
        ids.append(torch.argsort(row, descending=True, stable=True)[:cfg.top_k])
    return torch.stack(ids) if ids else torch.zeros((0, cfg.top_k), dtype=torch.long)


def _shard(x, params: dict, cfg: MoEConfig):
    """One rank's tokens ``x[T, H]`` against the GLOBAL params: (out[T, H] float64, aux, dropped)."""
    T = x.shape[0]
    logits = x.float() @ params["router"].float()
    scores = torch.softmax(logits, -1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
    sel = scores.detach() + (params["expert_bias"] if "expert_bias" in params else 0.0)
    idx = _select(sel, cfg)
    w = torch.gather(scores, 1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    aux = torch.zeros((), dtype=torch.float32)
    if T and cfg.aux_loss_coef:
        f = torch.zeros(cfg.num_experts)
        for e in idx.flatten().tolist():
            f[e] += 1.0 / (T * cfg.top_k)
        p = (scores / scores.sum(1, keepdim=True)).mean(0)
        aux = aux + cfg.aux_loss_coef * cfg.num_experts * (f * p).sum()
    if T and cfg.z_loss_coef:
        aux = aux + cfg.z_loss_coef * (torch.logsumexp(logits, 1) ** 2).mean()
    # Sender-side capacity: the first c_send copies per expert in (t, k) order.
    keep = torch.ones(idx.shape, dtype=torch.bool)
    if cfg.capacity_factor is not None:
        c_send = math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.num_experts)
        seen = [0] * cfg.num_experts
        for t in range(T):
            for k in range(cfg.top_k):
                e = int(idx[t, k])
                keep[t, k] = seen[e] < c_send
                seen[e] += 1
    xd = x.double()
    out = torch.zeros((T, x.shape[1]), dtype=torch.float64)
    for k in range(cfg.top_k):
        wgu = params["w_gate_up"].double()[idx[:, k]]            # [T, H, 2F]
        h = torch.einsum("th,thf->tf", xd, wgu)
        gate, up = h.chunk(2, -1)
        y = torch.einsum("tf,tfh->th", F.silu(gate) * up, params["w_down"].double()[idx[:, k]])
        # y · w rounded to x's dtype, as the layer's contract says (a no-op for float64 x).
        term = (w[:, k:k + 1].double() * y).to(x.dtype).double()
        out = out + torch.where(keep[:, k:k + 1], term, torch.zeros((), dtype=torch.float64))
    if "shared_gate_up" in params:
        gate, up = (xd @ params["shared_gate_up"].double()).chunk(2, -1)
        out = out + (F.silu(gate) * up) @ params["shared_down"].double()
    return out, aux, int((~keep).sum())


def moe_reference(xs: list, params: dict, cfg: MoEConfig):
    """``xs``: each rank's tokens ``[T, H]``; ``params``: global ``router[H, E]``, ``w_gate_up[E, H, 2F]``,
    ``w_down[E, F, H]`` (+ ``shared_gate_up``, ``shared_down``, ``expert_bias``). Returns per-rank
    lists ``(outs float64, aux losses, dropped copies)``; differentiable in every tensor."""
    res = [_shard(x, params, cfg) for x in xs]
    return [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]


# ---- the parent side of the multi-process layer tests --------------------------------------------

def layer_jobs(cfg: MoEConfig, tokens: int, world: int, seed: int, skew: float = 0.0) -> tuple:
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


def check_results(cfg: MoEConfig, jobs_by_rank: list, res: list, ep_size: int) -> list:
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


def edge_problems() -> list:
    """Hand-picked: heavy skew with a small capacity factor (drops certain), DeepSeek-V3-like sigmoid grouped
    routing with scaling and a shared expert, exact capacity with alignment, one token per rank; some of
    them again on the grouped-GEMM path."""
    base = dict(hidden=8, ffn=4, num_experts=8, top_k=2)
    return [
        (MoEConfig(**base, capacity_factor=0.25, aux_loss_coef=0.01), 8, 11, 4.0),
        (MoEConfig(**base, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                   shared_ffn=6, capacity_factor=1.0, z_loss_coef=1e-3), 7, 12, 0.0),
        (MoEConfig(**base, expert_alignment=8), 5, 13, 1.0),
        (MoEConfig(**base, capacity_factor=0.5), 1, 14, 0.0),
        (MoEConfig(**base, expert_bias=True, score_func="sigmoid", capacity_factor=2.0), 6, 15, 0.0),
        # the grouped-GEMM path (steps 6'-8'): heavy skew with drops (experts with no copy), DeepSeek-V3-like
        # routing with a shared expert, dropless, one token per rank
        (MoEConfig(**base, capacity_factor=0.25, aux_loss_coef=0.01, grouped_gemm=True), 8, 16, 4.0),
        (MoEConfig(**base, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
                   shared_ffn=6, z_loss_coef=1e-3, grouped_gemm=True), 7, 17, 0.0),
        (MoEConfig(**base, grouped_gemm=True), 1, 18, 0.0),
    ]


