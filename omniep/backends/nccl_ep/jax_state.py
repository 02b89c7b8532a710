"""The ``nccl_ep`` ranks of one JAX EP group in this process (``omniep._native_nccl.JaxNcclState``).

Two process models, chosen by how JAX runs:
  * one process driving every local GPU (single controller, ``jax.jit(shard_map(...))`` over the local
    devices): one NCCL communicator per device from grouped init inside this process; EP rank i runs
    on the i-th device of the EP axis;
  * one process per GPU (``jax.distributed``): rank 0's ``ncclUniqueId`` is all-gathered through JAX's
    key-value store and every process makes its own communicator.
The FFI handlers get the state's address as the attribute ``state`` and pick the rank of the device
they run on. Collective steps (construction, growing the data windows, destroy) run while TRACING,
which every process does in the same order (see cuda_nvshmem/jax_state.py).
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

from ...ep_core.errors import DestroyedError
from ..jax_native import KvExchange, kv_client, raise_for_error

_RETIRED: list = []  # destroyed native states: a stale executable gets an FFI error, not freed memory


class NcclJaxState:
    """Single controller when ``devices`` (CUDA ordinals in EP rank order) is given; otherwise this
    process's ``rank`` of ``num_ranks`` on CUDA device ``device``, bootstrapped through the key-value
    store under ``group_key`` (the same string on every process)."""

    def __init__(self, *, timeout_s: float = 30.0, devices: Optional[Sequence[int]] = None,
                 group_key: str = "", rank: int = 0, num_ranks: int = 1, device: int = 0,
                 bootstrap_timeout_s: float = 120.0, blocks: int = 0):
        native = importlib.import_module("omniep._native_nccl")
        self.timeout_s = float(timeout_s)
        timeout_ns = int(self.timeout_s * 1e9)
        if devices is not None:
            self.num_ranks = len(devices)
            self._kv = None
            self._impl = native.JaxNcclState([int(d) for d in devices], timeout_ns)
        else:
            self.num_ranks = num_ranks
            self._kv = KvExchange(kv_client(), group_key, rank, num_ranks, timeout_s=bootstrap_timeout_s,
                                  backend="nccl_ep")
            uid = self._kv.all_gather("unique-id", native.unique_id() if rank == 0 else b"")[0]
            self._impl = native.JaxNcclState(rank, num_ranks, uid, device, timeout_ns)
        if blocks:
            self._impl.set_blocks(int(blocks))

    def _g(self):
        if self._impl is None:
            raise DestroyedError("the nccl_ep JAX state was used after destroy()")
        return self._impl

    @property
    def handle(self) -> int:
        """The address the FFI handlers get as ``state``."""
        return int(self._g().handle)

    @property
    def data_bytes(self) -> int:
        return int(self._g().data_bytes)

    def reserve(self, nbytes: int) -> None:
        """Make every rank's data window at least ``nbytes``; collective, at the same tracing step on
        every process (sizes come from static shapes only)."""
        g = self._g()
        if nbytes <= g.data_bytes:
            return
        new = max(int(nbytes), 2 * g.data_bytes, 1 << 21)
        g.allocate_data((new + (1 << 21) - 1) >> 21 << 21)  # synchronises; NCCL-collective inside

    def check(self) -> None:
        """Synchronise; raise PeerTimeoutError if a local rank's kernels recorded a timed-out wait."""
        for i in range(self._g().local_size):
            raise_for_error(self.error(i), self.timeout_s)

    def error(self, i: int = 0) -> tuple:
        """``(code, rank, peer, phase)`` of local rank ``i`` (0 = none); synchronises its device."""
        return tuple(self._g().error(i))

    def destroy(self) -> None:
        """Collective: every process calls it."""
        if self._impl is None:
            return
        self._impl.destroy()
        _RETIRED.append(self._impl)
        self._impl = None
