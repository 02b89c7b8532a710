"""Framework-free core of omniep: interface, types, capacity math, reference model, registry, errors."""

from .backend import EPBackend
from .capacity import align_up, default_capacity
from .errors import (
    BackendUnavailableError,
    CapacityError,
    DestroyedError,
    InputError,
    OmniEPError,
    PeerFailedError,
    PeerTimeoutError,
    RankMismatchError,
    UnsupportedError,
)
from .registry import backend_names, get_backend_class, report, select_backend
from .types import Availability, Capabilities, DispatchConfig, Dispatched, Handle, Layout, ProcessModel

__all__ = [
    "EPBackend", "align_up", "default_capacity", "BackendUnavailableError", "CapacityError",
    "DestroyedError", "InputError", "OmniEPError", "PeerFailedError", "PeerTimeoutError", "RankMismatchError", "UnsupportedError",
    "backend_names", "get_backend_class", "report", "select_backend", "Availability", "Capabilities",
    "DispatchConfig", "Dispatched", "Handle", "Layout", "ProcessModel",
]
