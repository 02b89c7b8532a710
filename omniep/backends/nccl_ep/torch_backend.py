"""The ``nccl_ep`` backend for PyTorch: the native kernels over the NCCL device API, one process per GPU.

The ops are those of :class:`~omniep.backends.cuda_nvshmem.torch_backend.CudaNvshmemTorch` (same
handles, same buffer layout, same kernels; results bit for bit :mod:`omniep.ep_core.reference`); only
the per-group native state differs: an :class:`~omniep.native.nccl_rank.NcclRankState`, whose NCCL
communicator is made from a unique id all-gathered through ``torch.distributed``. One state per
``(group, device)`` lives for the life of the process (created collectively at the group's first call).
Both layouts (rank-major and expert-major) among peers on NVLink (the LSA team). Peers outside it (or
every peer with ``OMNIEP_FORCE_REMOTE=1`` on every rank) are reached through GIN puts and signals, for
the rank-major layout only; that path has not run on a network here (no NICs on our machines).
"""

from __future__ import annotations

import torch

from ...ep_core.types import Availability
from ..cuda_nvshmem.torch_backend import MIN_CC, CudaNvshmemTorch, torch_ops_reason
from ..torch_group import destroy_contexts
from . import native_reason, transport_summary


def destroy_states() -> None:
    """Release every group's NCCL communicator and windows. Collective: every rank calls it (e.g.
    before ``destroy_process_group``); otherwise they are released at process exit."""
    destroy_contexts(NcclEpTorch)


class NcclEpTorch(CudaNvshmemTorch):
    """prepare / dispatch / combine / backward passes for ONE rank of a group, over NCCL windows.
    ``capabilities()`` is :class:`CudaNvshmemTorch`'s (the same ops, layouts and limits)."""

    name = "nccl_ep"

    @classmethod
    def availability(cls) -> Availability:
        mod, why = native_reason()
        if mod is None:
            return Availability(False, why)
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device")
        cc = torch.cuda.get_device_capability()
        if tuple(cc) < MIN_CC:
            return Availability(False, f"built for sm_90; this GPU is sm_{cc[0]}{cc[1]}")
        if torch.cuda.device_count() < 2:
            return Availability(False, "one GPU only: NCCL refuses two ranks on one GPU, so nccl_ep needs a GPU "
                                       "per rank (use cuda_nvshmem to run several ranks on one GPU)")
        import torch.distributed as dist

        if not dist.is_available():
            return Availability(False, "torch was built without torch.distributed")
        ops = torch_ops_reason()
        if ops:
            return Availability(False, ops)
        return Availability(True, f"native kernels over the {transport_summary(mod)}")

    def _new_state(self, timeout: float):
        from ...native.nccl_rank import NcclRankState

        return self._remote_checked(lambda: NcclRankState(self.group, timeout_s=timeout))
