"""Comparisons of results, bit for bit: what the demo, the benchmarks and the tests check backends with."""

from __future__ import annotations

import numpy as np


def counted_rows(recv_x, recv_topk_idx) -> np.ndarray:
    """``recv_x`` with its expert-major padding slots (``recv_topk_idx[l, c] == -1``) zeroed, for
    comparisons: DESIGN §2 leaves those rows unspecified (``zero_padding=False``), the reference zeroes
    them. A rank-major ``recv_x`` (2-D) comes back unchanged."""
    x = np.array(recv_x, copy=True)
    idx = np.asarray(recv_topk_idx)
    if x.ndim == 3 and idx.shape == x.shape[:2]:
        x[idx < 0] = 0
    return x


def assert_bitwise_equal(actual, expected, what: str = "") -> None:
    """Raise AssertionError unless two arrays have the same shape, dtype and bits (NaN-safe)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape} != expected {expected.shape}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = raw_bits(actual), raw_bits(expected)
    if a.dtype.kind == "f":
        a, e = a.view(f"u{a.dtype.itemsize}"), e.view(f"u{e.dtype.itemsize}")
    bad = np.argwhere(a != e)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at {i}: "
                             f"{actual[i]!r} != expected {expected[i]!r}")


def raw_bits(a: np.ndarray) -> np.ndarray:
    """The array's bits as unsigned integers where numpy has no arithmetic for its dtype (bfloat16, fp8)."""
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" or a.dtype.name in ("bfloat16", "float8_e4m3fn") else a
