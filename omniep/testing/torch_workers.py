"""Worker functions for the multi-process torch tests, importable by spawned children.

Each ``*_session`` function is a :func:`omniep.testing.procs.run_ranks` target: it joins a gloo group
once and runs a whole list of jobs, because process start-up dominates the cost of a test. Inputs come
from the parent (numpy arrays, per rank); results go back as numpy arrays with their bits intact, and
the parent compares them with :mod:`omniep.ep_core.reference`. Only errors that every rank raises
alike (``CapacityError``, ``InputError`` from the frontends' agreement step) are caught here; anything
else fails the rank, and with it the run, promptly.
"""

from __future__ import annotations

import datetime
import os
import traceback

from ..ep_core.errors import CapacityError, DestroyedError, InputError
from ..ep_core.types import Layout
from . import torch_bits
from .torch_bits import to_numpy


# ---- process group and array conversion ----------------------------------------------------------

_DEVICE = "cpu"  # where to_torch puts tensors: "cuda:<rank>" in NCCL sessions


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0, transport: str = "gloo") -> None:
    """Join a process group on localhost: gloo on CPU, or NCCL with one GPU per rank."""
    global _DEVICE
    import torch
    import torch.distributed as dist

    if transport == "nccl":
        torch.cuda.set_device(rank)
        _DEVICE = f"cuda:{rank}"
    dist.init_process_group(transport, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def to_torch(a):
    """numpy (ml_dtypes bfloat16 / float8 included) -> torch on this rank's device, bits unchanged."""
    return torch_bits.to_torch(a, _DEVICE)


def _dispatched(recv_x, recv_topk_idx, recv_topk_weights, num_recv, num_recv_tokens_per_expert, dropped) -> dict:
    recv_x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    out = dict(recv_x=to_numpy(recv_x), recv_topk_idx=to_numpy(recv_topk_idx),
               recv_topk_weights=to_numpy(recv_topk_weights), num_recv=int(num_recv),
               num_recv_tokens_per_expert=to_numpy(num_recv_tokens_per_expert), dropped=int(dropped))
    if scales is not None:
        out["recv_x_scales"] = to_numpy(scales)
    return out


def _capacity_error(exc: CapacityError) -> dict:
    return dict(error="CapacityError", needed=exc.needed, capacity=exc.capacity, rank=exc.rank, message=str(exc))


# ---- property cases: frontend (autograd) and backend (static capacity with drops) ----------------

def frontend_job(rank: int, job: dict) -> dict:
    """dispatch -> combine through ``omniep.torch`` with autograd; every result as numpy."""
    import torch

    from .. import torch as ep

    case = job["case"]
    fp8 = case.dtype == "float8_e4m3fn"
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    if not fp8:
        x.requires_grad_()
    w.requires_grad_()
    x_in = (x, to_torch(job["x_scales"][rank])) if fp8 else x
    try:
        d = ep.dispatch(x_in, idx, w, num_experts=case.num_experts, capacity=case.capacity,
                        expert_alignment=case.expert_alignment, layout=case.layout)
    except CapacityError as exc:
        return _capacity_error(exc)
    res = _dispatched(d.recv_x, d.recv_topk_idx, d.recv_topk_weights, d.num_recv,
                      d.num_recv_tokens_per_expert, d.dropped)
    if fp8:
        return res
    g_x, g_w = torch.autograd.grad((d.recv_x, d.recv_topk_weights), (x, w),
                                   (to_torch(job["g_recv_x"][rank]), to_torch(job["g_recv_w"][rank])))
    y = to_torch(job["y"][rank]).requires_grad_()
    biases = [to_torch(b).requires_grad_() for b in job["bias"][rank]]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    out = ep.combine(y, d.handle, bias=bias)
    wrt = [y, *biases] + ([w] if case.layout == Layout.EXPERT_MAJOR else [])
    grads = torch.autograd.grad(out, wrt, to_torch(job["g_out"][rank]))
    res.update(out=to_numpy(out), g_x=to_numpy(g_x), g_w=to_numpy(g_w), g_y=to_numpy(grads[0]),
               g_bias=[to_numpy(g) for g in grads[1:1 + len(biases)]])
    if case.layout == Layout.EXPERT_MAJOR:
        res["g_topk_weights_combine"] = to_numpy(grads[-1])
    return res


def backend_job(rank: int, job: dict, backend_cls=None) -> dict:
    """The same through the backend directly (``backend_cls``, default ``CollectiveTorch``): static
    capacity overflow drops rows and counts them."""
    if backend_cls is None:
        from ..backends.collective.torch_backend import CollectiveTorch as backend_cls

    case = job["case"]
    be = backend_cls()
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    handle = be.prepare(idx, case.config())
    moved = (x, to_torch(job["x_scales"][rank])) if case.dtype == "float8_e4m3fn" else x
    fields, handle = be.dispatch(moved, w, handle)
    res = _dispatched(*fields)
    if case.dtype == "float8_e4m3fn":
        (again, *_), _ = be.dispatch(moved, None, handle)  # cached dispatch moves the same bytes
        res["cached_recv_x"], res["cached_recv_x_scales"] = to_numpy(again[0]), to_numpy(again[1])
        return res
    y, g_out = to_torch(job["y"][rank]), to_torch(job["g_out"][rank])
    res["out"] = to_numpy(be.combine(y, handle, tuple(to_torch(b) for b in job["bias"][rank])))
    g_x, g_w = be.dispatch_bwd(to_torch(job["g_recv_x"][rank]), to_torch(job["g_recv_w"][rank]), handle)
    g_y, g_w2 = be.combine_bwd(g_out, handle, y)
    res.update(g_x=to_numpy(g_x), g_w=to_numpy(g_w), g_y=to_numpy(g_y))
    if g_w2 is not None:
        res["g_topk_weights_combine"] = to_numpy(g_w2)
    return res


# ---- golden vectors, opcheck, Buffer -------------------------------------------------------------

def golden_job(rank: int, path: str, via_frontend: bool) -> dict:
    from .golden import load, static_capacity

    g = load(path)
    case = g.case
    case.capacity = static_capacity(case)
    job = dict(case=case, y=g.inputs["y"], bias=[[b] for b in g.inputs["bias"]], g_out=g.inputs["g_out"],
               g_recv_x=g.inputs["g_recv_x"], g_recv_w=g.inputs["g_recv_w"])
    return dict(backend=backend_job(rank, job), frontend=frontend_job(rank, job) if via_frontend else None)


def opcheck_job(rank: int, job: dict) -> dict:
    """``torch.library.opcheck`` of ``omniep::dispatch`` and ``omniep::combine`` (all ranks in lockstep)."""
    import torch
    import torch.distributed as dist

    from .. import torch as ep
    from ..frontends import torch_ops as ops

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    x.requires_grad_()
    w.requires_grad_()
    meta = (dist.group.WORLD.group_name, "collective", case.num_experts, case.layout.value,
            -1 if case.capacity is None else case.capacity, case.expert_alignment)
    out = {"dispatch": torch.library.opcheck(torch.ops.omniep.dispatch.default, (x, None, idx, w, *meta),
                                             raise_exception=False)}
    # The handle must come from the backend that `meta` names (auto could pick a native backend on GPUs,
    # whose expert-major handles carry different fields).
    d = ep.dispatch(x.detach(), idx, w.detach(), num_experts=case.num_experts, capacity=case.capacity,
                    expert_alignment=case.expert_alignment, layout=case.layout, backend="collective")
    y = to_torch(job["y"][rank]).requires_grad_()
    bias = to_torch(job["bias"][rank][0]).requires_grad_() if job["bias"][rank] else None
    weights = w if case.layout == Layout.EXPERT_MAJOR else None
    out["combine"] = torch.library.opcheck(torch.ops.omniep.combine.default,
                                           (y, weights, bias, None, ops.handle_tensors(d.handle), *meta),
                                           raise_exception=False)
    def shown(r) -> str:  # "SUCCESS", or the failure with its traceback (opcheck hides where it failed)
        if isinstance(r, BaseException):
            import traceback

            return "".join(traceback.format_exception(r))
        return str(r)

    return {k: {name: shown(r) for name, r in v.items()} for k, v in out.items()}


def buffer_job(rank: int, job: dict) -> dict:
    """DeepEP-style use of :class:`omniep.torch.Buffer`; results for the parent to compare."""
    import torch.distributed as dist

    from .. import torch as ep

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    res = {}
    buf = ep.Buffer(dist.group.WORLD, int(1e6), 0)
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, case.num_experts)
    res["layout"] = [to_numpy(per_rank), per_rdma, to_numpy(per_expert), to_numpy(in_rank), event]
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=case.expert_alignment)
    res["dispatch"] = [to_numpy(recv_x), to_numpy(recv_idx), to_numpy(recv_w), counts, event]
    cached = buf.dispatch(to_torch(job["x2"][rank]), handle=handle)
    res["cached"] = [to_numpy(cached[0])] + list(cached[1:])
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                         expert_alignment=case.expert_alignment, num_worst_tokens=job["num_worst_tokens"])
    res["worst"] = [to_numpy(worst[0]), to_numpy(worst[1]), to_numpy(worst[2]), worst[3], worst[5]]
    b0, b1 = (to_torch(b) for b in job["bias"][rank])
    combined, combined_w, event = buf.combine(to_torch(job["y"][rank]), handle, topk_weights=recv_w, bias=(b0, b1))
    res["combine"] = [to_numpy(combined), to_numpy(combined_w), event]
    buf.destroy()
    res["after_destroy"] = _raises(lambda: buf.dispatch(x, handle=handle), DestroyedError)
    with ep.Buffer(dist.group.WORLD) as scoped:
        scoped.get_dispatch_layout(idx, case.num_experts)
    res["after_with"] = _raises(lambda: scoped.get_dispatch_layout(idx, case.num_experts), DestroyedError)
    return res


