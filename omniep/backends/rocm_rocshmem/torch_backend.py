"""The ``rocm_rocshmem`` backend for PyTorch (ROCm build): native kernels, one rank per process, AMD GPUs.

The torch side is :class:`~omniep.backends.cuda_nvshmem.torch_backend.CudaNvshmemTorch` unchanged (torch's
ROCm build names AMD devices ``cuda`` and its streams are HIP streams); the native module is
``omniep._native_hip``: the same ``IpcRank`` (csrc/backends/ipc_rank.cu) compiled by hipcc, peers mapped
with ``hipIpcGetMemHandle`` / ``hipIpcOpenMemHandle``. Device discovery goes through ``hip-python``,
imported lazily: this module imports on any machine, and :meth:`RocmRocshmemTorch.availability` lists
exactly what is missing where it cannot run.

Status: compile-checked only (gfx90a / gfx940, hipcc 5.2.3). It has NOT run on AMD hardware.
"""

from __future__ import annotations

import importlib
import os

from ...ep_core.types import Availability, Capabilities, Layout, ProcessModel
from ..cuda_nvshmem.torch_backend import TORCH_OPS_MODULE, CudaNvshmemTorch
from ..torch_group import destroy_contexts
from .hip import amd_gpus, libamdhip64_found

NATIVE_MODULE = "omniep._native_hip"
BUILD_HINT = "make native OMNIEP_GPU=HIP"


def destroy_states() -> None:
    """Release every group's native buffers. Collective: every rank calls it."""
    destroy_contexts(RocmRocshmemTorch)


class RocmRocshmemTorch(CudaNvshmemTorch):
    """prepare / dispatch / combine / backward passes for ONE rank of a group, one process per AMD GPU."""

    name = "rocm_rocshmem"
    serves = "AMD GPU tensors"  # torch's ROCm build calls AMD GPUs "cuda"

    @classmethod
    def missing(cls) -> list[str]:
        """Everything this machine lacks for the backend, each as one phrase (empty: nothing missing)."""
        out = []
        gpus, why = amd_gpus()
        if not gpus:
            out.append(why)
            if why.startswith("hip-python"):  # say what else is missing, without hip-python
                if not libamdhip64_found():
                    out.append("libamdhip64 not found")
                if not os.path.exists("/dev/kfd"):
                    out.append("no AMD GPU (/dev/kfd absent)")
        try:
            importlib.import_module(NATIVE_MODULE)
        except ImportError:
            out.append(f"omniep native module {NATIVE_MODULE} not built for ROCm: {BUILD_HINT}")
        try:  # the torch ops over the rank's EpRank: cmake/torch.cmake builds them against CUDA torch only
            importlib.import_module(TORCH_OPS_MODULE)
        except ImportError:
            out.append(f"omniep native module {TORCH_OPS_MODULE} (the torch ops) has no ROCm build yet")
        try:
            import torch
        except ImportError:
            out.append("torch not installed")
        else:
            if getattr(torch.version, "hip", None) is None:
                out.append("torch is not a ROCm build (torch.version.hip is None)")
            else:
                import torch.distributed as dist

                if not dist.is_available():
                    out.append("torch was built without torch.distributed")
        return out

    @classmethod
    def availability(cls) -> Availability:
        missing = cls.missing()
        if missing:
            return Availability(False, "; ".join(missing))
        gpus, _ = amd_gpus()
        return Availability(True, f"native kernels over HIP IPC peers (p2p) on {', '.join(sorted(set(gpus)))}; "
                                  f"not yet run on AMD hardware by omniep's tests")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True, layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR),
            max_ranks=16, intranode=True, internode=False, process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,),
            frameworks=("torch",), cuda_graph_safe=False, hidden_multiple=1, devices=("gpu",),
        )

    def _new_state(self, timeout: float):
        from ...native.ipc_rank import IpcRankState

        return IpcRankState(self.group, timeout_s=timeout, module=NATIVE_MODULE)
