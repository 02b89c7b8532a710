"""Backend registry and run-time selection (DESIGN §6).

Backends are registered by import path so that importing omniep never imports a native module or
a framework it does not need. ``OMNIEP_BACKEND`` (default ``auto``) or a per-call ``backend=`` picks one.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

from . import env
from .errors import BackendUnavailableError, InputError, UnsupportedError
from .types import Availability

log = logging.getLogger("omniep")

# name -> framework -> "module:Class". Order of names is the order `auto` tries them in.
_REGISTRY: dict[str, dict[str, str]] = {
    "cuda_nvshmem": {
        "jax": "omniep.backends.cuda_nvshmem.jax_backend:CudaNvshmemJax",
        "torch": "omniep.backends.cuda_nvshmem.torch_backend:CudaNvshmemTorch",
    },
    "nccl_ep": {
        "jax": "omniep.backends.nccl_ep.jax_backend:NcclEpJax",
        "torch": "omniep.backends.nccl_ep.torch_backend:NcclEpTorch",
    },
    "rocm_rocshmem": {
        "jax": "omniep.backends.rocm_rocshmem.jax_backend:RocmRocshmemJax",
        "torch": "omniep.backends.rocm_rocshmem.torch_backend:RocmRocshmemTorch",
    },
    # NVIDIA's NCCL EP library (nccl-extensions) through omniep's adapter, for torch and JAX (one process
    # per GPU), where the library, a new enough NCCL and the adapter module are present (`omniep info` says
    # why, either way).
    "nccl_ep_lib": {
        "jax": "omniep.backends.nccl_ep_lib.jax_backend:NcclEpLibJax",
        "torch": "omniep.backends.nccl_ep_lib.torch_backend:NcclEpLibTorch",
    },
    "collective": {
        "jax": "omniep.backends.collective.jax_backend:CollectiveJax",
        "torch": "omniep.backends.collective.torch_backend:CollectiveTorch",
    },
}
FRAMEWORKS = ("jax", "torch")
_auto_logged: set = set()


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


env.own_choices("OMNIEP_BACKEND", lambda: ("auto",) + backend_names())


def register(name: str, framework: str, target: str) -> None:
    """Register ``module:Class`` as backend ``name`` for ``framework`` (used by native backends)."""
    if framework not in FRAMEWORKS:
        raise InputError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    _REGISTRY.setdefault(name, {})[framework] = target


def get_backend_class(name: str, framework: str):
    """The backend class, or raise BackendUnavailableError saying why it cannot be loaded."""
    if name not in _REGISTRY:
        raise InputError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)} (or 'auto')")
    target = _REGISTRY[name].get(framework)
    if target is None:
        raise BackendUnavailableError(name, f"not implemented for {framework} in this version of omniep")
    module, cls = target.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise BackendUnavailableError(name, f"cannot import {module}: {exc}") from exc


_AVAILABILITY: dict = {}  # (class, its availability function) -> Availability (torch only)


def class_availability(cls, framework: str) -> Availability:
    """``cls.availability()``, remembered for torch backends: the torch frontend resolves its backend on
    every call, and what a torch backend checks (built modules, devices, packages) does not change in a
    process. JAX resolves while tracing only, and its answers change when ``jax.distributed`` is
    initialized, so JAX always asks. The key holds the class and its ``availability`` function (a
    patched function asks again); environment settings read by a torch backend's availability (e.g.
    ``OMNIEP_TRANSPORT``) count as set at its first use in the process. (Scanning the environment on
    every call cost more than asking: ~0.5 ms a call, profiled on an H200.)"""
    if framework != "torch":
        return cls.availability()
    key = (cls, getattr(cls.availability, "__func__", cls.availability))
    if key not in _AVAILABILITY:
        _AVAILABILITY[key] = cls.availability()
    return _AVAILABILITY[key]


def availability(name: str, framework: str) -> Availability:
    try:
        return class_availability(get_backend_class(name, framework), framework)
    except BackendUnavailableError as exc:
        return Availability(False, exc.reason)


def device_kind(name: str) -> str:
    """Normalise a framework's device name: torch 'cuda' and jax 'gpu'/'cuda'/'rocm' are all 'gpu'."""
    return "gpu" if name in ("cuda", "gpu", "rocm", "hip") else name


