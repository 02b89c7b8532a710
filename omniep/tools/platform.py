"""What hardware this process sees, without initialising any framework's GPU runtime needlessly."""

from __future__ import annotations

import os
import shutil
import subprocess


def detect_vendor() -> str:
    """'nvidia', 'amd' or 'cpu' — from device nodes and driver tools, no framework import."""
    if os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi"):
        return "nvidia"
    if os.path.exists("/dev/kfd"):
        return "amd"
    return "cpu"


def gpu_names() -> list[str]:
    """Names of the GPUs the vendor tool lists (empty on a CPU-only machine)."""
    vendor = detect_vendor()
    cmd = {"nvidia": ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
           "amd": ["rocm-smi", "--showproductname"]}.get(vendor)
    if not cmd or not shutil.which(cmd[0]):
        return []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def framework_devices() -> dict[str, str]:
    """One line per installed framework: its version and the devices it sees."""
    lines = {}
    try:
        import jax

        devs = jax.devices()
        lines["jax"] = f"{jax.__version__}: {len(devs)} x {devs[0].platform} ({devs[0].device_kind})"
    except Exception as exc:  # an uninstalled or broken framework is information, not an error
        lines["jax"] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        import torch

        if torch.cuda.is_available():
            lines["torch"] = f"{torch.__version__}: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        else:
            lines["torch"] = f"{torch.__version__}: cpu"
    except Exception as exc:
        lines["torch"] = f"unavailable ({type(exc).__name__}: {exc})"
    return lines
