"""``import omniep.jax as ep``: dispatch / combine for JAX (see :mod:`omniep.frontends.jax`)."""

from .frontends.jax import Dispatched, Handle, combine, dispatch

__all__ = ["dispatch", "combine", "Dispatched", "Handle"]
