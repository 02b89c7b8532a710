"""Per-rank index math of the JAX collective backend: packing rows per destination, the receive order,
the expert-major slots, and sums in contract order.

Every function runs on ONE rank inside ``shard_map`` and has only static shapes. Moving data is done
on the raw bits (:func:`as_bits` / :func:`from_bits`), so rows arrive byte for byte as they were sent,
whatever the dtype (bf16, fp16, fp32, fp8, NaN payloads included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def unsigned(width: int):
    """The unsigned integer dtype of ``width`` bytes (1, 2, 4 or 8)."""
    return _BITS[width]


def as_bits(a):
    """``a`` reinterpreted as unsigned integers of the same width (data movement never rounds)."""
    return jax.lax.bitcast_convert_type(a, _BITS[np.dtype(a.dtype).itemsize])


def from_bits(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype)


def _varying_axes(a):
    """Axes ``a`` varies over under shard_map's ``check_vma``; None if this jax does not say."""
    aval = jax.typeof(a)
    for get in (lambda t: t.vma, lambda t: t.manual_axis_type.varying, lambda t: t.mat.varying):
        try:
            return frozenset(get(aval))
        except AttributeError:
            continue
    return None


def refit_bytes(blocks, shape, dtype):
    """``blocks [R, ...]`` as ``[R, *shape]`` of ``dtype`` (unsigned): each block's leading bytes, cut or
    zero-padded to the new size."""
    R = blocks.shape[0]
    width = np.dtype(dtype).itemsize
    size = int(np.prod(shape)) * width
    flat = as_bits(blocks).reshape(R, -1)
    if flat.dtype.itemsize > 1:
        flat = jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(R, -1)
    flat = jnp.pad(flat[:, :size], ((0, 0), (0, max(size - flat.shape[1], 0))))
    if width > 1:
        flat = jax.lax.bitcast_convert_type(flat.reshape(R, -1, width), dtype)
    return flat.reshape((R,) + tuple(shape))


def per_rank(tree, axis_name):
    """Mark every array of ``tree`` as varying over ``axis_name`` (shard_map's ``check_vma``).

    Outputs are per-rank data, but JAX types an array built from constants only (it happens with
    zero-size shapes) as invariant, and then rejects a per-rank cotangent for it."""
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def one(a):
        vma = _varying_axes(a)
        missing = tuple(ax for ax in axes if vma is not None and ax not in vma)
        if not missing:
            return a
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(a, missing, to="varying")
        return jax.lax.pvary(a, missing)

    return jax.tree.map(one, tree)


def _expand(mask, ndim):
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def take_rows(rows, index, valid):
    """``rows[index]`` where ``valid`` else 0, for ``index`` of any shape; rows are ``[N, ...]``.

    Out-of-range indices are clipped before the gather and masked after it (no wrap-around)."""
    out_shape = tuple(index.shape) + tuple(rows.shape[1:])
    zero = jnp.zeros((), rows.dtype)
    if rows.shape[0] == 0:  # nothing to read (and nothing to clip into)
        return jnp.zeros(out_shape, rows.dtype)
    got = jnp.take(rows, jnp.clip(index, 0, rows.shape[0] - 1), axis=0)
    return jnp.where(_expand(valid, got.ndim), got, zero)


def owner_of(topk_idx, num_experts: int, num_local_experts: int):
    """``[T, K]`` rank holding each chosen expert, ``-1`` for ``-1`` and for out-of-range ids."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return jnp.where(valid, topk_idx // num_local_experts, -1).astype(jnp.int32)


def send_positions(owner, num_ranks: int):
    """``send_pos[T, R]``: rank of token t among the tokens this rank sends to r, ascending; -1 if none.

    A token goes to a rank at most once, however many of that rank's experts it chose."""
    in_rank = jnp.any(owner[:, :, None] == jnp.arange(num_ranks, dtype=jnp.int32), axis=1)
    return jnp.where(in_rank, jnp.cumsum(in_rank, axis=0, dtype=jnp.int32) - 1, -1).astype(jnp.int32)


def token_of_slot(send_pos):
    """``[R, T]``: which token sits at position p of the buffer to rank r (``T`` where none), for
    ``send_pos`` as :func:`send_positions` makes it (per rank, positions 0 .. n-1 in token order)."""
    T, R = send_pos.shape
    # Gathers after a stable sort, no scatter: XLA's deterministic scatter on GPUs
    # (--xla_gpu_deterministic_ops) misplaced rows of the scatter this replaces (benchmarks/RESULTS.md,
    # 2026-11-26 17:53). Per rank, the tokens sent there come first, ascending.
    first = jnp.argsort(send_pos < 0, axis=0, stable=True).astype(jnp.int32).T
    count = jnp.sum(send_pos >= 0, axis=0, dtype=jnp.int32)
    return jnp.where(jnp.arange(T, dtype=jnp.int32)[None, :] < count[:, None], first, T)


def pack_by_dest(rows, send_pos):
    """Rows ``[T, ...]`` laid out for ``all_to_all``: ``[R, T, ...]``, row p of block r is the p-th token
    this rank sends to r; unused positions are 0."""
    T = send_pos.shape[0]
    slot_token = token_of_slot(send_pos)
    return take_rows(rows, slot_token, slot_token < T)


def exclusive_cumsum(counts):
    return jnp.cumsum(counts, dtype=jnp.int32) - counts


