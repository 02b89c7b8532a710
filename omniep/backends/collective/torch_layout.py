"""Routing arithmetic of the torch collective backend: pure tensor math, no communication.

Everything here works on the device of its inputs (CPU, CUDA, ROCm) and uses only integer
arithmetic, so it is exact. The receive order it produces is the contract order of
:mod:`omniep.ep_core.reference`: rank-major rows by (source rank, source token), expert-major copies
by (source rank, source token, k) inside each local expert.

``all_counts`` is the result of the one count exchange: ``[R, R + E]`` int, row ``s`` holds what
rank ``s`` sends — tokens per destination rank (``[:R]``) then (token, k) copies per expert
(``[R:]``). Every rank holds the same matrix, so every rank can work out every rank's receive plan
(capacity overflow, which of its own rows a destination keeps) without another exchange.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ...ep_core.types import DispatchConfig, Handle, Layout


@dataclasses.dataclass(frozen=True)
class TorchHandle(Handle):
    """:class:`~omniep.ep_core.types.Handle` plus what the torch collective backend derives from the
    count exchange.

      all_counts [R, R+E] int32  every rank's send counts (tokens per rank | copies per expert)
      send_slot               int32  where this rank's data lands, ``-1`` = not sent or dropped:
                                     rank-major ``[T, R]`` row at rank r; expert-major ``[T, K]``
                                     slot of copy (t, k) inside its local expert
      group_name              str    the ``torch.distributed`` group the handle belongs to
    """

    all_counts: Any = None
    send_slot: Any = None
    group_name: Optional[str] = None

    DATA_FIELDS = Handle.DATA_FIELDS + ("all_counts", "send_slot")
    META_FIELDS = Handle.META_FIELDS + ("group_name",)


def local_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Layout of one rank's routing. Returns ``(idx32 [T,K] int32, owner [T,K] int64 (-1 = none),
    send_pos [T,R] int32, num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32)``.

    ``send_pos[t, r]`` is t's position among the tokens sent to rank r (ascending t), -1 if not sent.
    """
    device = topk_idx.device
    idx = topk_idx.to(torch.int64)
    local = num_experts // num_ranks
    valid = idx >= 0
    owner = torch.where(valid, torch.div(idx, local, rounding_mode="floor"), -1)
    ranks = torch.arange(num_ranks, device=device)
    in_rank = (owner.unsqueeze(-1) == ranks).any(dim=1)  # a token goes to a rank at most once
    send_pos = torch.where(in_rank, in_rank.to(torch.int64).cumsum(0) - 1, -1).to(torch.int32)
    num_tokens_per_rank = in_rank.sum(0).to(torch.int32)
    # Invalid ids count into an extra bin that is cut off: no data-dependent shapes.
    per_expert = torch.bincount(torch.where(valid, idx, num_experts).flatten(), minlength=num_experts + 1)
    return (idx.to(torch.int32), owner, send_pos, num_tokens_per_rank,
            per_expert[:num_experts].to(torch.int32))


