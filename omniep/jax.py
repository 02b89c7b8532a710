"""``import omniep.jax as ep``: dispatch / combine / check for JAX (see :mod:`omniep.frontends.jax`)."""

from .frontends.jax import STATUS_WORDS, Dispatched, Handle, check, combine, dispatch

__all__ = ["dispatch", "combine", "check", "Dispatched", "Handle", "STATUS_WORDS"]
