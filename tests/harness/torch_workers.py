"""Worker functions for the multi-process torch tests, importable by spawned children.

Each ``*_session`` function is a :func:`omniep.testing.procs.run_ranks` target: it joins a gloo group
once and runs a whole list of jobs, because process start-up dominates the cost of a test. Inputs come
from the parent (numpy arrays, per rank); results go back as numpy arrays with their bits intact, and
the parent compares them with :mod:`omniep.ep_core.reference`. Only errors that every rank raises
alike (``CapacityError``; in :func:`error_session`, every typed omniep error: a mismatch, a peer's bad
input, a timeout) are caught here; anything else fails the rank, and with it the run, promptly.
"""

from __future__ import annotations

import datetime
import os
import traceback

from omniep.ep_core.errors import CapacityError, DestroyedError
from omniep.ep_core.types import Layout
from omniep.testing import torch_bits
from omniep.testing.torch_bits import to_numpy


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

    from omniep import torch as ep

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
    """The same as the backend's ops (``torch.ops.<namespace>.*`` of the context of ``backend_cls``,
    default ``collective``) in the default checks mode, so that a static capacity that overflows drops
    rows (copies) and counts them instead of raising; the CapacityError it leaves pending is read back
    with ``check()`` (``pending``). fp8 rank-major: a cached dispatch moves the same bytes again."""
    from omniep import torch as ep

    case = job["case"]
    ctx = ep.context(backend=backend_cls.name if backend_cls is not None else "collective")
    saved = ctx.checks
    ctx.set_checks("default")
    try:
        x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
        fp8 = case.dtype == "float8_e4m3fn"
        scales = to_torch(job["x_scales"][rank]) if fp8 else None
        em = case.layout == Layout.EXPERT_MAJOR
        cfg = (ctx.id, case.num_experts, int(em), -1 if case.capacity is None else case.capacity,
               case.expert_alignment)
        out = ctx.ops.dispatch(x, scales, idx, w, *cfg)
        handle = [out[2], out[3], *out[7]]
        res = _dispatched((out[0], out[1]) if fp8 else out[0], *out[2:7])
        if fp8:
            if not em:
                again = ctx.ops.cached_dispatch(x, scales, handle, *cfg)
                res["cached_recv_x"], res["cached_recv_x_scales"] = to_numpy(again[0]), to_numpy(again[1])
        else:
            y, g_out = to_torch(job["y"][rank]), to_torch(job["g_out"][rank])
            biases = [to_torch(b) for b in job["bias"][rank]] + [None, None]
            res["out"] = to_numpy(ctx.ops.combine(y, w if em else None, biases[0], biases[1], handle, *cfg))
            g_x, g_w = ctx.ops.dispatch_bwd(to_torch(job["g_recv_x"][rank]), to_torch(job["g_recv_w"][rank]),
                                            handle, *cfg)
            g_y, g_w2 = ctx.ops.combine_bwd(g_out, w if em else None, y if em else None, handle, *cfg)
            res.update(g_x=to_numpy(g_x), g_w=to_numpy(g_w), g_y=to_numpy(g_y))
            if em:
                res["g_topk_weights_combine"] = to_numpy(g_w2)
        try:
            ctx.check()
        except CapacityError as exc:
            res["pending"] = _capacity_error(exc)
        return res
    finally:
        ctx.set_checks(saved)


# ---- golden vectors, opcheck, Buffer -------------------------------------------------------------

def golden_job(rank: int, path: str, via_frontend: bool) -> dict:
    from harness.golden import load, static_capacity

    g = load(path)
    case = g.case
    case.capacity = static_capacity(case)
    job = dict(case=case, y=g.inputs["y"], bias=[[b] for b in g.inputs["bias"]], g_out=g.inputs["g_out"],
               g_recv_x=g.inputs["g_recv_x"], g_recv_w=g.inputs["g_recv_w"])
    return dict(backend=backend_job(rank, job), frontend=frontend_job(rank, job) if via_frontend else None)


