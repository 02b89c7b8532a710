"""AMD GPUs as hip-python sees them, imported lazily: no framework, no GPU needed to import this module
(the torch and JAX sides of ``rocm_rocshmem`` and the ``rocm`` tests ask it what is missing)."""

from __future__ import annotations

import ctypes


def _hip():
    """``hip.hip`` of hip-python, or raise ImportError / OSError saying why it cannot be loaded."""
    from hip import hip  # noqa: PLC0415  (lazy: hip-python loads libamdhip64 at import)

    return hip


def _hip_ok(err) -> bool:
    name = getattr(err, "name", None)
    return name == "hipSuccess" if name is not None else int(err) == 0


def amd_gpus() -> tuple[list, str]:
    """``(names, why)``: the AMD GPUs hip-python sees (``gcnArchName`` of each), or ``[]`` and the reason."""
    try:
        hip = _hip()
    except ImportError:
        return [], "hip-python not installed (pip install hip-python)"
    except OSError as exc:
        return [], f"libamdhip64 not found ({exc})"
    res = hip.hipGetDeviceCount()
    err, count = res[0], res[1]
    if not _hip_ok(err) or count < 1:
        return [], f"no AMD GPU (hipGetDeviceCount: {getattr(err, 'name', err)}, {count} devices)"
    names = []
    for d in range(count):
        props = hip.hipDeviceProp_t()
        if _hip_ok(hip.hipGetDeviceProperties(props, d)[0]):
            arch = props.gcnArchName
            names.append(arch.decode() if isinstance(arch, bytes) else str(arch))
    return names, f"{count} AMD GPU(s)"


def libamdhip64_found() -> bool:
    """Whether the HIP runtime library loads (asked when hip-python is missing)."""
    for name in ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False
