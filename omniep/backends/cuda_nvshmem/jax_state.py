"""The ``cuda_nvshmem`` JAX backend's per-group state, for both JAX process models.

One process driving every local GPU: :func:`local_group_state` (``JaxLocalIpcGroup``: the ranks'
buffers linked by device pointers with peer access, nothing to exchange).

One process per GPU: :class:`JaxRankState` wraps ``omniep._native_jax.JaxRank`` (``_native_hip_jax`` for
``rocm_rocshmem``: the same class built by hipcc, hipIpc handles): the rank's workspace
and symmetric data buffer (CUDA IPC, as :mod:`omniep.native.ipc_rank` for torch) whose address the XLA FFI handlers get
as the attribute ``state``. It is created ONCE per (process, EP group), while the first ``omniep.jax``
call of that group is traced, and bootstrapped through JAX's distributed key-value store: every
process publishes its IPC handle under a key of the group and reads everyone else's.

Collective steps (construction, :meth:`reserve` when the buffer grows, :meth:`destroy`) happen while
TRACING, never inside a compiled program: every process traces the same program in the same order,
so they meet in the same step. Growing the buffer synchronises this process's device first (an
executable still running keeps using the old buffer until then); compiled executables read the
buffer's current address from the state on every call, so they stay valid after it grows.
"""

from __future__ import annotations

import importlib

from ...ep_core.errors import BackendUnavailableError
from ...native.ipc_rank import grown_size
from ..jax_native import KvExchange, LocalJaxState, kv_client


class JaxRankState(LocalJaxState):
    """Rank ``rank`` of ``num_ranks`` on CUDA device ``device``; ``group_key`` names the group in the
    key-value store and must be the same string on every process of the group. Growing the buffer and
    destroying are collective exchanges of IPC handles here (the rest is :class:`LocalJaxState`'s)."""

    def __init__(self, group_key: str, rank: int, num_ranks: int, device: int, *, timeout_s: float = 30.0,
                 bootstrap_timeout_s: float = 120.0, blocks: int = 0, module: str = "omniep._native_jax",
                 backend: str = "cuda_nvshmem"):
        self.group_key, self.rank, self.num_ranks, self.device = group_key, rank, num_ranks, device
        client = kv_client()
        if client is None:
            raise BackendUnavailableError(backend, "jax.distributed is not initialized: call "
                                                   "jax.distributed.initialize(...) first")
        self._kv = KvExchange(client, group_key, rank, num_ranks, timeout_s=bootstrap_timeout_s, backend=backend)
        native = importlib.import_module(module)
        impl = native.JaxRank(rank, num_ranks, device, int(float(timeout_s) * 1e9))
        super().__init__(impl, backend=backend, timeout_s=timeout_s, blocks=blocks)
        impl.open_workspaces(self._kv.all_gather("workspace", impl.workspace_handle()))

    def reserve(self, nbytes: int) -> None:
        """Make the symmetric data buffer at least ``nbytes`` on every rank. Called while tracing with
        sizes derived from static shapes only, so every rank grows at the same step (collective)."""
        g = self._g()
        if nbytes <= g.data_bytes:
            return
        new = grown_size(nbytes, g.data_bytes)
        g.synchronize()  # executables already enqueued may still use the old buffers
        g.close_peer_data()
        self._kv.barrier("data-closed")  # nobody maps anyone's old buffer any more
        g.allocate_data(new)
        g.open_data(self._kv.all_gather("data", g.data_handle()))

    def destroy(self) -> None:
        """Collective: every rank calls it. Peers unmap my buffers before I free them."""
        if self._impl is None:
            return
        g = self._impl
        g.synchronize()
        g.close_peer_data()
        g.close_peer_workspaces()
        self._kv.barrier("closed")
        super().destroy()


def local_group_state(devices, *, timeout_s: float = 30.0, blocks: int = 0, module: str = "omniep._native_jax",
                      backend: str = "cuda_nvshmem") -> LocalJaxState:
    """Every rank in this process (single controller): rank i on GPU ``devices[i]``, the p2p transport
    over peer access (``<module>.JaxLocalIpcGroup``, no IPC handles)."""
    native = importlib.import_module(module)
    impl = native.JaxLocalIpcGroup([int(d) for d in devices], int(float(timeout_s) * 1e9))
    return LocalJaxState(impl, backend=backend, timeout_s=timeout_s, blocks=blocks)
