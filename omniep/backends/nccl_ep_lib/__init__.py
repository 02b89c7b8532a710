"""``nccl_ep_lib``: NVIDIA's NCCL EP library (``nccl_ep.h``, ``libnccl_ep.so`` of the ``nccl-extensions``
wheel, API version 2) as an optional engine under omniep's interface (issue 18 item 2).

Not to be confused with ``nccl_ep``, which is omniep's own kernels over the NCCL device API.

Status, plainly: this is the first slice. What exists is the availability check below (why the library
cannot run here, without initialising CUDA and without loading ``libnccl_ep.so``), the registry entry
(``omniep info`` lists it with the reason), and a CPU compile-time check of the ABI our adapter will rely
on (``csrc/backends/nccl_ep_lib_abi.cpp``, compiled by the CMake project's compile check,
``cmake/compile_check.cmake``, where ``nccl_ep.h`` is found; CI fetches the headers, ``.ci/run``).
The adapter from :class:`~omniep.ep_core.backend.EPBackend` to
``ncclEpCreateGroup`` / ``ncclEpInitHandle`` / ``ncclEpDispatch`` / ``ncclEpCombine`` is NOT written:
the backend is unavailable for every op everywhere, and its ops raise :class:`BackendUnavailableError`.

Availability is checked in this order, the first failure being the reason given:

a. ``libnccl_ep.so``: ``$OMNIEP_NCCL_EP_LIB`` (the file, or a folder holding it) if set, else the installed
   ``nccl`` package's ``ep/lib/cu13`` then ``ep/lib/cu12`` (found with ``importlib.util.find_spec``: the
   package is not imported, since importing ``nccl.ep`` loads the library);
b. the NCCL runtime ``libnccl_ep.so`` would bind to (it has no RUNPATH: ``libnccl.so.2`` as the process or
   the loader finds it): the ``nvidia-nccl-cu13`` wheel's ``lib/libnccl.so.2``, else ``libnccl.so.2``
   through the loader; loaded with ``ctypes.CDLL`` and asked ``ncclGetVersion``; it must be >= 2.30.4;
c. the NCCL symbols ``libnccl_ep.so`` imports that older releases lack (looked up by name only);
d. an NVIDIA GPU (``/proc/driver/nvidia/gpus``; no CUDA call);

and then, whatever the environment, "adapter not implemented yet".
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from typing import Optional

from ...ep_core.backend import EPBackend
from ...ep_core.errors import BackendUnavailableError
from ...ep_core.types import Availability, Capabilities, Layout, ProcessModel

NAME = "nccl_ep_lib"
API_VERSION = 2  # NCCL_EP_API_VERSION of the header the ABI check is written against
MIN_NCCL = 23004  # NCCL_VERSION_CODE of 2.30.4, the first NCCL libnccl_ep.so (nccl-extensions 0.1.0) links against
NEEDED_SYMBOLS = ("ncclCommQueryProperties", "ncclGetPeerDevicePointer", "ncclWinGetUserPtr")
LIB_NAME = "libnccl_ep.so"
CUDA_FLAVOURS = ("cu13", "cu12")
LOADER_NCCL = "libnccl.so.2"  # what libnccl_ep.so names in DT_NEEDED (it has no RUNPATH)
ADAPTER = "adapter is not implemented yet (omniep -> ncclEpDispatch/ncclEpCombine; issue 18 item 2)"
# What has not run on the hardware it is for (``omniep info`` prints it).
NOT_RUN = ("all of it: the adapter is not written, and libnccl_ep.so has never loaded here "
           "(it needs NCCL >= 2.30.4; our GPU machines have 2.28.9)")


# What the adapter is meant to serve first (not served today): bf16, rank-major through NCCL EP's HT
# algorithm and expert-major through LL, arrays on NVIDIA GPUs, one process per GPU.
PLANNED = Capabilities(dtypes=("bfloat16",), layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR),
                       process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,), devices=("gpu",))


def version_string(code: int) -> str:
    """``23004`` -> ``"2.30.4"`` (NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch)."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def version_reason(code: Optional[int], where: str, minimum: int = MIN_NCCL) -> str:
    """Why NCCL ``code`` (found at ``where``) is too old for the library, or ``""`` when it is new enough."""
    if code is None:
        return f"NCCL at {where} did not report its version (ncclGetVersion failed)"
    if code < minimum:
        return (f"NCCL {version_string(code)} at {where} is too old: the NCCL EP library needs NCCL >= "
                f"{version_string(minimum)} (found {version_string(code)})")
    return ""


