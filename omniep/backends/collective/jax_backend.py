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

Expert ids outside ``[-1, E)`` cannot raise under tracing: they are treated as ``-1`` (not sent) and
counted in this rank's ``dropped``. Eager frontends check ids before anything runs.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ...ep_core.backend import EPBackend
from ...ep_core.capacity import align_up
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Handle, Layout, ProcessModel
from . import jax_layout as lay


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

    def _exchange(self, blocks):
        """``[R, T, ...]`` -> ``[R, T, ...]``: block r goes to rank r; block s of the result came from s.
        Moved as raw bits, so nothing is rounded or canonicalised on the way."""
        got = jax.lax.all_to_all(lay.as_bits(blocks), self.group, 0, 0)
        return lay.from_bits(got, blocks.dtype)

    def _move_rows(self, rows, handle: Handle):
        """Source rows ``[T, ...]`` -> receive buffer flattened to ``[R * T, ...]`` (src-major)."""
        T = handle.send_pos.shape[0]
        got = self._exchange(lay.pack_by_dest(rows, handle.send_pos))
        return got.reshape((handle.config.num_ranks * T,) + tuple(rows.shape[1:]))

    def _return_to_sources(self, rows, handle: Handle, num_kept):
        """Receive-side rows ``[M, ...]`` in contract order back to their sources: ``[R, T, ...]``
        where block r, position p is what rank r holds for the p-th token this rank sent to it."""
        T = handle.send_pos.shape[0]
        return self._exchange(lay.rows_to_sources(rows, handle.recv_counts, num_kept, T))

    # ---- prepare / dispatch ----------------------------------------------------------------------

    def prepare(self, topk_idx, config: DispatchConfig) -> Handle:
        """Send-side layout and the count exchange. ``topk_idx[T, K]`` int32/int64 is narrowed once to
        int32; out-of-range ids are clamped to ``-2`` / ``E`` so they stay out of range."""
        R, E, L = config.num_ranks, config.num_experts, config.num_local_experts
        idx = jnp.clip(topk_idx, -2, E).astype(jnp.int32)
        send_pos = lay.send_positions(lay.owner_of(idx, E, L), R)
        per_rank = jnp.sum(send_pos >= 0, axis=0, dtype=jnp.int32)
        recv_counts = self._exchange(per_rank.reshape(R, 1)).reshape(R)
        return Handle(config, self.name, idx, None, send_pos, per_rank, recv_counts, None, None, None,
                      None, group=self.group)

    def dispatch(self, x, topk_weights, handle: Handle):
        """``x[T, H]`` (or a tuple of row arrays, e.g. fp8 ``(x, x_scales)``) and ``topk_weights[T, K]``
        f32 to the ranks of their experts. See :class:`omniep.ep_core.types.Dispatched` for outputs."""
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
        buf_idx = self._exchange(send_idx).reshape(R * T, K)
        buf_w = self._exchange(send_w).reshape(R * T, K)
        xs = x if isinstance(x, tuple) else (x,)
        bufs = [self._move_rows(lay.as_bits(a), handle) for a in xs]

        total = jnp.sum(handle.recv_counts, dtype=jnp.int32)
        invalid = jnp.sum((handle.topk_idx < -1) | (handle.topk_idx >= E), dtype=jnp.int32)
        if cfg.layout == Layout.RANK_MAJOR:
            row, valid = lay.rank_major_rows(handle.recv_counts, cap, T)
            recv_xs = [lay.take_rows(b, row, valid) for b in bufs]
            recv_idx = jnp.where(valid[:, None], lay.take_rows(buf_idx, row, valid), -1)
            recv_w = lay.take_rows(buf_w, row, valid)
            num_recv = jnp.minimum(total, cap)
            per_expert = jnp.sum(recv_idx[:, :, None] == jnp.arange(L, dtype=jnp.int32), axis=(0, 1),
                                 dtype=jnp.int32)
            dropped = total - num_recv + invalid
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
            dropped = jnp.sum(counts, dtype=jnp.int32) - num_recv + invalid
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

    def _reduce_rank_major(self, y, handle: Handle):
        """fp32 ``Σ_r y_r[slot(t, r)]`` in ascending r (rows dropped by capacity come back as +0.0)."""
        back = self._return_to_sources(y, handle, handle.num_recv)
        T = handle.send_pos.shape[0]
        terms = []
        for r in range(handle.config.num_ranks):
            pos = handle.send_pos[:, r]
            terms.append((lay.take_rows(back[r], pos, pos >= 0), pos >= 0))
        return lay.sum_in_order(terms, (T,) + tuple(y.shape[1:]))

    def _reduce_expert_major(self, per_copy, handle: Handle):
        """fp32 ``Σ_k per_copy[(t, k)]`` in ascending k; ``per_copy[M, K, ...]`` is receive-side."""
        R, T = handle.config.num_ranks, handle.send_pos.shape[0]
        back = self._return_to_sources(per_copy, handle, R * T)
        terms = lay.from_owner(back, self._owner(handle), handle.send_pos, per_k=True)
        return lay.sum_in_order(terms, (T,) + tuple(per_copy.shape[2:]))

    def _copies(self, values, handle: Handle):
        return lay.gather_copies(values, handle.recv_topk_idx, handle.recv_expert_slot)

    def combine(self, y, handle: Handle, bias: tuple = ()):
        """Rank-major ``y[C, H]``: ``out[t] = Σ_r y_r[slot(t, r)]``; expert-major ``y[L, C, H]``:
        ``out[t] = Σ_k w[t, k] * y[e_k][slot(t, k)]``. fp32, contract order, bias terms added last in
        the order given, rounded once to ``y.dtype``."""
        if handle.config.layout == Layout.RANK_MAJOR:
            acc = self._reduce_rank_major(y, handle)
        else:
            kept = handle.recv_expert_slot >= 0
            # The weight that travelled with the copy equals topk_weights[t, k] at the source.
            prod = handle.recv_topk_weights[..., None] * self._copies(y, handle).astype(jnp.float32)
            acc = self._reduce_expert_major(jnp.where(kept[..., None], prod, 0.0), handle)
        for b in bias:
            acc = acc + b.astype(jnp.float32)
        return lay.per_rank(acc.astype(y.dtype), self.group)

    # ---- backward --------------------------------------------------------------------------------

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: Handle):
        """``(g_x, g_topk_weights)``: ``g_x`` is the unweighted combine of ``g_recv_x`` (a tuple for fp8
        input); ``g_topk_weights[t, k]`` is read back from the slot that carried it (0 if dropped)."""
        cfg = handle.config
        R, T, K = cfg.num_ranks, *handle.topk_idx.shape
        owner = self._owner(handle)
        gs = g_recv_x if isinstance(g_recv_x, tuple) else (g_recv_x,)
        if cfg.layout == Layout.RANK_MAJOR:
            g_xs = [self._reduce_rank_major(g, handle).astype(g.dtype) for g in gs]
            back_w = self._return_to_sources(g_recv_topk_weights, handle, handle.num_recv)
            picked = lay.from_owner(back_w, owner, handle.send_pos, per_k=False)
            g_w = jnp.stack([jnp.where(v, rows[:, k], 0.0) for k, (rows, v) in enumerate(picked)], axis=1)
        else:
            g_xs = [self._reduce_expert_major(self._copies(g, handle), handle).astype(g.dtype) for g in gs]
            back_w = self._return_to_sources(self._copies(g_recv_topk_weights, handle), handle, R * T)
            picked = lay.from_owner(back_w, owner, handle.send_pos, per_k=True)
            g_w = jnp.stack([jnp.where(v, vals, 0.0) for vals, v in picked], axis=1)
        g_w = g_w.reshape(T, K).astype(jnp.float32)
        return lay.per_rank(((tuple(g_xs) if isinstance(g_recv_x, tuple) else g_xs[0]), g_w), self.group)

    def combine_bwd(self, g_out, handle: Handle, y: Optional[jax.Array] = None):
        """``(g_y, g_topk_weights)``. Rank-major: ``g_y`` is a cached dispatch of ``g_out`` and
        ``g_topk_weights`` is None. Expert-major: ``g_y[l, c] = round(w[t, k] * g_out[t])`` and
        ``g_topk_weights[t, k] = <g_out[t], y[l, c]>`` (fp32; needs the forward ``y``)."""
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
        picked = lay.from_owner(self._return_to_sources(dots, handle, R * T), self._owner(handle),
                                handle.send_pos, per_k=True)
        g_w = jnp.stack([jnp.where(v, vals, 0.0) for vals, v in picked], axis=1).reshape(T, K)
        return lay.per_rank((g_y, g_w), self.group)
