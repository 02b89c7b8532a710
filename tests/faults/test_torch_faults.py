"""Faults on the collective backend (PyTorch, gloo, CPU): a rank that dies or stalls in the middle of a
dispatch or a combine (DESIGN §9, issue 15). Every other rank ends in the documented error within the
timeout, naming the rank that failed and the op; the group then raises at once instead of hanging again;
no process is left behind and no file descriptor leaks."""

from __future__ import annotations

import pytest

harness = pytest.importorskip("harness.faults")
pytest.importorskip("torch")

WORLD, TIMEOUT_S, STALL_S = 3, 3.0, 8.0


def _run(victim: int, how: str, when: str, tmp_path) -> dict:
    env = dict(OMNIEP_TIMEOUT_S=str(TIMEOUT_S), OMNIEP_CHECKS="sync", OMNIEP_BACKEND="collective",
               FAULT_STALL_S=str(STALL_S))
    return harness.run_fault_group(WORLD, victim, how, when, tmp_path, env)


@pytest.mark.parametrize("when", ["dispatch", "combine"])
def test_a_killed_rank_is_named_by_every_survivor(tmp_path, when):
    res = _run(1, "kill", when, tmp_path)
    assert sorted(res) == [0, 2]  # rank 1 died without a word
    for r, out in res.items():
        assert out["error"] == "PeerFailedError" and out["peers"] == [1], out
        assert f"rank {r}: {when} #" in out["message"] and "peer rank 1 stopped answering" in out["message"], out
        assert out["seconds"] < TIMEOUT_S, out  # noticed by the transport, not by waiting the timeout out
        assert out["again"] == "PeerFailedError" and out["again_seconds"] < 0.5, out  # no second wait
        assert out["fds"][1] <= out["fds"][0], f"rank {r} leaked file descriptors: {out['fds']}"


@pytest.mark.parametrize("when", ["dispatch", "combine"])
def test_a_stalled_rank_is_a_timeout_naming_it(tmp_path, when):
    res = _run(2, "stall", when, tmp_path)
    assert sorted(res) == [0, 1, 2]
    for r in (0, 1):
        out = res[r]
        assert out["error"] == "PeerTimeoutError" and out["peers"] == [2], out
        assert f"{when} #" in out["message"] and f"timed out after {TIMEOUT_S:g} s waiting for peer rank 2" \
            in out["message"], out
        assert TIMEOUT_S <= out["seconds"] < TIMEOUT_S + 3, out  # the timeout, plus the short roll call
        assert out["again"] == "PeerTimeoutError" and out["again_seconds"] < 0.5, out
        assert out["fds"][1] <= out["fds"][0], f"rank {r} leaked file descriptors: {out['fds']}"
    # The stalled rank wakes up to a group its peers have left: it raises a peer error, or — when every
    # peer had sent its rows before giving up (a stall before the combine) — completes with all of them;
    # either way it returns (no hang: _run checked) and leaks nothing.
    late = res[2]
    assert late["error"] in (None, "PeerFailedError", "PeerTimeoutError"), late
    assert late["fds"][1] <= late["fds"][0], late


def test_the_store_host_dying_still_fails_promptly(tmp_path):
    """Rank 0 hosts the group's store (init_method tcp://): when it dies the roll call has nowhere to
    meet, so the survivors cannot tell who died — but they still fail promptly with PeerFailedError,
    and the group stays failed."""
    res = _run(0, "kill", "dispatch", tmp_path)
    assert sorted(res) == [1, 2]
    for r, out in res.items():
        assert out["error"] == "PeerFailedError", out
        assert out["peers"] == [] and "store is unreachable too" in out["message"], out
        assert out["seconds"] < TIMEOUT_S, out
        assert out["again"] == "PeerFailedError" and out["again_seconds"] < 0.5, out