def buffer_ll_job(rank: int, job: dict) -> dict:
    """DeepEP-style low-latency use of :class:`omniep.torch.Buffer` (bf16 and fp8 dispatch, weighted
    combine into ``out=``, the receive-count statistics); results for the parent to compare."""
    import torch
    import torch.distributed as dist

    from .. import torch as ep

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    L = case.num_experts // case.num_ranks
    buf = ep.Buffer(dist.group.WORLD, 0, int(1e6), low_latency_mode=True, num_qps_per_rank=L)
    stats = torch.zeros(L, dtype=torch.int32, device=x.device)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, job["max_tokens"], case.num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=False,
        return_recv_hook=True)
    hook()
    res = {"dispatch": [to_numpy(recv_x), to_numpy(count), event], "stats": to_numpy(stats)}
    (x8, scales), count8, _, _, no_hook = buf.low_latency_dispatch(x, idx, job["max_tokens"], case.num_experts)
    res["fp8"] = [to_numpy(x8), to_numpy(scales), to_numpy(count8), no_hook]
    y = to_torch(job["y"][rank])
    out = torch.empty((x.shape[0], x.shape[1]), dtype=y.dtype, device=y.device)
    combined, event, _ = buf.low_latency_combine(y, idx, w, handle, out=out)
    res["combine"] = [to_numpy(combined), combined is out, event]
    buf.destroy()
    return res