def opcheck_job(rank: int, job: dict) -> dict:
    """``torch.library.opcheck`` of ``omniep::dispatch`` and ``omniep::combine`` (all ranks in lockstep:
    opcheck runs each op several times, the same number of times on every rank)."""
    import torch

    from omniep import torch as ep

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    x.requires_grad_()
    w.requires_grad_()
    ctx = ep.context(backend="collective")
    em = case.layout == Layout.EXPERT_MAJOR
    meta = (ctx.id, case.num_experts, int(em), -1 if case.capacity is None else case.capacity,
            case.expert_alignment)
    # Not test_aot_dispatch_dynamic for dispatch: it compares two runs' outputs, and the handle a dispatch
    # returns carries its sequence number on the group (the handle's id), one more in the second run.
    # torch.compile of dispatch itself is checked end to end by compile_job.
    out = {"dispatch": torch.library.opcheck(torch.ops.omniep.dispatch.default, (x, None, idx, w, *meta),
                                             test_utils=("test_schema", "test_autograd_registration",
                                                         "test_faketensor"), raise_exception=False)}
    d = ep.dispatch(x.detach(), idx, w.detach(), num_experts=case.num_experts, capacity=case.capacity,
                    expert_alignment=case.expert_alignment, layout=case.layout, backend="collective")
    y = to_torch(job["y"][rank]).requires_grad_()
    bias = to_torch(job["bias"][rank][0]).requires_grad_() if job["bias"][rank] else None
    out["combine"] = torch.library.opcheck(torch.ops.omniep.combine.default,
                                           (y, w if em else None, bias, None, list(d.handle.tensors), *meta),
                                           raise_exception=False)

    def shown(r) -> str:  # "SUCCESS", or the failure with its traceback (opcheck hides where it failed)
        if isinstance(r, BaseException):
            return "".join(traceback.format_exception(r))
        return str(r)

    return {k: {name: shown(r) for name, r in v.items()} for k, v in out.items()}


def compile_job(rank: int, job: dict) -> dict:
    """``torch.compile(fullgraph=True)`` (inductor) of a function that dispatches, applies an expert
    function and combines, forward and backward, against the same function run eagerly: which of
    (out, recv_x, grad x, grad topk_weights) are bitwise equal, or the error."""
    import torch

    from omniep import torch as ep

    case = job["case"]
    x0, idx, w0 = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    H = x0.shape[1]

    def moe(x, topk_idx, topk_weights):
        d = ep.dispatch(x, topk_idx, topk_weights, num_experts=case.num_experts, layout=case.layout,
                        capacity=case.capacity)
        return ep.combine(d.recv_x * 2.0 + 1.0, d.handle), d.recv_x

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out, recv_x = fn(x, idx, w)
        (out * torch.arange(H, dtype=out.dtype, device=out.device)).sum().backward()
        return out.detach(), recv_x.detach(), x.grad, w.grad

    eager = run(moe)
    try:
        compiled = run(torch.compile(moe, fullgraph=True))
    except Exception:
        return dict(error=traceback.format_exc())
    return dict(equal=[bool(torch.equal(a, b)) for a, b in zip(eager, compiled)], rows=int(eager[1].shape[0]))


def _event(event) -> tuple:
    """A Buffer op's event as plain data: (its type's name, whether it holds a device event)."""
    return type(event).__name__, getattr(event, "event", None) is not None


