"""``import omniep.jax as ep``: dispatch / combine / check for JAX (see :mod:`omniep.frontends.jax`)."""

from .frontends import require_framework

require_framework("jax", "JAX", "pip install 'omniep[jax]' (jax[cuda13] or jax[rocm] for GPUs)")

from .frontends.jax import STATUS_WORDS, Dispatched, Handle, check, combine, dispatch

__all__ = ["dispatch", "combine", "check", "Dispatched", "Handle", "STATUS_WORDS"]
