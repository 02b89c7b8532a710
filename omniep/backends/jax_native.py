"""Plumbing shared by the native JAX backends (``cuda_nvshmem``, ``nccl_ep``): collective steps over
JAX's distributed key-value store, and the device error record turned into an exception.

The native JAX backends bootstrap their per-group state (CUDA IPC handles, an NCCL unique id) while
TRACING: every process traces the same program in the same order, so every process reaches the same
step. :class:`KvExchange` all-gathers bytes under keys named by the group and a step counter, and
turns a peer that never shows up into a :class:`PeerTimeoutError` naming it.
"""

from __future__ import annotations

from ..ep_core.errors import PeerTimeoutError


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


_PHASES = {1: "prepare (count exchange)", 2: "prepare (end)", 3: "dispatch (start)",
           4: "dispatch (end)", 5: "combine (start)", 6: "combine (end)"}  # csrc transport.h Phase


def raise_for_error(record: tuple, timeout_s: float) -> None:
    """Raise PeerTimeoutError for a rank's device error record ``(code, rank, peer, phase)``; nothing for
    code 0. The compiled program itself cannot raise: a timed-out kernel skips its work and records why."""
    code, rank, peer, phase = record
    if code == 0:
        return
    what = "barrier of its own blocks" if code == 2 else _PHASES.get(phase, "communication")
    raise PeerTimeoutError(rank, None if peer < 0 else peer, timeout_s, what=what)
