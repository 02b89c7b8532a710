"""The dense single-device oracle of the torch MoE layer (``omniep.layers.torch``): every token through
its kept experts, no communication, written from :mod:`omniep.layers.config`'s text — it calls nothing
of the layer's code. The routing is computed in float32 as the layer does (so the same experts are
chosen); the experts, the weighted sum and the shared expert in float64 (a more exact oracle)."""

from __future__ import annotations

import math

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


def _shard(x, params: dict, cfg: MoEConfig, num_ranks: int):
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
        out = out + torch.where(keep[:, k:k + 1], w[:, k:k + 1].double() * y, torch.zeros((), dtype=torch.float64))
    if "shared_gate_up" in params:
        gate, up = (xd @ params["shared_gate_up"].double()).chunk(2, -1)
        out = out + (F.silu(gate) * up) @ params["shared_down"].double()
    return out, aux, int((~keep).sum())


def moe_reference(xs: list, params: dict, cfg: MoEConfig):
    """``xs``: each rank's tokens ``[T, H]``; ``params``: global ``router[H, E]``, ``w_gate_up[E, H, 2F]``,
    ``w_down[E, F, H]`` (+ ``shared_gate_up``, ``shared_down``, ``expert_bias``). Returns per-rank
    lists ``(outs float64, aux losses, dropped copies)``; differentiable in every tensor."""
    res = [_shard(x, params, cfg, len(xs)) for x in xs]
    return [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]
