"""Run one function on R local processes (gloo ranks, JAX processes) with a deadline.

A failing rank fails the whole run promptly with its traceback; a rank that hangs becomes a
:class:`~omniep.ep_core.errors.PeerTimeoutError` naming it; no child outlives :func:`run_ranks`, nor
(on Linux) the process that called it, however that process ends.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional

from ..ep_core.errors import OmniEPError, PeerTimeoutError

# Variables every child gets: keep NVLink multicast off on shared GPU hosts, one CPU thread per rank.
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "OMP_NUM_THREADS": "1",
}


class RankFailedError(OmniEPError, RuntimeError):
    """A rank of a multi-process run raised or died; carries its rank and traceback."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Defaults a child takes unless the parent's environment (or ``env``) says otherwise: every op of the
# multi-process runs raises what it finds at once (DESIGN §9; the test suites' mode).
CHILD_DEFAULTS = {"OMNIEP_CHECKS": "sync"}


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (PR_SET_PDEATHSIG). A
    parent killed outright (SIGKILL) runs none of :func:`run_ranks`' cleanup, and its ranks -- JAX or
    torch processes, possibly spinning in a GPU kernel for a peer that is gone -- would keep running and
    slow whatever the GPU runs next."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:  # PR_SET_PDEATHSIG = 1
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


def _child(target, rank, world, port, args, env, results, parent=None):
    if parent is not None:
        _die_with_parent(parent)
    for key, value in CHILD_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.update(env)
    try:
        results.put((rank, True, target(rank, world, port, *args)))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target: Callable[..., Any], world: int, *, args: tuple = (), timeout: float = 120.0,
              env: Optional[dict] = None) -> list:
    """Call ``target(rank, world, port, *args)`` in ``world`` spawned processes; return results by rank.

    ``target`` must be importable (module level) and its result picklable. ``port`` is a free TCP port
    on localhost for the ranks' rendezvous.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {**CHILD_ENV, **(env or {})}
    procs = [ctx.Process(target=_child, args=(target, r, world, port, args, child_env, results, os.getpid()),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and p.exitcode != 0:
                        # Give a crashed child's last message a moment to arrive.
                        try:
                            rank, ok, value = results.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailedError(r, f"process exited with code {p.exitcode}") from None
                        break
                else:
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world) if r not in out]
                        raise PeerTimeoutError(missing[0], None, timeout,
                                               what=f"multi-process run (ranks {missing} unfinished)")
                    continue
            if not ok:
                raise RankFailedError(rank, value)
            out[rank] = value
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()


def gpu_count() -> int:
    """NVIDIA GPUs on this host per ``nvidia-smi -L`` (0 without it), without initialising CUDA or JAX
    in the calling process (tests decide what to skip before spawning children)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())