def ep_library_candidates() -> list:
    """Where ``libnccl_ep.so`` is looked for, in order: ``$OMNIEP_NCCL_EP_LIB`` alone when set, else the
    installed ``nccl`` package's ``ep/lib/<cu13|cu12>/``."""
    from ...ep_core import env

    configured = env.get("OMNIEP_NCCL_EP_LIB")
    if configured:
        return [os.path.join(configured, LIB_NAME) if os.path.isdir(configured) else configured]
    try:
        spec = importlib.util.find_spec("nccl")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(root, "ep", "lib", flavour, LIB_NAME) for root in roots for flavour in CUDA_FLAVOURS]


def find_ep_library() -> tuple[Optional[str], list]:
    """``(path, candidates)``: the first candidate that is a file, or None, with every place looked at."""
    candidates = ep_library_candidates()
    return next((c for c in candidates if os.path.isfile(c)), None), candidates


def nccl_runtime_candidates() -> list:
    """The NCCL runtimes ``libnccl_ep.so`` could bind to, in order: the nvidia-nccl wheel's, then the
    loader's ``libnccl.so.2``."""
    out = []
    try:
        for root in importlib.import_module("nvidia.nccl").__path__:
            path = os.path.join(root, "lib", "libnccl.so.2")
            if os.path.isfile(path):
                out.append(path)
    except ImportError:
        pass
    out.append(LOADER_NCCL)
    return out


def load_nccl() -> tuple[Optional[ctypes.CDLL], str, list]:
    """``(library, where, tried)``: the first NCCL runtime candidate that loads, or ``(None, "", tried)``
    with ``tried`` as ``"candidate (why not)"`` strings."""
    tried = []
    for cand in nccl_runtime_candidates():
        try:
            return ctypes.CDLL(cand), (f"{cand} (through the loader)" if cand == LOADER_NCCL else cand), tried
        except OSError as exc:
            tried.append(f"{cand} ({exc})")
    return None, "", tried


def nccl_version(lib) -> Optional[int]:
    """``ncclGetVersion`` of a loaded NCCL, or None when it has none or it fails."""
    fn = getattr(lib, "ncclGetVersion", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = ctypes.c_int(0)
    return code.value if fn(ctypes.byref(code)) == 0 else None


def missing_symbols(lib) -> list:
    """Which of :data:`NEEDED_SYMBOLS` the loaded NCCL lacks (dlsym by name; nothing is called)."""
    return [s for s in NEEDED_SYMBOLS if not hasattr(lib, s)]


def nvidia_gpus() -> int:
    """NVIDIA GPUs the driver exposes (``/proc/driver/nvidia/gpus`` entries), without initialising CUDA."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def environment_reason() -> str:
    """The first reason, in the order of the module docstring, why the NCCL EP library cannot run here,
    or ``""`` when the library, a new enough NCCL and a GPU are all present."""
    path, looked = find_ep_library()
    if path is None:
        where = ", ".join(looked) if looked else "no installed 'nccl' package"
        return (f"NCCL EP library ({LIB_NAME}) not found (looked at: {where}); pip install nccl-extensions "
                f"or set OMNIEP_NCCL_EP_LIB")
    lib, where, tried = load_nccl()
    if lib is None:
        return (f"{LIB_NAME} found at {path}, but no NCCL runtime for it (needs NCCL >= "
                f"{version_string(MIN_NCCL)}; tried {'; '.join(tried)})")
    why = version_reason(nccl_version(lib), where)
    missing = missing_symbols(lib)
    if why:
        return f"{why}; it lacks {', '.join(missing)}" if missing else why
    if missing:
        return (f"NCCL at {where} ({version_string(nccl_version(lib))}) lacks {', '.join(missing)}, which "
                f"{LIB_NAME} needs")
    if nvidia_gpus() < 1:
        return f"{LIB_NAME} at {path} and NCCL {version_string(nccl_version(lib))} found, but no NVIDIA GPU"
    return ""


def availability_reason() -> str:
    """The full reason: the environment's blocker first, then that the adapter does not exist."""
    why = environment_reason()
    return f"{why}; and the {ADAPTER}" if why else f"library, NCCL and GPU found, but the {ADAPTER}"


class NcclEpLibBackend(EPBackend):
    """Placeholder for the adapter: unavailable everywhere, every op raises :class:`BackendUnavailableError`
    with the reason. ``capabilities()`` serves nothing (no dtype, layout or device), so that no other
    backend's error names this one as serving a feature; :data:`PLANNED` is what the adapter is meant to
    serve first."""

    name = NAME
    framework = ""

    @classmethod
    def availability(cls) -> Availability:
        return Availability(False, availability_reason())

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(dtypes=(), layouts=(), devices=())

    def _unavailable(self, *_args, **_kwargs):
        raise BackendUnavailableError(self.name, availability_reason())

    num_ranks = prepare = dispatch = combine = dispatch_bwd = combine_bwd = _unavailable


class NcclEpLibTorch(NcclEpLibBackend):
    framework = "torch"


class NcclEpLibJax(NcclEpLibBackend):
    framework = "jax"
