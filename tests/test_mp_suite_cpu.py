"""The shared multi-process GPU suite (:mod:`harness.mp_suite`) on the CPU: its workers, cases
(both layouts: hypothesis-drawn, edge, static capacity with drops, fp8, golden vectors), expectations
and checks run end to end over the ``collective`` backend on gloo, which matches the reference bit for
bit. So the suite is known to be right before it runs on a GPU, where a failure then points at the
native backend under test (tests/gpu/test_native_multiprocess.py, tests/gpu/test_nccl_ep.py,
tests/rocm). The missing-peer job needs device-side waits and runs on GPUs only."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from harness import mp_suite  # noqa: E402


@pytest.fixture(scope="module")
def session():
    return mp_suite.run_session(2, False, {"OMNIEP_BACKEND": "collective"}, on_cpu=True)


def test_case_mix_has_both_layouts(session):
    _, jobs, _ = session
    for key in ("frontend", "backend", "golden"):
        assert {job["case"].layout for job in jobs[key]} == set(mp_suite.LAYOUTS), key
    assert any(job["case"].dtype == "float8_e4m3fn" and job["case"].layout == mp_suite.EM for job in jobs["backend"])


class TestSession(mp_suite.SessionChecks):
    """The session checks on ``session`` except the missing peer (the CPU session has no missing-peer job)."""