def buffer_job(rank: int, job: dict) -> dict:
    """DeepEP-style use of :class:`omniep.torch.Buffer`; results for the parent to compare."""
    import torch.distributed as dist

    from omniep import torch as ep

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    res = {}
    buf = ep.Buffer(dist.group.WORLD, int(1e6), 0)
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, case.num_experts)
    res["layout"] = [to_numpy(per_rank), per_rdma, to_numpy(per_expert), to_numpy(in_rank), _event(event)]
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=case.expert_alignment)
    res["dispatch"] = [to_numpy(recv_x), to_numpy(recv_idx), to_numpy(recv_w), counts, _event(event)]
    cached = buf.dispatch(to_torch(job["x2"][rank]), handle=handle)
    res["cached"] = [to_numpy(cached[0])] + list(cached[1:5]) + [_event(cached[5])]
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                         expert_alignment=case.expert_alignment, num_worst_tokens=job["num_worst_tokens"])
    res["worst"] = [to_numpy(worst[0]), to_numpy(worst[1]), to_numpy(worst[2]), worst[3], _event(worst[5])]
    b0, b1 = (to_torch(b) for b in job["bias"][rank])
    combined, combined_w, event = buf.combine(to_torch(job["y"][rank]), handle, topk_weights=recv_w, bias=(b0, b1))
    res["combine"] = [to_numpy(combined), to_numpy(combined_w), _event(event)]
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

    from omniep import torch as ep

    case = job["case"]
    x, idx, w = (to_torch(a[rank]) for a in (case.x, case.topk_idx, case.topk_weights))
    L = case.num_experts // case.num_ranks
    buf = ep.Buffer(dist.group.WORLD, 0, int(1e6), low_latency_mode=True, num_qps_per_rank=L)
    stats = torch.zeros(L, dtype=torch.int32, device=x.device)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, job["max_tokens"], case.num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=False,
        return_recv_hook=True)
    hook()
    res = {"dispatch": [to_numpy(recv_x), to_numpy(count), _event(event)], "stats": to_numpy(stats)}
    res["handle"] = [to_numpy(handle[0]), to_numpy(handle[1]), [handle[2], handle[3], handle[4]], len(handle)]
    (x8, scales), count8, _, _, no_hook = buf.low_latency_dispatch(x, idx, job["max_tokens"], case.num_experts)
    res["fp8"] = [to_numpy(x8), to_numpy(scales), to_numpy(count8), no_hook]
    # Power-of-two scales, and UE8M0 on H = 512 (four scales per int32; the flipped half makes a
    # token's scales differ from block to block, so the byte order shows)
    (x8, scales), _, _, _, _ = buf.low_latency_dispatch(x, idx, job["max_tokens"], case.num_experts, round_scale=True)
    wide = torch.cat([x, x.flip(1)], dim=1)
    (w8, ue8m0), _, _, _, _ = buf.low_latency_dispatch(wide, idx, job["max_tokens"], case.num_experts,
                                                       round_scale=True, use_ue8m0=True)
    res["round_scale"] = [to_numpy(x8), to_numpy(scales), to_numpy(w8), to_numpy(ue8m0)]
    y = to_torch(job["y"][rank])
    out = torch.empty((x.shape[0], x.shape[1]), dtype=y.dtype, device=y.device)
    combined, event, _ = buf.low_latency_combine(y, idx, w, handle, out=out)
    res["combine"] = [to_numpy(combined), combined is out, _event(event)]
    buf.destroy()
    return res


def _raises(fn, exc_type) -> str:
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def variant_job(rank: int, item: tuple) -> dict:
    """A case job (frontend, and backend when it has a static capacity) with the collective backend's
    rarer paths forced on every rank alike: ``bulk`` (every rank-major op on a handle sends its header
    first and its rows then), ``slot`` (a 256-byte slot that never grows: every first exchange whose
    blocks carry more than the header sends them again in the second, whole) or ``exact`` (the path of
    transports that need equal sizes on both ends, NCCL's: receives posted at the sizes expected)."""
    from omniep import torch as ep
    from omniep.backends.collective import torch_backend as tb

    variant, job = item
    ctx = ep.context(backend="collective")
    saved = tb.BULK, ctx.slot, ctx.tolerant
    try:
        if variant == "bulk":
            tb.BULK = 0
        elif variant == "slot":
            ctx.slot = 256  # the header and the counts still fit (R + E <= 48)
            ctx._grow_slot = lambda need: None
        else:
            ctx.tolerant = False
        res = dict(frontend=frontend_job(rank, job))
        res["backend"] = backend_job(rank, job) if job["case"].capacity is not None else None
        return res
    finally:
        tb.BULK, ctx.slot, ctx.tolerant = saved
        ctx.__dict__.pop("_grow_slot", None)