def select_backend(framework: str, name: Optional[str] = None, *, layout=None, dtype: Optional[str] = None,
                   fp8: bool = False, num_ranks: Optional[int] = None, device: Optional[str] = None):
    """Resolve ``name`` (or ``$OMNIEP_BACKEND``, default ``auto``) to a backend class for this request.

    A named backend must be available and serve the request, else :class:`BackendUnavailableError` /
    :class:`UnsupportedError` says why. ``auto`` takes the first backend in registry order that is
    available and serves the request (layout, dtype, ranks, device) and logs once what it chose and why
    the others were passed over.
    """
    request = dict(layout=layout, dtype=dtype, fp8=fp8, num_ranks=num_ranks, device=device)
    requested = name.strip().lower() if isinstance(name, str) and name.strip() else env.get("OMNIEP_BACKEND")
    if requested != "auto":
        cls = get_backend_class(requested, framework)
        avail = class_availability(cls, framework)
        if not avail:
            raise BackendUnavailableError(requested, avail.reason)
        require(cls, framework, **request)
        return cls
    skipped = []
    for candidate in _REGISTRY:
        avail = availability(candidate, framework)
        if not avail:
            skipped.append((candidate, avail.reason))
            continue
        cls = get_backend_class(candidate, framework)
        try:
            require(cls, framework, **request)
        except UnsupportedError as exc:
            skipped.append((candidate, f"does not serve {exc.feature}"))
            continue
        key = (framework, candidate)
        if key not in _auto_logged:
            _auto_logged.add(key)
            # One short line; the reasons are omniep info's (and the debug log's) business.
            why = (f"passed over: {', '.join(n for n, _ in skipped)}; `omniep info` says why" if skipped
                   else "first in preference order")
            log.info("omniep: backend chosen for %s: %s (%s)", framework, candidate, why)
            log.debug("omniep: passed over for %s: %s", framework, "; ".join(f"{n}: {r}" for n, r in skipped))
        return cls
    raise BackendUnavailableError("auto", "; ".join(f"{n}: {r}" for n, r in skipped))


def require(cls, framework: str, *, layout=None, dtype: Optional[str] = None, fp8: bool = False,
            num_ranks: Optional[int] = None, device: Optional[str] = None) -> None:
    """Raise UnsupportedError if backend ``cls`` cannot serve this request, naming who can."""
    caps = cls.capabilities()
    checks = []
    if layout is not None and layout not in caps.layouts:
        checks.append((f"layout {layout.value}", lambda c: layout in c.layouts))
    if dtype is not None and dtype not in caps.dtypes and not (fp8 and caps.fp8):
        checks.append((f"dtype {dtype}", lambda c: dtype in c.dtypes or (fp8 and c.fp8)))
    if num_ranks is not None and caps.max_ranks is not None and num_ranks > caps.max_ranks:
        checks.append((f"{num_ranks} ranks (max {caps.max_ranks})",
                       lambda c: c.max_ranks is None or num_ranks <= c.max_ranks))
    if device is not None and device_kind(device) not in caps.devices:
        checks.append((f"arrays on {device_kind(device)}", lambda c: device_kind(device) in c.devices))
    for feature, ok in checks:
        raise UnsupportedError(cls.name, feature, serving(framework, ok, exclude=cls.name))


def serving(framework: str, ok, exclude: Optional[str] = None) -> list[str]:
    """Names of the registered backends for ``framework`` (other than ``exclude``) whose capabilities
    satisfy ``ok(capabilities)``, in registry order: who can serve a request that one cannot."""
    served = []
    for other in _REGISTRY:
        try:
            other_cls = get_backend_class(other, framework)
        except BackendUnavailableError:
            continue
        if other != exclude and ok(other_cls.capabilities()):
            served.append(other)
    return served


def report(framework: Optional[str] = None) -> dict[str, dict[str, Availability]]:
    """Availability of every backend for every framework (what ``omniep info`` prints)."""
    frameworks = (framework,) if framework else FRAMEWORKS
    return {name: {fw: availability(name, fw) for fw in frameworks} for name in _REGISTRY}
