"""The portable ``collective`` backend for PyTorch: ``torch.distributed.all_to_all_single``.

One process per device; gloo on CPU, NCCL/RCCL on GPU. Tensors stay on the device of the input.
Per call: one exchange of counts (an all-gather, so every rank knows every rank's receive plan),
then one all-to-all of packed byte rows (data moves unchanged, any dtype, fp8 included).
Reductions are done by the receiving source rank in the contract order of
:mod:`omniep.ep_core.reference`: an fp32 accumulator from +0.0, one contribution at a time (ranks
ascending for rank-major, k ascending for expert-major), products rounded to fp32 before the add,
bias last, one rounding to the output dtype. Masked contributions never touch the accumulator
(``torch.where``), so results are bit for bit the reference's.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..torch_group import PythonOps, TorchGroupBackend
from ...ep_core import validation as v
from ...ep_core.capacity import align_up
from ...ep_core.errors import CapacityError, InputError
from ...ep_core.types import Availability, Capabilities, DispatchConfig, Layout, ProcessModel
from .torch_layout import (
    TorchHandle, acc_dtype, capacity_overflow, as_bytes, exclusive_cumsum, expert_major_send_slot, from_bytes, kept_from_sources,
    kept_to_destinations, local_layout, pack_rows, positions_in_group, rank_major_send_slot,
    receive_copy_slots, receive_plan,
)


class CollectiveTorch(PythonOps, TorchGroupBackend):
    """prepare / dispatch / combine / backward passes for ONE rank of a ``torch.distributed`` group.

    ``group`` is a ``ProcessGroup`` (``None``: the default group). Every rank of the group must make
    the same calls in the same order with the same config, hidden size and dtypes (the frontend
    checks that with one small exchange before the counts move).
    """

    name = "collective"

    @classmethod
    def availability(cls) -> Availability:
        try:
            import torch.distributed as dist
        except ImportError as exc:  # pragma: no cover - torch without distributed
            return Availability(False, f"torch.distributed cannot be imported: {exc}")
        if not dist.is_available():
            return Availability(False, f"torch {torch.__version__} was built without torch.distributed")
        return Availability(True, f"torch {torch.__version__}: torch.distributed all_to_all_single "
                                  f"(gloo on CPU, NCCL/RCCL on GPU)")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True,
            layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR), max_ranks=None, intranode=True,
            internode=True, process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,),
            frameworks=("torch",), cuda_graph_safe=False, hidden_multiple=1,
        )


    # ---- the omniep::* ops (omniep.frontends.torch_ops) --------------------------------------------
    # Handle tensors after recv_topk_idx / recv_topk_weights: topk_idx32, send_pos, num_tokens_per_rank,
    # recv_counts, num_recv, all_counts, send_slot, then (expert-major; empty otherwise) recv_expert_slot
    # and the uncapped rank-major receive of the routing (recv_topk_idx / weights [M, K]).

    def _config(self, num_experts, layout, capacity, expert_alignment, num_tokens=0) -> DispatchConfig:
        lay = Layout.EXPERT_MAJOR if layout else Layout.RANK_MAJOR
        if capacity < 0 and lay == Layout.EXPERT_MAJOR:
            capacity = self.world * num_tokens  # the default expert-major capacity: R * T
        return DispatchConfig(num_experts, self.world, lay, None if capacity < 0 else capacity, expert_alignment)

    def _handle(self, h, config: DispatchConfig, topk_weights=None) -> TorchHandle:
        recv_idx, recv_w, idx32, send_pos, per_rank, recv_counts, num_recv, all_counts, send_slot, slot, m_idx, m_w = h
        if config.layout == Layout.EXPERT_MAJOR:
            recv_idx, recv_w = m_idx, m_w
        else:
            slot = None
        return TorchHandle(config=config, backend=self.name, topk_idx=idx32, topk_weights=topk_weights,
                           send_pos=send_pos, num_tokens_per_rank=per_rank, recv_counts=recv_counts,
                           recv_topk_idx=recv_idx, recv_topk_weights=recv_w, num_recv=num_recv,
                           recv_expert_slot=slot, all_counts=all_counts, send_slot=send_slot,
                           group_name=getattr(self.group, "group_name", None))

    @staticmethod
    def _handle_tensors(h: TorchHandle) -> list:
        tensors = [h.topk_idx, h.send_pos, h.num_tokens_per_rank, h.recv_counts, h.num_recv, h.all_counts, h.send_slot]
        if h.config.layout == Layout.EXPERT_MAJOR:
            return tensors + [h.recv_expert_slot, h.recv_topk_idx, h.recv_topk_weights]
        new = h.topk_idx.new_empty
        return tensors + [new((0,)), new((0,)), new((0,), dtype=torch.float32)]

    def fake_handle(self, topk_idx, num_experts, layout, rows):
        T, K = topk_idx.shape
        R, i32 = self.world, torch.int32
        new = topk_idx.new_empty
        tensors = [new((T, K), dtype=i32), new((T, R), dtype=i32), new((R,), dtype=i32), new((R,), dtype=i32),
                   new((), dtype=i32), new((R, R + num_experts), dtype=i32), new((T, R) if layout == 0 else (T, K), dtype=i32)]
        if layout == 0:
            return tensors + [new((0,), dtype=i32), new((0,), dtype=i32), new((0,), dtype=torch.float32)]
        M = torch.library.get_ctx().new_dynamic_size()
        return tensors + [new((M, K), dtype=i32), new((M, K), dtype=i32), new((M, K), dtype=torch.float32)]

    def op_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment):
        v.check_group(num_experts, self.world)
        T, _ = v.check_routing(topk_idx, topk_weights)
        v.check_tokens(x, T, x_scales=x_scales)
        v.check_expert_ids(topk_idx.detach().cpu().numpy(), num_experts)
        config = self._config(num_experts, layout, capacity, expert_alignment, T)
        handle = self.prepare(topk_idx, config)
        overflow = capacity_overflow(handle.all_counts, config)
        if overflow:
            rank, needed, cap = overflow[0]
            raise CapacityError(needed, cap, rank=rank,
                                what="rows" if config.layout == Layout.RANK_MAJOR else "copies for one local expert")
        moved = (x, x_scales) if x_scales is not None else x
        (recv_x, recv_idx, recv_w, num_recv, per_expert, dropped), handle = self.dispatch(moved, topk_weights, handle)
        recv_x, recv_scales = recv_x if x_scales is not None else (recv_x, x.new_empty((0,), dtype=torch.float32))
        outputs = [recv_x, recv_scales, recv_idx, recv_w, num_recv, per_expert, dropped]
        # An op's outputs may alias neither its inputs nor each other (torch.library): copy what does.
        seen = {t.untyped_storage().data_ptr() for t in (x, topk_idx, topk_weights) if t.numel()}
        fresh = []
        for t in outputs + self._handle_tensors(handle):
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            if ptr is None:
                t = t.new_empty(t.shape)
            elif ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
            fresh.append(t)
        return (*fresh[:7], fresh[7:])

    def op_cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment):
        h = self._handle(handle, self._config(num_experts, layout, capacity, expert_alignment))
        v.check_tokens(x, int(h.topk_idx.shape[0]), x_scales=x_scales)
        (recv_x, *_), _ = self.dispatch((x, x_scales) if x_scales is not None else x, None, h)
        return recv_x if x_scales is not None else (recv_x, x.new_empty((0,), dtype=torch.float32))

    def op_combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment):
        config = self._config(num_experts, layout, capacity, expert_alignment, int(handle[2].shape[0]))
        h = self._handle(handle, config, topk_weights)
        biases = tuple(b for b in (bias0, bias1) if b is not None)
        shape = "[rows, H]" if layout == 0 else "[num_local_experts, capacity, H]"
        v.check_combine_input(y, tuple(handle[0].shape[: 1 if layout == 0 else 2]), layout_shape=shape)
        v.check_bias(biases, int(h.topk_idx.shape[0]), int(y.shape[-1]))
        return self.combine(y, h, biases)

    def op_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle, num_experts, layout, capacity, expert_alignment):
        config = self._config(num_experts, layout, capacity, expert_alignment, int(handle[2].shape[0]))
        return self.dispatch_bwd(g_recv_x, g_recv_topk_weights, self._handle(handle, config))

    def op_combine_bwd(self, g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment):
        config = self._config(num_experts, layout, capacity, expert_alignment, int(handle[2].shape[0]))
        g_y, g_w = self.combine_bwd(g_out, self._handle(handle, config, topk_weights), y)
        return g_y, (g_w if g_w is not None else g_out.new_empty((0,), dtype=torch.float32))

    # ---- communication --------------------------------------------------------------------------

    def all_to_all(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        """Rows ``send[sum(send_splits), ...]`` out, rows ``[sum(recv_splits), ...]`` in, by rank."""
        import torch.distributed as dist

        recv = send.new_empty((int(sum(recv_splits)),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), [int(n) for n in recv_splits],
                               [int(n) for n in send_splits], group=self.group)
        return recv

    def all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[n]`` int64 from every rank -> ``[R, n]``: an all-gather written as an all-to-all so the
        backend needs one collective only."""
        send = values.to(torch.int64).reshape(1, -1).repeat(self.world, 1)
        return self.all_to_all(send, [1] * self.world, [1] * self.world)

    # ---- prepare / dispatch ---------------------------------------------------------------------

    def prepare(self, topk_idx, config: DispatchConfig) -> TorchHandle:
        """Local layout plus the count exchange. ``topk_idx[T, K]`` int32/int64, ids validated."""
        R, me = self.world, self.rank
        idx32, owner, send_pos, per_rank, per_expert = local_layout(topk_idx, config.num_experts, R)
        all_counts = self.all_gather(torch.cat([per_rank, per_expert]))
        plan = receive_plan(all_counts, config)
        if config.layout == Layout.RANK_MAJOR:
            send_slot = rank_major_send_slot(send_pos, plan, me)
        else:
            send_slot = expert_major_send_slot(idx32, owner, plan, me, config)
        return TorchHandle(
            config=config, backend=self.name, topk_idx=idx32, topk_weights=None, send_pos=send_pos,
            num_tokens_per_rank=per_rank, recv_counts=all_counts[:, me].to(torch.int32),
            recv_topk_idx=None, recv_topk_weights=None, num_recv=None,
            all_counts=all_counts.to(torch.int32), send_slot=send_slot,
            group_name=getattr(self.group, "group_name", None),
        )

    def dispatch(self, x, topk_weights, handle: TorchHandle):
        """Move ``x[T, H]`` (or ``(x, x_scales)`` for fp8) and ``topk_weights[T, K]`` float32.

        A handle from :meth:`prepare` is completed (full dispatch: rows and routing move); a completed
        handle gives a cached dispatch (only ``x`` moves, ``topk_weights`` is ignored and the
        routing of the handle is returned). Returns ``((recv_x, recv_topk_idx, recv_topk_weights,
        num_recv, num_recv_tokens_per_expert, dropped), handle)`` as in :class:`Dispatched`.
        """
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        cfg, me, L = handle.config, self.rank, handle.config.num_local_experts
        plan = receive_plan(handle.all_counts, cfg)
        cached = handle.recv_topk_idx is not None
        rank_major = cfg.layout == Layout.RANK_MAJOR
        send_mask = (handle.send_slot >= 0) if rank_major else (handle.send_pos >= 0)
        send_splits = send_mask.sum(0).tolist()
        recv_splits = (kept_from_sources(plan, me) if rank_major else plan.tokens[:, me]).tolist()
        tokens = torch.nonzero(send_mask.T)[:, 1]  # destination-major, ascending token inside
        # Rows move as raw bytes: any dtype (fp8 included) is moved unchanged and indexed as uint8.
        moved = [x] + ([x_scales] if x_scales is not None else [])
        parts = [as_bytes(p)[tokens] for p in moved]
        if not cached:
            parts += [handle.topk_idx[tokens], topk_weights.to(torch.float32)[tokens]]
        buf, spans = pack_rows(parts)
        recv = self.all_to_all(buf, send_splits, recv_splits)
        payload = [recv[:, a:b] for a, b in spans[: len(moved)]]
        if not cached:
            (a, b), (c, d) = spans[-2:]
            gidx = from_bytes(recv[:, a:b], torch.int32, parts[-2].shape[1:])
            gw = from_bytes(recv[:, c:d], torch.float32, parts[-1].shape[1:])
            mine = (gidx >= me * L) & (gidx < (me + 1) * L)
            recv_local = torch.where(mine, gidx - me * L, -1).to(torch.int32)
            recv_w = torch.where(mine, gw, torch.zeros_like(gw))
        if rank_major:
            n = recv.shape[0]
            cap = n if cfg.capacity is None else cfg.capacity
            out = [_padded(r, cap, 0) for r in payload]
            if cached:
                recv_idx, recv_w_out = handle.recv_topk_idx, handle.recv_topk_weights
            else:
                recv_idx, recv_w_out = _padded(recv_local, cap, -1), _padded(recv_w, cap, 0)
                handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=recv_idx,
                                        recv_topk_weights=recv_w_out, num_recv=_scalar(n, x.device))
            per_expert = torch.bincount(torch.where(recv_idx >= 0, recv_idx, L).flatten().long(),
                                        minlength=L + 1)[:L]
            num_recv, dropped = n, int(plan.total[me]) - n
        else:
            cap = int(plan.capacity[me])
            if cached:
                recv_local, recv_w, slot = handle.recv_topk_idx, handle.recv_topk_weights, handle.recv_expert_slot
            else:
                slot = receive_copy_slots(recv_local, L, cap)
                handle = handle.replace(topk_weights=topk_weights, recv_topk_idx=recv_local,
                                        recv_topk_weights=recv_w, recv_expert_slot=slot)
            m, k = torch.nonzero(slot >= 0, as_tuple=True)
            lc = (recv_local[m, k].long(), slot[m, k].long())
            out = [_placed(r[m], lc, L, cap, 0) for r in payload]
            recv_idx = _placed(lc[0].to(torch.int32), lc, L, cap, -1)
            recv_w_out = _placed(recv_w[m, k], lc, L, cap, 0)
            per_expert = torch.minimum(plan.expert_copies[:, me * L:(me + 1) * L].sum(0), plan.capacity[me])
            num_recv = int(per_expert.sum())
            dropped = int(plan.total[me]) - num_recv
            if not cached:
                handle = handle.replace(num_recv=_scalar(num_recv, x.device))
        out = [from_bytes(o.reshape(-1, o.shape[-1]), p.dtype, p.shape[1:]).reshape(o.shape[:-1] + p.shape[1:])
               for o, p in zip(out, moved)]
        recv_x = tuple(out) if x_scales is not None else out[0]
        aligned = align_up(per_expert.to(torch.int32), cfg.expert_alignment).to(torch.int32)
        return ((recv_x, recv_idx, recv_w_out, _scalar(num_recv, x.device), aligned,
                 _scalar(dropped, x.device)), handle)

    # ---- the way back: receivers return rows / copies to their sources --------------------------

    def _owner(self, handle: TorchHandle) -> torch.Tensor:
        idx = handle.topk_idx.to(torch.int64)
        return torch.where(idx >= 0, torch.div(idx, handle.config.num_local_experts, rounding_mode="floor"), -1)

    def _return_rows(self, payload: torch.Tensor, handle: TorchHandle):
        """Rank-major: send each kept receive row ``payload[:num_recv]`` back to its source. Returns
        ``(rows [n, W], row_index [T, R] into rows (-1 = nothing from r), per-rank counts)``."""
        plan = receive_plan(handle.all_counts, handle.config)
        send_splits = kept_from_sources(plan, self.rank).tolist()
        recv_splits = kept_to_destinations(plan, self.rank)
        rows = self.all_to_all(payload[: sum(send_splits)], send_splits, recv_splits.tolist())
        offsets = exclusive_cumsum(recv_splits)
        row_index = torch.where(handle.send_slot >= 0, offsets + handle.send_pos.to(torch.int64), -1)
        return rows, row_index, recv_splits.tolist()

    def _copies_per_source(self, handle: TorchHandle) -> list:
        """Expert-major: kept copies this rank received from each source rank (rows are source-major,
        so a prefix sum over rows read at the sources' row boundaries; no atomics)."""
        kept_per_row = (handle.recv_expert_slot >= 0).sum(1)
        prefix = torch.cat([kept_per_row.new_zeros(1), kept_per_row.cumsum(0)])
        row_end = handle.recv_counts.to(torch.int64).cumsum(0)
        row_start = row_end - handle.recv_counts.to(torch.int64)
        return (prefix[row_end] - prefix[row_start]).tolist()

    def _copy_routes(self, handle: TorchHandle):
        """Source side, expert-major: kept copies per destination ``[R]`` and ``copy_index [T, K]``,
        the position of copy (t, k) in the destination-major, (t, k)-ascending list (-1 = none)."""
        kept = handle.send_slot >= 0
        dest = torch.where(kept, self._owner(handle), -1)
        per_dest = torch.bincount(torch.where(kept, dest, self.world).flatten(), minlength=self.world + 1)
        per_dest = per_dest[: self.world]
        pos = positions_in_group(dest.flatten(), self.world).view(dest.shape)
        copy_index = torch.where(kept, exclusive_cumsum(per_dest)[dest.clamp(min=0)] + pos, -1)
        return per_dest, copy_index

    def _kept_copies(self, handle: TorchHandle):
        """Receiver side, expert-major: (row m, k, local expert l, slot c) of kept copies, (m, k) order."""
        m, k = torch.nonzero(handle.recv_expert_slot >= 0, as_tuple=True)
        return m, k, handle.recv_topk_idx[m, k].long(), handle.recv_expert_slot[m, k].long()

    def _return_copies(self, payload: torch.Tensor, handle: TorchHandle):
        """Expert-major: send kept copies (in :meth:`_kept_copies` order) back to their sources."""
        per_dest, copy_index = self._copy_routes(handle)
        rows = self.all_to_all(payload, self._copies_per_source(handle), per_dest.tolist())
        return rows, copy_index

    # ---- reductions in contract order -----------------------------------------------------------

    @staticmethod
    def _sum_over_ranks(rows, row_index, per_rank: list, acc):
        """``acc[t] += rows[row_index[t, r]]`` for r ascending, only where ``row_index >= 0``."""
        for r, n in enumerate(per_rank):
            if n == 0:
                continue  # nothing from r: the accumulator is untouched, as in the reference
            idx = row_index[:, r]
            contrib = rows[idx.clamp(min=0)].to(acc.dtype)
            acc = torch.where((idx >= 0).unsqueeze(-1), acc + contrib, acc)
        return acc

    @staticmethod
    def _sum_over_k(rows, copy_index, weights, acc):
        """``acc[t] += w[t, k] * rows[copy_index[t, k]]`` for k ascending; the product is rounded to
        the accumulator dtype before the add (separate mul and add: no fused multiply-add)."""
        if rows.shape[0] == 0:
            return acc
        for k in range(copy_index.shape[1]):
            idx = copy_index[:, k]
            contrib = rows[idx.clamp(min=0)].to(acc.dtype)
            if weights is not None:
                contrib = torch.mul(weights[:, k:k + 1].to(acc.dtype), contrib)
            acc = torch.where((idx >= 0).unsqueeze(-1), torch.add(acc, contrib), acc)
        return acc

    @staticmethod
    def _finish(acc, bias, dtype):
        for b in bias:
            acc = acc + b.to(acc.dtype)
        return acc.to(dtype)

    # ---- combine and the backward passes --------------------------------------------------------

    def combine(self, y, handle: TorchHandle, bias: tuple = ()):
        """``out[T, H]`` in ``y``'s dtype. Rank-major ``y[C, H]``: sum over the ranks that received
        each token; expert-major ``y[L, C, H]``: ``sum_k topk_weights[t, k] * y[copy (t, k)]``."""
        T = handle.topk_idx.shape[0]
        acc = torch.zeros((T, y.shape[-1]), dtype=acc_dtype(y.dtype), device=y.device)
        if handle.config.layout == Layout.RANK_MAJOR:
            rows, row_index, per_rank = self._return_rows(y, handle)
            acc = self._sum_over_ranks(rows, row_index, per_rank, acc)
        else:
            _, _, l, c = self._kept_copies(handle)
            rows, copy_index = self._return_copies(y[l, c], handle)
            acc = self._sum_over_k(rows, copy_index, handle.topk_weights.to(torch.float32), acc)
        return self._finish(acc, tuple(bias), y.dtype)

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: TorchHandle):
        """``(g_x [T, H] in g_recv_x's dtype, g_topk_weights [T, K] float32)``; ``g_recv_topk_weights``
        None counts as zeros."""
        T, K = handle.topk_idx.shape
        dev = g_recv_x.device
        acc = torch.zeros((T, g_recv_x.shape[-1]), dtype=acc_dtype(g_recv_x.dtype), device=dev)
        if g_recv_topk_weights is None:
            g_recv_topk_weights = torch.zeros(g_recv_x.shape[:-1] + ((K,) if g_recv_x.dim() == 2 else ()),
                                              dtype=torch.float32, device=dev)
        g_recv_topk_weights = g_recv_topk_weights.to(torch.float32)
        if handle.config.layout == Layout.RANK_MAJOR:
            buf, spans = pack_rows([g_recv_x, g_recv_topk_weights])
            rows, row_index, per_rank = self._return_rows(buf, handle)
            rows_x = from_bytes(rows[:, spans[0][0]:spans[0][1]], g_recv_x.dtype, g_recv_x.shape[1:])
            rows_w = from_bytes(rows[:, spans[1][0]:spans[1][1]], torch.float32, (K,))
            g_x = self._finish(self._sum_over_ranks(rows_x, row_index, per_rank, acc), (), g_recv_x.dtype)
            owner = self._owner(handle)
            at = row_index.gather(1, owner.clamp(min=0))  # row carrying (t, k) in rows
            valid = (owner >= 0) & (at >= 0)
            if rows_w.shape[0] == 0:
                return g_x, torch.zeros((T, K), dtype=torch.float32, device=dev)
            picked = rows_w[at.clamp(min=0), torch.arange(K, device=dev)]
        else:
            _, _, l, c = self._kept_copies(handle)
            buf, spans = pack_rows([g_recv_x[l, c], g_recv_topk_weights[l, c].unsqueeze(-1)])
            rows, copy_index = self._return_copies(buf, handle)
            rows_x = from_bytes(rows[:, spans[0][0]:spans[0][1]], g_recv_x.dtype, g_recv_x.shape[2:])
            rows_w = from_bytes(rows[:, spans[1][0]:spans[1][1]], torch.float32, ())
            g_x = self._finish(self._sum_over_k(rows_x, copy_index, None, acc), (), g_recv_x.dtype)
            valid = copy_index >= 0
            if rows_w.shape[0] == 0:
                return g_x, torch.zeros((T, K), dtype=torch.float32, device=dev)
            picked = rows_w[copy_index.clamp(min=0)]
        return g_x, torch.where(valid, picked, torch.zeros_like(picked))

    def combine_bwd(self, g_out, handle: TorchHandle, y: Optional[torch.Tensor] = None):
        """``(g_y, g_topk_weights)``. Rank-major: ``g_y`` is a cached dispatch of ``g_out`` and
        ``g_topk_weights`` is None. Expert-major: ``g_y[l, c] = round(w[t, k] * g_out[t])`` and, when
        ``y`` is given (on every rank alike), ``g_topk_weights[t, k] = <g_out[t], y[l, c]>`` summed
        in float64, rounded to float32."""
        if handle.config.layout == Layout.RANK_MAJOR:
            (g_y, *_), _ = self.dispatch(g_out, None, handle)
            return g_y, None
        cfg, me, R = handle.config, self.rank, self.world
        T, K = handle.topk_idx.shape
        dtype = y.dtype if y is not None else g_out.dtype
        at = acc_dtype(dtype)
        kept = handle.send_slot >= 0
        dest = torch.where(kept, self._owner(handle), R).flatten()
        order = torch.argsort(dest, stable=True)[: int(kept.sum())]  # destination-major, (t, k) inside
        t_of, k_of = torch.div(order, K, rounding_mode="floor"), order % K
        w = handle.topk_weights.to(torch.float32)
        buf, spans = pack_rows([g_out[t_of], w[t_of, k_of].unsqueeze(-1)])
        per_dest = torch.bincount(dest, minlength=R + 1)[:R]
        recv = self.all_to_all(buf, per_dest.tolist(), self._copies_per_source(handle))
        rows_g = from_bytes(recv[:, spans[0][0]:spans[0][1]], g_out.dtype, g_out.shape[1:])
        rows_w = from_bytes(recv[:, spans[1][0]:spans[1][1]], torch.float32, (1,))
        _, _, l, c = self._kept_copies(handle)
        cap = y.shape[1] if y is not None else int(receive_plan(handle.all_counts, cfg).capacity[me])
        g_y = torch.zeros((cfg.num_local_experts, cap) + tuple(g_out.shape[1:]), dtype=dtype, device=g_out.device)
        g_y[l, c] = torch.mul(rows_w.to(at), rows_g.to(at)).to(dtype)
        if y is None:
            return g_y, None
        dots = (rows_g.to(torch.float64) * y[l, c].to(torch.float64)).sum(-1).to(torch.float32)
        back, copy_index = self._return_copies(dots.unsqueeze(-1), handle)
        back = back.reshape(-1)
        if back.shape[0] == 0:
            return g_y, torch.zeros((T, K), dtype=torch.float32, device=g_out.device)
        picked = back[copy_index.clamp(min=0)]
        return g_y, torch.where(copy_index >= 0, picked, torch.zeros_like(picked))


def _scalar(value: int, device) -> torch.Tensor:
    return torch.tensor(int(value), dtype=torch.int32, device=device)


def _padded(rows: torch.Tensor, capacity: int, fill) -> torch.Tensor:
    """``rows[n, ...]`` at the top of a ``[capacity, ...]`` buffer filled with ``fill`` (n <= capacity)."""
    out = torch.full((capacity,) + tuple(rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device) \
        if fill != 0 else torch.zeros((capacity,) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    out[: rows.shape[0]] = rows
    return out


def _placed(values: torch.Tensor, lc, num_local: int, capacity: int, fill) -> torch.Tensor:
    """Expert-major ``[L, capacity, ...]`` buffer with ``values[i]`` at ``(l[i], c[i])`` (unique)."""
    shape = (num_local, capacity) + tuple(values.shape[1:])
    out = torch.full(shape, fill, dtype=values.dtype, device=values.device) if fill != 0 \
        else torch.zeros(shape, dtype=values.dtype, device=values.device)
    out[lc] = values
    return out