def collective_session(rank: int, world: int, port: int, jobs: dict, transport: str = "gloo") -> dict:
    """Run every job list of ``jobs`` (keys: cases, golden, opcheck, buffer, buffer_ll, variants, compile) in one
    process group
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
                    elif key == "variants":
                        result = variant_job(rank, item)
                    elif key == "compile":
                        result = compile_job(rank, item)
                    else:
                        result = buffer_job(rank, item)
                except Exception as exc:
                    raise RuntimeError(f"{key} job {i} failed on rank {rank}: {exc}\n{traceback.format_exc()}") from exc
                out[key].append(result)
    finally:
        shutdown()
    return out


# ---- errors and divergence: every rank ends in a clear error ---------------------------------------

_TRACE: list = []  # what a check did before it raised (the parent tells "raised at once" from "later")


def error_session(rank: int, world: int, port: int, checks: list) -> list:
    """Run each ``(name, fn_name, kwargs)`` check in one gloo group; per check a dict: ``type`` and
    ``message`` of the error it ended in (None / "no error"), ``fields`` / ``ranks`` of a
    RankMismatchError, ``trace`` (the steps that returned before it). A check that failed the group's
    context (a mismatch) leaves a fresh one to the next: every rank destroys it alike."""
    from omniep import torch as ep
    from omniep.ep_core.errors import OmniEPError

    init_gloo(rank, world, port)
    results = []
    try:
        for name, fn_name, kwargs in checks:
            del _TRACE[:]
            try:
                globals()[fn_name](rank, **kwargs)
                res = dict(type=None, message="no error")
            except OmniEPError as exc:
                res = dict(type=type(exc).__name__, message=str(exc), fields=getattr(exc, "fields", None),
                           ranks=getattr(exc, "ranks", None))
            res["trace"] = list(_TRACE)
            results.append((name, res))
            if res["type"] in ("RankMismatchError", "PeerTimeoutError"):
                try:
                    ep.destroy()
                except OmniEPError:
                    pass
    finally:
        shutdown()
    return results


def _mine(value, rank: int):
    """A per-rank tuple's entry for ``rank``, or the value itself (the same on every rank)."""
    return value[rank] if isinstance(value, tuple) else value


def _routing(rank: int, tokens: int, experts: int, seed: int = 0, topk: int = 2):
    import torch

    gen = torch.Generator().manual_seed(100 * seed + rank)
    idx = torch.randint(0, max(experts, 1), (tokens, topk), generator=gen)
    return idx, torch.rand(tokens, topk, generator=gen), gen


def _checks(mode: str):
    """Set the default group's collective context to checks ``mode``; returns a function restoring it."""
    from omniep import torch as ep

    ctx = ep.context(backend="collective")
    saved = ctx.checks
    ctx.set_checks(mode)
    return lambda: ctx.set_checks(saved)


def error_dispatch(rank: int, *, tokens=3, hidden=4, experts=4, bad_id=None, capacity=None, layout="rank_major",
                   x_dtype="float32", checks="sync", then=None) -> None:
    """A dispatch where any keyword may be a per-rank tuple; ``bad_id`` (if not None) is written into
    the rank's topk_idx. ``checks``: the context's mode for it; ``then``: ``"check"`` (omniep.torch.check
    afterwards) or ``"dispatch"`` (an exact rank-major dispatch afterwards: the next host wait)."""
    import torch

    from omniep import torch as ep

    T, E = _mine(tokens, rank), _mine(experts, rank)
    idx, w, gen = _routing(rank, T, E)
    if _mine(bad_id, rank) is not None:
        idx[0, 0] = _mine(bad_id, rank)
    x = torch.randn(T, _mine(hidden, rank), generator=gen).to(getattr(torch, _mine(x_dtype, rank)))
    restore = _checks(checks)
    try:
        d = ep.dispatch(x, idx, w, num_experts=E, capacity=_mine(capacity, rank), layout=_mine(layout, rank))
        _TRACE.append(f"dispatch returned (dropped {int(d.dropped)})")
        _then(then, rank)
    finally:
        restore()


