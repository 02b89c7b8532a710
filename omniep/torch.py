"""``omniep.torch``: the PyTorch entry point (re-exports :mod:`omniep.frontends.torch`).

``dispatch`` / ``combine`` (autograd-aware custom ops), ``cached_dispatch`` and the DeepEP-compatible
``Buffer`` (with its ``Config`` and ``EventOverlap``).
"""

try:
    import torch
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":
        raise
    raise ModuleNotFoundError("omniep.torch needs PyTorch: pip install 'omniep[torch]' (or the torch build for your "
                              "CUDA / ROCm version)", name="torch") from None

del torch  # (imported only to say what to install when it is missing)

from .frontends.torch import (Dispatched, Handle, cached_dispatch, check, combine, context, destroy, dispatch,
                              synchronize)
from .frontends.torch_buffer import Buffer, Config, EventOverlap

__all__ = ["dispatch", "combine", "cached_dispatch", "check", "synchronize", "destroy", "context", "Buffer",
           "Config", "EventOverlap", "Dispatched", "Handle"]
