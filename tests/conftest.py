"""Test session setup: 8 virtual XLA CPU devices (must precede any jax import), OMNIEP_CHECKS=sync and
hypothesis profiles."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every op raises what it finds at once (DESIGN §9); spawned ranks inherit it (omniep.testing.procs).
os.environ.setdefault("OMNIEP_CHECKS", "sync")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# The shared native multi-process checks (tests/harness/mp_suite.py): keep pytest's assertion messages there.
pytest.register_assert_rewrite("harness.mp_suite")

# "ci" keeps the suite inside CI's budget on 2 cores; OMNIEP_HYPOTHESIS=thorough for long runs.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("OMNIEP_HYPOTHESIS", "ci"))


@pytest.fixture
def record_golden():
    """``record_golden(backend, framework, names, device="cpu")``: note on this machine that ``backend``
    reproduced those golden sets bit for bit (call it after the assertions; ``omniep info`` lists them)."""
    from omniep.tools.golden_record import record

    def _record(backend: str, framework: str, names, device: str = "cpu") -> None:
        record(backend, framework, list(names), device)

    return _record


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A torch.distributed gloo group of this process alone (rank 0 of 1), for the module's tests."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
