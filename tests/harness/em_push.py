"""Worker side of tests/gpu/test_em_push_combine.py: the expert-major combine that pushes each copy's row to its
source (csrc/kernels/em_combine.cuh), and the pull it falls back to when a rank has more tokens than the push
buffers hold (``T > ceil(C / R)``), through ``omniep.torch`` on the native backend.

Each job runs :func:`harness.mp_workers.frontend_job` (dispatch, dispatch_bwd, combine, combine_bwd with
autograd: bitwise against the reference in the parent), then dispatches again and combines three times back
to back with the same handle (``y``, ``y2``, ``y``: the push buffers' two parities and their reuse), and
reports which path the dispatch chose (the handle's ``push_ok`` word, the last of its routing tensor)."""

from __future__ import annotations


def session(rank: int, world: int, port: int, jobs: list, per_gpu: bool) -> list:
    import torch

    from harness.mp_workers import _cuda_inputs, frontend_job
    from harness.torch_workers import init_gloo, shutdown
    from omniep import torch as ep
    from omniep.testing.torch_bits import to_numpy

    torch.cuda.set_device(rank if per_gpu else 0)
    init_gloo(rank, world, port, timeout_s=120)
    to_cuda = _cuda_inputs().to_torch  # (bfloat16 arrays included)
    out = []
    try:
        for job in jobs:
            res = frontend_job(rank, job)
            case = job["case"]
            x, idx, w = (to_cuda(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
            d = ep.dispatch(x, idx, w, num_experts=case.num_experts, capacity=case.capacity, layout="expert_major")
            res["push"] = int(d.handle.tensors[3][-1].item())  # native_ops.cpp Routing: push_ok is the last word
            ys = [to_cuda(job[k][rank]) for k in ("y", "y2", "y")]
            res["again"] = [to_numpy(ep.combine(y, d.handle)) for y in ys]
            out.append(res)
        ep.destroy()
    finally:
        shutdown()
    return out