def _then(then, rank: int) -> None:
    import torch

    from omniep import torch as ep

    if then == "check":
        ep.check()
        _TRACE.append("check returned")
    elif then == "dispatch":
        idx, w, gen = _routing(rank, 3, 4, seed=7)
        ep.dispatch(torch.randn(3, 4, generator=gen), idx, w, num_experts=4)
        _TRACE.append("dispatch returned")


def error_combine(rank: int, *, bad_rank: int, layout="rank_major") -> None:
    """dispatch, then combine where ``bad_rank`` passes a y with one row too many."""
    import torch

    from omniep import torch as ep

    idx = torch.tensor([[0, 1], [1, -1], [0, -1]])
    cap = None if layout == "rank_major" else 6
    d = ep.dispatch(torch.randn(3, 4), idx, torch.rand(3, 2), num_experts=2, layout=layout, capacity=cap)
    y = d.recv_x
    if rank == bad_rank:
        y = torch.cat([y, y[:1]]) if y.shape[0] else torch.zeros(1, 4)
    ep.combine(y, d.handle)


def error_ops(rank: int, *, case: str, checks: str = "sync", then=None) -> None:
    """Two dispatches of different routings (so their handles' row counts differ), then ranks that
    diverge: ``other_handle`` (rank 0 combines with the first call's handle, rank 1 with the second's),
    ``cached_vs_combine`` (rank 0 cached-dispatches, rank 1 combines), ``skip`` (rank 1 skips its
    combine and dispatches again), ``hidden`` / ``dtype`` (rank 1 combines a y of another hidden size /
    dtype); anything else: a cached dispatch and a combine on every rank alike. ``checks`` / ``then`` as in
    :func:`error_dispatch`."""
    import torch

    from omniep import torch as ep

    restore = _checks(checks)
    try:
        calls = []
        for seed, T in ((1, 3 + rank), (2, 7 + rank)):
            idx, w, gen = _routing(rank, T, 4, seed=seed)
            x = torch.randn(T, 8, generator=gen)
            calls.append((x, ep.dispatch(x, idx, w, num_experts=4)))
        (_, d1), (x2, d2) = calls
        if case == "other_handle":
            d = d1 if rank == 0 else d2
            ep.combine(d.recv_x, d.handle)
        elif case == "cached_vs_combine":
            ep.cached_dispatch(x2, d2.handle) if rank == 0 else ep.combine(d2.recv_x, d2.handle)
        elif case == "skip":
            if rank == 0:
                ep.combine(d2.recv_x, d2.handle)
            idx, w, gen = _routing(rank, 4, 4, seed=3)
            ep.dispatch(torch.randn(4, 8, generator=gen), idx, w, num_experts=4)
        elif case == "hidden":
            ep.combine(d2.recv_x if rank == 0 else torch.cat([d2.recv_x, d2.recv_x], 1), d2.handle)
        elif case == "dtype":
            ep.combine(d2.recv_x if rank == 0 else d2.recv_x.to(torch.bfloat16), d2.handle)
        else:  # every rank alike
            ep.combine(ep.cached_dispatch(x2, d2.handle), d2.handle)
        _TRACE.append(f"{case} returned")
        _then(then, rank)
    finally:
        restore()


def error_silent(rank: int, *, silent: int, sleep_s: float) -> None:
    """Rank ``silent`` never joins the combine the others start (it waits ``sleep_s`` so that its
    sockets stay open): the others end in PeerTimeoutError after OMNIEP_TIMEOUT_S."""
    import time

    import torch

    from omniep import torch as ep

    idx, w, gen = _routing(rank, 3, 4, seed=9)
    d = ep.dispatch(torch.randn(3, 4, generator=gen), idx, w, num_experts=4)
    if rank == silent:
        time.sleep(sleep_s)
        return
    ep.combine(d.recv_x, d.handle)


