"""The native GPU core (``omniep._native``): availability, and drivers over it.

``omniep._native`` is an optional compiled module (``make native``; CMakeLists.txt at the repository
root). Nothing here imports it, torch or CUDA at import time: :func:`availability` says whether it
can run here and, if not, why in one line; :func:`load` returns the module or raises
:class:`~omniep.ep_core.errors.BackendUnavailableError` with that reason.

Drivers: :mod:`omniep.native.virtual_ranks` runs R ranks on ONE GPU (the p2p transport's virtual
ranks) from per-rank torch tensors — the test bed of the kernels.
"""

from __future__ import annotations

from ..ep_core.errors import BackendUnavailableError
from ..ep_core.types import Availability

NAME = "native_p2p"
MIN_COMPUTE_CAPABILITY = (9, 0)  # the module is built for CUDA_ARCHITECTURES 90

def force_remote() -> bool:
    """``OMNIEP_FORCE_REMOTE=1``: every peer takes the native kernels' remote path (puts + signals), even
    where loads and stores would reach it; the native rank classes read the same variable. Every rank
    of a group must agree (the remote path allocates symmetric areas and runs extra barriers)."""
    from ..ep_core import env

    return env.get("OMNIEP_FORCE_REMOTE")


# Device status codes (csrc/include/omniep/status.h, omniep.ep_core.descriptor.StatusCode).
ERROR_NONE, ERROR_PEER_TIMEOUT, ERROR_LOCAL_TIMEOUT = 0, 4, 5


def _import_native():
    import importlib

    return importlib.import_module("omniep._native")


def availability() -> Availability:
    """Whether the native core can run in this process, with the reason in one line."""
    try:
        native = _import_native()
    except ImportError as exc:
        return Availability(False, f"omniep._native not built: run `make native` ({exc})")
    try:
        import torch
    except ImportError:
        return Availability(False, "the native drivers need torch (pip install omniep[torch])")
    if not torch.cuda.is_available():
        return Availability(False, "no CUDA device visible to torch")
    cc = torch.cuda.get_device_capability()
    if tuple(cc) < MIN_COMPUTE_CAPABILITY:
        return Availability(
            False, f"omniep._native is built for sm_90; this GPU is sm_{cc[0]}{cc[1]} (rebuild with "
                   f"-DCMAKE_CUDA_ARCHITECTURES={cc[0]}{cc[1]})")
    return Availability(True, f"omniep._native {native.version()} on {torch.cuda.get_device_name()}")


def load():
    """``omniep._native``, or :class:`BackendUnavailableError` saying why it cannot run here."""
    avail = availability()
    if not avail:
        raise BackendUnavailableError(NAME, avail.reason)
    return _import_native()


__all__ = ["NAME", "availability", "load", "ERROR_NONE", "ERROR_PEER_TIMEOUT", "ERROR_LOCAL_TIMEOUT"]
