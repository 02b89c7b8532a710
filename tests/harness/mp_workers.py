"""Rank functions for the multi-process tests of the native torch backends (``cuda_nvshmem``, ``nccl_ep``,
``rocm_rocshmem``; importable by spawned children).

:func:`native_session` is an :func:`omniep.testing.procs.run_ranks` target: it pins a CUDA device
(``per_gpu``: device = rank; else every rank on device 0, several processes sharing one GPU over CUDA
IPC), joins a gloo group (the control plane; data moves through the native kernels) and runs every
job once, returning numpy arrays with their bits intact for the parent to compare with the
reference. Frontend jobs reuse :func:`harness.torch_workers.frontend_job` with inputs placed on
the GPU; backend jobs call the backend class directly (static capacity that drops rows): the one that
``OMNIEP_BACKEND`` names, ``cuda_nvshmem`` or ``nccl_ep`` (same torch backend interface).
``on_cpu``: the same jobs with CPU tensors (no device pinned), for a backend that serves them
(``collective``): the suite's own check on a machine without a GPU.
"""

from __future__ import annotations

import traceback

from omniep.ep_core.errors import CapacityError, PeerTimeoutError


_ON_GPU = True  # native_session(on_cpu=True) clears it: inputs stay on the CPU


def _cuda_inputs():
    """``torch_workers``, its ``to_torch`` putting every input on the current CUDA device (unless the
    session runs on the CPU)."""
    from harness import torch_workers as tw

    if _ON_GPU and not getattr(tw.to_torch, "_omniep_cuda", False):
        cpu = tw.to_torch

        def to_cuda(a):
            return cpu(a).cuda()

        to_cuda._omniep_cuda = True
        tw.to_torch = to_cuda
    return tw


def _backend_class():
    """The torch backend under test: ``OMNIEP_BACKEND`` (``cuda_nvshmem``, ``nccl_ep``, ``rocm_rocshmem``,
    or ``collective`` for the suite's own CPU run)."""
    import os

    from omniep.ep_core.registry import get_backend_class

    return get_backend_class(os.environ.get("OMNIEP_BACKEND", "cuda_nvshmem"), "torch")


def backend_job(rank: int, job: dict) -> dict:
    """dispatch (and, for fp8, again with the completed handle), combine (with the job's biases),
    dispatch_bwd, combine_bwd through the backend itself: ``torch_workers.backend_job`` with inputs
    on the GPU and the backend that ``OMNIEP_BACKEND`` names."""
    return _cuda_inputs().backend_job(rank, job, _backend_class())


def frontend_job(rank: int, job: dict) -> dict:
    """dispatch -> combine with autograd through ``omniep.torch`` (OMNIEP_BACKEND picks the backend)."""
    tw = _cuda_inputs()
    try:
        return tw.frontend_job(rank, job)
    except CapacityError as exc:
        return tw._capacity_error(exc)


def timeout_job(rank: int, job: dict) -> dict:
    """Rank ``job['silent']`` skips a dispatch; the others must get PeerTimeoutError naming it, from
    ``check()`` (the dispatch itself, with a static capacity, waits for nothing on the host)."""
    import torch.distributed as dist

    from omniep import torch as ep

    tw = _cuda_inputs()
    case = job["case"]
    out = dict(error=None)
    ctx = ep.context(backend=_backend_class().name)
    if rank != job["silent"]:
        x, idx, w = (tw.to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
        ctx.state._g().set_timeout_ns(int(2e9))  # fail fast: this wait cannot succeed
        ctx.set_checks("default")
        ep.dispatch(x, idx, w, num_experts=case.num_experts, capacity=case.capacity, backend=ctx.name)
        try:
            ctx.check()
        except PeerTimeoutError as exc:
            out = dict(error="PeerTimeoutError", rank=exc.rank, peer=exc.peer, message=str(exc))
    dist.barrier()
    return out


def native_session(rank: int, world: int, port: int, jobs: dict, per_gpu: bool, on_cpu: bool = False,
                   pg_backend: str = "gloo") -> dict:
    """Run ``jobs`` (keys: frontend, backend, timeout -> lists of job dicts) in one process group of
    ``pg_backend`` (gloo; or nccl, one GPU per rank). ``comm_sources`` in the result: where each native
    state's communicator came from (NcclRankState.comm_source), where states say so."""
    global _ON_GPU
    import torch

    from harness.torch_workers import init_gloo, shutdown

    from omniep import torch as ep

    _ON_GPU = not on_cpu
    if _ON_GPU:
        torch.cuda.set_device(rank if per_gpu else 0)
    init_gloo(rank, world, port, timeout_s=120, transport=pg_backend)
    runners = dict(frontend=frontend_job, backend=backend_job, timeout=timeout_job)
    out = {key: [] for key in jobs}
    try:
        for key in ("frontend", "backend", "timeout"):  # timeout last: it leaves the signals out of step
            for i, job in enumerate(jobs.get(key, ())):
                try:
                    out[key].append(runners[key](rank, job))
                except Exception as exc:
                    raise RuntimeError(f"{key} job {i} failed on rank {rank}: {exc}\n{traceback.format_exc()}") from exc
        ctx = ep.context(backend=_backend_class().name)
        out["comm_sources"] = [getattr(getattr(ctx, "state", None), "comm_source", None)]
        if not jobs.get("timeout"):
            ep.destroy()  # collective: the native buffers are released together
    finally:
        shutdown()
    return out
