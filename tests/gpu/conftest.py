"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest

# Shared checks that live in the package: keep pytest's assertion messages there (before any import of it).
pytest.register_assert_rewrite("harness.virtual_rank_checks")


@pytest.fixture
def native_pair():
    """``native_pair(session, args)``: each rank's result of ``session(rank, world, port, *args)`` (a harness
    function) in two processes sharing GPU 0 on cuda_nvshmem's torch ops over CUDA IPC, with
    ``OMNIEP_CHECKS=sync`` (or ``checks``) and a 20 s peer timeout. Skips without a GPU or
    omniep._native_torch."""
    from omniep.testing.procs import gpu_count, run_ranks

    if gpu_count() < 1:
        pytest.skip("no NVIDIA GPU")
    pytest.importorskip("omniep._native_torch")

    def run(session, args: tuple, checks: str = "sync") -> list:
        return run_ranks(session, 2, args=args, timeout=300,
                         env={"OMNIEP_BACKEND": "cuda_nvshmem", "OMNIEP_CHECKS": checks, "OMNIEP_TIMEOUT_S": "20"})
    return run


@pytest.fixture(scope="module")
def group():
    """``group(num_ranks)``: one VirtualRanks of that size per test module, created on first use.

    Workspaces are reused across the module's tests (allocating them per test would dominate the run
    time); every group is destroyed when the module's tests are done.
    """
    from omniep.native.virtual_ranks import VirtualRanks  # needs omniep._native: import only when used

    groups: dict = {}

    def get(num_ranks: int) -> VirtualRanks:
        if num_ranks not in groups:
            groups[num_ranks] = VirtualRanks(num_ranks, timeout_s=20.0)
        return groups[num_ranks]

    yield get
    for g in groups.values():
        g.destroy()
