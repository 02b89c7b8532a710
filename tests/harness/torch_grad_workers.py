"""Worker functions for the torch gradient tests (adjointness, a toy MoE layer), importable by
spawned children; see :mod:`harness.torch_workers` for the conventions."""

from __future__ import annotations

from omniep.ep_core.types import Layout
from harness.torch_workers import init_gloo, shutdown, to_numpy, to_torch


def grad_session(rank: int, world: int, port: int, jobs: dict) -> dict:
    """``jobs``: ``adjoint`` (cases) and ``moe`` (``(layout, seed)``) lists; results per job."""
    init_gloo(rank, world, port)
    try:
        return dict(adjoint=[adjoint_job(rank, job) for job in jobs["adjoint"]],
                    moe=[moe_job(rank, world, *job) for job in jobs["moe"]])
    finally:
        shutdown()


def _dot(a, b) -> float:
    import torch

    return float((a.detach().to(torch.float64) * b.detach().to(torch.float64)).sum())


def adjoint_job(rank: int, case) -> dict:
    """This rank's parts of ``<A u, v>`` and ``<u, A^T v>`` for dispatch and combine: the backend in
    float64 (exact data movement, float64 sums) and the autograd frontend in float32; the parent sums
    the parts over ranks."""
    import torch

    from omniep import torch as ep

    gen = torch.Generator().manual_seed(1000 + rank)
    idx, w = to_torch(case.topk_idx[rank]), to_torch(case.topk_weights[rank])
    T, H = case.x[rank].shape
    em = case.layout == Layout.EXPERT_MAJOR
    be = ep.context(backend="collective")
    cfg = (case.num_experts, int(em), -1 if case.capacity is None else case.capacity, case.expert_alignment)
    out = {}
    for dtype in (torch.float64, torch.float32):
        x = torch.randn(T, H, generator=gen, dtype=dtype)
        if dtype == torch.float64:  # the backend's ops unchecked: float64 moved as bytes, summed in float64
            res = be.dispatch(x, None, idx, w, *cfg)
            recv_x, recv_w, handle = res[0], res[3], [res[2], res[3], *res[7]]
        else:
            x.requires_grad_()
            w.requires_grad_()
            d = ep.dispatch(x, idx, w, num_experts=case.num_experts, capacity=case.capacity, layout=case.layout)
            recv_x, recv_w, handle = d.recv_x, d.recv_topk_weights, d.handle
        g_recv_x = torch.randn(recv_x.shape, generator=gen, dtype=dtype)
        g_recv_w = torch.randn(recv_w.shape, generator=gen)
        y = torch.randn(recv_x.shape, generator=gen, dtype=dtype)
        g_out = torch.randn(T, H, generator=gen, dtype=dtype)
        if dtype == torch.float64:
            g_x, g_w = be.dispatch_bwd(g_recv_x, g_recv_w, handle, *cfg)
            combined = be.combine(y, w if em else None, None, None, handle, *cfg)
            g_y, g_wc = be.combine_bwd(g_out, w if em else None, y if em else None, handle, *cfg)
            g_wc = g_wc if em else None
        else:
            g_x, g_w = torch.autograd.grad((recv_x, recv_w), (x, w), (g_recv_x, g_recv_w))
            y.requires_grad_()
            combined = ep.combine(y, handle)
            wrt = (y, w) if em else (y,)
            g_y, *rest = torch.autograd.grad(combined, wrt, g_out)
            g_wc = rest[0] if rest else None
        name = str(dtype).removeprefix("torch.")
        out[name] = dict(
            dispatch=(_dot(recv_x, g_recv_x) + _dot(recv_w, g_recv_w), _dot(x, g_x) + _dot(w, g_w)),
            combine=(_dot(combined, g_out), _dot(y, g_y)),
            combine_weights=None if g_wc is None else (_dot(combined, g_out), _dot(w, g_wc)))
    return out


def moe_job(rank: int, world: int, layout: str, seed: int) -> dict:
    """A toy MoE layer (router top-k, dispatch, per-expert linear, combine) on the EP group, and the
    same layer computed densely on the global arrays; outputs and gradients of both."""
    import torch

    from omniep import torch as ep

    gen = torch.Generator().manual_seed(seed)
    H, K, L = 8, 2, 2
    E = L * world
    xs = [torch.randn(5 + r, H, generator=gen) for r in range(world)]
    targets = [torch.randn(5 + r, H, generator=gen) for r in range(world)]
    router, experts = torch.randn(H, E, generator=gen), torch.randn(E, H, H, generator=gen) * 0.3

    def route(x, router_w):
        weights, idx = torch.softmax(x @ router_w, dim=-1).topk(K, dim=-1)
        return weights, idx

    # Expert parallel: this rank holds its tokens, a router replica and its L experts.
    x, router_ep = xs[rank].clone().requires_grad_(), router.clone().requires_grad_()
    local = experts[rank * L:(rank + 1) * L].clone().requires_grad_()
    weights, idx = route(x, router_ep)
    # Ranks hold 5 + r tokens: expert-major needs an explicit capacity (its default R * T needs equal T).
    capacity = world * (4 + world) if layout == Layout.EXPERT_MAJOR.value else None
    d = ep.dispatch(x, idx, weights, num_experts=E, layout=layout, capacity=capacity)
    if layout == Layout.RANK_MAJOR.value:  # weights are the caller's business
        y = torch.zeros_like(d.recv_x)
        for k in range(K):
            lid = d.recv_topk_idx[:, k].long()
            h = torch.einsum("nh,nhg->ng", d.recv_x, local[lid.clamp(min=0)])
            y = y + torch.where((lid >= 0).unsqueeze(-1), d.recv_topk_weights[:, k:k + 1] * h, torch.zeros_like(h))
    else:  # expert-major feeds a grouped GEMM; combine applies the weights
        y = torch.einsum("lch,lhg->lcg", d.recv_x, local)
    out = ep.combine(y, d.handle)
    g_ep = torch.autograd.grad((out * targets[rank]).sum(), (x, router_ep, local))

    # Dense: every token through its experts, on the gathered arrays.
    x_all, router_d, experts_d = torch.cat(xs).requires_grad_(), router.clone().requires_grad_(), experts.clone().requires_grad_()
    weights_d, idx_d = route(x_all, router_d)
    dense = sum(weights_d[:, k:k + 1] * torch.einsum("th,thg->tg", x_all, experts_d[idx_d[:, k]]) for k in range(K))
    g_dense = torch.autograd.grad((dense * torch.cat(targets)).sum(), (x_all, router_d, experts_d))
    rows = slice(sum(5 + r for r in range(rank)), sum(5 + r for r in range(rank + 1)))
    return dict(out=to_numpy(out), dense_out=to_numpy(dense[rows]), g_x=to_numpy(g_ep[0]),
                dense_g_x=to_numpy(g_dense[0][rows]), g_router=to_numpy(g_ep[1]), dense_g_router=to_numpy(g_dense[1]),
                g_experts=to_numpy(g_ep[2]), dense_g_experts=to_numpy(g_dense[2][rank * L:(rank + 1) * L]))
