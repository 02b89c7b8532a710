"""``nccl_ep`` without a GPU (or without its module): availability says why, in words a user can act on."""

import pytest

from omniep.backends import nccl_ep
from omniep.ep_core import registry

pytest.importorskip("torch")


def test_registered_after_cuda_nvshmem():
    names = registry.backend_names()
    assert names.index("cuda_nvshmem") < names.index("nccl_ep")


def test_availability_gives_a_clear_reason_here():
    avail = registry.availability("nccl_ep", "torch")
    assert isinstance(avail.reason, str) and avail.reason
    if not avail:
        known = ("no CUDA device", "not built", "NCCL not found", "too old", "no device API", "one GPU only")
        assert any(k in avail.reason for k in known), avail.reason


def test_not_built_reason_names_the_build_command(monkeypatch):
    real = nccl_ep.importlib.import_module

    def fake(name, *a):
        if name == "omniep._native_nccl":
            raise ImportError("No module named 'omniep._native_nccl'")
        return real(name, *a)

    monkeypatch.setattr(nccl_ep.importlib, "import_module", fake)
    monkeypatch.setattr(nccl_ep, "_wheel_nccl", lambda: ("/x", 22809, True))
    mod, why = nccl_ep.native_reason()
    assert mod is None and "not built" in why and "OMNIEP_NCCL=ON make native" in why
    monkeypatch.setattr(nccl_ep, "_wheel_nccl", lambda: ("/x", 22704, False))
    assert "2.27.4 too old" in nccl_ep.native_reason()[1]
    monkeypatch.setattr(nccl_ep, "_wheel_nccl", lambda: ("/x", None, False))
    assert "no device API" in nccl_ep.native_reason()[1]
    monkeypatch.setattr(nccl_ep, "_wheel_nccl", lambda: (None, None, False))
    assert "NCCL not found" in nccl_ep.native_reason()[1]
