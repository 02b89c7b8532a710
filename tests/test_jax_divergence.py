"""Ranks that disagree (issue 13, item 6): two ``jax.distributed`` CPU processes (gloo, 2 devices each,
one 4-rank EP mesh) where the second calls dispatch / combine with a different num_experts, hidden
size, dtype, layout, capacity, top-k, or combine hidden size / dtype, or passes one bad expert id.

Every case must end, on every process, in a clear error naming the rank and the differing field: with
``OMNIEP_CHECKS=sync`` raised from the jitted call; in the default mode (one case per failure kind) as a
status that ``omniep.jax.check`` raises, the statuses equal word for word to the reference comparison
and the failed ops having moved nothing. Never a hang (``run_ranks``' deadline), never a crash, never
silent values. All cases run in one pair of processes, each traced and compiled on its own."""

import multiprocessing
import re

import pytest

from omniep.ep_core import descriptor as dsc
from harness import jax_divergence as jd
from omniep.testing.procs import run_ranks

WORLD, DEVICES = 2, 2
ENV = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
RANKS = WORLD * DEVICES
RUNS = [(case, mode) for case in jd.CASES for mode in case.modes]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results():
    out = run_ranks(jd.mp_divergence, WORLD, env=ENV, timeout=400)
    assert not multiprocessing.active_children()
    return out


def params_per_rank(case):
    """What each rank ran: the last process's ranks apply the case's change."""
    return [case.params(last=r >= RANKS - DEVICES) for r in range(RANKS)]


def records(results, case, mode):
    got = []
    for proc in results:
        (rec,) = [r for r in proc["records"] if r["case"] == case.name and r["mode"] == mode]
        got.append((proc["local_ranks"], rec))
    return got


def expected_message(case, rank):
    """The start of the error every rank must raise (descriptor.error_from_status's wording)."""
    if case.field is None:
        bad_rank, bad_id = case.change["bad"][0] % RANKS, case.change["bad"][1]
        return (rf"InputError: rank {bad_rank} rejected its input in dispatch #0 \(seen on rank {rank}\): "
                rf"topk_idx holds expert id {bad_id}")
    others = [r for r in range(RANKS) if (r >= RANKS - DEVICES) != (rank >= RANKS - DEVICES)]
    return (rf"RankMismatchError: rank {rank}: its {case.op} #0 does not match what rank\(s\) "
            rf"{re.escape(str(others))} sent: fields that differ: .*\(first: {case.field} = ")


def test_every_case_ran_on_every_process_in_bounded_time(results):
    assert [p["process"] for p in results] == list(range(WORLD))
    assert [p["local_ranks"] for p in results] == [[0, 1], [2, 3]]
    for proc in results:
        assert [(r["case"], r["mode"]) for r in proc["records"]] == [(c.name, m) for c, m in RUNS]
        for rec in proc["records"]:
            assert rec["seconds"] < 60, rec  # compile + run; a hang would have hit run_ranks' deadline


@pytest.mark.parametrize("case", [c for c in jd.CASES if "sync" in c.modes], ids=lambda c: c.name)
def test_sync_mode_raises_on_every_process(results, case):
    for local_ranks, rec in records(results, case, "sync"):
        assert rec["raised"] is not None, f"{case.name}: no error on ranks {local_ranks}: {rec}"
        assert rec["raised"]["type"] == "JaxRuntimeError"
        message = rec["raised"]["message"]
        assert "CpuCallback error calling callback" in message
        # the error of one of this process's ranks (whichever device's callback failed first)
        assert any(re.search(expected_message(case, r), message) for r in local_ranks), message


@pytest.mark.parametrize("case", [c for c in jd.CASES if "default" in c.modes], ids=lambda c: c.name)
def test_default_mode_returns_the_status_and_check_raises(results, case):
    want_dispatch, want_combine = jd.reference_statuses(params_per_rank(case))
    for local_ranks, rec in records(results, case, "default"):
        assert rec["raised"] is None, rec["raised"]
        assert sorted(rec["ranks"]) == local_ranks
        # check() of the global status array raises on every process: its first rank's error
        whole = rec["check"]["status" if case.op == "dispatch" else "combine_status"]
        assert whole is not None and re.match(expected_message(case, local_ranks[0]),
                                              f"{whole['type']}: {whole['message']}"), whole
        for r, facts in rec["ranks"].items():
            # word for word what the reference comparison gives this rank
            assert facts["status"] == want_dispatch[r] and facts["combine_status"] == want_combine[r], (r, facts)
            failed = facts["error"] if case.op == "dispatch" else facts["combine_error"]
            assert failed is not None, (r, facts)
            assert re.match(expected_message(case, r), f"{failed['type']}: {failed['message']}"), failed
            if case.field is not None:
                assert failed["rank"] == r and case.field in failed["fields"], failed
                last = RANKS - DEVICES  # the first rank of the last process
                assert failed["ranks"] == [q for q in range(RANKS) if (q >= last) != (r >= last)]
            # a failed op moved nothing; a dispatch that agreed moved its rows
            assert facts["combine_moved_nothing"]
            assert facts["dispatch_moved_nothing"] == (case.op == "dispatch"), facts
            if case.op == "combine":
                assert facts["error"] is None and not any(facts["status"])
            else:
                assert facts["combine_error"]["type"] == failed["type"]


def test_the_failure_kinds_are_all_covered():
    kinds = {(c.op, c.field is None) for c in jd.CASES if "default" in c.modes}
    assert kinds == {("dispatch", False), ("combine", False), ("dispatch", True)}
    assert {c.field for c in jd.CASES} >= {"num_experts", "hidden", "dtype", "layout", "capacity"}
    assert {dsc.StatusCode.RANK_MISMATCH, dsc.StatusCode.BAD_INPUT} == {
        dsc.StatusCode.BAD_INPUT if c.field is None else dsc.StatusCode.RANK_MISMATCH for c in jd.CASES}
