"""Ranks that disagree through ``omniep.jax`` on ``cuda_nvshmem`` (issue 13, items 3 and 6): two JAX
processes on GPU 0 (CUDA IPC), the second dispatching with another hidden size or num_experts,
combining with another hidden size, or passing one expert id outside ``[-1, E)``.

The kernels compare the op descriptors at the op's first barrier: every rank must report the failure in
its status (``omniep.jax.check`` raises ``RankMismatchError`` naming the rank, the other rank and the
field first differing, or ``InputError`` naming the rank with the bad id), with ``OMNIEP_CHECKS=sync``
the jitted call itself must raise it, and nothing may hang (``run_ranks``' deadline, the kernels'
``OMNIEP_TIMEOUT_S``). A bad id fails only its op: the session goes on. A rank mismatch fails the
group for good, so each session ends with one."""

from __future__ import annotations

import re

import pytest

from harness.jax_mp_workers import gpu_session_env
from omniep.testing.procs import gpu_count, run_ranks

pytestmark = pytest.mark.gpu
pytest.importorskip("jax")
harness = pytest.importorskip("harness.jax_native_divergence")

WORLD = 2
# XLA:GPU shares autotuning results between the processes of a job through the distributed KV store,
# per compiled module: a process compiling a program the others never compile waits for them forever,
# in compilation, before any op runs (seen on jax 0.11.2). Divergent programs need it off.
NO_SHARDED_AUTOTUNING = "--xla_gpu_shard_autotuning=false"
SESSIONS = {
    "bad_id_then_hidden": (("bad_expert_id", "default"), ("bad_expert_id", "sync"),
                           ("bad_expert_id_expert_major", "default"), ("hidden", "default")),
    "combine_hidden_sync": (("combine_hidden", "sync"),),
    "num_experts": (("num_experts", "default"),),
}


@pytest.fixture(scope="module", params=list(SESSIONS))
def session(request):
    import importlib.util

    if importlib.util.find_spec("omniep._native_jax") is None:
        pytest.skip("omniep._native_jax not built")
    if gpu_count() < 1:
        pytest.skip("no GPU visible")
    runs = SESSIONS[request.param]
    results = run_ranks(harness.session, WORLD, args=(runs, False), timeout=150,
                        env={**gpu_session_env("cuda_nvshmem"), "OMNIEP_TIMEOUT_S": "10", "XLA_FLAGS": NO_SHARDED_AUTOTUNING})
    assert [r["process"] for r in results] == list(range(WORLD))
    return runs, results


def _other(rank: int) -> int:
    return 1 - rank


def _mismatch(rank: int, field: str) -> str:
    return (rf"rank {rank}: its \w+ #\d+ does not match what rank\(s\) \[{_other(rank)}\] sent: "
            rf"fields that differ: .*\(first: {field} = ")


BAD = r"rank 1 rejected its input in \w+ #\d+ \(seen on rank {rank}\): topk_idx holds expert id 1000"


def test_every_rank_reports_the_failure(session):
    """Every run of the session, in order; in the first session the hidden-size mismatch after the
    bad-id runs must be reported as itself (BAD_INPUT is not sticky: the bad id failed only its op)."""
    runs, results = session
    for i, (name, mode) in enumerate(runs):
        for rank, proc in enumerate(results):
            rec = proc["records"][i]
            assert (rec["case"], rec["mode"]) == (name, mode)
            field = {"hidden": "hidden", "combine_hidden": "hidden", "num_experts": "num_experts"}.get(name)
            want = BAD.format(rank=rank) if field is None else _mismatch(rank, field)
            kind = "InputError" if field is None else "RankMismatchError"
            if mode == "sync":
                assert rec["raised"] is not None, rec
                assert re.search(rf"{kind}: {want}", rec["raised"]["message"]), rec["raised"]["message"][-2000:]
                continue
            assert rec["raised"] is None, rec["raised"]
            (facts,) = rec["ranks"].values()
            which = "combine_error" if name.startswith("combine") else "error"
            err = facts[which]
            assert err is not None and err["type"] == kind, facts
            assert re.search(want, err["message"]), err["message"]
            # check() on the global status raises the same for this process's rank
            assert rec["check"]["status" if which == "error" else "combine_status"]["type"] == kind
            if name.startswith("combine"):
                assert facts["error"] is None, facts  # the dispatch itself agreed
            if name.startswith("bad_expert_id"):
                # the failed prepare left a handle that routes nothing: the combine in the same
                # program moved nothing and returned the bias
                assert facts["combine_moved_nothing"], facts