def fail_one_rank(rank: int, world: int, port: int, fail_rank: int, pid_dir: str) -> None:
    """Rank ``fail_rank`` raises; the others block in a dispatch that can never complete."""
    import torch

    from omniep import torch as ep

    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    init_gloo(rank, world, port, timeout_s=300)
    if rank == fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    ep.dispatch(torch.randn(2, 4), torch.tensor([[0], [1]]), torch.rand(2, 1), num_experts=world)


def output_reuse_session(rank: int, world: int, port: int) -> dict:
    """Four dispatch + combine rounds on the collective backend (CPU) with the same routing: x1, x2, x2, x1.
    Round 1's results are dropped before round 2; round 2's are kept through rounds 3 and 4; round 3's
    are dropped before round 4. So rounds 2 and 4 may reuse storage that holds the other input's results,
    and rounds 1 and 3 (fresh storage) have their inputs. Returns each round's results (copies, numpy), round
    2's results read again after round 4, and the storage address of each round's ``recv_x`` and output."""
    import torch

    from omniep import torch as ep

    init_gloo(rank, world, port)
    try:
        T, H, E, K = 64, 256, 4 * world, 2
        gen = torch.Generator().manual_seed(11 + rank)
        xs = [torch.randn(T, H, generator=gen) for _ in range(2)]
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        w = torch.rand(T, K, generator=gen)
        out = {"recv_x": [], "out": [], "recv_ptr": [], "out_ptr": []}
        kept, blockers = None, []
        for i in range(4):
            d = ep.dispatch(xs[(0, 1, 1, 0)[i]], idx, w, num_experts=E)
            y = ep.combine(d.recv_x, d.handle)
            out["recv_x"].append(to_numpy(d.recv_x.clone()))
            out["out"].append(to_numpy(y.clone()))
            out["recv_ptr"].append(d.recv_x.untyped_storage().data_ptr())
            out["out_ptr"].append(y.untyped_storage().data_ptr())
            if i == 1:
                kept = (d, y)
            sizes = [t.untyped_storage().nbytes() for t in (d.recv_x, y)]
            del d, y
            # A plain allocator would hand a dropped result's memory to these: a storage the next round
            # shares with this one was kept for it, not found again by chance.
            blockers.extend(torch.empty(n, dtype=torch.uint8) for n in sizes)
        out["kept_recv_x"], out["kept_out"] = to_numpy(kept[0].recv_x.clone()), to_numpy(kept[1].clone())
        return out
    finally:
        shutdown()


def exchange_count_session(rank: int, world: int, port: int, layout: str) -> dict:
    """The same dispatch + combine three times on the collective backend over gloo, counting its
    collectives: rows of 256 KB per peer overflow the first slot (64 KB), so the first dispatch sends
    them in an exchange of their own and the later ones inline, behind their routing. Returns the
    collectives per op and every call's results (numpy), which must not depend on the path."""
    import torch

    from omniep import torch as ep

    init_gloo(rank, world, port)
    try:
        T, H, E, K = 64, 1024, 4 * world, 2
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(T, H, generator=gen)
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        w = torch.rand(T, K, generator=gen)
        ctx = ep.context(backend="collective")
        real, calls = ctx._a2a, [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        ctx._a2a = counted
        out = {"dispatch_calls": [], "combine_calls": [], "recv_x": [], "out": []}
        cap = T * world if layout == "expert_major" else None
        for _ in range(3):
            calls[0] = 0
            d = ep.dispatch(x, idx, w, num_experts=E, layout=layout, capacity=cap)
            out["dispatch_calls"].append(calls[0])
            calls[0] = 0
            y = ep.combine(d.recv_x, d.handle)
            out["combine_calls"].append(calls[0])
            out["recv_x"].append(to_numpy(d.recv_x))
            out["out"].append(to_numpy(y))
        return out
    finally:
        shutdown()
