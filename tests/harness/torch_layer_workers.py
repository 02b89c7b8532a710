"""Worker functions for the torch MoE layer tests (``omniep.layers.torch``), importable by spawned
children; conventions as in :mod:`harness.torch_workers` (one gloo world per session, numpy out)."""

from __future__ import annotations

from harness.torch_workers import init_gloo, shutdown, to_numpy

def run_layers(jobs: list, world: int, ep_size: int = 0, device: str = "cpu", env=None) -> list:
    """Run ``jobs`` (one list of per-rank jobs per problem) in one session of ``world`` ranks (see
    :func:`layer_session`); returns the results as ``[problem][rank]``."""
    from omniep.testing.procs import run_ranks

    res = run_ranks(_rank_jobs, world, args=(jobs, ep_size, device), timeout=300, env=env)
    return [[res[r][i] for r in range(world)] for i in range(len(jobs))]


def _rank_jobs(rank, world, port, jobs, ep_size, device):
    return layer_session(rank, world, port, [j[rank] for j in jobs], ep_size, device)


PARAMS = ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down")


def layer_session(rank: int, world: int, port: int, jobs: list, ep_size: int = 0, device: str = "cpu") -> list:
    """Run each job on this rank; ``ep_size`` (0 = world) splits the world into EP groups of that many
    consecutive ranks (EP × DP): each group is one layer instance with its own tokens. ``device``:
    ``cpu`` (gloo), ``cuda:0`` (every rank on GPU 0, gloo) or ``per_gpu`` (rank r on GPU r, NCCL)."""
    import torch
    import torch.distributed as dist

    if device == "per_gpu":
        init_gloo(rank, world, port, transport="nccl")
        device = f"cuda:{rank}"
    else:
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        init_gloo(rank, world, port)
    try:
        ep_size = ep_size or world
        group = None
        if ep_size != world:
            for first in range(0, world, ep_size):  # every rank creates every group, in the same order
                g = dist.new_group(list(range(first, first + ep_size)))
                if first <= rank < first + ep_size:
                    group = g
        return [layer_job(rank, job, group, device) for job in jobs]
    finally:
        shutdown()


def layer_job(rank: int, job: dict, group, device: str = "cpu") -> dict:
    """``job``: ``config`` (MoEConfig kwargs), ``x`` / ``g`` (this rank's tokens and the gradient of
    the output, numpy), ``seed``, optional ``dtype``, ``backend`` and ``expert_bias`` (values for the
    load-balancing buffer). Returns out, aux, the module's
    parameters and the gradients of ``(out * g).sum() + aux`` w.r.t. x and every parameter."""
    import torch

    from omniep.layers import MoEConfig
    from omniep.layers.torch import MoE

    dtype = getattr(torch, job.get("dtype", "float32"))
    layer = MoE(MoEConfig(**job["config"]), group=group, seed=job["seed"], dtype=dtype, device=device,
                backend=job.get("backend"))
    if job.get("expert_bias") is not None:
        layer.expert_bias.copy_(torch.from_numpy(job["expert_bias"]))
    x = torch.from_numpy(job["x"]).to(device=device, dtype=dtype).requires_grad_()
    out, aux = layer(x)
    ((out.float() * torch.from_numpy(job["g"]).to(device)).sum() + aux).backward()
    res = dict(out=to_numpy(out), aux=float(aux.detach()), g_x=to_numpy(x.grad))
    for name in PARAMS:
        p = getattr(layer, name)
        if p is not None:
            res[name] = to_numpy(p.detach())
            res[f"g_{name}"] = to_numpy(p.grad)
    return res
