"""Backend selection (DESIGN §6): OMNIEP_BACKEND, auto's single log line, reasons, UnsupportedError."""

import logging

import pytest

from omniep.ep_core import Capabilities, Layout, registry
from omniep.ep_core.errors import BackendUnavailableError, InputError, UnsupportedError

FRAMEWORKS = ("jax", "torch")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unknown_backend_names_the_variable_and_the_known_ones(framework, monkeypatch):
    monkeypatch.setenv("OMNIEP_BACKEND", "nvshmem_typo")
    with pytest.raises(InputError, match="OMNIEP_BACKEND='nvshmem_typo' is not valid: expected one of auto, "
                                         "cuda_nvshmem, .*collective"):
        registry.select_backend(framework)
    with pytest.raises(InputError, match="unknown backend 'nvshmem_typo'.*collective"):  # a per-call name
        registry.select_backend(framework, "nvshmem_typo")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_backend_names_ignore_case_and_whitespace(framework, monkeypatch):
    monkeypatch.setenv("OMNIEP_BACKEND", "  COLLECTIVE \n")
    assert registry.select_backend(framework).name == "collective"
    monkeypatch.setenv("OMNIEP_BACKEND", "   ")  # blank: the default, auto
    assert registry.select_backend(framework).name == "collective"
    assert registry.select_backend(framework, " Collective").name == "collective"


@pytest.mark.parametrize("name, raw, match", [
    ("OMNIEP_CHECKS", "loud", "OMNIEP_CHECKS='loud' is not valid: expected one of default, sync"),
    ("OMNIEP_TIMEOUT_S", "-3", "OMNIEP_TIMEOUT_S='-3' is not valid: expected a number of seconds > 0"),
    ("OMNIEP_TIMEOUT_S", "soon", "expected a number of seconds"),
    ("OMNIEP_TRANSPORT", "rdma", "expected one of ipc, nvshmem"),
    ("OMNIEP_FORCE_REMOTE", "yes", "OMNIEP_FORCE_REMOTE='yes' is not valid: expected 0 or 1"),
    ("OMNIEP_FUSED_COPY_BYTES", "4MB", "expected a whole number of bytes"),
])
def test_every_variable_rejects_what_it_does_not_accept(name, raw, match, monkeypatch):
    from omniep.ep_core import env

    monkeypatch.setenv(name, raw)
    with pytest.raises(InputError, match=match):
        env.get(name)
    monkeypatch.setenv(name, f"  {env.VARIABLES[name].default.upper()}  ")
    env.get(name)  # the default, spelled loosely, is accepted


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_named_backend_that_cannot_run_raises_with_reason(framework, monkeypatch):
    monkeypatch.setenv("OMNIEP_BACKEND", "rocm_rocshmem")
    with pytest.raises(BackendUnavailableError, match="rocm_rocshmem.*not available here: .+"):
        registry.select_backend(framework)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_auto_falls_back_to_collective_and_logs_once(framework, monkeypatch, caplog):
    monkeypatch.delenv("OMNIEP_BACKEND", raising=False)
    monkeypatch.setattr(registry, "_auto_logged", set())
    with caplog.at_level(logging.INFO, logger="omniep"):
        first = registry.select_backend(framework)
        second = registry.select_backend(framework, "auto")
    assert first is second and first.name == "collective" and first.framework == framework
    lines = [r.getMessage() for r in caplog.records if "backend chosen" in r.getMessage()]
    assert lines == [f"omniep: backend chosen for {framework}: collective (passed over: cuda_nvshmem, nccl_ep, "
                     f"rocm_rocshmem, nccl_ep_lib; `omniep info` says why)"], lines


def test_per_call_name_overrides_environment(monkeypatch):
    monkeypatch.setenv("OMNIEP_BACKEND", "rocm_rocshmem")
    assert registry.select_backend("jax", "collective").name == "collective"


def test_report_lists_every_backend_with_a_reason():
    rep = registry.report()
    assert set(rep) == {"collective", "cuda_nvshmem", "nccl_ep", "rocm_rocshmem", "nccl_ep_lib"}
    for per_fw in rep.values():
        for avail in per_fw.values():
            assert avail.reason.strip()
    assert rep["collective"]["jax"].available and rep["collective"]["torch"].available


class _RankMajorOnly:
    """A backend class as the registry sees it, serving only the rank-major layout."""

    name = "rank_major_only"
    framework = "jax"

    @classmethod
    def capabilities(cls):
        return Capabilities(layouts=(Layout.RANK_MAJOR,), max_ranks=4)


def test_unsupported_request_names_backend_feature_and_alternatives(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "rank_major_only", {"jax": "test_registry:_RankMajorOnly"})
    with pytest.raises(UnsupportedError, match="'rank_major_only' does not support layout expert_major; "
                                               "backends that serve it: cuda_nvshmem, nccl_ep, rocm_rocshmem, "
                                               "nccl_ep_lib, collective"):
        registry.require(_RankMajorOnly, "jax", layout=Layout.EXPERT_MAJOR)
    with pytest.raises(UnsupportedError, match="8 ranks"):
        registry.require(_RankMajorOnly, "jax", num_ranks=8)
    registry.require(_RankMajorOnly, "jax", layout=Layout.RANK_MAJOR, num_ranks=4)  # served: no error


class _GpuOnly:
    """A backend class as the registry sees it: available, but only for arrays on a GPU."""

    name = "gpu_only"
    framework = "torch"

    @classmethod
    def availability(cls):
        from omniep.ep_core import Availability

        return Availability(True, "test backend")

    @classmethod
    def capabilities(cls):
        return Capabilities(devices=("gpu",))


def test_auto_skips_a_backend_that_does_not_serve_the_device(monkeypatch, caplog):
    """An available GPU-only backend ahead of collective is skipped for CPU tensors, and auto says why;
    named, it raises UnsupportedError naming the device and who serves it."""
    monkeypatch.delenv("OMNIEP_BACKEND", raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", {"gpu_only": {"torch": "test_registry:_GpuOnly"},
                                                **registry._REGISTRY})
    monkeypatch.setattr(registry, "_auto_logged", set())
    with caplog.at_level(logging.DEBUG, logger="omniep"):  # the reasons: the debug line under the choice
        assert registry.select_backend("torch", device="cpu").name == "collective"
    assert "gpu_only: does not serve arrays on cpu" in caplog.text
    assert registry.select_backend("torch", device="cuda").name == "gpu_only"
    with pytest.raises(UnsupportedError, match="'gpu_only' does not support arrays on cpu.*collective"):
        registry.select_backend("torch", "gpu_only", device="cpu")
