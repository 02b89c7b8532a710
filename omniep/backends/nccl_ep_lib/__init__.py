"""``nccl_ep_lib``: NVIDIA's NCCL EP library (``nccl_ep.h``, ``libnccl_ep.so`` of the ``nccl-extensions``
wheel, API version 2) as an optional engine under omniep's interface (issue 18 item 2).

Not to be confused with ``nccl_ep``, which is omniep's own kernels over the NCCL device API.

What it is. A C++ adapter (``csrc/backends/nccl_ep_lib.{h,cpp}``, order kernels in
``csrc/backends/nccl_ep_lib_order.cu``, module ``omniep._native_nccl_ep_lib``) written against
``nccl_ep.h``; it opens ``libnccl_ep.so`` with ``dlopen`` at run time, makes one NCCL EP group per layout
over the torch process group's NCCL communicator (or its own; JAX: its own, from a unique id exchanged
through JAX's key-value store), and runs every op as one native call -- the same adapter entry points
from both frameworks: the PyTorch binding (:mod:`.torch_backend`) and the XLA FFI handlers
(``csrc/ffi/jax_nccl_ep_lib_handlers.cpp``, :mod:`.jax_backend`):

* rank-major (DESIGN §2 "normal" mode) on NCCL EP's HT algorithm, ``NCCL_EP_LAYOUT_FLAT``; expert-major
  (``[L, C, H]``) on LL, ``NCCL_EP_LAYOUT_EXPERT_MAJOR``;
* ``prepare`` + ``dispatch``: ``ncclEpUpdateHandle`` with ``topk_idx``, ``ncclEpDispatch``; a cached
  dispatch / ``combine_bwd``: ``ncclEpDispatch`` with the handle's routing (HT: ``NCCL_EP_BWD_PASS``);
  ``combine``: ``ncclEpCombine`` (LL applies ``topk_weights`` itself); rank-major ``dispatch_bwd``:
  ``ncclEpCombine`` with ``NCCL_EP_BWD_PASS`` (the rows' and the weights' gradients); expert-major
  ``dispatch_bwd``: ``ncclEpCombine`` with unit weights.

The order (the one thing NCCL EP leaves open). ``nccl_ep.h`` says HT flat tokens "arrive as a single
contiguous sequence with no rank-major or expert-major structure", gives no order inside an LL expert,
and returns no source information with either; combine returns "tokens in the original order". So the
adapter assumes no order: every row it sends carries a tag (source rank, source token; expert-major also
the token's expert ids and weights) after its payload, and on the device the receiver flags each filled
slot's key ``source rank * max_tokens + source token``; an exclusive prefix sum of the flags is each
row's contract position -- rank-major rows by (source rank, source token), expert-major copies by the
same inside each expert (one copy per (token, expert), which NCCL EP's layout guarantees and the adapter
enforces by rejecting duplicate expert ids in a row). Rows past the capacity are the last in that order
(dropped, counted). Combine writes each contract row back into the slot its dispatch filled. The full
statement is in ``csrc/backends/nccl_ep_lib_order.h``; the CPU tests run the same mapping code against
:mod:`omniep.ep_core.reference`.

What it serves (``capabilities()``): PyTorch and JAX, bfloat16 rows, both layouts, one process per GPU
(JAX: one process per GPU over ``jax.distributed``; not the single controller). Not served, each raising
:class:`~omniep.ep_core.errors.UnsupportedError`: fp8 rows, combine ``bias`` (NCCL EP rounds the sum; a
bias added after it would round twice), the expert-major combine's backward (the gradient of
``topk_weights`` needs one value per (token, k) back at the source, and NCCL EP's LL combine returns one
weighted sum per token), the expert-major ``dispatch_bwd`` with a non-zero gradient of
``recv_topk_weights`` (same reason; PyTorch raises, JAX -- which cannot tell under ``jit`` -- returns NaN
there, see :mod:`.jax_backend`). JAX-only limits (:mod:`.jax_backend`): the statuses are zeros (no op
descriptor is exchanged), and a native handle per traced dispatch (a dispatch run again before the
ops of its earlier run, e.g. in ``lax.scan`` under ``grad`` without remat: those ops return NaN, found
on the device). Bitwise equality of combine with the contract (fp32 sums in ascending rank / k
order, rounded once) depends on how NCCL EP reduces, which its header does not state: the GPU property
suite checks it wherever the library loads.

Status, plainly: NOTHING of it has run. ``libnccl_ep.so`` (nccl-extensions 0.1.0) needs NCCL >= 2.30.4;
our GPU machines have 2.28.9, which lacks ``ncclCommQueryProperties``, ``ncclGetPeerDevicePointer`` and
``ncclWinGetUserPtr``. What is checked without it: a CUDA build (nvcc) compiles the adapter against
``nccl_ep.h`` wherever the header is found (CI takes it from the wheels, ``.ci/run``;
``cmake/nccl_ep_lib.cmake``), together with the ABI pins (``csrc/backends/nccl_ep_lib_abi.cpp``) and, where
jax's FFI headers are found too, the JAX handlers; where it was built, on CPU, the module imports, its
host-side argument checks and its order mapping run, its loader reports why a library cannot be used,
and the JAX handlers are listed and register with XLA for CUDA (they cannot be called without a GPU:
XLA refuses a CUDA stream on CPU). A build without nvcc has none of it (``omniep info --build``).

Availability is checked in this order, the first failure being the reason given:

a. ``libnccl_ep.so``: ``$OMNIEP_NCCL_EP_LIB`` (the file, or a folder holding it) if set, else the installed
   ``nccl`` package's ``ep/lib/cu13`` then ``ep/lib/cu12`` (found with ``importlib.util.find_spec``: the
   package is not imported, since importing ``nccl.ep`` loads the library);
b. the NCCL runtime ``libnccl_ep.so`` would bind to (it has no RUNPATH: ``libnccl.so.2`` as the process or
   the loader finds it): the ``nvidia-nccl-cu13`` wheel's ``lib/libnccl.so.2``, else ``libnccl.so.2``
   through the loader; loaded with ``ctypes.CDLL`` and asked ``ncclGetVersion``; it must be >= 2.30.4;
c. the NCCL symbols ``libnccl_ep.so`` imports that older releases lack (looked up by name only);
d. an NVIDIA GPU (``/proc/driver/nvidia/gpus``; no CUDA call);
e. the adapter module ``omniep._native_nccl_ep_lib`` (built where ``nccl_ep.h`` was found at build time);
f. per framework: PyTorch needs a CUDA build of torch with ``torch.distributed``; JAX needs the module's
   JAX handlers (built where jax was importable), a CUDA GPU for jax, and one process per GPU over
   ``jax.distributed``.

When all pass, the library is opened at the group's first op (``dlopen`` + ``dlsym``, its NCCL's version
checked again), and a failure there is raised with the loader's words.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from typing import Optional

from ...ep_core.errors import BackendUnavailableError
from ...ep_core.types import Capabilities, Layout, ProcessModel

NAME = "nccl_ep_lib"
API_VERSION = 2  # NCCL_EP_API_VERSION of the header the ABI check is written against
MIN_NCCL = 23004  # NCCL_VERSION_CODE of 2.30.4, the first NCCL libnccl_ep.so (nccl-extensions 0.1.0) links against
NEEDED_SYMBOLS = ("ncclCommQueryProperties", "ncclGetPeerDevicePointer", "ncclWinGetUserPtr")
LIB_NAME = "libnccl_ep.so"
CUDA_FLAVOURS = ("cu13", "cu12")
LOADER_NCCL = "libnccl.so.2"  # what libnccl_ep.so names in DT_NEEDED (it has no RUNPATH)
MODULE = "omniep._native_nccl_ep_lib"
# What has not run on the hardware it is for (``omniep info`` prints it).
NOT_RUN = ("all of it: the adapter (torch and JAX, HT rank-major and LL expert-major) is built and its host "
           "side tested on CPU, but libnccl_ep.so has never loaded here (it needs NCCL >= 2.30.4; our GPU "
           "machines have 2.28.9)")

# What the adapter serves (the PyTorch backend's capabilities; the JAX one's with frameworks=("jax",)):
# bf16, rank-major through NCCL EP's HT algorithm and expert-major through LL, one process per GPU.
SERVED = Capabilities(dtypes=("bfloat16",), fp8=False, layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR),
                      max_ranks=None, intranode=True, internode=False,
                      process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,), frameworks=("torch",),
                      cuda_graph_safe=False, hidden_multiple=1, devices=("gpu",))


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


def native_module():
    """``(module, "")`` when the adapter module imports, else ``(None, why)``."""
    try:
        return importlib.import_module(MODULE), ""
    except ImportError as exc:
        return None, (f"the adapter module {MODULE} is not built (a CUDA build makes it where nccl_ep.h is found "
                      f"at build time: pip install nccl-extensions, or -DOMNIEP_NCCL_EP_ROOT=<dir>; "
                      f"`omniep info --build` says why it was skipped): {exc}")


def open_library(native):
    """The adapter's ``Library`` over the ``libnccl_ep.so`` found here (both frameworks), or
    :class:`BackendUnavailableError` with where it looked or the loader's words."""
    path, looked = find_ep_library()
    if path is None:
        where = ", ".join(looked) or "no installed 'nccl' package"
        raise BackendUnavailableError(NAME, f"libnccl_ep.so not found (looked at: {where})")
    try:
        return native.Library.open(path)
    except native.LoadError as exc:
        raise BackendUnavailableError(NAME, str(exc)) from None


