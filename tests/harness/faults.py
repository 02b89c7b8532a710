"""Worker side of tests/faults/: one gloo rank of a group in which one rank fails on purpose — it dies
(``os._exit``) or stalls (sleeps with its sockets open) before a dispatch or before a combine — and
what the other ranks saw: the error, whom it names, how long it took, whether the next op raised at
once, and the process's open file descriptors before the group and after its teardown."""

from __future__ import annotations

import datetime
import json
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


def fault_rank(rank: int, world: int, ports: tuple, victim: int, how: str, when: str, out_dir: str) -> None:
    """A healthy group on ``ports[0]`` (dispatch + combine, torn down: the file descriptors after it are
    the baseline — the first use of torch.distributed and omniep opens some for good), then a group on
    ``ports[1]`` in which rank ``victim`` fails (``how``: "kill" or "stall") ``when`` ("dispatch": before
    its dispatch; "combine": after it, before its combine). Every rank writes ``rank{r}.json`` unless
    killed; ``fds`` = [after the healthy group, after the faulty one], results released both times."""
    import gc

    import torch

    from omniep import torch as ep

    gen = torch.Generator().manual_seed(rank)
    args = (torch.randn(4, 8, generator=gen), torch.randint(0, 2 * world, (4, 2), generator=gen),
            torch.rand(4, 2, generator=gen))
    _group(rank, world, ports[0])
    d = ep.dispatch(*args, num_experts=2 * world)
    ep.combine(d.recv_x, d.handle)
    del d
    _teardown()
    gc.collect()
    fds_before = _fds()
    _group(rank, world, ports[1])
    try:
        res = _faulty_ops(rank, world, args, victim, how, when)
    finally:
        _teardown()
    gc.collect()
    res["fds"] = [fds_before, _fds()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
