"""The ``rocm_rocshmem`` backend for JAX: the ``cuda_nvshmem`` JAX backend's handlers built for AMD GPUs.

:class:`~omniep.backends.cuda_nvshmem.jax_backend.CudaNvshmemJax` unchanged but for where its XLA FFI
handlers live and whom XLA calls them for: ``omniep._native_hip_jax`` (csrc/ffi/jax_handlers.cpp and
csrc/python/module_jax.cpp compiled by hipcc, cmake/hip.cmake) registered for the ``ROCM`` platform.
The same kernels and launchers as the torch side, on XLA's HIP stream: one process per GPU (hipIpc
peers, bootstrapped through JAX's distributed key-value store) or one process driving every local GPU
(peer access); rank-major and expert-major, the op descriptor and ``status`` outputs, custom_vjp.

Status: the handlers and the module compile for gfx90a / gfx940 with Debian's hipcc 5.2.3 on every CI
run (cmake/hip_compile_check.cmake); NOTHING here has run on AMD hardware (docs/amd.md is the plan).
"""

from __future__ import annotations

from ...ep_core.types import Availability
from ..cuda_nvshmem.jax_backend import CudaNvshmemJax
from . import NOT_RUN

NATIVE_MODULE = "omniep._native_hip_jax"


class RocmRocshmemJax(CudaNvshmemJax):
    """``group`` is the ``shard_map`` axis name of the EP group (one AMD GPU per process, or every local
    GPU of one process)."""

    name = "rocm_rocshmem"
    _module = NATIVE_MODULE
    _platform = "ROCM"
    _ipc = "HIP IPC"
    _build_hint = "build omniep with ROCm >= 6.2 and jax installed (OMNIEP_GPU=HIP pip install --no-build-isolation .)"

    @classmethod
    def availability(cls) -> Availability:
        found = super().availability()
        if not found.available:
            return found
        return Availability(True, f"{found.reason}; {NOT_RUN}")
