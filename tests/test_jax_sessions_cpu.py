"""The JAX GPU sessions' own checks, run on CPU over the collective backend (real XLA CPU devices).

:func:`harness.jax_mp_workers.jax_single_controller_session` is what the GPU tests run for the
native JAX backends; here it runs with ``OMNIEP_BACKEND=collective`` on two XLA CPU devices in a child
process, so its cases (both layouts, drops, odd rows, int64 ids), golden files and fp8 check are known
to hold against the reference before a GPU sees them: a failure on a GPU then points at the native code.
"""

from __future__ import annotations

import pytest

from harness.jax_mp_workers import check_session_results, golden_names, jax_single_controller_session, session_cases
from omniep.testing.procs import run_ranks

pytest.importorskip("jax")


def test_single_controller_session_over_collective_on_cpu():
    cases, names = session_cases(2), golden_names(2)
    assert {c.layout.value for c, *_ in cases} == {"rank_major", "expert_major"}
    assert any(n.startswith("em_") for n in names) and any(n.startswith("rm_") for n in names)
    env = {"OMNIEP_BACKEND": "collective", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    results = run_ranks(jax_single_controller_session, 1, args=(cases, names, 2), timeout=600, env=env)
    assert len(results) == 1
    check_session_results(results, 2, cases, names)  # the checker the GPU tests use
