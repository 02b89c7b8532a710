"""numpy <-> torch with the bits unchanged (bfloat16 and float8 through same-width integers), and a
bitwise comparison of a result against a numpy reference.

numpy has no bfloat16/float8 of its own: those arrays are ``ml_dtypes`` types on the numpy side.
"""

from __future__ import annotations

import numpy as np

from .cases import np_dtype

_SAME_WIDTH = {"bfloat16": ("int16", "int16"), "float8_e4m3fn": ("uint8", "uint8")}  # numpy, torch


def to_torch(a, device=None):
    """numpy array -> torch tensor on ``device`` (default CPU), bits unchanged."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name in _SAME_WIDTH:
        t = torch.from_numpy(a.view(_SAME_WIDTH[a.dtype.name][0]).copy()).view(getattr(torch, a.dtype.name))
    else:
        t = torch.from_numpy(a.copy())
    return t if device is None else t.to(device)


def to_numpy(t) -> np.ndarray:
    """torch tensor (any device) -> numpy array, bits unchanged (bfloat16 / float8 as ml_dtypes)."""
    import torch

    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name in _SAME_WIDTH:
        return t.view(getattr(torch, _SAME_WIDTH[name][1])).numpy().view(np_dtype(name))
    return t.numpy()


def assert_bits_equal(got, want, what: str) -> None:
    """``got`` (torch tensor or numpy array) has ``want``'s shape and, cast to ``want``'s dtype, its bits.

    Floats are compared as same-width unsigned integers, so NaNs compare by payload and -0.0 differs from 0.0.
    """
    want = np.asarray(want)
    got = to_numpy(got) if not isinstance(got, np.ndarray) else got
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    w = want.view(f"u{want.dtype.itemsize}") if want.dtype.kind in "fV" else want
    g = got.astype(want.dtype).view(w.dtype) if want.dtype.kind in "fV" else got.astype(want.dtype)
    bad = np.nonzero(g.reshape(-1) != w.reshape(-1))[0]
    assert bad.size == 0, f"{what}: {bad.size} elements differ, first at flat index {bad[0]}: " \
                          f"got {got.reshape(-1)[bad[0]]} want {want.reshape(-1)[bad[0]]}"


def randn(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Standard normal samples drawn in float32, then rounded to ``dtype`` (a name :func:`np_dtype` knows)."""
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))
