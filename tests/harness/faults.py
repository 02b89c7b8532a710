"""Worker side of tests/faults/ (and tests/gpu/test_native_faults.py): one rank of a group (gloo process
group; tensors on the CPU, or on GPU 0 for the native backends) in which one rank fails on purpose — it
dies (``os._exit``) or stalls (sleeps with its sockets open) before a dispatch or before a combine —
and what the other ranks saw: the error, whom it names, how long it took, whether the next op raised
at once, and the process's open file descriptors (and, on a GPU, the memory torch holds) before the
group and after its teardown."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _group(rank: int, world: int, port: int):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _teardown() -> None:
    import torch.distributed as dist

    from omniep import torch as ep
    from omniep.ep_core.errors import OmniEPError

    try:
        ep.destroy()
    except OmniEPError:
        pass  # (raised before, where the test saw it)
    dist.destroy_process_group()


def _gpu_bytes() -> int:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _faulty_ops(rank: int, world: int, args: tuple, victim: int, how: str, when: str) -> dict:
    """The ops of the faulty group, from the warm-up to the fault: what this rank saw (plain data only,
    so that nothing of the group outlives the call)."""
    from omniep import torch as ep
    from omniep.ep_core.errors import OmniEPError

    def fail_here(stage: str) -> None:
        if rank == victim and when == stage:
            if how == "kill":
                os._exit(9)
            time.sleep(float(os.environ["FAULT_STALL_S"]))

    res = dict(rank=rank, error=None)
    start = time.monotonic()
    try:
        warm = ep.dispatch(*args, num_experts=2 * world)  # the group works before the fault
        ep.combine(warm.recv_x, warm.handle)
        start = time.monotonic()
        fail_here("dispatch")
        d = ep.dispatch(*args, num_experts=2 * world)
        fail_here("combine")
        ep.combine(d.recv_x, d.handle)
    except OmniEPError as exc:
        res.update(error=type(exc).__name__, message=str(exc), peers=getattr(exc, "peers", None),
                   seconds=time.monotonic() - start)
    if res["error"] is not None:
        again = time.monotonic()
        try:
            ep.dispatch(*args, num_experts=2 * world)
            res["again"] = None
        except OmniEPError as exc:
            res.update(again=type(exc).__name__, again_message=str(exc), again_seconds=time.monotonic() - again)
    return res


def fault_rank(rank: int, world: int, ports: tuple, victim: int, how: str, when: str, out_dir: str,
               device: str = "cpu") -> None:
    """A healthy group on ``ports[0]`` (dispatch + combine, torn down: the file descriptors after it are
    the baseline — the first use of torch.distributed and omniep opens some for good), then a group on
    ``ports[1]`` in which rank ``victim`` fails (``how``: "kill" or "stall") ``when`` ("dispatch": before
    its dispatch; "combine": after it, before its combine). Every rank writes ``rank{r}.json`` unless
    killed; ``fds`` = [after the healthy group, after the faulty one], results released both times, and
    ``gpu_bytes`` likewise (``device="cuda"``: every rank on GPU 0; 0 on the CPU)."""
    import gc

    import torch

    from omniep import torch as ep

    gen = torch.Generator().manual_seed(rank)
    args = tuple(t.to(device) for t in (torch.randn(4, 8, generator=gen),
                                        torch.randint(0, 2 * world, (4, 2), generator=gen),
                                        torch.rand(4, 2, generator=gen)))
    _group(rank, world, ports[0])
    d = ep.dispatch(*args, num_experts=2 * world)
    ep.combine(d.recv_x, d.handle)
    del d
    _teardown()
    gc.collect()
    fds_before, gpu_before = _fds(), _gpu_bytes()
    _group(rank, world, ports[1])
    try:
        res = _faulty_ops(rank, world, args, victim, how, when)
    finally:
        _teardown()
    gc.collect()
    res["fds"] = [fds_before, _fds()]
    res["gpu_bytes"] = [gpu_before, _gpu_bytes()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def data_faults(rank: int, world: int, port: int) -> dict:
    """Faults in the data and in the order of calls, on a healthy group (every rank runs this):

    * ``nan_weights``: one routing weight of token 0 on rank 1 is NaN. Expert-major combine applies the
      weights, so rank 1's row 0 turns NaN and nothing else may change: every other output must have the
      bits of the same ops with clean weights.
    * ``nan_rows``: rank 0's token 1 holds a NaN in x (rank-major): dispatch and combine move it as data;
      only the received rows and outputs that carry that token may differ from the clean run.
    * ``destroyed``: ``omniep.torch.destroy()`` between a dispatch and its combine: the combine raises
      ``DestroyedError`` on every rank (no hang, no crash), and the next dispatch on the group works.
    Returned as plain data: per case, what differed, and the error seen."""
    import numpy as np
    import torch

    from omniep import torch as ep
    from omniep.ep_core.errors import OmniEPError

    _group(rank, world, port)
    E, T, K, H = 2 * world, 6, 2, 8
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    out = {}
    try:
        def em_pair(weights):
            d = ep.dispatch(x, idx, weights, num_experts=E, layout="expert_major")
            return ep.combine(d.recv_x * 2.0, d.handle).numpy()

        clean = em_pair(w)
        bad_w = w.clone()
        if rank == 1:
            bad_w[0, 0] = float("nan")
        dirty = em_pair(bad_w)
        nan_rows = np.isnan(dirty).any(axis=1)
        same = np.array_equal(clean[~nan_rows].view(np.int32), dirty[~nan_rows].view(np.int32))
        out["nan_weights"] = dict(nan_rows=np.flatnonzero(nan_rows).tolist(), others_bitwise=bool(same),
                                  all_nan=bool(np.isnan(dirty[nan_rows]).all()))

        def rm_pair(rows):
            d = ep.dispatch(rows, idx, w, num_experts=E)
            return d.recv_x.numpy(), ep.combine(d.recv_x, d.handle).numpy()

        clean_recv, clean_out = rm_pair(x)
        bad_x = x.clone()
        if rank == 0:
            bad_x[1, 3] = float("nan")
        dirty_recv, dirty_out = rm_pair(bad_x)
        recv_nan = np.isnan(dirty_recv).any(axis=1)
        out_nan = np.isnan(dirty_out).any(axis=1)
        out["nan_rows"] = dict(
            recv_nan_rows=int(recv_nan.sum()), out_nan_rows=np.flatnonzero(out_nan).tolist(),
            recv_others_bitwise=bool(np.array_equal(clean_recv[~recv_nan].view(np.int32),
                                                    dirty_recv[~recv_nan].view(np.int32))),
            out_others_bitwise=bool(np.array_equal(clean_out[~out_nan].view(np.int32),
                                                   dirty_out[~out_nan].view(np.int32))))

        d = ep.dispatch(x, idx, w, num_experts=E)
        ep.destroy()
        try:
            ep.combine(d.recv_x, d.handle)
            out["destroyed"] = dict(error=None)
        except OmniEPError as exc:
            out["destroyed"] = dict(error=type(exc).__name__, message=str(exc))
        again = ep.dispatch(x, idx, w, num_experts=E)  # a new context of the same group
        back = ep.combine(again.recv_x, again.handle).numpy()
        out["destroyed"]["after"] = bool(np.array_equal(back.view(np.int32), clean_out.view(np.int32)))
    finally:
        _teardown()
    return out


def run_fault_group(world: int, victim: int, how: str, when: str, out_dir, env: dict, device: str = "cpu",
                    hang_s: float = 90.0, target=None) -> dict:
    """Parent side: ``world`` spawned ``target`` processes (:func:`fault_rank`, or another function of
    its signature) with ``env`` added to their environment; returns what every rank that lived wrote, by
    rank. Fails if any is still alive after ``hang_s`` (a hang) or a child process is left behind."""
    target = target or fault_rank
    from omniep.testing.procs import CHILD_ENV, free_port

    env = dict(CHILD_ENV, **env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children inherit the parent's environment at start
    ctx, ports = mp.get_context("spawn"), (free_port(), free_port())
    try:
        procs = [ctx.Process(target=target, args=(r, world, ports, victim, how, when, str(out_dir), device))
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    deadline = time.monotonic() + hang_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish: a hang"
    assert not mp.active_children()
    out = {}
    for r in range(world):
        path = os.path.join(str(out_dir), f"rank{r}.json")
        if os.path.exists(path):  # a killed rank wrote nothing
            with open(path) as f:
                out[r] = json.load(f)
    return out
