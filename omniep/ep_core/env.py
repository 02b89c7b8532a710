"""Every ``OMNIEP_*`` environment variable the library reads, in one table (DESIGN §9: bad input is a
clear error naming it).

:func:`get` reads a variable: surrounding whitespace is dropped and names are case-folded
(``OMNIEP_BACKEND=" CUDA_NVSHMEM "`` is ``cuda_nvshmem``); a value the variable does not accept raises
:class:`InputError` naming the variable, the value and what it accepts. :func:`report` is what
``omniep info`` prints: every variable with the value in force and a verdict. The build's own
variables (``OMNIEP_GPU``, ``OMNIEP_NVSHMEM``, ``OMNIEP_NCCL``, ``OMNIEP_COMPILE_CHECK``, the ``*_ROOT``
folders, the cache entry ``OMNIEP_HIP_CHECK_ARCHS``; CMakeLists.txt) are read at build time, not here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from .errors import InputError


# Valid names that another module owns, by variable: the registry gives OMNIEP_BACKEND's (it imports this
# module, so the names are handed down rather than looked up).
_OWNED_CHOICES: dict = {}


def own_choices(name: str, choices) -> None:
    """Make ``choices()`` (a callable returning the valid names) the choices of variable ``name``."""
    _OWNED_CHOICES[name] = choices


def _backend_names() -> Optional[tuple]:
    owner = _OWNED_CHOICES.get("OMNIEP_BACKEND")
    return owner() if owner is not None else None  # None: the registry is not imported, nothing to check


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str
    choices: Optional[Callable[[], Optional[tuple]]] = None  # names (case-folded); None: `number` says what
    number: Optional[str] = None  # "seconds": a float > 0; "bytes": an int >= 0; "count": an int >= 1;
    #                               "flag": 0 or 1; "path": any

    def parse(self, raw: str):
        """The value of ``raw`` (already stripped), or ValueError saying what the variable accepts."""
        if self.choices is not None:
            value, valid = raw.lower(), self.choices()
            if valid is not None and value not in valid:
                raise ValueError(f"expected one of {', '.join(valid)}")
            return value
        if self.number == "seconds":
            value = float(raw) if _is_float(raw) else None
            if value is None or not value > 0:
                raise ValueError("expected a number of seconds > 0")
            return value
        if self.number == "bytes":
            if not raw.isdigit():
                raise ValueError("expected a whole number of bytes >= 0")
            return int(raw)
        if self.number == "count":
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError("expected a whole number >= 1")
            return int(raw)
        if self.number == "path":
            return raw
        if raw not in ("0", "1"):
            raise ValueError("expected 0 or 1")
        return raw == "1"

    def accepts(self) -> str:
        if self.choices is not None:
            return " | ".join(self.choices() or ("a registered backend's name",))
        return {"seconds": "seconds > 0", "bytes": "bytes >= 0", "count": "a whole number >= 1", "flag": "0 | 1",
                "path": "a path"}[self.number]


def _is_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


VARIABLES = {v.name: v for v in (
    Variable("OMNIEP_BACKEND", "auto", "the backend every op uses unless the call names one; auto: the fastest "
             "available one that serves the call (DESIGN §6)", choices=_backend_names),
    Variable("OMNIEP_CHECKS", "default", "sync: every op waits for its status and raises at once (the test "
             "suites' mode); default: raised at the next host wait", choices=lambda: ("default", "sync")),
    Variable("OMNIEP_TIMEOUT_S", "100", "how long any wait on a peer may take before it fails naming the rank",
             number="seconds"),
    Variable("OMNIEP_TRANSPORT", "ipc", "cuda_nvshmem's transport: ipc (CUDA IPC peer pointers) or nvshmem "
             "(needs omniep._native_nvshmem)", choices=lambda: ("ipc", "nvshmem")),
    Variable("OMNIEP_FORCE_REMOTE", "0", "1: the native kernels reach every peer by their remote (put + signal) "
             "path, as across nodes; every rank must agree", number="flag"),
    Variable("OMNIEP_FUSED_COPY_BYTES", "4194304", "rank-major ops whose local copy is at most this many bytes "
             "do it inside the communication kernel (one launch fewer)", number="bytes"),
    Variable("OMNIEP_LAYER_COMPILE", "1", "1: the torch MoE layer's elementwise work on a GPU (SwiGLU, weighting) "
             "runs through torch.compile, fused; 0: eager kernels", number="flag"),
    Variable("OMNIEP_CACHE_DIR", "", "where omniep keeps what it learns on this machine (the golden sets each "
             "backend passed, `omniep info`); unset: ~/.cache/omniep", number="path"),
    Variable("OMNIEP_NCCL_EP_LIB", "", "nccl_ep_lib: NVIDIA's libnccl_ep.so (the file or its folder); unset: "
             "the installed nccl-extensions package's ep/lib/cu13, then cu12", number="path"),
    Variable("OMNIEP_NCCL_EP_LIB_MAX_TOKENS", "4096", "nccl_ep_lib: the most tokens any rank dispatches (NCCL EP's "
             "max_dispatch_tokens_per_rank, sizing its buffers); the same on every rank", number="count"),
)}


def get(name: str):
    """The value of ``name`` in force (its default when unset or blank), parsed; InputError if invalid."""
    var = VARIABLES[name]
    raw = os.environ.get(name, "").strip()
    try:
        return var.parse(raw or var.default)
    except ValueError as exc:
        raise InputError(f"{name}={os.environ.get(name)!r} is not valid: {exc}") from None


def report() -> list[dict]:
    """Every variable: ``name``, ``value`` (as set, or None), ``default``, ``accepts``, ``doc`` and
    ``error`` (None, or why the value set is invalid)."""
    rows = []
    for name, var in VARIABLES.items():
        error = None
        try:
            get(name)
        except InputError as exc:
            error = str(exc)
        rows.append(dict(name=name, value=os.environ.get(name), default=var.default, accepts=var.accepts(),
                         doc=var.doc, error=error))
    return rows
