"""Toy MoE layer in PyTorch over omniep: router top-k -> dispatch -> per-expert MLP -> combine.

One process per rank (``torch.distributed``); each holds its tokens and its ``L = E / R`` experts.
Nothing in it names a backend: ``OMNIEP_BACKEND`` chooses one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omniep import torch as ep


def route(x, router, top_k: int):
    """Softmax router, top-k: ``(topk_idx[T, K] int64, topk_weights[T, K] float32)``."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    return idx, weights


def _mlp(h, w1, w2):
    return F.gelu(h @ w1) @ w2


def moe_layer(x, router, w1, w2, *, num_experts: int, top_k: int, group=None, layout: str = "rank_major",
              capacity=None):
    """``x[T, H]`` local tokens; ``w1[L, H, F]``, ``w2[L, F, H]`` this rank's experts. Returns ``[T, H]``."""
    idx, weights = route(x, router, top_k)
    d = ep.dispatch(x, idx, weights, num_experts=num_experts, group=group, capacity=capacity, layout=layout)
    if layout == "expert_major":
        y = torch.stack([_mlp(d.recv_x[l], w1[l], w2[l]) for l in range(w1.shape[0])])
        return ep.combine(y.to(x.dtype), d.handle)
    y = torch.zeros(d.recv_x.shape, dtype=torch.float32, device=x.device)
    for l in range(w1.shape[0]):
        gate = torch.where(d.recv_topk_idx == l, d.recv_topk_weights, 0.0).sum(-1)
        y = y + gate[:, None] * _mlp(d.recv_x, w1[l], w2[l])
    return ep.combine(y.to(x.dtype), d.handle)


def dense_moe(x, router, w1, w2, *, top_k: int):
    """The same layer on the global arrays without communication: the check for :func:`moe_layer`."""
    idx, weights = route(x, router, top_k)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(top_k):
        h = torch.einsum("th,thf->tf", x, w1[idx[:, k]])
        out = out + weights[:, k:k + 1] * torch.einsum("tf,tfh->th", F.gelu(h), w2[idx[:, k]])
    return out.to(x.dtype)


def global_problem(world: int, tokens_per_rank: int = 16, hidden: int = 32, ffn: int = 64,
                   num_experts: int = 16, seed: int = 0):
    """Every rank builds the same global inputs from one seed and takes its share."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world * tokens_per_rank, hidden, generator=gen)
    router = torch.randn(hidden, num_experts, generator=gen) * hidden ** -0.5
    w1 = torch.randn(num_experts, hidden, ffn, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, ffn, hidden, generator=gen) * ffn ** -0.5
    g = torch.randn(x.shape, generator=gen)
    return x, router, w1, w2, g


def check_layer(rank: int, world: int, layout: str = "rank_major", top_k: int = 2,
                num_experts: int = 16) -> dict:
    """Forward + backward of :func:`moe_layer` on this rank of the default process group, with its
    errors against :func:`dense_moe`."""
    x, router, w1, w2, g = global_problem(world, num_experts=num_experts)
    T, L = x.shape[0] // world, num_experts // world
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * L, (rank + 1) * L)
    leaves = [t.clone().requires_grad_() for t in (x[mine], router, w1[experts], w2[experts])]
    out = moe_layer(*leaves, num_experts=num_experts, top_k=top_k, layout=layout)
    (out * g[mine]).sum().backward()

    ref_leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    ref = dense_moe(*ref_leaves, top_k=top_k)
    (ref * g).sum().backward()
    router_grad = leaves[1].grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks
    out, ref = out.detach(), ref.detach()
    grad_err = max(float((leaves[0].grad - ref_leaves[0].grad[mine]).abs().max()),
                   float((router_grad - ref_leaves[1].grad).abs().max()),
                   float((leaves[2].grad - ref_leaves[2].grad[experts]).abs().max()),
                   float((leaves[3].grad - ref_leaves[3].grad[experts]).abs().max()))
    return {"ranks": world, "layout": layout, "fwd_err": float((out - ref[mine]).abs().max()),
            "grad_err": grad_err}


def rank_main(rank: int, world: int, port: int, layout: str = "rank_major") -> dict:
    """One gloo rank of a localhost run: :func:`check_layer` inside its own process group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return check_layer(rank, world, layout)
    finally:
        dist.destroy_process_group()
