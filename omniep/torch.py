"""``omniep.torch``: the PyTorch entry point (re-exports :mod:`omniep.frontends.torch`).

``dispatch`` / ``combine`` (autograd-aware custom ops), ``cached_dispatch`` and the DeepEP-compatible
``Buffer`` (with its ``Config`` and ``EventOverlap``).
"""

from .frontends import require_framework

require_framework("torch", "PyTorch", "pip install 'omniep[torch]' (or the torch build for your CUDA / ROCm version)")

from .frontends.torch import (Dispatched, Handle, cached_dispatch, check, combine, context, destroy, dispatch,
                              synchronize)
from .frontends.torch_buffer import Buffer, Config, EventOverlap, topk_idx_t

__all__ = ["dispatch", "combine", "cached_dispatch", "check", "synchronize", "destroy", "context", "Buffer",
           "Config", "EventOverlap", "Dispatched", "Handle", "topk_idx_t"]
