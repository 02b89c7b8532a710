"""``omniep info``: vendor, devices, and every backend's availability with the reason."""

from __future__ import annotations

import importlib
import os

from ..ep_core import registry
from .platform import detect_vendor, framework_devices, gpu_names


def info_lines() -> list[str]:
    lines = [f"vendor: {detect_vendor()}"]
    gpus = gpu_names()
    lines.append(f"gpus: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else ""))
    for fw, desc in framework_devices().items():
        lines.append(f"{fw}: {desc}")
    lines.append(f"OMNIEP_BACKEND={os.environ.get('OMNIEP_BACKEND', 'auto')}")
    lines.append("backends:")
    report = registry.report()
    for name, per_fw in report.items():
        for fw, avail in per_fw.items():
            state = "available" if avail else "unavailable"
            lines.append(f"  {name:<14} {fw:<6} {state:<12} {avail.reason}")
    lines.append("not run on the hardware it is for:")
    for name in report:
        note = getattr(importlib.import_module(f"omniep.backends.{name}"), "NOT_RUN", "")
        if note:
            lines.append(f"  {name:<14} {note}")
    return lines


def main(argv=None) -> int:
    print("\n".join(info_lines()))
    return 0
