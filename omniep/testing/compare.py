"""Comparisons of results, bit for bit: what the demo, the benchmarks and the tests check backends with."""

from __future__ import annotations

import numpy as np


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
