"""Op descriptors and status words inside a JAX program (DESIGN §9): the in-graph side of
:mod:`omniep.ep_core.descriptor`, which stays the one definition of both layouts and of the comparison.

Every function runs for ONE rank inside ``shard_map``. A descriptor here is a ``[DESC_WORDS]`` int32
array, a status a ``[STATUS_WORDS]`` int32 array, in the field orders of ``descriptor.DESC_FIELDS`` /
``STATUS_FIELDS``. :func:`compare` is the jnp twin of :func:`omniep.ep_core.descriptor.compare` (the
reference; tests hold them equal on random descriptor tables).

Sequence numbers and handle ids: under ``jit`` a trace-time op counter is meaningless across processes
(tracing order may differ between processes, and one trace serves many calls), so JAX descriptors
carry ``seq = 0`` and ``handle = -1`` for a dispatch (no handle used) / ``0`` for every op that uses a
handle. Both are still compared; every other compared field (op, E, H, dtype, layout, capacity,
num_topk) tells the ranks apart.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...ep_core import descriptor as dsc
from ...ep_core.types import DispatchConfig
from .jax_layout import per_rank, unsigned

_N_COMPARED = len(dsc.COMPARED)
_INPUT_STATUS = dsc.DESC_FIELDS.index("input_status")
_INPUT_DETAIL = dsc.DESC_FIELDS.index("input_detail")
_FIELD = {name: i for i, name in enumerate(dsc.DESC_FIELDS)}


def op_descriptor(op: dsc.OpKind, config: DispatchConfig, *, hidden: int, dtype: str, num_topk: int) -> tuple:
    """The static part of a JAX op's descriptor (a tuple of ``DESC_WORDS`` Python ints; the input
    verdict is 0 here and filled in on the device by :func:`with_input_verdict`). ``hidden`` / ``dtype``:
    of the rows the op moves (``x`` for a dispatch, ``y`` for a combine; the fp8 rows of an fp8 pair)."""
    return tuple(dsc.descriptor(seq=0, op=op, num_experts=config.num_experts, hidden=hidden, dtype=dtype,
                                layout=config.layout.value, capacity=config.capacity,
                                handle=-1 if op == dsc.OpKind.DISPATCH else 0, num_topk=num_topk))


def with_input_verdict(desc: Sequence[int], topk_idx, num_experts: int):
    """``desc`` as a ``[DESC_WORDS]`` int32 array with this rank's verdict on ``topk_idx[T, K]``:
    ``input_status = INPUT_BAD_EXPERT_ID`` and ``input_detail`` = the first id outside ``[-1, E)`` in
    row-major order (saturated to int32), when there is one.

    One plain min-reduction over the ids (the first bad position), then one scalar read: this runs on
    every dispatch, and XLA:CPU vectorises a plain reduction where a reduction of (position, id)
    pairs runs element by element."""
    i32 = jnp.int32
    words = jnp.asarray(np.asarray(desc, np.int32))
    flat = topk_idx.reshape(-1)
    n = flat.shape[0]
    if n == 0:
        return words
    info = jnp.iinfo(i32)
    pos = jnp.min(jnp.where((flat < -1) | (flat >= num_experts), jnp.arange(n, dtype=i32), n))
    any_bad = pos < n
    bad_id = jnp.clip(jax.lax.dynamic_index_in_dim(flat, jnp.minimum(pos, n - 1), keepdims=False),
                      info.min, info.max).astype(i32)
    field = jnp.arange(dsc.DESC_WORDS, dtype=i32)
    verdict = jnp.where(any_bad, dsc.INPUT_BAD_EXPERT_ID, dsc.INPUT_OK).astype(i32)
    return (words + jnp.where(field == _INPUT_STATUS, verdict, 0)
            + jnp.where((field == _INPUT_DETAIL) & any_bad, bad_id, 0))


def _first_of(keys, *payload):
    """``(min(keys), payload at it...)`` as ONE reduction; ``keys`` are distinct apart from a sentinel
    (``len(keys)``: none), so ties do not matter."""
    def pick(a, b):
        take_a = a[0] <= b[0]
        return tuple(jnp.where(take_a, x, y) for x, y in zip(a, b))

    i32 = jnp.int32
    return jax.lax.reduce((keys,) + payload, (i32(keys.shape[0]),) + (i32(0),) * len(payload), pick, (0,))


def compare(mine, table, rank):
    """``[STATUS_WORDS]`` int32 status of rank ``rank`` (a traced scalar) from its descriptor ``mine``
    ``[DESC_WORDS]`` and every rank's, ``table[R, DESC_WORDS]`` (its own row included): exactly
    :func:`omniep.ep_core.descriptor.compare`.

    It runs in every prepare, so it is written for XLA:CPU, which pays per operation: per-row facts
    first (the differing fields as a bit mask, the lowest of them and both values there), then one
    reduction per search (first differing rank, first rank with bad input) carrying what the status
    needs from that rank, then one elementwise assembly; no loop over ranks, no gathers."""
    i32 = jnp.int32
    mine, table = mine.astype(i32), table.astype(i32)
    R, F = table.shape[0], _N_COMPARED
    fidx = jnp.arange(F, dtype=i32)
    ranks = jnp.arange(R, dtype=i32)
    # A rank whose host rejected its arguments sent what it could fill in: only its verdict counts.
    rejected = (table[:, _INPUT_STATUS] == dsc.INPUT_REJECTED) | (mine[_INPUT_STATUS] == dsc.INPUT_REJECTED)
    differs = (table[:, :F] != mine[None, :F]) & ~rejected[:, None]                         # [R, F]
    diff = jnp.sum(jnp.where(differs, jnp.left_shift(i32(1), fidx), 0), axis=1, dtype=i32)   # [R] field masks
    field_r = jnp.min(jnp.where(differs, fidx, F), axis=1)                                   # lowest per row
    at_field = fidx[None, :] == field_r[:, None]
    mine_r = jnp.sum(jnp.where(at_field, mine[None, :F], 0), axis=1, dtype=i32)
    theirs_r = jnp.sum(jnp.where(at_field, table[:, :F], 0), axis=1, dtype=i32)
    row_differs = diff != 0
    first, field, mine_f, theirs_f = _first_of(jnp.where(row_differs, ranks, R), field_r, mine_r, theirs_r)
    verdicts = table[:, _INPUT_STATUS]
    # A rank that rejected its own arguments raises that error itself; the others report it.
    reports = (verdicts != dsc.INPUT_OK) & ~((ranks == rank) & (verdicts == dsc.INPUT_REJECTED))
    bad_rank, verdict, detail = _first_of(jnp.where(reports, ranks, R), verdicts, table[:, _INPUT_DETAIL])
    mismatch, has_bad = first < R, bad_rank < R
    # Bit r for ranks < 31 only (the sign bit stays clear), as the reference does.
    peers = jnp.sum(jnp.where(row_differs & (ranks < 31), jnp.left_shift(i32(1), jnp.minimum(ranks, 30)), 0),
                    dtype=i32)
    fields = jax.lax.reduce(diff, i32(0), jax.lax.bitwise_or, (0,))

    def pick(on_mismatch, on_bad, otherwise=0):
        return jnp.where(mismatch, on_mismatch, jnp.where(has_bad, on_bad, otherwise)).astype(i32)

    words = {
        "code": pick(int(dsc.StatusCode.RANK_MISMATCH), int(dsc.StatusCode.BAD_INPUT), int(dsc.StatusCode.OK)),
        "rank": jnp.asarray(rank, i32),
        "peer": pick(first, bad_rank, -1),
        "peers": pick(peers, 0),
        "fields": pick(fields, 0),
        "field": pick(field, verdict),
        "mine": pick(mine_f, detail),
        "theirs": pick(theirs_f, mine[_FIELD["num_experts"]]),
        "op": mine[_FIELD["op"]],
        "seq": mine[_FIELD["seq"]],
    }
    slot = jnp.arange(dsc.STATUS_WORDS, dtype=i32)  # assembled elementwise: one fusion, not a stack
    return sum(jnp.where(slot == k, words[name], 0) for k, name in enumerate(dsc.STATUS_FIELDS))


def words_as_units(words, dtype):
    """int32 ``words [..., n]`` as the unsigned units of ``dtype``'s width (1, 2, 4 or 8 bytes) that hold
    the same bytes, in order: ``[..., n * 4 // width]`` (``n`` even for 8-byte units)."""
    u32 = jax.lax.bitcast_convert_type(words.astype(jnp.int32), jnp.uint32)
    width = jnp.dtype(dtype).itemsize
    if width == 4:
        return u32
    if width < 4:
        units = jax.lax.bitcast_convert_type(u32, unsigned(width))  # [..., n, 4 // width]
        return units.reshape(units.shape[:-2] + (-1,))
    return jax.lax.bitcast_convert_type(u32.reshape(u32.shape[:-1] + (-1, 2)), jnp.uint64)


def units_as_words(units, num_words: int):
    """Inverse of :func:`words_as_units`: the first ``num_words`` int32 of ``units [..., m]``."""
    width = jnp.dtype(units.dtype).itemsize
    if width == 4:
        u32 = units[..., :num_words]
    elif width < 4:
        part = units[..., :num_words * 4 // width]
        u32 = jax.lax.bitcast_convert_type(part.reshape(part.shape[:-1] + (num_words, 4 // width)), jnp.uint32)
    else:
        u32 = jax.lax.bitcast_convert_type(units[..., :num_words // 2], jnp.uint32)
        u32 = u32.reshape(u32.shape[:-2] + (num_words,))
    return jax.lax.bitcast_convert_type(u32, jnp.int32)


def settled(status):
    """The status an op returns: all zero when OK (:func:`compare` fills in the rank and op even then;
    they only mean something beside a failure), else as compared."""
    return jnp.where(is_ok(status), 0, status)


def is_ok(status):
    """Traced bool: ``status`` reports nothing (``code == 0``)."""
    return status[0] == dsc.StatusCode.OK


def zero_status(axis_name):
    """An all-OK status, typed as per-rank data of ``axis_name``."""
    return per_rank(jnp.zeros((dsc.STATUS_WORDS,), jnp.int32), axis_name)
