"""Typed errors of omniep. Every message says what was wrong, what was expected and what to do."""


class OmniEPError(Exception):
    """Base class of every error omniep raises on purpose."""


class InputError(OmniEPError, ValueError):
    """Bad input detected before any communication or kernel runs (dtype, shape, rank, expert id)."""


class CapacityError(OmniEPError, RuntimeError):
    """A static receive buffer was too small: ``needed`` rows arrived for ``capacity`` slots.

    Raised by eager calls; inside ``jit`` the overflow is returned as the ``dropped`` count instead.
    """

    def __init__(self, needed: int, capacity: int, *, rank: int | None = None, what: str = "rows"):
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"capacity overflow{where}: {needed} {what} must be received but capacity is {capacity}; "
            f"{needed - capacity} would be dropped. Raise `capacity` to at least {needed} "
            f"(rank-major: capacity=None is the exact worst case; expert-major: the default R * T holds "
            f"one copy per token and expert, so a token whose top-k repeats an expert needs more)."
        )
        self.needed = needed
        self.capacity = capacity
        self.rank = rank


class UnsupportedError(OmniEPError, NotImplementedError):
    """A backend was asked for a feature it does not serve."""

    def __init__(self, backend: str, feature: str, served_by: list[str] | tuple[str, ...] = ()):
        alt = f"; backends that serve it: {', '.join(served_by)}" if served_by else "; no registered backend serves it"
        super().__init__(f"backend {backend!r} does not support {feature}{alt}")
        self.backend = backend
        self.feature = feature
        self.served_by = tuple(served_by)


class BackendUnavailableError(OmniEPError, RuntimeError):
    """A named backend cannot run on this machine; the message carries the reason."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"backend {backend!r} is not available here: {reason}")
        self.backend = backend
        self.reason = reason


def _who(peers) -> str:
    peers = list(peers)
    if not peers:
        return "a peer rank"
    return f"peer rank {peers[0]}" if len(peers) == 1 else f"peer ranks {', '.join(map(str, peers))}"


class PeerTimeoutError(OmniEPError, TimeoutError):
    """A wait on a peer rank did not finish in time; names the rank(s) that did not answer (``peer``: the
    first, ``peers``: all of them; empty where nothing could tell)."""

    def __init__(self, rank: int, peer: int | None, seconds: float, what: str = "communication", *,
                 peers=None):
        peers = list(peers) if peers is not None else ([peer] if peer is not None else [])
        super().__init__(f"rank {rank}: {what} timed out after {seconds:g} s waiting for {_who(peers)}")
        self.rank = rank
        self.peer = peers[0] if peers else None
        self.peers = peers


class PeerFailedError(OmniEPError, RuntimeError):
    """A peer rank went away in the middle of an op (its process died, its connection closed): names it.
    The group cannot be used afterwards; every later op on it raises this again."""

    def __init__(self, rank: int, peers, what: str, detail: str = ""):
        peers = list(peers)
        gone = f"{_who(peers)} stopped answering" if peers else "a peer rank stopped answering (which one could not be told)"
        super().__init__(f"rank {rank}: {what} failed: {gone}" + (f" ({detail})" if detail else ""))
        self.rank = rank
        self.peer = peers[0] if peers else None
        self.peers = peers


class RankMismatchError(OmniEPError, RuntimeError):
    """The ranks of a group are not running the same op: a peer's op descriptor (op, sequence number,
    num_experts, hidden size, dtype, layout, capacity, handle, num_topk) differs from this rank's.
    ``ranks``: the ranks whose descriptor differs; ``fields``: the fields that differ."""

    def __init__(self, message: str, *, rank: int | None = None, ranks=(), fields=()):
        super().__init__(message)
        self.rank = rank
        self.ranks = list(ranks)
        self.fields = list(fields)


class DestroyedError(OmniEPError, RuntimeError):
    """A buffer or backend object was used after ``destroy()``."""
