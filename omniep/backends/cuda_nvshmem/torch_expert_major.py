"""The expert-major ("low-latency") layout of the native one-rank-per-process torch backends
(``cuda_nvshmem``, and so ``nccl_ep`` and ``rocm_rocshmem``): the half of
:class:`~omniep.backends.cuda_nvshmem.torch_backend.CudaNvshmemTorch` that serves
``Layout.EXPERT_MAJOR``, over the ``em_*`` ops of :mod:`omniep.native.ipc_rank_em`.

Handles are filled as the ``collective`` backend fills them, so the frontend treats both alike:
``all_counts [R, R + E]`` is the whole count matrix (tokens per destination rank | copies per expert,
every rank's row: the expert-major prepare exchanges it), ``send_slot [T, K]`` the slot of copy
(t, k) inside its local expert (-1 = unrouted or dropped), ``recv_counts`` tokens per source,
``num_recv`` the copies kept. The receive-side routing is not kept in the handle (the kernels find
every copy through ``send_slot``): a handle is complete once it carries ``topk_weights``, and a
dispatch with a complete handle moves rows with the handle's weights. Results are bit for bit
:mod:`omniep.ep_core.reference`; ``g_topk_weights`` of combine_bwd (a dot product over H, in fp32)
is matched to rounding (omniep.testing.bounds: DESIGN fixes no order for that sum over H).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ep_core.capacity import align_up
from ...ep_core.errors import InputError
from ..collective.torch_layout import TorchHandle, receive_plan


class ExpertMajorTorch:
    """Mixed into CudaNvshmemTorch: ``_em_*`` are its ops for expert-major handles (its ``_state``,
    ``_remember`` and ``_derived`` give the native state and the per-handle cache)."""

    def _em_sizes(self, handle: TorchHandle) -> tuple[int, int]:
        """``(C, rows)``: slots per expert of every rank's buffer, and of my results. Exact mode reads the
        count matrix on the host (C is the busiest expert of any rank, rows that of mine)."""
        cap = handle.config.capacity
        if cap is not None:
            return cap, cap
        needed = receive_plan(handle.all_counts, handle.config).needed.tolist()
        return max(needed, default=0), needed[self.rank]

    def _em_derived(self, handle: TorchHandle) -> dict:
        """``recv_expert_count [L]`` (kept copies per local expert), ``num_recv_tokens_per_expert [L]`` and
        ``dropped []``: what prepare's kernel left, or the same from the count matrix."""
        derived = self._derived(handle.all_counts)
        if derived is not None:
            return derived
        cfg, R, me = handle.config, self.world, self.rank
        L = cfg.num_local_experts
        copies = handle.all_counts[:, R + me * L:R + (me + 1) * L].to(torch.int64).sum(0)
        kept = copies if cfg.capacity is None else copies.clamp(max=cfg.capacity)
        count = kept.to(torch.int32)
        return dict(recv_expert_count=count,
                    num_recv_tokens_per_expert=align_up(count, cfg.expert_alignment).to(torch.int32),
                    dropped=(copies.sum() - kept.sum()).to(torch.int32))

    def _em_prepare(self, topk_idx, config) -> TorchHandle:
        st = self._state(topk_idx.device)
        lay = st.layout(topk_idx, config.num_experts, None)
        em = st.em_layout(lay, config.num_experts, config.capacity, config.expert_alignment)
        all_counts = torch.cat([lay.counts, em.expert_counts], dim=1)
        self._remember(all_counts, recv_expert_count=em.recv_expert_count,
                  num_recv_tokens_per_expert=em.num_recv_tokens_per_expert, dropped=em.dropped)
        return TorchHandle(
            config=config, backend=self.name, topk_idx=lay.topk_idx, topk_weights=None, send_pos=lay.send_pos,
            num_tokens_per_rank=lay.num_tokens_per_rank, recv_counts=lay.recv_counts, recv_topk_idx=None,
            recv_topk_weights=None, num_recv=em.num_recv, all_counts=all_counts, send_slot=em.copy_slot,
            group_name=getattr(self.group, "group_name", None),
        )

    def _em_dispatch(self, x, topk_weights, handle: TorchHandle):
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        weights = handle.topk_weights if handle.topk_weights is not None else topk_weights
        if weights is None:
            raise InputError("expert-major dispatch needs topk_weights (the handle carries none yet)")
        st = self._state(x.device)
        C, rows = self._em_sizes(handle)
        derived = self._em_derived(handle)
        recv_x, recv_s, recv_idx, recv_w = st.em_dispatch(
            x, x_scales, weights, topk_idx=handle.topk_idx, copy_slot=handle.send_slot,
            recv_expert_count=derived["recv_expert_count"], capacity=C, rows=rows,
            num_experts=handle.config.num_experts)
        if handle.topk_weights is None:
            handle = handle.replace(topk_weights=weights)
        out_x = (recv_x, recv_s) if x_scales is not None else recv_x
        return ((out_x, recv_idx, recv_w, handle.num_recv.clone(), derived["num_recv_tokens_per_expert"].clone(),
                 derived["dropped"].clone()), handle)

    def _em_weights(self, handle: TorchHandle):
        if handle.topk_weights is None:
            raise InputError("expert-major combine needs the routing weights: dispatch with this handle first")
        return handle.topk_weights

    def _em_combine(self, y, handle: TorchHandle, bias: tuple = (), g_recv_topk_weights=None, weighted=True):
        st = self._state(y.device)
        C, rows = self._em_sizes(handle)
        return st.em_combine(y, topk_idx=handle.topk_idx, copy_slot=handle.send_slot,
                             topk_weights=self._em_weights(handle) if weighted else None, capacity=C, rows=rows,
                             num_experts=handle.config.num_experts, bias=tuple(bias),
                             g_recv_topk_weights=g_recv_topk_weights)

    def _em_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle: TorchHandle):
        if g_recv_topk_weights is None:
            g_recv_topk_weights = torch.zeros(g_recv_x.shape[:2], dtype=torch.float32, device=g_recv_x.device)
        return self._em_combine(g_recv_x, handle, (), g_recv_topk_weights, weighted=False)

    def _em_combine_bwd(self, g_out, handle: TorchHandle, y: Optional[torch.Tensor] = None):
        st = self._state(g_out.device)
        C, rows = self._em_sizes(handle)
        return st.em_combine_bwd(g_out, topk_idx=handle.topk_idx, copy_slot=handle.send_slot,
                                 topk_weights=self._em_weights(handle),
                                 recv_expert_count=self._em_derived(handle)["recv_expert_count"], capacity=C,
                                 rows=rows, num_experts=handle.config.num_experts, y=y)
