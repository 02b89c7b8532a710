"""``rocm_rocshmem`` without an AMD GPU: the backend imports, says exactly what is missing, and selecting it
by name raises BackendUnavailableError with that reason (what ``omniep info`` prints)."""

from __future__ import annotations

import pytest

from omniep.ep_core import registry
from omniep.ep_core.errors import BackendUnavailableError
from omniep.ep_core.types import Layout, ProcessModel

torch = pytest.importorskip("torch")

from omniep.backends.rocm_rocshmem import torch_backend as tb  # noqa: E402

MISSING = ("hip-python not installed", "libamdhip64 not found", "no AMD GPU",
           "omniep native module omniep._native", "torch is not a ROCm build")


def test_registered_for_torch_only():
    assert registry.get_backend_class("rocm_rocshmem", "torch") is tb.RocmRocshmemTorch
    with pytest.raises(BackendUnavailableError, match="not implemented for jax"):
        registry.get_backend_class("rocm_rocshmem", "jax")


def test_capabilities():
    caps = tb.RocmRocshmemTorch.capabilities()
    assert set(caps.dtypes) == {"bfloat16", "float16", "float32"} and caps.fp8
    assert caps.layouts == (Layout.RANK_MAJOR, Layout.EXPERT_MAJOR) and caps.devices == ("gpu",)
    assert caps.process_models == (ProcessModel.ONE_PROCESS_PER_DEVICE,) and caps.frameworks == ("torch",)


def test_unavailable_here_with_the_exact_reason():
    avail = tb.RocmRocshmemTorch.availability()
    if avail:
        pytest.skip("an AMD GPU with everything the backend needs is present")
    parts = avail.reason.split("; ")
    assert parts and all(any(p.startswith(m) for m in MISSING) for p in parts), avail.reason
    assert registry.availability("rocm_rocshmem", "torch").reason == avail.reason


def test_selecting_it_by_name_raises_with_that_reason(monkeypatch):
    avail = tb.RocmRocshmemTorch.availability()
    if avail:
        pytest.skip("an AMD GPU with everything the backend needs is present")
    monkeypatch.setenv("OMNIEP_BACKEND", "rocm_rocshmem")
    with pytest.raises(BackendUnavailableError) as exc:
        registry.select_backend("torch")
    assert avail.reason in str(exc.value)


def test_reasons_name_each_missing_piece(monkeypatch):
    def no_hip_python():
        raise ImportError("No module named 'hip'")

    def no_libamdhip64():
        raise OSError("libamdhip64.so: cannot open shared object file")

    class FakeHip:  # hip-python present, no device
        @staticmethod
        def hipGetDeviceCount():
            return 100, 0  # hipErrorNoDevice

    monkeypatch.setattr(tb, "_hip", no_hip_python)
    assert "hip-python not installed" in tb.RocmRocshmemTorch.availability().reason
    monkeypatch.setattr(tb, "_hip", no_libamdhip64)
    assert "libamdhip64 not found" in tb.RocmRocshmemTorch.availability().reason
    monkeypatch.setattr(tb, "_hip", lambda: FakeHip)
    assert "no AMD GPU (hipGetDeviceCount" in tb.RocmRocshmemTorch.availability().reason


def test_not_built_reason(monkeypatch):
    real = tb.importlib.import_module

    def fake(name, *a, **k):
        if name in (tb.NATIVE_MODULE, tb.TORCH_OPS_MODULE):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(tb.importlib, "import_module", fake)
    reason = tb.RocmRocshmemTorch.availability().reason
    assert f"omniep native module {tb.NATIVE_MODULE} not built for ROCm: make native OMNIEP_GPU=HIP" in reason
    assert f"omniep native module {tb.TORCH_OPS_MODULE} (the torch ops) has no ROCm build yet" in reason
