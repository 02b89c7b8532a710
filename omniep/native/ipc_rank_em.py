"""The expert-major ("low-latency") ops of one rank per process: the half of
:class:`~omniep.native.ipc_rank.IpcRankState` (and so of ``NvshmemRankState`` / ``NcclRankState``) that
serves ``layout="expert_major"`` (DESIGN §2). :mod:`omniep.native.expert_major` drives the same kernels
(csrc/kernels/em_*.cuh) on virtual ranks.

Receiver r gets ``recv_x[L, C, H]``: for each local expert one copy per (source token, k) that chose
it, ordered by (source rank, source token, k); slots past ``C`` are dropped and counted, padding slots
are zero (``recv_topk_idx`` -1, weights 0). Every pass after prepare finds a copy through
``copy_slot[T, K]`` (its slot at the expert's rank, -1 = unrouted or dropped).

Symmetric regions of the data buffer (sized from values every rank agrees on, ``L * C`` slots, so
every rank grows it at the same call): dispatch ``recv_x [L, C, row_bytes]``, ``recv_x2`` (fp8 scales),
``recv_topk_idx`` / ``recv_topk_weights [L, C]``; combine and dispatch_bwd ``y [L, C, H]`` (and
``g_recv_topk_weights [L, C]``); combine_bwd ``g_y [L, C, H]`` (and ``y`` for the weight gradients).
``C`` is the buffer's slots per expert; a rank's own tensors may have fewer (``rows``: exact mode
sizes each rank's receive by its own busiest expert): one plain copy when they match ``C``, else a
2-D copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..ep_core.errors import InputError


@dataclasses.dataclass
class ExpertLayout:
    """Expert-major prepare of one rank, on the device (int32), after :meth:`IpcRankState.layout`."""

    copy_slot: object                   # [T, K]: slot of copy (t, k) at its expert's rank, -1 = none / dropped
    recv_expert_count: object           # [L]: copies kept per local expert (slots [count, C) are padding)
    num_recv_tokens_per_expert: object  # [L]: the same rounded up to expert_alignment
    num_recv: object                    # []: copies kept
    dropped: object                     # []: copies lost to capacity
    max_expert_count: object            # []: copies of my busiest local expert (before capacity)
    expert_counts: object               # [R, E]: copies source s sends to expert e (every rank's row)


class ExpertMajorOps:
    """Mixed into :class:`~omniep.native.ipc_rank.IpcRankState` (uses its buffer, copies and stream)."""

    # ---- [L, rows, ...] tensors <-> [L, C, ...] regions of the data buffer ----
    def _copy_experts(self, dst: int, dst_rows: int, src: int, src_rows: int, rows: int, num_experts: int,
                      row_bytes: int) -> None:
        """``rows`` rows of each of ``num_experts`` blocks (``dst_rows`` / ``src_rows`` rows per block)."""
        width = rows * row_bytes
        if not (width and num_experts):
            return
        if dst_rows == rows == src_rows:  # both contiguous: one plain copy (a 2-D copy is slower)
            self._g().memcpy(dst, src, width * num_experts, self._stream())
        else:
            self._g().memcpy2d(dst, dst_rows * row_bytes, src, src_rows * row_bytes, width, num_experts,
                               self._stream())

    def _copy_in_experts(self, offset: int, t, capacity: int) -> None:
        """``t[L, rows, *row]`` (contiguous) into the first ``rows`` slots of each expert at ``offset``."""
        L, rows = t.shape[:2]
        self._copy_experts(self._g().data_ptr + offset, capacity, int(t.data_ptr()), rows, rows, L,
                           math.prod(t.shape[2:]) * t.element_size())

    def _copy_out_experts(self, offset: int, capacity: int, shape: tuple, dtype):
        """A fresh ``[L, rows, *row]`` tensor with the first ``rows`` slots of each expert at ``offset``."""
        out = self._empty(shape, dtype)
        L, rows = shape[:2]
        self._copy_experts(int(out.data_ptr()), rows, self._g().data_ptr + offset, capacity, rows, L,
                           math.prod(shape[2:]) * out.element_size())
        return out

    def _expert_rows(self, name: str, t, num_local: int, rows: int, trailing: tuple):
        want = (num_local, rows) + tuple(trailing)
        if tuple(t.shape) != want:
            raise InputError(f"{name} has shape {tuple(t.shape)}; expected {list(want)} as produced by the "
                             f"expert-major dispatch with this handle")
        return t.contiguous()

    # ---- ops ----
    def em_layout(self, lay, num_experts: int, capacity: Optional[int], expert_alignment: int) -> ExpertLayout:
        """After :meth:`layout` (``lay``) on the same stream: every copy's slot, per-expert receive counts
        and the whole ``[R, E]`` count matrix. ``capacity=None``: nothing dropped."""
        from .ipc_rank import INT32_MAX

        torch = self._torch
        T, K = lay.topk_idx.shape
        R, L, i32 = self.world, num_experts // self.world, torch.int32
        em = ExpertLayout(self._empty((T, K), i32), self._empty((L,), i32), self._empty((L,), i32),
                          self._empty((), i32), self._empty((), i32), self._empty((), i32),
                          self._empty((R, num_experts), i32))
        self._g().em_layout(dict(
            topk_idx32=lay.topk_idx.data_ptr(), num_tokens_per_expert=lay.num_tokens_per_expert.data_ptr(),
            copy_slot=em.copy_slot.data_ptr(), recv_expert_count=em.recv_expert_count.data_ptr(),
            num_recv_tokens_per_expert=em.num_recv_tokens_per_expert.data_ptr(), num_recv=em.num_recv.data_ptr(),
            dropped=em.dropped.data_ptr(), max_expert_count=em.max_expert_count.data_ptr(),
            expert_count_matrix=em.expert_counts.data_ptr(), num_tokens=T, num_topk=K, num_experts=num_experts,
            capacity=INT32_MAX if capacity is None else capacity, expert_alignment=expert_alignment,
        ), self._stream())
        self._mark("kernel")
        return em

    def em_dispatch(self, x, x_scales, topk_weights, *, topk_idx, copy_slot, recv_expert_count, capacity: int,
                    rows: int, num_experts: int):
        """Push one copy per kept (t, k) into slot ``copy_slot[t, k]`` of its expert at its rank (``capacity``
        slots per expert) and copy the first ``rows`` slots of mine out. Returns ``(recv_x [L, rows, H],
        recv_x_scales [L, rows, S] or None, recv_topk_idx [L, rows], recv_topk_weights [L, rows])``."""
        from .ipc_rank import regions

        torch = self._torch
        x = x.contiguous()
        T, H = x.shape
        K, L = topk_idx.shape[1], num_experts // self.world
        sizes = [H * x.element_size()]
        if x_scales is not None:
            x_scales = x_scales.contiguous().to(torch.float32)
            sizes.append(x_scales.shape[1] * 4)
        sizes += [4, 4]  # recv_topk_idx, recv_topk_weights
        offsets, total = regions(L * capacity, sizes)
        self.reserve(total)
        w = topk_weights.contiguous().to(torch.float32)
        args = dict(x=x.data_ptr(), topk_idx32=topk_idx.data_ptr(), topk_weights=w.data_ptr(),
                    copy_slot=copy_slot.data_ptr(), recv_expert_count=recv_expert_count.data_ptr(),
                    recv_x=offsets[0], recv_topk_idx=offsets[-2], recv_topk_weights=offsets[-1], num_tokens=T,
                    row_bytes=sizes[0], num_topk=K, num_experts=num_experts, capacity=capacity)
        if x_scales is not None:
            args.update(x2=x_scales.data_ptr(), recv_x2=offsets[1], row2_bytes=sizes[1])
        self._g().em_dispatch(args, self._stream())
        self._mark("kernel")
        recv_x = self._copy_out_experts(offsets[0], capacity, (L, rows, H), x.dtype)
        recv_s = None
        if x_scales is not None:
            recv_s = self._copy_out_experts(offsets[1], capacity, (L, rows, x_scales.shape[1]), torch.float32)
        recv_idx = self._copy_out_experts(offsets[-2], capacity, (L, rows), torch.int32)
        recv_w = self._copy_out_experts(offsets[-1], capacity, (L, rows), torch.float32)
        return recv_x, recv_s, recv_idx, recv_w

    def em_combine(self, y, *, topk_idx, copy_slot, topk_weights, capacity: int, rows: int, num_experts: int,
                   bias: tuple = (), g_recv_topk_weights=None):
        """Copy ``y[L, rows, H]`` into my buffer (``capacity`` slots per expert); every source pulls its
        copies back and sums ``w[t, k] * y[copy (t, k)]`` in k order (fp32, products rounded, bias last,
        one rounding).
        ``topk_weights=None`` means every weight is 1 (dispatch_bwd, which passes
        ``g_recv_topk_weights [L, rows]`` and also reads back the per-copy weight gradients).
        Returns ``out[T, H]`` (and ``g_topk_weights[T, K]``)."""
        from .ipc_rank import dtype_code, regions

        torch = self._torch
        T, K = topk_idx.shape
        L = num_experts // self.world
        H = y.shape[-1] if y.dim() else 0
        y = self._expert_rows("y", y, L, rows, (H,))
        grad = g_recv_topk_weights is not None
        offsets, total = regions(L * capacity, [H * y.element_size()] + ([4] if grad else []))
        self.reserve(total)
        self._copy_in_experts(offsets[0], y, capacity)
        out = self._empty((T, H), y.dtype)
        bias_args, bias = self._bias_args(bias)  # `bias` keeps converted copies alive until the launch
        args = dict(y=offsets[0], out=out.data_ptr(), topk_idx32=topk_idx.data_ptr(), copy_slot=copy_slot.data_ptr(),
                    num_tokens=T, hidden=H, num_topk=K, num_experts=num_experts, capacity=capacity,
                    dtype=dtype_code(y.dtype), **bias_args)
        if topk_weights is not None:
            w = topk_weights.contiguous().to(torch.float32)
            args["topk_weights"] = w.data_ptr()
        g_w = None
        if grad:
            gw_in = self._expert_rows("g_recv_topk_weights", g_recv_topk_weights, L, rows, ()).to(torch.float32)
            self._copy_in_experts(offsets[1], gw_in, capacity)
            g_w = self._empty((T, K), torch.float32)
            args.update(g_recv_topk_weights=offsets[1], g_topk_weights=g_w.data_ptr(), with_topk_grad=1)
        self._mark("copy_in")
        self._g().em_combine(args, self._stream())
        return (out, g_w) if grad else out

    def em_combine_bwd(self, g_out, *, topk_idx, copy_slot, topk_weights, recv_expert_count, capacity: int,
                       rows: int, num_experts: int, y=None):
        """``g_y[l, c] = round(w[t, k] * g_out[t])`` pushed to every kept copy's slot (padding zero) and,
        with ``y [L, rows, H]``, ``g_topk_weights[t, k] = <g_out[t], y[copy (t, k)]>`` (fp32, matched to
        rounding). Returns ``(g_y [L, rows, H], g_topk_weights [T, K] or None)``."""
        from .ipc_rank import dtype_code, regions

        torch = self._torch
        g_out = g_out.contiguous()
        T, H = g_out.shape
        K, L = topk_idx.shape[1], num_experts // self.world
        row_bytes = H * g_out.element_size()
        offsets, total = regions(L * capacity, [row_bytes] + ([row_bytes] if y is not None else []))
        self.reserve(total)
        w = topk_weights.contiguous().to(torch.float32)
        args = dict(g_out=g_out.data_ptr(), topk_idx32=topk_idx.data_ptr(), topk_weights=w.data_ptr(),
                    copy_slot=copy_slot.data_ptr(), recv_expert_count=recv_expert_count.data_ptr(), g_y=offsets[0],
                    num_tokens=T, hidden=H, num_topk=K, num_experts=num_experts, capacity=capacity,
                    dtype=dtype_code(g_out.dtype), with_topk_grad=int(y is not None))
        g_w = None
        if y is not None:
            if y.dtype != g_out.dtype:
                raise InputError(f"y ({y.dtype}) and g_out ({g_out.dtype}) must have the same dtype")
            self._copy_in_experts(offsets[1], self._expert_rows("y", y, L, rows, (H,)), capacity)
            g_w = self._empty((T, K), torch.float32)
            args.update(y=offsets[1], g_topk_weights=g_w.data_ptr())
        self._g().em_combine_bwd(args, self._stream())
        self._mark("kernel")
        return self._copy_out_experts(offsets[0], capacity, (L, rows, H), g_out.dtype), g_w
