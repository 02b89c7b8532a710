"""``omniep info``: vendor, devices, and every backend's availability with the reason."""

from __future__ import annotations

import importlib
import json

from .. import __version__
from ..ep_core import env, registry
from .platform import detect_vendor, framework_devices, gpu_names


def build_data() -> dict:
    """What the native build of this install built and why it skipped the rest (``omniep._build_info``,
    written by CMake: cmake/parts.cmake): ``{"gpu": str, "parts": {name: {"state", "detail"}}}``; an
    install that never ran CMake says so."""
    try:
        from .._build_info import BUILD
    except ImportError:
        return {"gpu": "none", "parts": {}, "note": "no native build in this install (pip install "
                                                    "--no-build-isolation . or make native builds one)"}
    return BUILD


def info_data() -> dict:
    """What ``omniep info`` reports, as plain data (``--json``)."""
    report = registry.report()
    return {
        "version": __version__,
        "build": build_data(),
        "vendor": detect_vendor(),
        "gpus": gpu_names(),
        "frameworks": framework_devices(),
        "environment": env.report(),
        "backends": {name: {fw: {"available": bool(a), "reason": a.reason} for fw, a in per_fw.items()}
                     for name, per_fw in report.items()},
        "golden_passed": _golden_passed(),
        "not_run_on_hardware": {name: note for name in report
                                if (note := getattr(importlib.import_module(f"omniep.backends.{name}"), "NOT_RUN", ""))},
    }


def _golden_passed() -> dict:
    """``{backend: {framework: [set names]}}`` reproduced bit for bit on this machine (tools/golden_record)."""
    from .golden_record import load

    return {backend: {fw: sorted(sets) for fw, sets in per_fw.items()} for backend, per_fw in sorted(load().items())}


def build_lines(build: dict) -> list[str]:
    lines = [f"native build: {build['gpu']}" + (f" ({build['note']})" if build.get("note") else "")]
    for name, part in build["parts"].items():
        lines.append(f"  {name:<18} {part['state']:<8} {part['detail']}")
    return lines


def info_lines(data: dict) -> list[str]:
    lines = [f"omniep {data['version']}", f"vendor: {data['vendor']}", *build_lines(data["build"])]
    gpus = data["gpus"]
    lines.append(f"gpus: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else ""))
    for fw, desc in data["frameworks"].items():
        lines.append(f"{fw}: {desc}")
    lines.append("environment:")
    width = max((len(var["name"]) for var in data["environment"]), default=0)
    for var in data["environment"]:
        shown = "(unset)" if var["value"] is None else repr(var["value"])
        verdict = f"INVALID: {var['error']}" if var["error"] else f"default={var['default']}; accepts {var['accepts']}"
        lines.append(f"  {var['name']:<{width}} {shown:<14} {verdict}")
    lines.append("backends:")
    for name, per_fw in data["backends"].items():
        for fw, avail in per_fw.items():
            state = "available" if avail["available"] else "unavailable"
            lines.append(f"  {name:<14} {fw:<6} {state:<12} {avail['reason']}")
    lines.append("golden sets reproduced bit for bit on this machine (by its test suites):")
    for name, per_fw in data["golden_passed"].items():
        for fw, sets in per_fw.items():
            lines.append(f"  {name:<14} {fw:<6} {len(sets)}: {', '.join(sets)}")
    if not data["golden_passed"]:
        lines.append("  none recorded yet (make test, pytest -m gpu)")
    lines.append("not run on the hardware it is for:")
    for name, note in data["not_run_on_hardware"].items():
        lines.append(f"  {name:<14} {note}")
    return lines


def main(as_json: bool = False, build_only: bool = False) -> int:
    """Print the report; exit status 1 when an OMNIEP_* variable is set to something invalid.
    ``build_only``: only what the native build built (no framework or device probes)."""
    if build_only:
        build = build_data()
        print(json.dumps(build, indent=1) if as_json else "\n".join(build_lines(build)))
        return 0
    data = info_data()
    print(json.dumps(data, indent=1) if as_json else "\n".join(info_lines(data)))
    return 1 if any(var["error"] for var in data["environment"]) else 0