def _raises(fn, exc_type) -> str:
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def collective_session(rank: int, world: int, port: int, jobs: dict, transport: str = "gloo") -> dict:
    """Run every job list of ``jobs`` (keys: cases, golden, opcheck, buffer) in one process group
    (``transport`` gloo on CPU, or nccl with one GPU per rank)."""
    init_gloo(rank, world, port, transport=transport)
    out = {key: [] for key in jobs}
    try:
        for key, items in jobs.items():
            for i, item in enumerate(items):
                try:
                    if key == "cases":
                        result = dict(frontend=frontend_job(rank, item),
                                      backend=backend_job(rank, item) if item["case"].capacity is not None else None)
                    elif key == "golden":
                        result = golden_job(rank, *item)
                    elif key == "opcheck":
                        result = opcheck_job(rank, item)
                    elif key == "buffer_ll":
                        result = buffer_ll_job(rank, item)
                    else:
                        result = buffer_job(rank, item)
                except Exception as exc:
                    raise RuntimeError(f"{key} job {i} failed on rank {rank}: {exc}\n{traceback.format_exc()}") from exc
                out[key].append(result)
    finally:
        shutdown()
    return out


# ---- errors: every rank raises alike -------------------------------------------------------------

def error_session(rank: int, world: int, port: int, checks: list) -> list:
    """Run each ``(name, fn_name, kwargs)`` check; return ``(name, error type, message)`` per check."""
    init_gloo(rank, world, port)
    results = []
    try:
        for name, fn_name, kwargs in checks:
            try:
                globals()[fn_name](rank, **kwargs)
                results.append((name, None, "no error"))
            except (InputError, CapacityError, DestroyedError) as exc:
                results.append((name, type(exc).__name__, str(exc)))
    finally:
        shutdown()
    return results


def error_dispatch(rank: int, *, tokens=(3, 3), hidden=(4, 4), experts=(4, 4), bad_id=(None, None),
                   capacity=None, layout="rank_major", x_dtype=("float32", "float32")) -> None:
    """dispatch where each keyword gives per-rank values; ``bad_id[rank]`` (if not None) is written
    into this rank's topk_idx."""
    import torch

    from .. import torch as ep

    gen = torch.Generator().manual_seed(rank)
    T, E = tokens[rank], experts[rank]
    idx = torch.randint(0, max(E, 1), (T, 2), generator=gen)
    if bad_id[rank] is not None:
        idx[0, 0] = bad_id[rank]
    x = torch.randn(T, hidden[rank], generator=gen).to(getattr(torch, x_dtype[rank]))
    ep.dispatch(x, idx, torch.rand(T, 2, generator=gen), num_experts=E, capacity=capacity, layout=layout)


def error_combine(rank: int, *, bad_rank: int, layout="rank_major") -> None:
    """dispatch, then combine where ``bad_rank`` passes a y with one row too many."""
    import torch

    from .. import torch as ep

    idx = torch.tensor([[0, 1], [1, -1], [0, -1]])
    d = ep.dispatch(torch.randn(3, 4), idx, torch.rand(3, 2), num_experts=2, layout=layout)
    y = d.recv_x
    if rank == bad_rank:
        y = torch.cat([y, y[:1]]) if y.shape[0] else torch.zeros(1, 4)
    ep.combine(y, d.handle)


def fail_one_rank(rank: int, world: int, port: int, fail_rank: int, pid_dir: str) -> None:
    """Rank ``fail_rank`` raises; the others block in a dispatch that can never complete."""
    import torch

    from .. import torch as ep

    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    init_gloo(rank, world, port, timeout_s=300)
    if rank == fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    ep.dispatch(torch.randn(2, 4), torch.tensor([[0], [1]]), torch.rand(2, 1), num_experts=world)
