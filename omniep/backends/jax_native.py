"""Plumbing shared by the native JAX backends (``cuda_nvshmem``, ``nccl_ep``): collective steps over
JAX's distributed key-value store, and the ranks' device statuses turned into exceptions.

The native JAX backends bootstrap their per-group state (CUDA IPC handles, an NCCL unique id) while
TRACING: every process traces the same program in the same order, so every process reaches the same
step. :class:`KvExchange` all-gathers bytes under keys named by the group and a step counter, and
turns a peer that never shows up into a :class:`PeerTimeoutError` naming it.
"""

from __future__ import annotations

from ..ep_core.descriptor import raise_for_status
from ..ep_core.errors import PeerTimeoutError
from ..native.ipc_rank import grown_size


def kv_client():
    """JAX's distributed key-value store client, or None when ``jax.distributed`` is not initialized."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax layout changed
        return None
    return getattr(distributed.global_state, "client", None)


class KvExchange:
    """All-gathers of bytes among the ``num_ranks`` processes of group ``group_key`` (the same string on
    every process). ``backend`` names who is bootstrapping in error messages."""

    def __init__(self, client, group_key: str, rank: int, num_ranks: int, *, timeout_s: float, backend: str):
        self._client, self.group_key, self.rank, self.num_ranks = client, group_key, rank, num_ranks
        self._timeout_ms = int(timeout_s * 1000)
        self._backend = backend
        self._step = 0

    def all_gather(self, what: str, value: bytes) -> list:
        """Every rank's ``value``, by rank. Collective: every rank calls it in the same order."""
        self._step += 1
        key = f"omniep/jax/{self.group_key}/{self._step}-{what}"
        self._client.key_value_set(f"{key}/{self.rank}", value.hex() or "-")
        out = []
        for r in range(self.num_ranks):
            try:
                got = self._client.blocking_key_value_get(f"{key}/{r}", self._timeout_ms)
            except Exception as exc:  # the store raises its own error type on timeout
                raise PeerTimeoutError(self.rank, r, self._timeout_ms / 1000,
                                       what=f"{self._backend} bootstrap ({what}): {exc}") from None
            out.append(b"" if got == "-" else bytes.fromhex(got))
        return out

    def barrier(self, what: str) -> None:
        self.all_gather(what, b"")


_RETIRED: list = []  # destroyed native states: a stale executable gets an FFI error, not freed memory


class LocalJaxState:
    """Python side of a native JAX state object (``JaxLocalIpcGroup``, ``JaxNcclState``, ``JaxRank``).
    As is, for those whose collective steps need no exchange from Python: every rank of the group is in
    this process (single controller), or the native object does its own (NCCL); the one-process-per-GPU
    IPC state overrides :meth:`reserve` and :meth:`destroy` with its handle exchanges. ``impl`` has
    ``handle``, ``data_bytes``, ``local_size``, ``allocate_data(bytes)`` (synchronises first),
    ``statuses(i)``, ``set_blocks(n)`` and ``destroy()``."""

    def __init__(self, impl, *, backend: str, timeout_s: float, blocks: int = 0):
        self._impl, self._backend, self.timeout_s = impl, backend, float(timeout_s)
        if blocks:
            impl.set_blocks(int(blocks))

    def _g(self):
        if self._impl is None:
            from ..ep_core.errors import DestroyedError

            raise DestroyedError(f"the {self._backend} JAX state was used after destroy()")
        return self._impl

    @property
    def handle(self) -> int:
        """The address the FFI handlers get as ``state``."""
        return int(self._g().handle)

    @property
    def data_bytes(self) -> int:
        return int(self._g().data_bytes)

    def reserve(self, nbytes: int) -> None:
        """Make every rank's data buffer at least ``nbytes`` (collective: the same tracing step on every
        process; sizes come from static shapes only)."""
        g = self._g()
        if nbytes <= g.data_bytes:
            return
        g.allocate_data(grown_size(nbytes, g.data_bytes))

    def check(self) -> None:
        """Synchronise; raise what a local rank's kernels recorded (its sticky status: a timed-out wait,
        a rank mismatch), e.g. PeerTimeoutError naming the peer. The per-op statuses reach JAX as the
        ops' ``status`` outputs."""
        for i in range(self._g().local_size):
            raise_for_status(self.statuses(i)[0], self.timeout_s)

    def statuses(self, i: int = 0) -> tuple:
        """``(sticky, pending)`` statuses of local rank ``i`` (descriptor.STATUS_FIELDS); synchronises."""
        return tuple(self._g().statuses(i))

    def destroy(self) -> None:
        """Collective: every process calls it."""
        if self._impl is None:
            return
        self._impl.destroy()
        _RETIRED.append(self._impl)
        self._impl = None
