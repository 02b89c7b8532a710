"""Op descriptors and status words: how ranks find out, on the data path, that they disagree (DESIGN §9).

Every op that communicates sends, with data it already exchanges (the counts of a prepare, the start
barrier of a native kernel, a header of the collective backend's payload), its **op descriptor**:
``DESC_WORDS`` int32 values in :data:`DESC_FIELDS` order. A receiver compares each peer's descriptor
with its own on the fields that must agree (:data:`COMPARED`) and checks the sender's own verdict on
its input (``input_status``: e.g. an expert id outside ``[-1, E)``). What it finds goes into a
**status**: ``STATUS_WORDS`` int32 values in :data:`STATUS_FIELDS` order, ``code == 0`` when all is
well. Frameworks raise it (:func:`error_from_status`) at the next host wait, at ``check()`` /
``synchronize()`` / destroy, and at once when ``OMNIEP_CHECKS=sync``; JAX returns it as an array.

The same layouts are written by the native kernels (``csrc/include/omniep/status.h`` mirrors every
number here) and by the collective backends, so one decoder serves every backend and framework.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

from . import env
from .errors import CapacityError, InputError, OmniEPError, PeerTimeoutError, RankMismatchError


class OpKind(enum.IntEnum):
    """What a rank is doing; part of its descriptor (values shared with C++: status.h)."""

    DISPATCH = 1         # prepare + dispatch (the routing moves)
    CACHED_DISPATCH = 2  # rows only, with a handle
    COMBINE = 3
    DISPATCH_BWD = 4
    COMBINE_BWD = 5
    BARRIER = 6


# Descriptor fields, in order. `seq`: the op's number on the group (the k-th op this rank issues on
# it); `handle`: the seq of the dispatch that made the handle the op uses (-1: none); `input_status`
# / `input_detail`: this rank's verdict on its own input (0 = fine; INPUT_BAD_EXPERT_ID with the id);
# `part`: 0 in the op's first exchange, > 0 in later exchanges of the same op (native kernels).
DESC_FIELDS = ("seq", "op", "num_experts", "hidden", "dtype", "layout", "capacity", "handle", "num_topk",
               "input_status", "input_detail", "part")
DESC_WORDS = len(DESC_FIELDS)  # 12
# Fields that must be equal on every rank (bit i of a status `fields` mask = DESC_FIELDS[i]).
COMPARED = DESC_FIELDS[:9]
# input_status: the rank's verdict on its own input. REJECTED: its host refused the arguments (bad
# dtype, shape, ...: the rank raised its own InputError) and took part in the op only to say so.
INPUT_OK, INPUT_BAD_EXPERT_ID, INPUT_REJECTED = 0, 1, 2

# Element types as descriptors carry them (the C ABI's DType codes, plus the ones only the collective
# backends move).
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float8_e4m3fn": 3, "float64": 4}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
LAYOUT_CODES = {"rank_major": 0, "expert_major": 1}


class StatusCode(enum.IntEnum):
    OK = 0
    RANK_MISMATCH = 1   # a peer's descriptor differs from mine (sticky: the group is failed)
    BAD_INPUT = 2       # a rank reported bad input (an expert id out of range); nothing was moved
    CAPACITY = 3        # a receive buffer was too small: rows were dropped and counted
    PEER_TIMEOUT = 4    # a wait on a peer timed out (sticky)
    LOCAL_TIMEOUT = 5   # this rank's own blocks never met at a barrier (sticky)


STATUS_FIELDS = ("code", "rank", "peer", "peers", "fields", "field", "mine", "theirs", "op", "seq")
STATUS_WORDS = len(STATUS_FIELDS)  # 10
# Meaning per code: RANK_MISMATCH: peer = first rank whose descriptor differs, peers = mask of all
# such ranks (ranks < 31), fields = mask of differing fields, field = the first of them, mine /
# theirs = its value here / there. BAD_INPUT: peer = the rank, field = its input_status, mine = its
# input_detail (the bad expert id), theirs = E.
# CAPACITY: peer = the rank whose buffer overflowed, mine = rows (copies) needed, theirs = capacity.
# Timeouts: peer = the rank not heard from (-1: own blocks), fields = the phase (status.h kPhase*).
# op / seq: the op of THIS rank during which it was found.
STICKY = (StatusCode.RANK_MISMATCH, StatusCode.PEER_TIMEOUT, StatusCode.LOCAL_TIMEOUT)

PHASES = {1: "prepare (count exchange)", 2: "prepare (end)", 3: "dispatch (start)", 4: "dispatch (end)",
          5: "combine (start)", 6: "combine (end)", 7: "barrier", 8: "combine (remote rows)"}


def descriptor(*, seq: int, op: OpKind, num_experts: int, hidden: int, dtype: str, layout: str,
               capacity: Optional[int], handle: int = -1, num_topk: int = 0, input_status: int = INPUT_OK,
               input_detail: int = 0) -> list:
    """A descriptor as a list of :data:`DESC_WORDS` Python ints (``capacity=None``: exact, -1)."""
    return [int(seq) & 0x7FFFFFFF, int(op), int(num_experts), int(hidden), DTYPE_CODES.get(dtype, -1),
            LAYOUT_CODES[layout], -1 if capacity is None else int(capacity), int(handle), int(num_topk),
            int(input_status), int(input_detail), 0]


def compare(mine: Sequence[int], table: Sequence[Sequence[int]], rank: int) -> list:
    """Status of rank ``rank`` (a list of :data:`STATUS_WORDS` ints) from its own descriptor ``mine``
    and every rank's (``table[r]``, its own row included). Bad input on any rank wins over a mismatch
    only when the descriptors agree: a mismatch means the ranks are not even in the same op. A rank
    whose host rejected its arguments (``INPUT_REJECTED``) sent what it could fill in: only its verdict
    counts, and it reports its own error itself (as the native kernels do, ``sync.cuh``)."""
    status = [0] * STATUS_WORDS
    status[1], status[2], status[8], status[9] = rank, -1, int(mine[1]), int(mine[0])
    peers, fields, first = 0, 0, -1
    for r, row in enumerate(table):
        if int(row[9]) == INPUT_REJECTED or int(mine[9]) == INPUT_REJECTED:
            continue
        diff = 0
        for i in range(len(COMPARED)):
            if int(row[i]) != int(mine[i]):
                diff |= 1 << i
        if diff:
            if first < 0:
                first = r
                field = (diff & -diff).bit_length() - 1
                status[5], status[6], status[7] = field, int(mine[field]), int(row[field])
            if r < 31:
                peers |= 1 << r
            fields |= diff
    if first >= 0:
        status[0], status[2], status[3], status[4] = int(StatusCode.RANK_MISMATCH), first, peers, fields
        return status
    for r, row in enumerate(table):
        if int(row[9]) != INPUT_OK and not (r == rank and int(row[9]) == INPUT_REJECTED):
            status[0], status[2], status[5] = int(StatusCode.BAD_INPUT), r, int(row[9])
            status[6], status[7] = int(row[10]), int(mine[2])
            return status
    return status


def _value(field: str, value: int) -> str:
    if field == "op":
        try:
            return OpKind(value).name.lower()
        except ValueError:
            return str(value)
    if field == "dtype":
        return DTYPE_NAMES.get(value, str(value))
    if field == "layout":
        return {0: "rank_major", 1: "expert_major"}.get(value, str(value))
    if field == "capacity" and value < 0:
        return "exact (None)"
    return str(value)


def error_from_status(status: Sequence[int], timeout_s: Optional[float] = None) -> Optional[OmniEPError]:
    """The exception a status stands for (None when ``code == 0``)."""
    code, rank, peer, peers, fields, field, mine, theirs, op, seq = (int(v) for v in status[:STATUS_WORDS])
    try:
        what = f"{OpKind(op).name.lower()} #{seq}"
    except ValueError:
        what = f"op #{seq}"
    if code == StatusCode.OK:
        return None
    if code == StatusCode.RANK_MISMATCH:
        ranks = [r for r in range(31) if peers >> r & 1] or [peer]
        names = [f for i, f in enumerate(DESC_FIELDS) if fields >> i & 1]
        first = DESC_FIELDS[field] if 0 <= field < len(DESC_FIELDS) else "?"
        return RankMismatchError(
            f"rank {rank}: its {what} does not match what rank(s) {ranks} sent: fields that differ: "
            f"{', '.join(names)} (first: {first} = {_value(first, mine)} here, {_value(first, theirs)} on rank "
            f"{peer}). Every rank of the group must issue the same ops, in the same order, with the same "
            f"num_experts, hidden size, dtype, layout, capacity and handle. The group is failed: destroy it "
            f"and create it again.", rank=rank, ranks=ranks, fields=names)
    if code == StatusCode.BAD_INPUT:
        if field == INPUT_BAD_EXPERT_ID:
            return InputError(f"rank {peer} rejected its input in {what} (seen on rank {rank}): topk_idx holds "
                              f"expert id {mine}; ids must be in [-1, {theirs}) (-1 = no expert). No data was moved.")
        return InputError(f"rank {peer} rejected its input in {what} (seen on rank {rank}; rank {peer} raised why). "
                          f"No data was moved.")
    if code == StatusCode.CAPACITY:
        return CapacityError(mine, theirs, rank=peer)
    if code in (StatusCode.PEER_TIMEOUT, StatusCode.LOCAL_TIMEOUT):
        phase = "barrier of its own blocks" if code == StatusCode.LOCAL_TIMEOUT else PHASES.get(fields, "communication")
        seconds = timeout_s if timeout_s is not None else timeout_from_env()
        return PeerTimeoutError(rank, None if peer < 0 else peer, seconds, what=phase)
    return OmniEPError(f"rank {rank}: unknown status code {code} in {what}")


def raise_for_status(status: Sequence[int], timeout_s: Optional[float] = None) -> None:
    err = error_from_status(status, timeout_s)
    if err is not None:
        raise err


def checks_mode() -> str:
    """``OMNIEP_CHECKS``: ``sync`` (every op waits for its status and raises at once: the test suites'
    mode) or ``default`` (raised at the next host wait). Read when a group's backend is resolved."""
    return env.get("OMNIEP_CHECKS")


def timeout_from_env() -> float:
    """``OMNIEP_TIMEOUT_S`` (default 100 s): how long any wait on a peer may take."""
    return env.get("OMNIEP_TIMEOUT_S")
