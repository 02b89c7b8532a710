"""omniep.jax across processes: 2 JAX processes over jax.distributed on localhost (gloo CPU collectives),
2 CPU devices each, one 4-device EP mesh. Runs in the default ``pytest`` invocation."""

import multiprocessing
import time

import pytest

from harness import jax_workers
from omniep.testing.procs import RankFailedError, run_ranks

WORLD = 2
# Set in each child before it imports jax (run_ranks applies env first).
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow
def test_two_processes_dispatch_combine_and_grads_match_reference():
    results = run_ranks(jax_workers.mp_check_cases, WORLD, env=ENV, timeout=240)
    assert [r["process"] for r in results] == [0, 1]
    for proc, res in enumerate(results):
        assert res["num_devices"] == 4 and res["local_devices"] == 2
        assert len(res["checked"]) == 4
        for entry in res["checked"]:
            # each process checked exactly the two ranks whose devices it holds
            assert entry["ranks"] == [2 * proc, 2 * proc + 1], entry
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_a_failing_rank_fails_promptly_and_no_child_survives():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="InputError: num_experts=9 is not a multiple") as info:
        run_ranks(jax_workers.mp_fail_on_rank, WORLD, args=(1,), env=ENV, timeout=240)
    assert info.value.rank == 1
    # Rank 0 is left waiting in the exchange; run_ranks must not wait for it (or for the timeout).
    assert time.monotonic() - start < 90
    assert not multiprocessing.active_children()
