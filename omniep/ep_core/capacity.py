"""Capacity math: the one place that says how big receive buffers are and what overflows."""

from __future__ import annotations

from .errors import InputError
from .types import Layout


def align_up(n, alignment: int):
    """Round ``n`` (int or array) up to a multiple of ``alignment`` (>= 1)."""
    return ((n + alignment - 1) // alignment) * alignment


def default_capacity(num_ranks: int, num_tokens: int, layout: Layout) -> int:
    """Exact worst case of the static receive buffer.

    Rank-major: every token of every rank comes here, ``R*T`` rows. Expert-major: every token of every
    rank picks one local expert, ``R*T`` slots per expert (a token row that names the same expert twice
    makes two copies; such input can overflow and is then counted in ``dropped``).
    """
    del layout  # the same bound for both layouts, kept as an argument so callers say which they mean
    return num_ranks * num_tokens


def resolve_capacity(capacity, num_ranks: int, num_tokens: int, layout: Layout, *, static: bool):
    """Validate ``capacity`` and fill the default. ``static`` frameworks (JAX) never get ``None`` back."""
    if capacity is None:
        return default_capacity(num_ranks, num_tokens, layout) if static else None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise InputError(f"capacity must be a non-negative int or None, got {capacity!r}")
    return capacity


def check_expert_alignment(expert_alignment) -> int:
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise InputError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    return expert_alignment
