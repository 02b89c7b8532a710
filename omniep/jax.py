"""``import omniep.jax as ep``: dispatch / combine / check for JAX (see :mod:`omniep.frontends.jax`)."""

try:
    import jax
except ModuleNotFoundError as _exc:
    if _exc.name != "jax":
        raise
    raise ModuleNotFoundError("omniep.jax needs JAX: pip install 'omniep[jax]' (jax[cuda13] or jax[rocm] for "
                              "GPUs)", name="jax") from None

del jax  # (imported only to say what to install when it is missing)

from .frontends.jax import STATUS_WORDS, Dispatched, Handle, check, combine, dispatch

__all__ = ["dispatch", "combine", "check", "Dispatched", "Handle", "STATUS_WORDS"]
