"""Routing arithmetic of the torch collective backend: no communication.

Tensor functions work on the device of their inputs (CPU, CUDA, ROCm) with integer arithmetic only,
so they are exact; the ``*_plan`` functions work on host integers (the count matrix every rank holds
after the dispatch's count exchange), so every rank derives the same plan without another exchange.
The orders produced are the contract's (:mod:`omniep.ep_core.reference`): rank-major rows by (source
rank, source token), expert-major copies by (source rank, source token, k) inside each local expert.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def owner_table(num_experts: int, num_ranks: int, device) -> torch.Tensor:
    """``[E + 1]`` int64, indexed by expert id (``-1`` wraps to the last entry): the rank holding expert
    ``id``; ``R`` for ``id = -1``. One indexing op routes a whole ``topk_idx``."""
    local = num_experts // num_ranks
    return torch.tensor([e // local for e in range(num_experts)] + [num_ranks], dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def local_table(num_experts: int, num_ranks: int, rank: int, device) -> torch.Tensor:
    """``[E + 1]`` int32, indexed by expert id (``-1`` wraps to the last entry): expert ``id``'s index among
    ``rank``'s experts, -1 if it is not one of them (or ``id = -1``)."""
    local = num_experts // num_ranks
    return torch.tensor([e - rank * local if e // local == rank else -1 for e in range(num_experts)] + [-1],
                        dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _rank_ids(num_ranks: int, device) -> torch.Tensor:
    return torch.arange(num_ranks, dtype=torch.int64, device=device)


def routes(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(owner [T, K] int64, in_rank [T, R] bool)`` for ids in ``[-1, E)`` (checked before): the rank
    holding each chosen expert (``R`` for -1) and whether token t goes to rank r (at most once, however
    many of r's experts it chose)."""
    owner = owner_table(num_experts, num_ranks, topk_idx.device)[topk_idx]
    in_rank = (owner.unsqueeze(-1) == _rank_ids(num_ranks, topk_idx.device)).any(1)
    return owner, in_rank


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: (token, k) choices per expert, for ids in ``[-1, E)``."""
    return torch.bincount(topk_idx.reshape(-1) + 1, minlength=num_experts + 1)[1:]


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """DeepEP's ``get_dispatch_layout`` of one rank, on ``topk_idx``'s device without a host sync (fixed
    shapes, scatters only). Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, R] bool)``. Ids outside ``[-1, E)`` are counted nowhere (the caller checks them
    where a check costs no sync; a dispatch catches them on the device)."""
    ids = topk_idx.long()
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1)  # out of range: as "no expert"
    _, in_rank = routes(ids, num_experts, num_ranks)
    # (not expert_counts: torch.bincount sizes its output from the data, a host sync on CUDA)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    per_expert.scatter_add_(0, ids.reshape(-1) + 1, torch.ones(ids.numel(), dtype=torch.int32, device=ids.device))
    return in_rank.sum(0, dtype=torch.int32), per_expert[1:], in_rank


def positions_in_group(keys: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For a 1-D ``keys`` (``-1`` = ignore): how many earlier elements have the same key (int64, -1
    where ignored). A stable sort keeps equal keys in their original order."""
    keys = keys.long()
    binned = torch.where(keys >= 0, keys, num_groups)
    order = torch.argsort(binned, stable=True)
    counts = torch.bincount(binned, minlength=num_groups + 1)
    starts = counts.cumsum(0) - counts
    pos = torch.empty_like(order)
    pos[order] = torch.arange(keys.numel(), device=keys.device) - starts[binned[order]]
    return torch.where(keys >= 0, pos, -1)


# ---- plans on host integers: counts[s] is what rank s sent in the count exchange -----------------

def rank_major_plan(tokens: list, me: int, capacity: int):
    """``tokens[s][r]``: tokens rank s sends to rank r. Returns ``(kept_from [R], kept_to [R], overflow)``:
    rows this rank keeps from each source and rows each destination keeps of this rank's (the first
    ``capacity`` rows of a receiver in (source, token) order; ``capacity < 0``: all), and ``(rank,
    needed)`` of the first rank whose rows exceed the capacity (None if none)."""
    R = len(tokens)
    totals = [sum(tokens[s][r] for s in range(R)) for r in range(R)]
    if capacity < 0:
        return [tokens[s][me] for s in range(R)], list(tokens[me]), None

    def kept(s: int, r: int) -> int:
        before = sum(tokens[q][r] for q in range(s))
        return min(tokens[s][r], max(0, capacity - before))

    over = next(((r, n) for r, n in enumerate(totals) if n > capacity), None)
    return [kept(s, me) for s in range(R)], [kept(me, r) for r in range(R)], over


def expert_major_plan(copies: torch.Tensor, me: int, num_ranks: int, capacity: int):
    """``copies [R, E]`` int64 (CPU): (token, k) copies rank s sends to expert e. Returns ``(kept [R, E]``
    copies of s that expert e keeps (the first ``capacity`` in (source, token, k) order), ``kept_to [R]``
    copies of this rank each destination keeps, ``kept_from [R]`` copies this rank keeps from each
    source, ``per_expert [L]`` copies kept per local expert, ``overflow``)``."""
    R, E = copies.shape
    L = E // num_ranks
    before = copies.cumsum(0) - copies
    kept = torch.minimum(copies, (capacity - before).clamp(min=0))
    kept_to = kept[me].view(num_ranks, L).sum(1)
    mine = slice(me * L, (me + 1) * L)
    kept_from, per_expert = kept[:, mine].sum(1), kept[:, mine].sum(0)
    busiest = copies.sum(0).view(num_ranks, L).amax(1) if L else torch.zeros(num_ranks, dtype=copies.dtype)
    over = [(r, n) for r, n in enumerate(busiest.tolist()) if n > capacity]
    return kept, kept_to.tolist(), kept_from.tolist(), per_expert, (over[0] if over else None)


def expert_major_send_slots(idx: torch.Tensor, owner: torch.Tensor, copies: torch.Tensor, me: int,
                            num_experts: int, num_ranks: int, capacity: int):
    """Sender side, expert-major: ``copy_index [T, K]`` int64, the position of copy (t, k) among this
    rank's copies that find a slot at their owner (``copies [R, E]``: every rank's copies per expert,
    host), in destination-major, (t, k)-ascending order — the order the owners return them in; -1 for
    none or dropped."""
    idx = idx.long()
    valid = owner < num_ranks
    pos = positions_in_group(torch.where(valid, idx, -1).flatten(), num_experts).view(idx.shape)
    # Copies of expert e from the ranks before me take its first slots; mine follow in (t, k) order.
    prefix = copies[:me].sum(0).to(idx.device)
    slot = prefix[idx.clamp(min=0, max=num_experts - 1)] + pos
    keep = valid & (slot < capacity)
    dest = torch.where(keep, owner, num_ranks).flatten()
    order = positions_in_group(torch.where(keep.flatten(), dest, -1), num_ranks).view(idx.shape)
    per_dest = torch.bincount(dest, minlength=num_ranks + 1)[:num_ranks]
    start = per_dest.cumsum(0) - per_dest
    return torch.where(keep, start[owner.clamp(max=num_ranks - 1)] + order, -1)


def expert_major_recv_slots(recv_local: torch.Tensor, num_local: int, capacity: int) -> torch.Tensor:
    """Receiver side, expert-major: ``[M, K]`` slot of copy (row, k) inside its local expert, in (row,
    k) order (rows are in (source, token) order already), -1 if not local or beyond ``capacity``."""
    pos = positions_in_group(recv_local.flatten(), num_local).view(recv_local.shape)
    return torch.where((pos >= 0) & (pos < capacity), pos, -1)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for every supported dtype; float64 stays float64 (adjointness checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
