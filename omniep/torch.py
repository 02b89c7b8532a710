"""``omniep.torch``: the PyTorch entry point (re-exports :mod:`omniep.frontends.torch`).

``dispatch`` / ``combine`` (autograd-aware custom ops), ``cached_dispatch`` and the DeepEP-compatible
``Buffer``.
"""

from .frontends.torch import Buffer, Dispatched, Handle, cached_dispatch, combine, dispatch

__all__ = ["dispatch", "combine", "cached_dispatch", "Buffer", "Dispatched", "Handle"]
