"""numpy <-> torch with the bits unchanged (bfloat16 and float8 through same-width integers).

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