def positions_in_group(keys: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For a 1-D ``keys`` (``-1`` = ignore): how many earlier elements have the same key.

    A stable sort keeps equal keys in their original order, so position = index in sorted order
    minus the start of the key's run. Returns int64, ``-1`` where ``keys < 0``.
    """
    keys = keys.to(torch.int64)
    binned = torch.where(keys >= 0, keys, num_groups)
    order = torch.argsort(binned, stable=True)
    counts = torch.bincount(binned, minlength=num_groups + 1)
    starts = counts.cumsum(0) - counts
    pos_sorted = torch.arange(keys.numel(), device=keys.device) - starts[binned[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return torch.where(keys >= 0, pos, -1)


def exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.cumsum(dim) - t


@dataclasses.dataclass(frozen=True)
class ReceivePlan:
    """Per receiving rank, from ``all_counts`` (int64 tensors on the handle's device).

    needed [R]: rows (rank-major) or copies of the busiest local expert (expert-major) that arrive;
    capacity [R]: rows / slots per expert of the receive buffer (``needed`` where capacity is None);
    total [R]: rows (rank-major) or copies (expert-major) that arrive before capacity.
    """

    needed: torch.Tensor
    capacity: torch.Tensor
    total: torch.Tensor
    tokens: torch.Tensor          # [R, R] tokens s -> r
    expert_copies: torch.Tensor   # [R, E] copies s -> e


def receive_plan(all_counts: torch.Tensor, config: DispatchConfig) -> ReceivePlan:
    R, L = config.num_ranks, config.num_local_experts
    counts = all_counts.to(torch.int64)
    tokens, copies = counts[:, :R], counts[:, R:]
    if config.layout == Layout.RANK_MAJOR:
        total = tokens.sum(0)
        needed = total
    else:
        per_expert = copies.sum(0).view(R, L)
        total = per_expert.sum(1)
        needed = per_expert.max(1).values if L else torch.zeros_like(total)
    capacity = needed if config.capacity is None else torch.full_like(needed, config.capacity)
    return ReceivePlan(needed, capacity, total, tokens, copies)


def capacity_overflow(all_counts: torch.Tensor, config: DispatchConfig) -> list[tuple[int, int, int]]:
    """``(rank, needed, capacity)`` for every rank whose receive buffer is too small (same on every rank)."""
    if config.capacity is None:
        return []
    plan = receive_plan(all_counts, config)
    needed = plan.needed.tolist()
    return [(r, n, config.capacity) for r, n in enumerate(needed) if n > config.capacity]


def kept_from_sources(plan: ReceivePlan, me: int) -> torch.Tensor:
    """Rank-major: rows rank ``me`` keeps from each source ``[R]`` (the first ``capacity`` in order)."""
    recv = plan.tokens[:, me]
    return torch.minimum(recv, (plan.capacity[me] - exclusive_cumsum(recv)).clamp(min=0))


def kept_to_destinations(plan: ReceivePlan, me: int) -> torch.Tensor:
    """Rank-major: rows of rank ``me`` each destination keeps ``[R]`` (same formula, sender's view)."""
    before_me = exclusive_cumsum(plan.tokens, 0)[me]
    return torch.minimum(plan.tokens[me], (plan.capacity - before_me).clamp(min=0))


def rank_major_send_slot(send_pos: torch.Tensor, plan: ReceivePlan, me: int) -> torch.Tensor:
    """``[T, R]`` int32: row of token t in rank r's receive buffer, -1 if not sent or dropped."""
    before_me = exclusive_cumsum(plan.tokens, 0)[me]
    kept = kept_to_destinations(plan, me)
    pos = send_pos.to(torch.int64)
    return torch.where((pos >= 0) & (pos < kept), before_me + pos, -1).to(torch.int32)


def expert_major_send_slot(idx32: torch.Tensor, owner: torch.Tensor, plan: ReceivePlan, me: int,
                           config: DispatchConfig) -> torch.Tensor:
    """``[T, K]`` int32: slot of copy (t, k) inside its local expert at the owner rank, -1 if none/dropped."""
    E, L = config.num_experts, config.num_local_experts
    idx = idx32.to(torch.int64)
    valid = idx >= 0
    pos = positions_in_group(torch.where(valid, idx, -1).flatten(), E).view(idx.shape)
    before_me = exclusive_cumsum(plan.expert_copies, 0)[me]      # [E]
    safe = idx.clamp(min=0)
    slot = before_me[safe] + pos
    cap = plan.capacity[torch.div(safe, L, rounding_mode="floor")]
    return torch.where(valid & (slot < cap), slot, -1).to(torch.int32)


def receive_copy_slots(recv_local: torch.Tensor, num_local: int, capacity: int) -> torch.Tensor:
    """Expert-major, receiver's view: ``[M, K]`` slot of copy (row, k), in (row, k) order per local
    expert (rows are already in (source, token) order), -1 if not local or beyond ``capacity``."""
    pos = positions_in_group(recv_local.flatten(), num_local).view(recv_local.shape)
    return torch.where((pos >= 0) & (pos < capacity), pos, -1).to(torch.int32)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` of any dtype as ``[n, bytes_per_row]`` uint8 (a view when possible)."""
    width = 1
    for d in t.shape[1:]:
        width *= int(d)
    if t.numel() == 0:  # empty tensors may carry strides that view() rejects
        return torch.empty((t.shape[0], width * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().reshape(t.shape[0], width).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, row_shape: tuple) -> torch.Tensor:
    """Inverse of :func:`as_bytes` for a column slice of a packed byte buffer. The slice is copied into
    a fresh buffer: a slice's storage offset need not be aligned for ``dtype``."""
    fresh = torch.empty(tuple(b.shape), dtype=torch.uint8, device=b.device).copy_(b)
    if fresh.numel() == 0:
        return torch.empty((b.shape[0],) + tuple(row_shape), dtype=dtype, device=b.device)
    return fresh.view(dtype).reshape((b.shape[0],) + tuple(row_shape))


def pack_rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Concatenate the byte rows of ``parts`` (same row count); returns the buffer and column spans."""
    byte_parts = [as_bytes(p) for p in parts]
    spans, start = [], 0
    for p in byte_parts:
        spans.append((start, start + p.shape[1]))
        start += p.shape[1]
    return torch.cat(byte_parts, dim=1), spans


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for every supported dtype; float64 stays float64 (adjointness checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32

