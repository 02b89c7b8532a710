"""Worker functions for the torch MoE layer tests (``omniep.layers.torch``), importable by spawned
children; conventions as in :mod:`harness.torch_workers` (one gloo world per session, numpy out)."""

from __future__ import annotations

from harness.torch_workers import init_gloo, shutdown, to_numpy

PARAMS = ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down")


def layer_session(rank: int, world: int, port: int, jobs: list, ep_size: int = 0) -> list:
    """Run each job on this rank; ``ep_size`` (0 = world) splits the world into EP groups of that many
    consecutive ranks (EP × DP): each group is one layer instance with its own tokens."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        ep_size = ep_size or world
        group = None
        if ep_size != world:
            for first in range(0, world, ep_size):  # every rank creates every group, in the same order
                g = dist.new_group(list(range(first, first + ep_size)))
                if first <= rank < first + ep_size:
                    group = g
        return [layer_job(rank, job, group) for job in jobs]
    finally:
        shutdown()


def layer_job(rank: int, job: dict, group) -> dict:
    """``job``: ``config`` (MoEConfig kwargs), ``x`` / ``g`` (this rank's tokens and the gradient of
    the output, numpy), ``seed``, optional ``dtype``, ``backend`` and ``expert_bias`` (values for the
    load-balancing buffer). Returns out, aux, the module's
    parameters and the gradients of ``(out * g).sum() + aux`` w.r.t. x and every parameter."""
    import torch

    from omniep.layers import MoEConfig
    from omniep.layers.torch import MoE

    dtype = getattr(torch, job.get("dtype", "float32"))
    layer = MoE(MoEConfig(**job["config"]), group=group, seed=job["seed"], dtype=dtype, backend=job.get("backend"))
    if job.get("expert_bias") is not None:
        layer.expert_bias.copy_(torch.from_numpy(job["expert_bias"]))
    x = torch.from_numpy(job["x"]).to(dtype).requires_grad_()
    out, aux = layer(x)
    ((out.float() * torch.from_numpy(job["g"])).sum() + aux).backward()
    res = dict(out=to_numpy(out), aux=float(aux.detach()), g_x=to_numpy(x.grad))
    for name in PARAMS:
        p = getattr(layer, name)
        if p is not None:
            res[name] = to_numpy(p.detach())
            res[f"g_{name}"] = to_numpy(p.grad)
    return res
