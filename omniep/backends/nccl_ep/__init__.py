"""``nccl_ep``: the native kernels (csrc/kernels, unchanged) over the NCCL device API (NCCL >= 2.28).

Transport ``nccl_dev`` (csrc/transports/nccl_dev.cuh): symmetric NCCL windows, LSA pointers for peers
on NVLink, the barriers and timeouts of the shared kernels. Peers off the LSA team (other nodes, or
every peer with ``OMNIEP_FORCE_REMOTE=1``) take the kernels' remote path over GIN (puts from
registered memory and GIN signals; rank-major layout only: GIN has no gets). That path is compiled
and selected for such peers but has NOT run on a network here (no NICs on our machines). Optional module ``omniep._native_nccl``, built
by ``pip install --no-build-isolation .`` (``make native``) where the ``nvidia-nccl-cu13`` wheel is installed. NCCL refuses two ranks on one GPU: this backend needs a GPU per rank.
"""

from __future__ import annotations

import importlib
from typing import Optional

# What has not run on the hardware it is for (``omniep info`` prints it).
NOT_RUN = ("GIN (peers outside the NVLink/LSA team): compiled and selected for them, refused without a "
           "GIN-capable NIC; it has NOT run on a network here")
MIN_NCCL = 22800  # NCCL_VERSION_CODE of 2.28.0, the first release with nccl_device.h as used here
BUILD_HINT = "OMNIEP_NCCL=ON make native (omniep info --build says why it was skipped)"


def version_string(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def transport_summary(mod) -> str:
    """What the loaded module runs over, for availability reasons and ``omniep info``."""
    return (f"NCCL {version_string(mod.nccl_version())} device API (LSA peers over NVLink; peers off NVLink "
            f"through GIN puts + signals, compiled and selected for them but NOT run on a network here)")


def _wheel_nccl() -> tuple[Optional[str], Optional[int], bool]:
    """``(root, version code, has nccl_device.h)`` of the nvidia-nccl wheel, or Nones if absent."""
    import os
    import re

    try:
        root = list(importlib.import_module("nvidia.nccl").__path__)[0]
    except ImportError:
        return None, None, False
    header = os.path.join(root, "include", "nccl.h")
    code = None
    try:
        with open(header) as f:
            m = re.search(r"#define NCCL_VERSION_CODE (\d+)", f.read())
            code = int(m.group(1)) if m else None
    except OSError:
        pass
    return root, code, os.path.exists(os.path.join(root, "include", "nccl_device.h"))


def native_reason() -> tuple[Optional[object], str]:
    """``(module, "")`` when ``omniep._native_nccl`` imports and its libnccl has the device API, else
    ``(None, why)``: NCCL missing, NCCL too old, no device API, or the module not built."""
    try:
        mod = importlib.import_module("omniep._native_nccl")
    except ImportError as exc:
        if "ncclDevComm" in str(exc) or "ncclCommWindow" in str(exc):
            return None, f"no device API in the libnccl that was loaded ({exc}); need NCCL >= 2.28"
        root, code, device_api = _wheel_nccl()
        if root is None:
            return None, f"NCCL not found (pip install nvidia-nccl-cu13) and native NCCL module not built: {BUILD_HINT}"
        if code is not None and code < MIN_NCCL:
            return None, f"NCCL {version_string(code)} too old: the device API needs >= 2.28"
        if not device_api:
            return None, f"no device API: {root}/include has no nccl_device.h (need NCCL >= 2.28)"
        return None, f"native NCCL module not built: {BUILD_HINT} ({exc})"
    code = mod.nccl_version()
    if code < MIN_NCCL:
        return None, f"NCCL {version_string(code)} too old (loaded at run time): the device API needs >= 2.28"
    return mod, ""
