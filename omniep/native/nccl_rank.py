"""One rank per process over the NCCL device API (``omniep._native_nccl``, transport ``nccl_dev``).

:class:`NcclRankState` runs the ops of :class:`~omniep.native.ipc_rank.IpcRankState` (same buffer
layout, same copies, the kernels of ``csrc/kernels`` unchanged) on an :class:`NcclRank`: rank 0's
``ncclUniqueId`` is all-gathered through ``torch.distributed`` (gloo or NCCL), every rank makes its own
NCCL communicator on its current device, and the workspace and data buffer are ``ncclMemAlloc``
memory registered as symmetric NCCL windows. Peers must be in the LSA team (NVLink, one node); the
native constructor refuses anything else (GIN is compiled but no kernel uses it yet). Growing the
data buffer and destroying the state are collective, as for NVSHMEM.
"""

from __future__ import annotations

import importlib

from .ipc_rank import NvshmemRankState


class NcclRankState(NvshmemRankState):
    """This process's rank of ``group`` on the current CUDA device. Collective construction.

    Buffer growth (``allocate_data``: deregister, free, allocate, register, all collective) and
    ``destroy`` (the C++ destructor tears down devComm, windows and communicator, collectively) are
    those of :class:`NvshmemRankState`; only the bootstrap differs."""

    def __init__(self, group, *, timeout_s: float = 30.0, blocks: int = 0):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        native = importlib.import_module("omniep._native_nccl")
        uid = self._all_gather(native.unique_id() if self.rank == 0 else None)[0]
        self._impl = native.NcclRank(self.rank, self.world, uid, int(self.timeout_s * 1e9))
        self.marks = None
        if blocks:
            self._impl.set_blocks(int(blocks))
