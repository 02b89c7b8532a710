"""This process's rank of a ``torch.distributed`` group in a native module: bootstrap and lifetime.

:class:`IpcRankState` is the rank over the p2p transport with CUDA IPC peers (``omniep._native_mp``;
``omniep._native_hip`` on AMD): its workspace is exported with ``cudaIpcGetMemHandle`` and opened by
every peer (NVLink peer access across GPUs; plain device memory when several processes share a GPU),
the handles all-gathered once with ``torch.distributed.all_gather_object``. :class:`NvshmemRankState`
is the rank over NVSHMEM (rank 0's unique id all-gathered the same way); ``omniep.native.nccl_rank``
has the NCCL one. The ops themselves run in C++ (``omniep._native_torch`` over the rank's EpRank,
csrc/backends/ep_rank.h): the data buffer grows there too, collectively inside an op, so nothing here
runs per op. Construction and :meth:`destroy` are collective.

Also here: the sizing rules the JAX states follow while tracing (:func:`regions`, :func:`grown_size`),
the same as the C++ ops' (csrc/backends/rank_ops.cuh ``pack_regions`` / ``grown_size``).
"""

from __future__ import annotations

import importlib

from ..ep_core.descriptor import raise_for_status
from ..ep_core.errors import DestroyedError

_ALIGN = 256


# The native ranks of groups that failed, kept alive until the process exits (see IpcRankState.destroy).
QUARANTINE: list = []


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def grown_size(nbytes: int, current: int) -> int:
    """The data buffer's next size when ``nbytes`` do not fit in ``current``: at least double, at least
    2 MiB, in whole 2 MiB granules (so a growing sequence of calls re-allocates O(log) times)."""
    new = max(int(nbytes), 2 * int(current), 1 << 21)
    return (new + (1 << 21) - 1) >> 21 << 21


def regions(capacity: int, row_bytes: list) -> tuple[list, int]:
    """Offsets of ``[capacity, row_bytes[i]]`` regions packed in the data buffer, and the total."""
    offsets, total = [], 0
    for b in row_bytes:
        offsets.append(total)
        total += _align(capacity * b)
    return offsets, total


class IpcRankState:
    """This process's rank of ``group`` on the current CUDA device. Collective construction."""

    def __init__(self, group, *, timeout_s: float = 100.0, blocks: int = 0, module: str = "omniep._native_mp"):
        """``module``: the native module holding ``IpcRank``: ``omniep._native_mp`` (CUDA IPC) or
        ``omniep._native_hip`` (the same class built for AMD, HIP IPC; torch's ROCm build names the
        device ``cuda`` too, so nothing else here differs)."""
        self._setup(group, timeout_s, blocks,
                    lambda timeout_ns: importlib.import_module(module).IpcRank(self.rank, self.world, timeout_ns))
        self._impl.open_workspaces(self._all_gather(self._impl.workspace_handle()))

    def _setup(self, group, timeout_s: float, blocks: int, bootstrap) -> None:
        """What every rank state's construction shares: the torch handles, ``group``, ``rank``, ``world``,
        ``device`` (the current CUDA device) and ``timeout_s``; then ``_impl = bootstrap(timeout_ns)`` (the
        subclass's native rank, made once ``rank`` and ``world`` are set) and its block count when
        ``blocks`` is given."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        self._impl = bootstrap(int(self.timeout_s * 1e9))
        if blocks:
            self._impl.set_blocks(int(blocks))

    def _root_unique_id(self, native):
        """Rank 0's ``native.unique_id()``, all-gathered through ``torch.distributed`` (collective)."""
        return self._all_gather(native.unique_id() if self.rank == 0 else None)[0]

    def _all_gather(self, obj) -> list:
        out = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def _g(self):
        if self._impl is None:
            raise DestroyedError("the native rank state was used after destroy()")
        return self._impl

    @property
    def ep_rank(self) -> int:
        """Address of the rank's EpRank interface (csrc/backends/ep_rank.h) for the op bindings."""
        return int(self._g().ep_rank)

    @property
    def data_bytes(self) -> int:
        return int(self._g().data_bytes)

    def destroy(self, failed: bool = False) -> None:
        """Collective: every rank must call it (peers unmap my buffers before I free them). ``failed``:
        the group failed (a peer died or timed out): no handshake with the peers, and my buffers are
        kept until the process exits (:data:`QUARANTINE`) — a stalled peer may still write into them,
        and memory it can reach must not be handed back to the allocator. A peer that dies during
        the handshake makes it the same."""
        if self._impl is None:
            return
        self._torch.cuda.synchronize()
        self._impl.close_peer_data()
        self._impl.close_peer_workspaces()
        if not failed:
            try:
                self._all_gather(None)  # nobody maps my buffers any more
            except RuntimeError:  # the process group lost a peer (gloo / NCCL error)
                failed = True
        if failed:
            QUARANTINE.append(self._impl)
        self._impl = None  # otherwise the C++ destructor frees them

    def barrier(self) -> None:
        """A bare device-side barrier over the group on the current stream (collective, in op order).
        Benchmarks put it right before a timed region so that every rank's stream starts it together."""
        self._g().barrier(int(self._torch.cuda.current_stream().cuda_stream))

    def statuses(self, clear_pending: bool = True) -> tuple:
        """``(sticky, pending)`` statuses of this rank (``descriptor.STATUS_FIELDS``); synchronises."""
        return tuple(self._g().statuses(clear_pending))

    def check(self) -> None:
        """Synchronise; raise what this rank's ops recorded (sticky first; the pending one is cleared)."""
        fatal, pending = self.statuses()
        raise_for_status(fatal, self.timeout_s)
        raise_for_status(pending, self.timeout_s)

    def reset(self) -> None:
        self._g().reset()


class NvshmemRankState(IpcRankState):
    """The same rank over the NVSHMEM transport (``omniep._native_nvshmem``): workspace and data buffer
    from ``nvshmem_malloc``; rank 0's unique id is all-gathered through ``torch.distributed``. One group
    per process (NVSHMEM is initialised once). Peers without a load/store pointer (other nodes, or every
    peer with ``OMNIEP_FORCE_REMOTE=1``) take the kernels' put + signal path."""

    def __init__(self, group, *, timeout_s: float = 100.0, blocks: int = 0):
        def bootstrap(timeout_ns: int):
            native = importlib.import_module("omniep._native_nvshmem")
            return native.NvshmemRank(self.rank, self.world, self._root_unique_id(native), timeout_ns)

        self._setup(group, timeout_s, blocks, bootstrap)

    def destroy(self, failed: bool = False) -> None:
        """Collective. ``failed``: kept (:data:`QUARANTINE`), since freeing and finalising are collective
        and a dead peer would never join them."""
        if self._impl is not None:
            self._torch.cuda.synchronize()
            if failed:
                QUARANTINE.append(self._impl)
            self._impl = None  # otherwise the destructor frees (collectively) and finalises NVSHMEM
