"""``rocm_rocshmem`` without an AMD GPU: the backend imports, says exactly what is missing, and selecting it
by name raises BackendUnavailableError with that reason (what ``omniep info`` prints)."""

from __future__ import annotations

import importlib.util

import pytest

from omniep.ep_core import registry
from omniep.ep_core.errors import BackendUnavailableError
from omniep.ep_core.types import Layout, ProcessModel

torch = pytest.importorskip("torch")

from omniep.backends.rocm_rocshmem import hip as hip_discovery  # noqa: E402
from omniep.backends.rocm_rocshmem import torch_backend as tb  # noqa: E402

MISSING = ("hip-python not installed", "libamdhip64 not found", "no AMD GPU",
           "omniep native module omniep._native", "torch is not a ROCm build")


def test_registered_for_torch_and_jax():
    assert registry.get_backend_class("rocm_rocshmem", "torch") is tb.RocmRocshmemTorch
    pytest.importorskip("jax")
    from omniep.backends.rocm_rocshmem.jax_backend import RocmRocshmemJax

    assert registry.get_backend_class("rocm_rocshmem", "jax") is RocmRocshmemJax


def test_jax_side_unavailable_here_with_the_exact_reason():
    """The JAX handlers' module (omniep._native_hip_jax) is built only by a ROCm build; without it, or
    with it but no AMD GPU in jax, the reason says which — and selecting the backend raises it."""
    jax = pytest.importorskip("jax")
    from omniep.backends.cuda_nvshmem.jax_backend import jax_gpu_reason
    from omniep.backends.rocm_rocshmem.jax_backend import RocmRocshmemJax

    avail = RocmRocshmemJax.availability()
    if avail:
        pytest.skip("jax sees AMD GPUs and omniep._native_hip_jax is built")
    if importlib.util.find_spec("omniep._native_hip_jax") is None:
        assert avail.reason.startswith("omniep._native_hip_jax (JAX FFI handlers) not built: build omniep with "
                                       "ROCm >= 6.2"), avail.reason
    else:
        assert avail.reason == jax_gpu_reason("rocm")
    if jax.default_backend() == "cpu":
        assert jax_gpu_reason("rocm") == ("jax has no GPU (default backend: cpu); install jax with ROCm "
                                          "(pip install jax[rocm])")
    assert registry.availability("rocm_rocshmem", "jax").reason == avail.reason
    with pytest.raises(BackendUnavailableError, match="rocm_rocshmem"):
        registry.select_backend("jax", "rocm_rocshmem")


def test_jax_side_registers_its_handlers_for_rocm():
    """The same handler table as cuda_nvshmem, from the HIP module, registered for XLA's ROCM platform."""
    pytest.importorskip("jax")
    from omniep.backends.cuda_nvshmem.jax_backend import CudaNvshmemJax
    from omniep.backends.rocm_rocshmem.jax_backend import RocmRocshmemJax

    assert (RocmRocshmemJax._module, RocmRocshmemJax._platform) == ("omniep._native_hip_jax", "ROCM")
    assert (CudaNvshmemJax._module, CudaNvshmemJax._platform) == ("omniep._native_jax", "CUDA")
    assert RocmRocshmemJax._prefix == CudaNvshmemJax._prefix
    caps = RocmRocshmemJax.capabilities()
    assert caps.frameworks == ("jax",) and caps.layouts == (Layout.RANK_MAJOR, Layout.EXPERT_MAJOR)


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

    monkeypatch.setattr(hip_discovery, "_hip", no_hip_python)
    assert "hip-python not installed" in tb.RocmRocshmemTorch.availability().reason
    monkeypatch.setattr(hip_discovery, "_hip", no_libamdhip64)
    assert "libamdhip64 not found" in tb.RocmRocshmemTorch.availability().reason
    monkeypatch.setattr(hip_discovery, "_hip", lambda: FakeHip)
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