def rank_major_rows(recv_counts, num_rows: int, num_tokens: int):
    """Contract order of the receive: for rows ``m < num_rows`` the flat index ``src * T + pos`` into
    the ``[R, T]`` receive buffer, and whether row m exists (``m < Σ recv_counts``).

    Rows are ordered by (source rank, source token): source s fills rows
    ``[offset[s], offset[s] + recv_counts[s])``."""
    m = jnp.arange(num_rows, dtype=jnp.int32)
    ends = jnp.cumsum(recv_counts, dtype=jnp.int32)
    src = jnp.sum(m[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)
    valid = src < recv_counts.shape[0]
    src = jnp.minimum(src, recv_counts.shape[0] - 1)
    pos = m - exclusive_cumsum(recv_counts)[src]
    return src * num_tokens + pos, valid


def rows_to_sources(rows, recv_counts, num_kept, num_tokens: int):
    """Inverse of :func:`rank_major_rows`: rows ``[M, ...]`` in contract order back to ``[R, T, ...]``
    blocks per source rank; rows ``>= num_kept`` (dropped or padding) come back as 0."""
    R = recv_counts.shape[0]
    pos = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    m = exclusive_cumsum(recv_counts)[:, None] + pos
    valid = (pos < recv_counts[:, None]) & (m < num_kept)
    return take_rows(rows, m.reshape(R * num_tokens), valid.reshape(R * num_tokens)).reshape(
        (R, num_tokens) + tuple(rows.shape[1:]))


def expert_slots(recv_local_idx, num_local_experts: int, capacity: int):
    """Expert-major placement of the copies ``(row m, k)`` with ``recv_local_idx[m, k] >= 0``.

    Copies of one local expert are numbered in (row, k) order, i.e. (source rank, source token, k).
    Returns ``slot[M, K]`` (``-1`` when not local or beyond ``capacity``) and ``counts[L]`` (copies per
    expert before capacity)."""
    M, K = recv_local_idx.shape
    flat = recv_local_idx.reshape(M * K)
    onehot = (flat[:, None] == jnp.arange(num_local_experts, dtype=jnp.int32)).astype(jnp.int32)
    running = jnp.cumsum(onehot, axis=0, dtype=jnp.int32)
    slot = jnp.take_along_axis(running, jnp.clip(flat, 0, num_local_experts - 1)[:, None], axis=1)[:, 0] - 1
    slot = jnp.where((flat >= 0) & (slot < capacity), slot, -1)
    return slot.reshape(M, K).astype(jnp.int32), jnp.sum(onehot, axis=0, dtype=jnp.int32)


def expert_table(recv_local_idx, slot, num_local_experts: int, capacity: int):
    """``[L, C]``: flat copy index ``m * K + k`` held by slot c of local expert l, ``-1`` when empty, for
    ``slot`` as :func:`expert_slots` makes it (per expert, slots 0 .. n-1 in copy order)."""
    M, K = recv_local_idx.shape
    L = num_local_experts
    kept = (slot >= 0).reshape(M * K)
    expert = jnp.where(kept, recv_local_idx.reshape(M * K), L)
    # Expert l's kept copies hold slots 0 .. n_l - 1 in copy order (expert_slots), so after a stable sort
    # by expert its slot c is entry start_l + c: gathers only (see token_of_slot on scatters).
    order = jnp.argsort(expert, stable=True)
    # Where each expert's run starts in the sorted experts, and where it ends (binary searches).
    bounds = jnp.searchsorted(expert[order], jnp.arange(L + 1, dtype=expert.dtype)).astype(jnp.int32)
    c = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    held = c < (bounds[1:] - bounds[:-1])[:, None]
    return jnp.where(held, take_rows(order.astype(jnp.int32), bounds[:-1, None] + c, held), -1)


def gather_copies(values, recv_local_idx, slot):
    """Expert-major ``values[L, C, ...]`` read back per copy: ``[M, K, ...]``, 0 where slot is -1."""
    L, C = values.shape[:2]
    flat = values.reshape((L * C,) + tuple(values.shape[2:]))
    return take_rows(flat, recv_local_idx * C + slot, slot >= 0)


def from_owner(back, owner, send_pos, per_k: bool):
    """Source side of a return trip: ``back[R, T, (K,) ...]`` as returned by ``all_to_all``; for each
    (t, k) the entry of the rank that owns expert (t, k), at the position t had in the buffer to it.
    Returns a list over k of ``[T, ...]`` and the mask ``owner[:, k] >= 0``."""
    R, T = back.shape[:2]
    K = owner.shape[1]
    rest = back.shape[3:] if per_k else back.shape[2:]
    flat = back.reshape((-1,) + tuple(rest))
    out = []
    for k in range(K):
        r = jnp.maximum(owner[:, k], 0)
        pos = jnp.take_along_axis(send_pos, r[:, None], axis=1)[:, 0]
        index = (r * T + pos) * K + k if per_k else r * T + pos
        valid = owner[:, k] >= 0
        out.append((take_rows(flat, index, valid), valid))
    return out


def sum_in_order(contributions, like_shape):
    """fp32 sum of ``[(value, mask)]`` in list order, from +0.0, one addition per term.

    Masked-out terms contribute exactly nothing (``where``, not a multiply, so NaN/inf elsewhere cannot
    leak in). XLA rewrites ``0 + a`` to ``a``, which would keep a leading -0.0 where IEEE gives +0.0:
    the first term is canonicalised instead (``+0.0 + a == a`` except ``a == -0.0``)."""
    acc = None
    for value, mask in contributions:
        term = jnp.where(_expand(mask, value.ndim), value.astype(jnp.float32), jnp.float32(0))
        if acc is None:
            acc = jnp.where(term == 0, jnp.float32(0), term)
        else:
            acc = acc + term
    return jnp.zeros(like_shape, jnp.float32) if acc is None else acc
