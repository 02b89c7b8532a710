"""One rank per process over the NCCL device API (``omniep._native_nccl``, transport ``nccl_dev``).

:class:`NcclRankState` runs the ops of :class:`~omniep.native.ipc_rank.IpcRankState` (same buffer
layout, same copies, the kernels of ``csrc/kernels`` unchanged) on an :class:`NcclRank` whose NCCL
communicator is the torch NCCL process group's own when there is one, else made from rank 0's
``ncclUniqueId`` all-gathered through ``torch.distributed`` (gloo); the workspace and data buffer are
``ncclMemAlloc`` memory registered as symmetric NCCL windows. Peers in the LSA team (NVLink, one node)
are reached by loads and stores; the others (``remote_mask``) through GIN puts and signals (rank-major
ops only; not run on a network here). Growing the data buffer and destroying the state are
collective, as for NVSHMEM.
"""

from __future__ import annotations

import importlib

from .ipc_rank import NvshmemRankState


def torch_group_comm(group) -> int:
    """The ``ncclComm_t`` address of ``group``'s NCCL backend on CUDA, or 0 when it has none (a gloo
    group, a torch without ``_comm_ptr``, or a communicator not made yet: torch makes it at the group's
    first collective, or at ``init_process_group(..., device_id=...)``)."""
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError, ValueError):
        return 0  # no CUDA backend in this group (gloo)
    if not hasattr(backend, "_comm_ptr"):
        return 0
    if not backend._comm_ptr():
        # Torch makes the communicator lazily: one tiny collective on this rank's GPU makes it. Every
        # rank gets here at the same step (state construction is collective).
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=pg)
        torch.cuda.synchronize()
    return int(backend._comm_ptr())


class NcclRankState(NvshmemRankState):
    """This process's rank of ``group`` on the current CUDA device. Collective construction.

    When ``group`` is an NCCL process group whose communicator exists, that communicator is reused
    (``comm_source == "torch process group"``: our windows and devComm are registered on it; torch
    keeps owning it). Otherwise (gloo, or ``reuse_group=False``) rank 0's unique id is all-gathered
    and every rank makes its own (``comm_source == "own"``). Buffer growth (``allocate_data``:
    deregister, free, allocate, register, all collective) and ``destroy`` (the C++ destructor tears
    down devComm and windows, and its own communicator) are those of :class:`NvshmemRankState`; only
    the bootstrap differs."""

    def __init__(self, group, *, timeout_s: float = 30.0, blocks: int = 0, reuse_group: bool = True):
        def bootstrap(timeout_ns: int):
            native = importlib.import_module("omniep._native_nccl")
            comm = torch_group_comm(group) if reuse_group else 0
            # Every rank must take the same road (both are collective): agree on it.
            if all(self._all_gather(bool(comm))):
                self.comm_source = "torch process group"
                return native.NcclRank(comm, timeout_ns)
            self.comm_source = "own"
            return native.NcclRank(self.rank, self.world, self._root_unique_id(native), timeout_ns)

        self._setup(group, timeout_s, blocks, bootstrap)
