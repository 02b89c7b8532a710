"""Load a project script (``benchmarks/*.py``, ``scripts/*.py``: not an installed package) as a module, for
the CPU tests of its pure functions."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(relpath: str):
    """The module of ``ROOT / relpath``. Its directory is appended to ``sys.path`` (the script may import a
    neighbour, as benchmarks import host_timing; appended, it shadows nothing already importable)."""
    path = ROOT / relpath
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
