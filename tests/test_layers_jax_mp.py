"""omniep.layers.jax across processes: 2 JAX processes over jax.distributed on localhost (gloo CPU
collectives), 2 CPU devices each; the MoE layer against the dense oracle (tests/harness/jax_layer_workers.py).
Apart from tests/test_layers_jax.py to keep that file's time; runs in the default ``pytest`` invocation."""

import pytest

from harness import jax_layer_workers
from omniep.testing.procs import run_ranks


@pytest.mark.slow
def test_two_processes_match_the_reference():
    """2 JAX processes (jax.distributed, gloo), 2 CPU devices each: a 4-rank EP mesh, then EP groups that
    span the processes with FSDP over the data axis; each process compares against the oracle."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    results = run_ranks(jax_layer_workers.mp_layer_cases, 2, env=env, timeout=240)
    assert [r["process"] for r in results] == [0, 1]
    for res in results:
        assert res["num_devices"] == 4 and res["checked"] == ["ep", "ep_x_fsdp"]