def group_for(groups: dict, native, comm, layout: int, num_experts: int, num_topk: int, hidden: int,
              dtype_code: int, max_tokens: int, timeout_s: float):
    """``(key, group)``: the native ``Group`` of ``groups`` that serves this shape -- one per (layout, E, K,
    tagged row bytes) -- made (collectively: every rank in the same order) when there is none yet."""
    row = native.row_bytes(hidden, native.dtype_bytes(dtype_code), num_topk, layout == 1)
    key = (layout, num_experts, num_topk, row)
    if key not in groups:
        groups[key] = native.Group(comm, layout, num_experts, num_topk, max_tokens, row, int(timeout_s * 1e9))
    return key, groups[key]


def op_error(native, layout: int, num_ranks: int, num_experts: int, num_tokens: int, hidden: int, num_topk: int,
             dtype_code: int, capacity: int, expert_alignment: int, max_tokens: int) -> str:
    """The adapter's host-side check of an op against the group made for it (``check_op``), as the message
    of an :class:`InputError`; ``""`` when it passes."""
    row = native.row_bytes(hidden, native.dtype_bytes(dtype_code), num_topk, layout == 1)
    why = native.check_op(layout, num_ranks, num_experts, num_tokens, hidden, num_topk, dtype_code, capacity,
                          expert_alignment, max_tokens, row)
    return f"nccl_ep_lib: {why}" if why else ""


def availability_reason() -> str:
    """Why the adapter cannot run here, framework aside (d.-e. of the module docstring), or ``""``."""
    why = environment_reason()
    if why:
        return why
    _, why = native_module()
    return why
