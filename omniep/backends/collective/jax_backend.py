"""The portable ``collective`` backend for JAX: dense ``jax.lax.all_to_all`` inside ``shard_map``.

Every method runs for ONE rank inside ``shard_map`` over the axis ``self.group`` and reproduces
:mod:`omniep.ep_core.reference` bit for bit. Data travels in static per-destination buffers
``[R, T, ...]`` (block r holds, in ascending token order, the tokens this rank sends to rank r):
``ragged_all_to_all`` would move fewer bytes but does not run on XLA:CPU, and this backend is the
baseline that runs everywhere. Counts travel with ``all_to_all`` too.

Arithmetic is fixed (see the reference): every sum is fp32 from +0.0, one term at a time in contract
order (a Python loop over the static R or K, never an XLA reduction whose order may change), bias
terms last, rounded once. The one product of the forward pass, ``w[t, k] * y`` of the expert-major
combine, is rounded to fp32 on the receiving rank *before* the return ``all_to_all``: XLA:CPU (and
GPU) fuse a multiply feeding an add into one FMA, ``optimization_barrier`` does not stop it, and a
collective between the two always does. That return trip therefore carries fp32.

Checks on the data path (DESIGN §9, :mod:`.jax_status`): the FIRST exchange of every op has a shape
every rank derives from what all ranks already agreed on, and carries every rank's op descriptor:
prepare's count exchange (``[R, DESC_WORDS + 1]``: its shape depends only on R); combine's payload
exchange, in the geometry the dispatch's agreed descriptor gives (descriptor rows appended to every
block; see ``_exchange_with_descriptor``). Each rank compares the table it receives, the same on
every rank, into the op's status; every exchange that follows (shapes that depend on H, K, T, the
dtype, the layout) runs under ``lax.cond`` on that status, so ranks whose programs differ never meet
in a collective of different shapes (gloo aborts the process on one): they all skip it and report
the mismatch. Expert ids outside ``[-1, E)`` are such a failure too (BAD_INPUT, reported by every
rank): the op then moves nothing. (In one process, which traces one program for every rank, only bad
input can fail an op, and its handle routing nothing is enough: there the ``cond`` is left out, see
``_guarded``.) What a failed op returns: ``recv_x`` 0, ``recv_topk_idx`` -1, weights 0, every count
0, a handle that routes nothing; a combine (or backward pass) with that handle moves nothing, returns
the bias sum (or 0) and reports the dispatch's status again.

Collectives are matched by order, so each op's exchanges depend on all of its inputs: XLA then orders
them the same way in every rank's program, even where the programs differ elsewhere. Ops that do not
depend on each other (two dispatches of unrelated routings) may still be ordered differently by XLA
in programs that differ; as in a model, chain them.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ...ep_core import descriptor as dsc
from ...ep_core import validation as val
from ...ep_core.backend import EPBackend
from ...ep_core.capacity import align_up
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Handle, Layout, ProcessModel
from . import jax_layout as lay
from . import jax_status as js


def _axis_size(axis_name) -> int:
    if hasattr(jax.lax, "axis_size"):
        return int(jax.lax.axis_size(axis_name))
    return int(jax.lax.psum(1, axis_name))  # older jax: a static int inside shard_map


class CollectiveJax(EPBackend):
    """``group`` is the ``shard_map`` axis name (or tuple of names) of the EP group."""

    name = "collective"
    framework = "jax"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, f"jax {jax.__version__} on {jax.default_backend()}")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True,
            layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR), max_ranks=None,
            intranode=True, internode=True,
            process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE, ProcessModel.ONE_PROCESS_MANY_DEVICES),
            frameworks=("jax",), cuda_graph_safe=False, hidden_multiple=1,
        )

    def num_ranks(self) -> int:
        return _axis_size(self.group)

    # ---- communication -------------------------------------------------------------------------

    # Whether exchanges after the descriptor run under a ``cond`` on the status: None = when the group
    # may span processes (``jax.process_count() > 1``). Tests set it to take either path in one process.
    guard_exchanges: Optional[bool] = None

    def _guarded(self) -> bool:
        """One process traces ONE program for all its devices: their descriptors cannot differ but in
        the input verdict, and a failed prepare's handle already routes nothing (zeros are exchanged).
        Only ranks in different processes can run programs whose shapes differ; a ``cond`` is what
        keeps them out of such a collective, and it is not free (benchmarks/jax_descriptor_cost.py)."""
        return jax.process_count() > 1 if self.guard_exchanges is None else self.guard_exchanges

    def _exchange(self, status, *blocks):
        """``[R, T, ...]`` -> ``[R, T, ...]`` for each of ``blocks``: block r goes to rank r; block s of the
        result came from s. Moved as raw bits, so nothing is rounded or canonicalised on the way.

        Guarded (:meth:`_guarded`): runs only when ``status`` (the op's, the same code on every rank)
        is OK, else nothing is exchanged and every result is 0; one ``cond`` for all blocks, since the
        ranks' programs may differ in these shapes exactly when the status is not OK."""
        bits = lay.per_rank(tuple(lay.as_bits(b) for b in blocks), self.group)

        def move(bs):
            # One branch holds all of an op's exchanges: it runs only when the op's descriptors agreed,
            # and then its computation (shapes and all) is the same on every rank, so is its order.
            return lay.per_rank(tuple(jax.lax.all_to_all(b, self.group, 0, 0) for b in bs), self.group)

        if self._guarded():
            got = jax.lax.cond(js.is_ok(status), move,
                               lambda bs: lay.per_rank(tuple(jnp.zeros_like(b) for b in bs), self.group), bits)
        else:
            got = move(bits)
        return tuple(lay.from_bits(g, b.dtype) for g, b in zip(got, blocks))

    def _exchange_descriptors(self, mine, extra=None):
        """The op's first exchange, ``[R, DESC_WORDS (+ extra columns)]`` int32 whatever the op's data:
        ``mine`` to every rank, with ``extra[r]`` (``[R, n]``) to rank r. Returns the op's status (of
        this rank, :func:`.jax_status.compare`; all zero when OK) and the received ``extra`` columns
        ``[R, n]``."""
        R = self.num_ranks()
        blocks = jnp.broadcast_to(mine, (R, mine.shape[0]))
        if extra is not None:
            blocks = jnp.concatenate([blocks, extra.astype(jnp.int32)], axis=1)
        table = jax.lax.all_to_all(blocks, self.group, 0, 0)
        status = js.compare(mine, table[:, :dsc.DESC_WORDS], jax.lax.axis_index(self.group))
        return js.settled(status), table[:, dsc.DESC_WORDS:]

    def _move_rows(self, rows, handle: Handle):
        """Source rows ``[T, ...]`` -> receive buffer flattened to ``[R * T, ...]`` (src-major)."""
        T = handle.send_pos.shape[0]
        (got,) = self._exchange(handle.status, lay.pack_by_dest(rows, handle.send_pos))
        return got.reshape((handle.config.num_ranks * T,) + tuple(rows.shape[1:]))

    def _return_to_sources(self, handle: Handle, num_kept, *rows):
        """Receive-side rows ``[M, ...]`` in contract order back to their sources, each as ``[R, T, ...]``
        where block r, position p is what rank r holds for the p-th token this rank sent to it (one
        exchange for all of ``rows``)."""
        T = handle.send_pos.shape[0]
        return self._exchange(handle.status, *(lay.rows_to_sources(r, handle.recv_counts, num_kept, T) for r in rows))

    # ---- prepare / dispatch ----------------------------------------------------------------------

    def prepare(self, topk_idx, config: DispatchConfig, descriptor=None) -> Handle:
        """Send-side layout and the count exchange, which carries the op descriptor. ``topk_idx[T, K]``
        int32/int64 is narrowed once to int32; out-of-range ids are clamped to ``-2`` / ``E`` so they
        stay out of range (and make the status BAD_INPUT). ``descriptor``: see
        :meth:`omniep.ep_core.backend.EPBackend.prepare`. ``handle.status`` is the op's status; when it
        is not OK the handle routes nothing (``send_pos`` -1, counts 0)."""
        R, E, L = config.num_ranks, config.num_experts, config.num_local_experts
        if descriptor is None:
            descriptor = js.op_descriptor(dsc.OpKind.DISPATCH, config, hidden=0, dtype="",
                                          num_topk=int(topk_idx.shape[1]))
        mine = js.with_input_verdict(descriptor, topk_idx, E)
        idx = jnp.clip(topk_idx, -2, E).astype(jnp.int32)
        send_pos = lay.send_positions(lay.owner_of(idx, E, L), R)
        per_rank = jnp.sum(send_pos >= 0, axis=0, dtype=jnp.int32)
        status, counts = self._exchange_descriptors(mine, per_rank.reshape(R, 1))
        ok = js.is_ok(status)
        send_pos = jnp.where(ok, send_pos, -1)
        per_rank = jnp.where(ok, per_rank, 0)
        recv_counts = jnp.where(ok, counts.reshape(R), 0)
        return Handle(config, self.name, idx, None, send_pos, per_rank, recv_counts, None, None, None,
                      None, group=self.group, status=status, descriptor=tuple(int(v) for v in descriptor))

    def dispatch(self, x, topk_weights, handle: Handle):
        """``x[T, H]`` (or a tuple of row arrays, e.g. fp8 ``(x, x_scales)``) and ``topk_weights[T, K]``
        f32 to the ranks of their experts. See :class:`omniep.ep_core.types.Dispatched` for outputs;
        the op's status is ``handle.status`` (from :meth:`prepare`). A cached dispatch (a completed
        handle) exchanges no descriptor of its own: its ``x`` must have the hidden size and dtype the
        handle was prepared for, on every rank."""
        cfg = handle.config
        R, E, L, cap = cfg.num_ranks, cfg.num_experts, cfg.num_local_experts, cfg.capacity
        T, K = handle.topk_idx.shape
        owner = lay.owner_of(handle.topk_idx, E, L)
        # Routing per destination block: local expert ids of the destination (-1 elsewhere), weights.
        slot_token = lay.token_of_slot(handle.send_pos)
        sent = slot_token < T
        dest = jnp.arange(R, dtype=jnp.int32)[:, None, None]
        mine = (lay.take_rows(owner, slot_token, sent) == dest) & sent[..., None]
        send_idx = jnp.where(mine, lay.take_rows(handle.topk_idx, slot_token, sent) - dest * L, -1)
        send_w = jnp.where(mine, lay.take_rows(topk_weights, slot_token, sent), 0.0)
        xs = x if isinstance(x, tuple) else (x,)
        buf_idx, buf_w, *bufs = self._exchange(handle.status, send_idx, send_w,
                                               *(lay.pack_by_dest(lay.as_bits(a), handle.send_pos) for a in xs))
        buf_idx, buf_w = buf_idx.reshape(R * T, K), buf_w.reshape(R * T, K)
        bufs = [b.reshape((R * T,) + tuple(b.shape[2:])) for b in bufs]

        total = jnp.sum(handle.recv_counts, dtype=jnp.int32)
        if cfg.layout == Layout.RANK_MAJOR:
            row, valid = lay.rank_major_rows(handle.recv_counts, cap, T)
            recv_xs = [lay.take_rows(b, row, valid) for b in bufs]
            recv_idx = jnp.where(valid[:, None], lay.take_rows(buf_idx, row, valid), -1)
            recv_w = lay.take_rows(buf_w, row, valid)
            num_recv = jnp.minimum(total, cap)
            per_expert = jnp.sum(recv_idx[:, :, None] == jnp.arange(L, dtype=jnp.int32), axis=(0, 1),
                                 dtype=jnp.int32)
            dropped = total - num_recv
            handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=recv_idx,
                                    recv_topk_weights=recv_w, num_recv=num_recv)
            out_idx, out_w = recv_idx, recv_w
        else:
            # Rank-major receive first (uncapped, R*T rows), then a local permutation into [L, C, ...].
            row, valid = lay.rank_major_rows(handle.recv_counts, R * T, T)
            full_idx = jnp.where(valid[:, None], lay.take_rows(buf_idx, row, valid), -1)
            full_w = lay.take_rows(buf_w, row, valid)
            slot, counts = lay.expert_slots(full_idx, L, cap)
            table = lay.expert_table(full_idx, slot, L, cap)
            filled = table >= 0
            copy = jnp.maximum(table, 0)
            src_row = lay.take_rows(row, copy // K, filled)
            recv_xs = [lay.take_rows(b, src_row, filled) for b in bufs]
            out_idx = jnp.where(filled, jnp.arange(L, dtype=jnp.int32)[:, None], -1)
            out_w = lay.take_rows(full_w.reshape(-1), copy, filled)
            kept = jnp.minimum(counts, cap)
            num_recv = jnp.sum(kept, dtype=jnp.int32)
            per_expert = kept
            dropped = jnp.sum(counts, dtype=jnp.int32) - num_recv
            handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=full_idx,
                                    recv_topk_weights=full_w, num_recv=num_recv, recv_expert_slot=slot)
        recv_xs = [lay.from_bits(r, a.dtype) for r, a in zip(recv_xs, xs)]
        recv_x = tuple(recv_xs) if isinstance(x, tuple) else recv_xs[0]
        per_expert = align_up(per_expert, cfg.expert_alignment).astype(jnp.int32)
        return lay.per_rank(((recv_x, out_idx, out_w, num_recv, per_expert, dropped), handle), self.group)

    # ---- combine ---------------------------------------------------------------------------------

    def _owner(self, handle: Handle):
        cfg = handle.config
        return lay.owner_of(handle.topk_idx, cfg.num_experts, cfg.num_local_experts)

    def _sum_rank_major(self, back, handle: Handle):
        """fp32 ``Σ_r back[r][slot(t, r)]`` in ascending r, ``back[R, T, ...]`` as returned by the
        exchange (rows dropped by capacity come back as +0.0)."""
        terms = []
        for r in range(handle.config.num_ranks):
            pos = handle.send_pos[:, r]
            terms.append((lay.take_rows(back[r], pos, pos >= 0), pos >= 0))
        return lay.sum_in_order(terms, (back.shape[1],) + tuple(back.shape[2:]))

    def _sum_expert_major(self, back, handle: Handle):
        """fp32 ``Σ_k back[(t, k)]`` in ascending k, ``back[R, T, K, ...]`` as returned by the exchange."""
        terms = lay.from_owner(back, self._owner(handle), handle.send_pos, per_k=True)
        return lay.sum_in_order(terms, (back.shape[1],) + tuple(back.shape[3:]))

    def _copies(self, values, handle: Handle):
        return lay.gather_copies(values, handle.recv_topk_idx, handle.recv_expert_slot)

    def _combine_rows(self, handle: Handle):
        """``(row shape, unit dtype)`` of the blocks a combine sends when its ``y`` has the hidden size and
        element width of the dispatch that made ``handle`` (bf16 after an fp8 dispatch): the geometry
        every rank whose dispatch agreed derives alike, in which the combine's descriptor travels."""
        desc = handle.descriptor
        hidden = max(int(desc[dsc.DESC_FIELDS.index("hidden")]), 1) if desc else 1
        if handle.config.layout == Layout.EXPERT_MAJOR:
            return (int(handle.topk_idx.shape[1]), hidden), jnp.uint32  # the products travel as fp32
        name = dsc.DTYPE_NAMES.get(int(desc[dsc.DESC_FIELDS.index("dtype")])) if desc else None
        width = 4 if name is None else 2 if name in val.FP8_DTYPES else jnp.dtype(name).itemsize
        return (hidden,), lay.unsigned(width)

    def _exchange_with_descriptor(self, payload, descriptor, handle: Handle):
        """A combine's exchange of ``payload [R, T, ...]`` (block r to rank r) with its ``descriptor``
        riding along: returns what came back (``[R, T, ...]``, ``payload``'s dtype) and the status.

        The descriptor goes in rows appended to every block, in the geometry of :meth:`_combine_rows`,
        which depends only on what the dispatch's ranks agreed on; a ``payload`` of that geometry (the
        common case: ``y`` like ``x``) travels in the same exchange, so checking costs no collective.
        Otherwise this exchange carries the descriptor (and filler), and the payload follows in a
        second one when every rank's descriptor agreed (then every rank has the same geometry and
        needs it); when they differ nothing more is exchanged. A handle whose status is not OK
        exchanges nothing (``_exchange``) and its status is the combine's."""
        R, T = payload.shape[:2]
        row, unit = self._combine_rows(handle)
        bits = lay.as_bits(payload)
        conforming = tuple(bits.shape[2:]) == row and bits.dtype == unit
        mine = jnp.asarray(np.asarray(descriptor, np.int32))
        words = js.words_as_units(mine, unit)
        per_row = int(np.prod(row))
        n = -(-words.shape[0] // per_row)  # rows that hold the descriptor
        desc_rows = jnp.pad(words, (0, n * per_row - words.shape[0])).reshape((1, n) + row)
        # Not conforming: the blocks carry the payload's leading bytes, unused, so that this exchange
        # depends on y like a conforming one does (XLA orders it after y's producers on every rank;
        # zeros would let it move ahead of other collectives, differently in each program).
        first = bits if conforming else lay.refit_bytes(bits, (T,) + row, unit)
        (got,) = self._exchange(handle.status,
                                jnp.concatenate([first, jnp.broadcast_to(desc_rows, (R, n) + row)], axis=1))
        table = js.units_as_words(got[:, T:].reshape(R, n * per_row), dsc.DESC_WORDS)
        own = js.settled(js.compare(mine, table, jax.lax.axis_index(self.group)))
        status = jnp.where(js.is_ok(handle.status), own, handle.status)
        if conforming:
            back = got[:, :T]
        else:
            (back,) = self._exchange(status, bits)
        return lay.from_bits(back, payload.dtype), status

    def combine(self, y, handle: Handle, bias: tuple = ()):
        """Rank-major ``y[C, H]``: ``out[t] = Σ_r y_r[slot(t, r)]``; expert-major ``y[L, C, H]``:
        ``out[t] = Σ_k w[t, k] * y[e_k][slot(t, k)]``. fp32, contract order, bias terms added last in
        the order given, rounded once to ``y.dtype``.

        Returns ``(out, status)``: the combine's descriptor (op, E, H and dtype of ``y``, layout,
        capacity, top-k) compared across ranks (:meth:`_exchange_with_descriptor`), or the status of
        ``handle`` when that is not OK. When the status is not OK, ``out`` is the bias sum (0 without
        bias): nothing that came back is used."""
        cfg = handle.config
        R, T = cfg.num_ranks, handle.send_pos.shape[0]
        desc = js.op_descriptor(dsc.OpKind.COMBINE, cfg, hidden=int(y.shape[-1]), dtype=val.dtype_name(y),
                                num_topk=int(handle.topk_idx.shape[1]))
        if cfg.layout == Layout.RANK_MAJOR:
            payload = lay.rows_to_sources(y, handle.recv_counts, handle.num_recv, T)
            back, status = self._exchange_with_descriptor(payload, desc, handle)
            acc = self._sum_rank_major(back, handle)
        else:
            kept = handle.recv_expert_slot >= 0
            # The weight that travelled with the copy equals topk_weights[t, k] at the source.
            prod = handle.recv_topk_weights[..., None] * self._copies(y, handle).astype(jnp.float32)
            payload = lay.rows_to_sources(jnp.where(kept[..., None], prod, 0.0), handle.recv_counts, R * T, T)
            back, status = self._exchange_with_descriptor(payload, desc, handle)
            acc = self._sum_expert_major(back, handle)
        acc = jnp.where(js.is_ok(status), acc, jnp.float32(0))
        for b in bias:
            acc = acc + b.astype(jnp.float32)
        return lay.per_rank((acc.astype(y.dtype), status), self.group)

    # ---- backward --------------------------------------------------------------------------------

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: Handle):
        """``(g_x, g_topk_weights)``: ``g_x`` is the unweighted combine of ``g_recv_x`` (a tuple for fp8
        input); ``g_topk_weights[t, k]`` is read back from the slot that carried it (0 if dropped).
        Exchanges only when ``handle.status`` (the forward's) is OK; both are 0 otherwise."""
        cfg = handle.config
        R, T, K = cfg.num_ranks, *handle.topk_idx.shape
        owner = self._owner(handle)
        gs = g_recv_x if isinstance(g_recv_x, tuple) else (g_recv_x,)
        # One exchange for every cotangent: nothing of this op can be ordered apart from the rest (a
        # zero weight cotangent depends on nothing, and two programs could schedule it differently).
        if cfg.layout == Layout.RANK_MAJOR:
            *backs, back_w = self._return_to_sources(handle, handle.num_recv, *gs, g_recv_topk_weights)
            g_xs = [self._sum_rank_major(b, handle).astype(g.dtype) for b, g in zip(backs, gs)]
            picked = lay.from_owner(back_w, owner, handle.send_pos, per_k=False)
            g_w = jnp.stack([jnp.where(v, rows[:, k], 0.0) for k, (rows, v) in enumerate(picked)], axis=1)
        else:
            *backs, back_w = self._return_to_sources(handle, R * T, *(self._copies(g, handle) for g in gs),
                                                     self._copies(g_recv_topk_weights, handle))
            g_xs = [self._sum_expert_major(b, handle).astype(g.dtype) for b, g in zip(backs, gs)]
            picked = lay.from_owner(back_w, owner, handle.send_pos, per_k=True)
            g_w = jnp.stack([jnp.where(v, vals, 0.0) for vals, v in picked], axis=1)
        g_w = g_w.reshape(T, K).astype(jnp.float32)
        return lay.per_rank(((tuple(g_xs) if isinstance(g_recv_x, tuple) else g_xs[0]), g_w), self.group)

    def combine_bwd(self, g_out, handle: Handle, y: Optional[jax.Array] = None):
        """``(g_y, g_topk_weights)``. Rank-major: ``g_y`` is a cached dispatch of ``g_out`` and
        ``g_topk_weights`` is None. Expert-major: ``g_y[l, c] = round(w[t, k] * g_out[t])`` and
        ``g_topk_weights[t, k] = <g_out[t], y[l, c]>`` (fp32; needs the forward ``y``). ``handle.status``
        must be the forward combine's status: nothing is exchanged unless it is OK (both are 0 then)."""
        cfg = handle.config
        R, L, cap = cfg.num_ranks, cfg.num_local_experts, cfg.capacity
        T, K = handle.topk_idx.shape
        dtype = y.dtype if y is not None else g_out.dtype
        buf = self._move_rows(lay.as_bits(g_out), handle)
        if cfg.layout == Layout.RANK_MAJOR:
            row, valid = lay.rank_major_rows(handle.recv_counts, cap, T)
            g_y = lay.from_bits(lay.take_rows(buf, row, valid), g_out.dtype)
            return lay.per_rank(g_y.astype(dtype), self.group), None
        g_rows = lay.from_bits(buf, g_out.dtype)
        row, valid = lay.rank_major_rows(handle.recv_counts, R * T, T)
        table = lay.expert_table(handle.recv_topk_idx, handle.recv_expert_slot, L, cap)
        filled, copy = table >= 0, jnp.maximum(table, 0)
        g32 = lay.take_rows(g_rows, lay.take_rows(row, copy // K, filled), filled).astype(jnp.float32)
        w = lay.take_rows(handle.recv_topk_weights.reshape(-1), copy, filled)
        g_y = jnp.where(filled[..., None], (w[..., None] * g32).astype(dtype), jnp.zeros((), dtype))
        if y is None:
            return lay.per_rank(g_y, self.group), None
        g_per_row = lay.take_rows(g_rows, row, valid).astype(jnp.float32)
        dots = jnp.einsum("mh,mkh->mk", g_per_row, self._copies(y, handle).astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        dots = jnp.where(handle.recv_expert_slot >= 0, dots, 0.0)
        (back,) = self._return_to_sources(handle, R * T, dots)
        picked = lay.from_owner(back, self._owner(handle), handle.send_pos, per_k=True)
        g_w = jnp.stack([jnp.where(v, vals, 0.0) for vals, v in picked], axis=1).reshape(T, K)
        return lay.per_rank((g_y, g_w), self.group)
